"""`--api-server-count` and `--engine-core-cpus`: vLLM's flag name, LORASERVE_* variables, validation,
and the default from the host's CPUs (docs/OPERATIONS.md)."""

from __future__ import annotations

import pytest
from loraserve.cli import build_parser, settings_from_args
from loraserve.frontends.placement import api_server_count, default_api_server_count


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    ("cpus", "cuda", "expected"),
    [(2, True, 1), (8, True, 1), (10, True, 2), (13, True, 3), (16, True, 4), (64, True, 4), (64, False, 1)],
)
def test_default_count_from_the_cores(cpus, cuda, expected):
    assert default_api_server_count(cpus, cuda) == expected


def test_flags_and_environment():
    assert settings([]).api_server_count is None and settings([]).engine_core_cpus == "auto"
    chosen = settings(["--api-server-count", "3", "--engine-core-cpus", "14,15"])
    assert (chosen.api_server_count, chosen.engine_core_cpus) == (3, "14,15")
    assert api_server_count(chosen) == 3
    from_env = settings([], {"LORASERVE_API_SERVER_COUNT": "2", "LORASERVE_ENGINE_CORE_CPUS": "off"})
    assert (from_env.api_server_count, from_env.engine_core_cpus) == (2, "off")
    assert api_server_count(settings(["--device", "cpu"])) == 1  # the CPU device: one front end


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-server-count", "0"], "--api-server-count must be a positive integer"),
        (["--engine-core-cpus", "x"], "--engine-core-cpus"),
    ],
)
def test_bad_values_are_refused_at_start(argv, message):
    with pytest.raises(ValueError, match=message):  # `loraserve serve` turns it into a usage error
        settings(argv)
