"""The installed packages import and keep their layering rules."""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TORCH_ONLY = ["attention.py", "positional.py", "layers.py", "model.py", "decoding.py", "config.py"]
FORBIDDEN_IN_MODEL = {
    "lightning",
    "pytorch_lightning",
    "hydra",
    "omegaconf",
    "datasets",
    "tokenizers",
    "data",
    "wandb",
}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_packages_import() -> None:
    import data
    import transformer

    assert transformer.__doc__ and data.__doc__


@pytest.mark.parametrize("name", TORCH_ONLY)
def test_model_modules_import_only_torch(name: str) -> None:
    path = REPO_ROOT / "transformer" / name
    if not path.exists():
        pytest.skip(f"{name} not written yet")
    assert not (_imported_roots(path) & FORBIDDEN_IN_MODEL)


def test_data_never_imports_transformer() -> None:
    for path in (REPO_ROOT / "data").glob("*.py"):
        assert "transformer" not in _imported_roots(path), path
