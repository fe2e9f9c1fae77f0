"""scripts/offline_bundle.py's first checks, without building anything: bad arguments and an unreadable
`--have` file are one `error:` line each, the latter reported before pip's version is looked at."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["out", "--bogus"], ["out", "--python-version"]])
def test_bad_arguments_are_one_error_line(
    bundle: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert bundle.main(argv) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "usage: offline_bundle.sh" in lines[0]


def test_a_missing_freeze_file_is_reported_before_pip_s_version(
    bundle: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pip", types.SimpleNamespace(__version__="23.0"))  # too old
    out = tmp_path / "bundle"
    assert bundle.main([str(out), "--have", str(tmp_path / "missing.txt")]) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --have ") and "cannot read it" in lines[0]
    assert not out.exists()  # the folder it made is gone again
    (tmp_path / "freeze.txt").write_text("torch==2.11.0\n")
    assert bundle.main([str(out), "--have", str(tmp_path / "freeze.txt")]) == 1
    assert "pip 23.0 is too old" in _error_lines(capsys)[0]
