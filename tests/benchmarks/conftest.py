"""Every test here runs a GPU benchmark script on the CPU with a tiny model (a minute or more each on
two cores): they belong to the slow tier (`make test-slow`)."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
