"""The house rules that keep kfacflow easy to change: no import cycle, leaf schema and registry, every file linted."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "kfacflow"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lazy_exports(tree: ast.Module) -> set[ast.AST]:
    """The import nodes inside a module's ``__getattr__`` (PEP 562): loaded on first use of a name, never on import."""
    hooks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    return {node for hook in hooks for node in ast.walk(hook) if isinstance(node, ast.Import | ast.ImportFrom)}


def import_graph(lazy: bool = False, runtime: bool = False) -> dict[str, set[str]]:
    """Every kfacflow module and the kfacflow modules it imports anywhere (in functions, for mypy only too).

    ``lazy``: only the imports of a module's ``__getattr__`` instead (the root's re-export of the library API).
    ``runtime``: without the imports under ``if TYPE_CHECKING:``, which only mypy reads.
    """
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hooked = lazy_exports(tree)
        unread = type_checking_imports(tree) if runtime else set()
        for node in ast.walk(tree):
            if (node in hooked) != lazy or node in unread:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("kfacflow") and target != name:
                    graph[name].add(target)
    return graph


def type_checking_imports(tree: ast.Module) -> set[ast.AST]:
    """The import nodes under ``if TYPE_CHECKING:``: for mypy, never run."""
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {node for block in guarded for stmt in block.body for node in ast.walk(stmt)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 30 and "kfacflow.running.build" in graph["kfacflow.running.trainer"], "the graph was not read"
    assert cycles(graph) == []


def room(module: str, depth: int) -> str:
    """The package a module lives in, at most ``depth`` levels below ``kfacflow``.

    A module that sits beside subpackages above that depth (``kfac/state.py`` beside ``kfac/hooks/``) is a room
    of its own, as is each module of the top level.
    """
    parts = module.split(".")
    for level in range(min(depth, len(parts) - 1), 0, -1):
        package = PACKAGE.parent / Path(*parts[: level + 1])
        if not (package / "__init__.py").exists():
            continue
        beside_rooms = level < depth and any((sub / "__init__.py").exists() for sub in package.iterdir())
        return module if beside_rooms and len(parts) == level + 2 else ".".join(parts[: level + 1])
    return module


def rooms(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The import graph of packages: one package imports another where one of its modules does."""
    packages: dict[str, set[str]] = {room(m, depth): set() for m in graph}
    for module, deps in graph.items():
        packages[room(module, depth)] |= {room(d, depth) for d in deps} - {room(module, depth)}
    return packages


@pytest.mark.parametrize("depth", [1, 2])
def test_no_package_imports_one_that_imports_it(depth: int) -> None:
    """Rooms by role (``running``, ``simulation``, ``kfac`` and its ``stages``, ``hooks``, ...) layer as modules do.

    At run time: the registry names the stage types it holds for mypy alone (under ``TYPE_CHECKING``).
    """
    packages = rooms(import_graph(runtime=True), depth)
    assert {"kfacflow.running", "kfacflow.kfac" if depth == 1 else "kfacflow.kfac.hooks"} <= set(packages)
    assert "kfacflow.kfac" in packages["kfacflow.running"], "the graph was not read"
    assert cycles(packages) == []


def test_rooms_are_packages_at_the_depth_asked() -> None:
    assert room("kfacflow.kfac.hooks.capture", 1) == "kfacflow.kfac"
    assert room("kfacflow.kfac.hooks.capture", 2) == "kfacflow.kfac.hooks"
    assert room("kfacflow.kfac.state", 2) == "kfacflow.kfac.state" and room("kfacflow.timing", 1) == "kfacflow.timing"
    graph = {"kfacflow.running.trainer": {"kfacflow.kfac.state"}, "kfacflow.kfac.state": {"kfacflow.running.seeding"}}
    assert cycles(rooms(graph, 1)) == [["kfacflow.kfac", "kfacflow.running"]]


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_schema_and_registry_import_nothing_else_of_kfacflow() -> None:
    code = (
        "import sys, kfacflow.configuration.schema, kfacflow.registry; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'kfacflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == [
        "kfacflow",
        "kfacflow.configuration",  # the package's docstring alone
        "kfacflow.configuration.ranges",
        "kfacflow.configuration.schema",
        "kfacflow.registry",
    ]
    graph = import_graph()
    # The package root holds only the exceptions every layer raises, and imports nothing of kfacflow
    # but, on first use of the name, the library API it re-exports (kfacflow.KFACPreconditioner, kfacflow.muon).
    assert graph["kfacflow"] == set() and graph["kfacflow.configuration.schema"] == {"kfacflow.configuration.ranges"}
    assert graph["kfacflow.configuration.ranges"] == {"kfacflow"}
    lazy = {m: deps for m, deps in import_graph(lazy=True).items() if deps}
    assert lazy == {"kfacflow": {"kfacflow.library", "kfacflow.library_muon"}}
    # The registry's only other imports are the stage types, for mypy (under TYPE_CHECKING).
    assert graph["kfacflow.registry"] <= {"kfacflow", "kfacflow.comm.base", "kfacflow.kfac.stages.contracts"}


def test_performance_models_import_neither_backends_nor_kfac() -> None:
    graph = import_graph()
    assert "kfacflow.perf" in graph["kfacflow.simulation.calibration"], "the graph was not read"
    # Calibration (kfacflow.simulation.calibration) times the backends and fits with kfacflow.perf; the models,
    # their fitting and the profiles know neither the backends nor K-FAC, directly or through another module.
    reached: set[str] = set()
    todo = ["kfacflow.perf"]
    while todo:
        for dep in graph[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert sorted(m for m in reached if m.split(".")[:2] in (["kfacflow", "comm"], ["kfacflow", "kfac"])) == []


def test_stage_contracts_hold_no_any() -> None:
    tree = ast.parse((PACKAGE / "kfac" / "stages" / "contracts.py").read_text())
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)] + [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    assert "Any" not in names


def test_ruff_sees_every_tracked_python_file() -> None:
    git, ruff = shutil.which("git"), shutil.which("ruff")
    if git is None or ruff is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout and ruff")
    tracked = subprocess.run([git, "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    seen = subprocess.run([ruff, "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True)
    linted = {str(Path(line).resolve().relative_to(ROOT)) for line in seen.stdout.split() if line.endswith(".py")}
    missing = sorted(set(tracked.stdout.split()) - linted)
    assert not missing, f"ruff does not lint {missing}: list them in [tool.ruff] include"


MODULE_LINES, CLASS_LINES = 400, 300
"""The house's limits: a module a newcomer reads in one go, a class that holds one idea."""


def oversized(package: Path = PACKAGE) -> list[str]:
    """Every package module over :data:`MODULE_LINES` lines and every class over :data:`CLASS_LINES`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(package.parent)
        if (lines := len(text.splitlines())) > MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > CLASS_LINES:  # type: ignore[operator]
                found.append(f"{name}: class {node.name}, {size} lines")
    return found


def test_no_module_over_400_lines_and_no_class_over_300() -> None:
    assert oversized() == []


def test_an_oversized_module_or_class_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("class Big:\n" + "    x = 1\n" * 300 + "\n" * 100)
    assert oversized(tmp_path / "pkg") == ["pkg/big.py: 401 lines", "pkg/big.py: class Big, 301 lines"]


def layers(text: str) -> list[tuple[str, list[str]]]:
    """The rows of a page's layer table: each layer's name and the paths (in ``kfacflow/``) it lists."""
    rows = []
    for line in text.split("## Layout", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], re.findall(r"`([\w/]+(?:\.py|/))`", cells[1])))
    return rows


def layer_of(module: str, rows: list[tuple[str, list[str]]]) -> int:
    """The row of the table that lists ``module`` (its file, or the longest folder holding it), or -1."""
    path = module.replace(".", "/").removeprefix("kfacflow").lstrip("/")
    files = {f"{path}.py", f"{path}/__init__.py".lstrip("/")}  # a module, or a package's own file
    best, depth = -1, -1
    for i, (_, paths) in enumerate(rows):
        for listed in paths:
            hit = listed in files or (listed.endswith("/") and f"{path}/".startswith(listed))
            if hit and len(listed) > depth:
                best, depth = i, len(listed)
    return best


def test_the_architecture_pages_layers_are_the_import_graphs() -> None:
    rows = layers((ROOT / "docs" / "architecture.md").read_text())
    assert len(rows) > 5, "the layer table was not read"
    graph = import_graph(runtime=True)
    assert sorted(m for m in graph if layer_of(m, rows) < 0) == [], "modules the table does not place"
    upward = [
        f"{a} ({rows[layer_of(a, rows)][0]}) imports {b} ({rows[layer_of(b, rows)][0]})"
        for a, deps in graph.items()
        for b in deps
        if layer_of(b, rows) > layer_of(a, rows)
    ]
    assert upward == []


def test_the_layer_table_names_only_modules_that_exist() -> None:
    """A path in a row is in ``kfacflow/`` itself or in a folder the row names (``running/``: ``trainer.py``)."""
    for name, paths in layers((ROOT / "docs" / "architecture.md").read_text()):
        folders = [PACKAGE / p for p in paths if p.endswith("/")]
        missing = [p for p in paths if not any((base / p).exists() for base in (PACKAGE, ROOT, *folders))]
        assert missing == [], f"the row {name!r} names what is not there"


def test_a_module_is_placed_by_its_file_or_its_folder() -> None:
    rows = [("low", ["__init__.py", "comm/base.py"]), ("high", ["comm/", "kfac/planning/plan.py"])]
    assert [layer_of(m, rows) for m in ("kfacflow", "kfacflow.comm.base", "kfacflow.comm.scatter")] == [0, 0, 1]
    assert layer_of("kfacflow.kfac.planning.plan", rows) == 1 and layer_of("kfacflow.kfac.planning.routes", rows) == -1
