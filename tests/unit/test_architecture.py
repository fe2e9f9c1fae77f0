"""The layout's rules (docs/architecture.md), checked on the source: which package may import which, no
import circles, Hydra only at the edge, evaluation / export without Lightning at run time, and no test
module importing another (shared test code lives in tests/helpers/)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.repo import REPO_ROOT

THIRD_PARTY_OF_THE_EDGE = {"hydra", "omegaconf"}
ENTRY_POINTS = ("train", "evaluate", "serve")


def _modules() -> Iterator[tuple[str, Path]]:
    for package in ("transformer", "data"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            yield ".".join(p for p in parts if p != "__init__"), path
    for script in ENTRY_POINTS:
        if (REPO_ROOT / f"{script}.py").is_file():  # serve.py: from issue 64's server on
            yield script, REPO_ROOT / f"{script}.py"


def _imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at the top or inside a function (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import (the project uses absolute ones)"
            names.add(node.module or "")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


GRAPH = {module: _imports(path, module) for module, path in _modules()}
OURS = set(GRAPH)


def _project_imports(module: str) -> set[str]:
    return {name for name in GRAPH[module] if name in OURS and name != module}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ENTRY_POINTS:
        return "entry point"
    if parts[0] == "data":
        return "data"
    if len(parts) == 1:
        return "package"  # transformer/__init__.py: re-exports the core and the searches
    if parts[1:3] == ["cli", "distill"]:
        return "distill"
    rooms = ("search", "training", "evaluation", "interop", "cli", "inference", "serving")
    return parts[1] if parts[1] in rooms else "core"


# layer -> the layers of this project it may import (besides itself)
ALLOWED = {
    "core": set(),  # the model and its KV cache: never search/ (it sits above the model) nor distill/
    "search": {"core"},
    "package": {"core", "search"},
    "data": set(),
    "evaluation": {"core", "search"},
    "training": {"core", "search", "evaluation"},
    "interop": {"core", "search", "evaluation", "data"},  # aiayn-import writes the pipeline's tokenizer
    # the Python API of a checkpoint (no Hydra, no Lightning: data's tokenizers and batching, not datamodules)
    "inference": {"core", "search", "evaluation", "data", "interop"},
    "serving": {"inference", "core", "search", "evaluation"},  # the HTTP server on top of inference
    "cli": {"core", "search", "evaluation", "training", "data", "inference"},
    "distill": {"core", "search", "evaluation", "data", "cli", "inference"},  # on top of the other cli parts
    "entry point": {
        "core",
        "search",
        "evaluation",
        "training",
        "data",
        "cli",
        "distill",
        "inference",
        "serving",
    },
}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_run_one_way(module: str) -> None:
    layer = _layer(module)
    wrong = sorted(
        f"{name} ({_layer(name)})"
        for name in _project_imports(module)
        if _layer(name) != layer and _layer(name) not in ALLOWED[layer]
    )
    assert not wrong, f"{module} ({layer}) may import only {sorted(ALLOWED[layer])}, imports {wrong}"


def test_the_core_imports_neither_search_nor_distill() -> None:
    """The arrows run down: the model and its KV cache (`transformer.kv_cache`) never reach up into the
    searches that drive them, nor into distillation, the inference API or the server (the table above says
    so; this names the rule)."""
    upward = sorted(
        f"{module} -> {name}"
        for module in GRAPH
        if _layer(module) == "core"
        for name in _project_imports(module)
        if name.startswith(
            ("transformer.search", "transformer.cli", "transformer.inference", "transformer.serving")
        )
    )
    assert not upward, f"core modules import search/, cli/ (distill/), inference/ or serving/: {upward}"
    assert "transformer.kv_cache" in GRAPH and _layer("transformer.kv_cache") == "core"


@pytest.mark.parametrize(
    "module", sorted(m for m in GRAPH if _layer(m) not in ("cli", "distill", "entry point"))
)
def test_hydra_lives_at_the_edge(module: str) -> None:
    roots = {name.split(".")[0] for name in GRAPH[module]}
    assert not roots & THIRD_PARTY_OF_THE_EDGE, f"{module} imports {sorted(roots & THIRD_PARTY_OF_THE_EDGE)}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m) in ("core", "search", "package")))
def test_the_core_imports_only_torch(module: str) -> None:
    roots = {name.split(".")[0] for name in GRAPH[module]}
    foreign = roots - set(sys.stdlib_module_names) - {"torch", "transformer", "__future__"}
    assert not foreign, f"the core module {module} imports {sorted(foreign)}"


def test_the_core_modules_are_the_ones_documented() -> None:
    top = {p.stem for p in (REPO_ROOT / "transformer").glob("*.py")} - {"__init__"}
    documented = (REPO_ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(name for name in top if f"{name}.py" not in documented)
    assert not missing, f"docs/architecture.md does not list the core module(s) {missing}"


def test_no_import_circles() -> None:
    """Module-level import graph of the project (imports inside functions included): no cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in _project_imports(node):
            if succ.startswith("transformer") and node == "transformer":
                continue  # the package re-exports its core modules: not an import of the package itself
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


TEST_FILES = sorted((REPO_ROOT / "tests").rglob("test_*.py"))
TEST_MODULES = {_dotted(path) for path in TEST_FILES}


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in tests/helpers/ (shared fixtures in tests/conftest.py): a
    test module that imports another one breaks when the other's private helpers change. Also caught: the
    dotted name of another test module in a string (a Hydra `_target_` that a child process imports)."""
    wrong = []
    for path in TEST_FILES:
        own = _dotted(path)
        tree = ast.parse(path.read_text())
        strings = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        names = _imports(path, own) | strings
        for other in sorted(TEST_MODULES - {own}):
            if any(name == other or name.startswith(f"{other}.") for name in names):
                wrong.append(f"{path.relative_to(REPO_ROOT)} -> {other}")
    assert not wrong, (
        f"test modules that import another one (move what they share to tests/helpers/): {wrong}"
    )


def test_nothing_imports_conftest_and_the_test_helpers_import_no_circle() -> None:
    """tests/conftest.py holds fixtures and hooks only: every helper lives in tests/helpers/, so no module
    imports conftest (pytest loads it); and the helper modules import one another without a circle."""
    files = sorted((REPO_ROOT / "tests").rglob("*.py"))
    wrong = [
        str(path.relative_to(REPO_ROOT))
        for path in files
        if any(name == "tests.conftest" or name.startswith("tests.conftest.") for name in _imports(path, ""))
    ]
    assert not wrong, f"modules that import tests/conftest.py (move what they use to tests/helpers/): {wrong}"
    helpers = {_dotted(p): p for p in (REPO_ROOT / "tests" / "helpers").glob("*.py") if p.stem != "__init__"}
    uses = {
        module: {n for n in _imports(path, module) if n in helpers} - {module}
        for module, path in helpers.items()
    }

    def circle(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if module in path:
            return (*path[path.index(module) :], module)
        for used in sorted(uses[module]):
            found = circle(used, (*path, module))
            if found:
                return found
        return None

    circles = {found for module in sorted(helpers) if (found := circle(module, ()))}
    assert not circles, f"import circles among tests/helpers/: {sorted(circles)}"


MODULES_WITHOUT_LIGHTNING = (
    "transformer",
    "transformer.checkpoint",
    "transformer.evaluation.restore",
    "transformer.evaluation.scoring",
    "transformer.evaluation.reports",
    "transformer.evaluation.plots",
    "transformer.evaluation.sweep_report",
    "transformer.interop.export_cli",
    "transformer.inference",
    "transformer.serving.app",  # the server: inference and FastAPI, no Lightning, no Hydra
    "data.batching",
)


def test_restoring_scoring_and_exporting_need_no_lightning_or_hydra() -> None:
    edge = ("lightning", "pytorch_lightning", "hydra", "omegaconf")
    code = (
        f"import sys, {', '.join(MODULES_WITHOUT_LIGHTNING)}; print(sorted(set({edge}) & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
