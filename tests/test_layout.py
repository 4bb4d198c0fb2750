"""The repo's layout rules (docs/ARCHITECTURE.md, Layout rules): the stdlib `platform` module is never shadowed,
imports flow one way, the control plane has no import circle, each engine setting is declared once, and
each rule about names and requests has one definition."""

import ast
import functools
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
    "engine": {"loraserve", "adapters_store", "litestar"},
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


# --- no import circle in the control plane ---------------------------------------------------------------


def module_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (the package folder `root/package`).

    Imports inside functions count (a late import is still an import circle, only hidden); an
    `if __name__ == "__main__":` block does not (it runs as a script, never on import). An edge goes to
    the module named: `from a.b import c` to `a.b.c` when that is a module, else to `a.b`; the parent
    packages Python initializes on the way are not edges (every submodule would otherwise form a circle
    with its package's `__init__`).
    """
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        named: list[str] = []
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named += [alias.name for alias in node.names]
            else:
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                named += [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names
                ]
        graph[name] = set()
        for target in named:
            parts = target.split(".")
            hit = next(
                (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules),
                None,
            )
            if hit is not None and hit != name:
                graph[name].add(hit)
    return graph


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_control_plane_has_no_import_circle():
    graph = module_graph(REPO / "platform", "loraserve")
    assert len(graph) > 100 and "loraserve.errors" in graph["loraserve.app"]
    assert circles(graph) == []


def test_the_circle_finder_sees_late_imports_and_ignores_package_parents_and_scripts(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from pkg.sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")  # late
    (pkg / "c.py").write_text("from . import a\nif __name__ == '__main__':\n    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# --- one definition per rule -------------------------------------------------------------------------------

CODE = ("adapter_format", "adapters_store", "engine", "lora_kernels", "platform/loraserve", "benchmarks")
NAMES = "adapter_format/names.py"


@functools.cache
def code_files() -> tuple[pathlib.Path, ...]:
    return tuple(path for folder in CODE for path in sorted((REPO / folder).rglob("*.py")))


@functools.cache
def source(path: pathlib.Path) -> str:
    return path.read_text()


def files_with(*fragments: str) -> list[pathlib.Path]:
    """The code files whose text holds one of `fragments` (only those are parsed: parsing all takes seconds)."""
    return [path for path in code_files() if any(f in source(path) for f in fragments)]


@functools.cache
def syntax_tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(source(path), str(path))


@functools.cache
def literals(path: pathlib.Path) -> tuple[str, ...]:
    """The file's string literals, the constant parts of f-strings included, docstrings left out."""
    tree = syntax_tree(path)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return tuple(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    )


def homes(hint: str, predicate) -> dict[str, int]:
    """file -> how many of its literals match `predicate` (among the files whose text holds `hint`)."""
    found = {}
    for path in files_with(hint):
        count = sum(1 for text in literals(path) if predicate(text))
        if count:
            found[path.relative_to(REPO).as_posix()] = count
    return found


def test_the_version_and_name_syntax_are_written_once():
    assert homes("[1-9]", lambda text: "[1-9][0-9]{0,17}" in text) == {NAMES: 1}
    assert homes("[A-Za-z0-9]", lambda text: "[A-Za-z0-9][A-Za-z0-9._-]" in text) == {NAMES: 1}
    # every other spelling of a positive integer is JSON's number grammar (0 or [1-9][0-9]*), another rule
    others = homes("[1-9]", lambda text: "[1-9][0-9]" in text and "[1-9][0-9]{0,17}" not in text)
    assert set(others) == {"platform/loraserve/inference/tools/json_partial.py"}
    assert all(
        "0|[1-9][0-9]*" in text for text in literals(REPO / next(iter(others))) if "[1-9][0-9]" in text
    )


def _at_joins(path: pathlib.Path) -> int:
    """f-strings that write `{x}@{y}`: a value, then text starting with '@', then a value."""
    count = 0
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            count += any(
                isinstance(a, ast.FormattedValue)
                and isinstance(b, ast.Constant)
                and b.value == "@"
                and isinstance(c, ast.FormattedValue)
                for a, b, c in zip(parts, parts[1:], parts[2:])
            )
    return count


def _splits_at(path: pathlib.Path) -> int:
    """Calls that split a string at '@' (`.partition("@")`, `.rpartition("@")`, `.split("@")`, ...)."""
    return sum(
        1
        for node in ast.walk(syntax_tree(path))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"partition", "rpartition", "split", "rsplit"}
        and any(isinstance(arg, ast.Constant) and arg.value == "@" for arg in node.args)
    )


def test_name_at_version_is_written_and_read_in_one_place():
    written = {p.relative_to(REPO).as_posix(): n for p in files_with("}@{") if (n := _at_joins(p))}
    read = {p.relative_to(REPO).as_posix(): n for p in files_with('"@"', "'@'") if (n := _splits_at(p))}
    assert written == {NAMES: 1}
    assert read == {NAMES: 2}  # parse_ref (partition) and strip_version (rpartition)


# functions of one rule each: defined in adapter_format/names.py and nowhere else
NAME_RULES = (
    "check_name",
    "check_adapter_name",
    "check_route_name",
    "is_valid_name",
    "check_version",
    "parse_version",
    "parse_ref",
    "format_ref",
    "format_adapter_id",
    "parse_adapter_id",
    "format_merge_id",
    "parse_merge_id",
    "split_adapter_id",
)


def test_each_name_rule_is_defined_once():
    defined: dict[str, list[str]] = {}
    for path in files_with(*(f"def {name}(" for name in NAME_RULES)):
        for node in ast.walk(syntax_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in NAME_RULES:
                defined.setdefault(node.name, []).append(path.relative_to(REPO).as_posix())
    assert defined == {name: [NAMES] for name in NAME_RULES}


def test_request_checks_live_in_the_engine_alone():
    """The HTTP layer calls the engine's request checks (engine/core/request_checks.py) rather than restating
    them: each message is written once, in the engine."""
    for fragment in ("which is greater than max allowed", " is out of vocabulary", " has token ids "):
        found = homes(fragment.strip(), lambda text, f=fragment: f in text)
        assert len(found) == 1 and next(iter(found)).startswith("engine/"), (fragment, found)


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
