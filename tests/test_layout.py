"""The repo layout must never shadow Python's stdlib `platform` module (see docs/ARCHITECTURE.md, Layout rules)."""

import ast
import pathlib
import platform
import re
import sysconfig

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_stdlib_platform_is_not_shadowed():
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert pathlib.Path(platform.__file__).resolve().parent == stdlib
    assert callable(platform.machine)


def test_platform_folder_is_not_a_package():
    assert not (REPO / "platform" / "__init__.py").exists()
    assert not (REPO / "platform" / "conftest.py").exists()


# package -> the top-level packages it must never import (docs/ARCHITECTURE.md, imports flow one way)
FORBIDDEN_IMPORTS = {
    "adapter_format": {"engine", "adapters_store", "loraserve", "lora_kernels"},
    "adapters_store": {"engine", "loraserve", "lora_kernels", "litestar"},
    "lora_kernels": {"engine", "adapters_store", "adapter_format", "loraserve"},
}


def imported_packages(folder: pathlib.Path) -> dict[str, set[str]]:
    """file -> the top-level names it imports, those imported inside functions included."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[path.relative_to(folder).as_posix()] = names
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_imports_flow_one_way(package):
    files = imported_packages(REPO / package)
    assert files, f"{package} has no Python files"
    offending = {f: sorted(names & FORBIDDEN_IMPORTS[package]) for f, names in files.items()}
    assert {f: names for f, names in offending.items() if names} == {}


def test_the_import_scan_sees_every_form_of_import(tmp_path):
    (tmp_path / "a.py").write_text("import engine.lora\nfrom adapters_store import base\n")
    (tmp_path / "b.py").write_text(
        "def f():\n    from engine.lora import manager\n    import loraserve as x\n"
    )
    (tmp_path / "c.py").write_text("from . import sibling\n")
    assert imported_packages(tmp_path) == {
        "a.py": {"engine", "adapters_store"},
        "b.py": {"engine", "loraserve"},
        "c.py": set(),
    }


def test_the_scheduler_never_names_a_scheduling_policy():
    """The scheduler asks its policy object (engine/scheduling_policies/); adding a policy never edits it."""
    from engine.config import SCHEDULING_POLICIES

    text = (REPO / "engine" / "scheduler.py").read_text()
    named = {name for name in SCHEDULING_POLICIES if re.search(rf"\b{name}\b", text, re.IGNORECASE)}
    assert named == set()
    assert "scheduling_policy" not in text  # nor reads the setting itself (make_policy does)
