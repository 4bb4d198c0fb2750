"""Malformed and hostile uploads (tests/hostile_adapters.py): each refused with its code, the config key
named, a short message, and nothing written. The big tables run on the local backend (validation runs
before any backend write); a sample runs on S3 too."""

from __future__ import annotations

import threading

import pytest
from hostile_adapters import (
    CONFIG,
    CONFIG_FILE_IDS,
    CONFIG_FILES,
    WEIGHT_FILE_IDS,
    WEIGHT_FILES,
    WEIGHTS,
    bad_config_value_params,
    with_config_value,
)

from adapter_format import safetensors_header
from adapters_store import InvalidAdapter


def refused(store, keys_of, folder) -> InvalidAdapter:
    with pytest.raises(InvalidAdapter) as err:
        store.put("acme", "bad", folder)
    assert keys_of(store) == [], "validation must fail before anything is written"
    assert len(err.value.message) < 600, "a message never echoes a whole hostile value"
    return err.value


@pytest.fixture(params=["local"])
def backend(request):
    """The tables run on the local store only; test_a_sample_on_both_backends covers S3."""
    return request.param


@pytest.mark.parametrize(("key", "raw", "code"), bad_config_value_params())
def test_bad_config_values_name_the_field(store, keys_of, adapter_dir, copy_adapter, key, raw, code):
    error = refused(store, keys_of, with_config_value(copy_adapter(adapter_dir), key, raw))
    assert (error.code, error.field) == (code, key)
    assert key in error.message


@pytest.mark.parametrize(("case_id", "data", "fragment"), CONFIG_FILES, ids=CONFIG_FILE_IDS)
def test_malformed_config_files(store, keys_of, adapter_dir, copy_adapter, case_id, data, fragment):
    folder = copy_adapter(adapter_dir)
    (folder / CONFIG).write_bytes(data)
    error = refused(store, keys_of, folder)
    assert error.code == "bad_config" and fragment in error.message
    assert str(folder) not in error.message, "no staging path in what callers see"


@pytest.mark.parametrize(("case_id", "data", "code", "fragment"), WEIGHT_FILES, ids=WEIGHT_FILE_IDS)
def test_malformed_safetensors_files(
    store, keys_of, adapter_dir, copy_adapter, case_id, data, code, fragment
):
    folder = copy_adapter(adapter_dir)
    (folder / WEIGHTS).write_bytes(data)
    error = refused(store, keys_of, folder)
    assert error.code == code and fragment in error.message


def test_a_header_over_the_size_bound_is_refused_before_parsing(
    store, keys_of, adapter_dir, copy_adapter, monkeypatch
):
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", 100)
    error = refused(store, keys_of, copy_adapter(adapter_dir))
    assert error.code == "bad_weights" and "an adapter's header is far below 100" in error.message


def test_a_catastrophic_alpha_pattern_does_not_hang_the_upload(store, keys_of, adapter_dir, copy_adapter):
    folder = with_config_value(copy_adapter(adapter_dir), "alpha_pattern", '{"(?:(?:.|.)*?)*?(?!j).": 4}')
    outcome = []
    worker = threading.Thread(
        target=lambda: outcome.append(_raised(store.put, "acme", "bad", folder)), daemon=True
    )
    worker.start()
    worker.join(timeout=60)
    assert outcome, "the upload hung on a regex (Python's re backtracks on this one for minutes)"
    assert isinstance(outcome[0], InvalidAdapter) and outcome[0].field == "alpha_pattern"
    assert keys_of(store) == []


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # returned to the test thread: an assert here would be lost
        return exc
    return None


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
@pytest.mark.parametrize(
    ("key", "raw", "code"), [("lora_alpha", "1e999", "bad_alpha"), ("r", "true", "bad_rank")]
)
def test_a_sample_on_both_backends(store, keys_of, adapter_dir, copy_adapter, key, raw, code):
    error = refused(store, keys_of, with_config_value(copy_adapter(adapter_dir), key, raw))
    assert (error.code, error.field) == (code, key)
    folder = copy_adapter(adapter_dir)
    (folder / WEIGHTS).write_bytes(WEIGHT_FILES[0][1])
    assert refused(store, keys_of, folder).code == "bad_weights"
