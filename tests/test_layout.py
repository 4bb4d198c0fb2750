"""The repo layout must never shadow Python's stdlib `platform` module (see docs/ARCHITECTURE.md, Layout rules)."""

import pathlib
import platform
import sysconfig

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_stdlib_platform_is_not_shadowed():
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert pathlib.Path(platform.__file__).resolve().parent == stdlib
    assert callable(platform.machine)


def test_platform_folder_is_not_a_package():
    assert not (REPO / "platform" / "__init__.py").exists()
    assert not (REPO / "platform" / "conftest.py").exists()
