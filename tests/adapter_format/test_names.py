"""adapter_format/names.py: the one home of names, versions, references and engine adapter ids."""

from __future__ import annotations

import pytest

from adapter_format.errors import InvalidName
from adapter_format.names import (
    MERGE_MARK,
    check_name,
    format_adapter_id,
    format_merge_id,
    format_ref,
    parse_adapter_id,
    parse_ref,
    parse_version,
    split_adapter_id,
    split_tenant,
    strip_version,
)

KEY = "0123456789abcdef" * 2


@pytest.mark.parametrize(
    "segment, expected",
    [
        ("1", 1),
        ("9" * 18, int("9" * 18)),
        ("9" * 19, None),
        ("0", None),
        ("01", None),
        ("-1", None),
        ("", None),
    ],
)
def test_versions_are_positive_without_leading_zeros_and_fit_an_int64(segment, expected):
    assert parse_version(segment) == expected


def test_a_reference_round_trips_and_the_latest_has_no_version():
    assert parse_ref("bot@18") == ("bot", 18) and format_ref("bot", 18) == "bot@18"
    assert parse_ref("bot") == ("bot", None) and format_ref("bot", None) == "bot"
    with pytest.raises(InvalidName, match="without leading zeros"):
        parse_ref("bot@" + "1" * 19)


@pytest.mark.parametrize(
    "value, message",
    [
        ("", "is empty"),
        ("x" * 65, "65 characters long"),
        ("a@1", "contains '@'"),
        ("../x", "contains '..'"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        (".x", "is invalid"),
        (None, "must be a string"),
    ],
)
def test_each_bad_name_says_why_and_the_rule(value, message):
    with pytest.raises(InvalidName, match=message) as caught:
        check_name(value, "route name")
    assert caught.value.code == "invalid_name" and isinstance(caught.value, ValueError)
    if value is not None:
        assert "use 1-64 letters" in str(caught.value)


def test_engine_ids_of_versions_and_merges_split_for_labels():
    assert split_adapter_id(format_adapter_id("acme", "bot", 3)) == ("acme", "bot", 3)
    assert split_adapter_id(format_merge_id("acme", KEY)) == ("acme", MERGE_MARK + KEY, 0)
    for other in ("bot@3", "acme/bot", "acme/merge+short", "sql~2", "/models/sql"):
        assert split_adapter_id(other) is None
    with pytest.raises(InvalidName, match="has no version"):
        parse_adapter_id("acme/bot")


def test_tenant_qualified_names():
    assert split_tenant("acme/bot@2") == ("acme", "bot@2") and split_tenant("bot") == (None, "bot")
    assert strip_version("acme/bot@3") == "acme/bot"
    for unchanged in ("chat", "a@b", "acme/bot@01", "@3"):
        assert strip_version(unchanged) == unchanged
