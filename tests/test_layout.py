"""The repo layout must never shadow Python's stdlib `platform` module (see docs/ARCHITECTURE.md, Layout rules),
imports flow one way, and each engine setting is declared once."""

import ast
import pathlib
import platform
import re
import subprocess
import sys
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


# -- one declaration per setting (engine/engine_args.py) ------------------------------------------------

ENGINE_ARGS = REPO / "engine" / "engine_args.py"


def test_the_engine_settings_declaration_imports_no_torch():
    """The server's settings and `loraserve serve --help` read engine/engine_args.py; torch stays out of it."""
    probe = (
        "import sys, engine.engine_args; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    )
    assert result.stdout.strip() == "[]"


def engine_settings() -> dict[str, object]:
    """Each engine setting's name -> its default, read from the declaration's source (no import)."""
    tree = ast.parse(ENGINE_ARGS.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"]
    found = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "setting":
                value = value.args[0]
            found[node.target.id] = value
    return found


def choice_lists() -> dict[str, tuple]:
    """The declaration's module-level tuples of choices (SCHEDULING_POLICIES, ...) by name."""
    found = {}
    for node in ast.parse(ENGINE_ARGS.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            items = node.value.elts
            if len(items) > 1 and all(isinstance(e, ast.Constant) for e in items):
                found[node.targets[0].id] = tuple(e.value for e in items)
    return found


def redeclared_settings(folder: pathlib.Path, settings: dict[str, ast.expr]) -> list[str]:
    """Places in `folder` that state an engine setting again: its default as a literal (a field
    `name: T = 20` or a keyword `name=20`; None, the "unset" of many things, aside), a flag
    `add_argument("--name", ...)`, or a field-by-field `EngineConfig(name=...)`."""
    defaults = {name: _literal(value) for name, value in settings.items()}
    flags = {"--" + name.replace("_", "-") for name in settings}
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path == ENGINE_ARGS:
            continue
        where = _where(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.AnnAssign) and _repeats(
                getattr(node.target, "id", None), node.value, defaults
            ):
                found.append(f"{where}:{node.lineno} declares {node.target.id}")
            elif isinstance(node, ast.Call):
                callee = getattr(node.func, "id", getattr(node.func, "attr", None))
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and first.value in flags:
                    found.append(f"{where}:{node.lineno} adds the flag {first.value}")
                for keyword in node.keywords:
                    if keyword.arg in settings and (
                        callee == "EngineConfig" or _repeats(keyword.arg, keyword.value, defaults)
                    ):
                        found.append(f"{where}:{node.lineno} passes {keyword.arg}=")
    return found


_NOT_A_LITERAL = object()


def _literal(node: ast.expr | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else _NOT_A_LITERAL
    except ValueError:  # an expression (a name, a call): not a repeated literal
        return _NOT_A_LITERAL


def _repeats(name: str | None, value: ast.expr | None, defaults: dict[str, object]) -> bool:
    if name not in defaults or defaults[name] is None or defaults[name] is _NOT_A_LITERAL:
        return False
    literal = _literal(value)
    return (
        literal is not _NOT_A_LITERAL and type(literal) is type(defaults[name]) and literal == defaults[name]
    )


def _where(path: pathlib.Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def repeated_choice_lists(folders: list[pathlib.Path], lists: dict[str, tuple]) -> list[str]:
    """Tuple or list literals anywhere in `folders` (the declaration aside) equal to a choice list."""
    wanted = {frozenset(choices): name for name, choices in lists.items()}
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            if path == ENGINE_ARGS:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) > 1:
                    if all(isinstance(e, ast.Constant) for e in node.elts):
                        name = wanted.get(frozenset(e.value for e in node.elts))
                        if name is not None:
                            found.append(f"{_where(path)}:{node.lineno} repeats {name}")
    return found


def test_each_engine_setting_and_choice_list_is_declared_once():
    """Defaults, flags and choices of the engine's settings live in engine/engine_args.py alone: the
    server's settings embed them and the CLI derives its flags from them (docs/ARCHITECTURE.md, "Settings")."""
    settings = engine_settings()
    assert {"max_logprobs", "scheduling_policy", "max_loras", "grammar_compile_timeout_s"} <= set(settings)
    assert ast.literal_eval(settings["max_logprobs"]) == 20
    for folder in ("platform/loraserve", "engine"):
        assert redeclared_settings(REPO / folder, settings) == []
    lists = choice_lists()
    assert {"SCHEDULING_POLICIES", "KV_CACHE_DTYPES", "ATTENTION_BACKENDS", "LOAD_FORMATS"} <= set(lists)
    assert repeated_choice_lists([REPO / "engine", REPO / "platform" / "loraserve"], lists) == []


def test_the_settings_scan_sees_each_form_of_repetition(tmp_path):
    (tmp_path / "a.py").write_text(
        "class S:\n    max_logprobs: int = 20\n"
        "add('--max-loras', type=int, default=4)\n"
        "EngineConfig(model=m, max_loras=settings.max_loras)\n"
        "f(block_size=16, seed=None)\n"
        "g(max_logprobs=limits.max_logprobs, block_size=8)\n"
        "POLICIES = ('fcfs', 'fair')\n"
    )
    settings = {
        name: ast.parse(value, mode="eval").body
        for name, value in [("max_logprobs", "20"), ("max_loras", "4"), ("block_size", "16"), ("seed", "0")]
    }
    assert redeclared_settings(tmp_path, settings) == [
        "a.py:2 declares max_logprobs",
        "a.py:3 adds the flag --max-loras",
        "a.py:4 passes max_loras=",
        "a.py:5 passes block_size=",
    ]
    assert repeated_choice_lists([tmp_path], {"SCHEDULING_POLICIES": ("fair", "fcfs")}) == [
        "a.py:7 repeats SCHEDULING_POLICIES"
    ]


def test_the_scheduler_never_names_a_scheduling_policy():
    """The scheduler asks its policy object (engine/scheduling_policies/); adding a policy never edits it."""
    from engine.engine_args import SCHEDULING_POLICIES

    text = (REPO / "engine" / "scheduler.py").read_text()
    named = {name for name in SCHEDULING_POLICIES if re.search(rf"\b{name}\b", text, re.IGNORECASE)}
    assert named == set()
    assert "scheduling_policy" not in text  # nor reads the setting itself (make_policy does)
