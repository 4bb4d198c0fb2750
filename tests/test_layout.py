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


# -- the output path: one definition of each rule (docs/ARCHITECTURE.md, "The output path") -----------

ENGINE = REPO / "engine"
OUTPUT_PATH = "engine/frontend/output_processor.py"  # the front end's half, shared by every front end


def files_containing(folder: pathlib.Path, pattern: str) -> list[str]:
    """The repo-relative paths of the Python files under `folder` whose text matches `pattern`."""
    regex = re.compile(pattern)
    return sorted(
        path.relative_to(REPO).as_posix() for path in folder.rglob("*.py") if regex.search(path.read_text())
    )


def imported_modules(path: pathlib.Path) -> set[str]:
    """The dotted module names `path` imports (functions' imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_core_keeps_no_second_output_assembly():
    assert not (ENGINE / "output_processor.py").exists()
    assert (REPO / OUTPUT_PATH).exists()


@pytest.mark.parametrize(
    ("rule", "pattern"),
    [
        ("the child id of an n > 1 request", r"\}#\{"),
        ("the children's params (seeds, prompt logprobs once, extra eos)", r"\bchild_params\("),
        ("the cumulative logprob", r"cumulative_logprob \+="),
        ("detokenization and stop strings", r"\bIncrementalDetokenizer\("),
    ],
)
def test_each_output_rule_is_applied_in_one_place(rule, pattern):
    """Outside their own definitions, these are applied by the front end's output path alone."""
    found = [
        f
        for f in files_containing(ENGINE, pattern)
        if f not in ("engine/core/request_checks.py", "engine/detokenizer.py")  # where two are defined
    ]
    assert found == [OUTPUT_PATH], rule


def test_the_engine_core_never_imports_the_front_end():
    core = [ENGINE / "engine_core.py", *sorted((ENGINE / "core").glob("*.py"))]
    offending = {
        p.name: sorted(
            m for m in imported_modules(p) if m.startswith(("engine.frontend", "engine.llm_engine"))
        )
        for p in core
    }
    assert {name: mods for name, mods in offending.items() if mods} == {}


def test_the_engines_parts_never_import_the_core_process():
    """The process that runs the core (engine/core_process/) sits over the engine; only the front end,
    which starts or joins it, and the process itself import it."""
    allowed = ("core_process/", "frontend/", "async_llm.py")
    offending = {}
    for path in sorted(ENGINE.rglob("*.py")):
        name = path.relative_to(ENGINE).as_posix()
        if not name.startswith(allowed):
            found = sorted(m for m in imported_modules(path) if m.startswith("engine.core_process"))
            if found:
                offending[name] = found
    assert offending == {}
