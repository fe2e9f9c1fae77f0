"""Where `aiayn-import` writes, and what it may never touch: an output that is, holds or lies inside the
source directory is refused (a hub id's downloaded snapshot included), `--force` replaces only an earlier
import's output, symlinked outputs are written through or refused, and no failure at any step (the save,
either rename of the swap, a full disk) leaves a staging directory behind or the previous output changed.
Every refused command is checked to leave the source's files, names and bytes, as they were.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import opus_mt_directory  # noqa: E402
from transformer.checkpoint import load_checkpoint  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return opus_mt_directory(tmp_path_factory.mktemp("built") / "opus-mt-de-en", data_dir("MULTI30K_DIR"))


@pytest.fixture
def opus(built: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny OPUS-MT directory per test (a test that fails may have damaged it)."""
    copy = tmp_path / "models" / "opus-mt-de-en"
    copy.mkdir(parents=True)
    for file in built.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    return copy


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root` (hidden ones included): a file's bytes, a symlink's target, a directory."""
    tree: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            tree[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            tree[name] = "dir"
        else:
            tree[name] = path.read_bytes()
    return tree


def _refused(capsys, argv: list[str], fragment: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err


@pytest.mark.parametrize(
    ("where", "fragment"),
    [
        ("the source", "is the directory imported from"),
        ("its parent", "holds the directory imported from"),
        ("its grandparent", "holds the directory imported from"),
        ("inside it", "lies inside the directory imported from"),
        ("a symlink to it", "is the directory imported from"),
    ],
)
def test_an_output_that_is_holds_or_lies_in_the_source_is_refused_and_nothing_is_touched(
    opus: Path, tmp_path: Path, capsys, where: str, fragment: str
) -> None:
    (opus.parent / "notes.txt").write_text("the user's, beside the model")
    output = {
        "the source": opus,
        "its parent": opus.parent,
        "its grandparent": tmp_path,
        "inside it": opus / "imported",
        "a symlink to it": tmp_path / "link",
    }[where]
    if where == "a symlink to it":
        output.symlink_to(opus, target_is_directory=True)
    before = _tree(tmp_path)
    _refused(capsys, [str(opus), "--output", str(output), "--force"], fragment)
    _refused(capsys, [str(opus), "--output", str(output)], "directory imported from")
    assert _tree(tmp_path) == before


def test_a_hub_snapshot_is_checked_once_downloaded(opus: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """A hub id names no local directory until downloaded: the snapshot directory is checked then."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **_: str(opus))
    before = _tree(tmp_path)
    _refused(capsys, ["Helsinki-NLP/opus-mt-de-en", "--output", str(opus / "out"), "--force"], "lies inside")
    assert _tree(tmp_path) == before
    assert main(["Helsinki-NLP/opus-mt-de-en", "--output", str(tmp_path / "ok")]) == 0


def test_force_replaces_only_an_earlier_import(opus: Path, tmp_path: Path, capsys) -> None:
    output = tmp_path / "out"
    assert main([str(opus), "--output", str(output)]) == 0
    first = (output / "model.ckpt").stat().st_ino
    assert main([str(opus), "--output", str(output), "--force"]) == 0  # an earlier import: replaced
    assert (output / "model.ckpt").stat().st_ino != first and sorted(os.listdir(output)) == ["model.ckpt"]
    for foreign in ("notes.txt", ".hidden", "checkpoints"):
        mine = output / foreign
        mine.mkdir() if foreign == "checkpoints" else mine.write_text("mine")
        before = _tree(tmp_path)
        _refused(capsys, [str(opus), "--output", str(output), "--force"], f"holds {foreign}, which this")
        assert _tree(tmp_path) == before
        mine.rmdir() if foreign == "checkpoints" else mine.unlink()
    # a model.ckpt that is a symlink (to the user's own file) is not ours either
    (tmp_path / "precious.ckpt").write_bytes(b"mine")
    (output / "model.ckpt").unlink()
    (output / "model.ckpt").symlink_to(tmp_path / "precious.ckpt")
    _refused(capsys, [str(opus), "--output", str(output), "--force"], "holds model.ckpt")
    assert (tmp_path / "precious.ckpt").read_bytes() == b"mine"


def test_a_symlink_loop_output_is_refused_and_leaves_nothing(opus: Path, tmp_path: Path, capsys) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    before = _tree(tmp_path)
    _refused(capsys, [str(opus), "--output", str(loop)], "loop")
    _refused(capsys, [str(opus), "--output", str(dangling), "--force"], "does not exist")
    assert _tree(tmp_path) == before


def test_a_symlink_to_an_empty_directory_is_written_through(opus: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "model"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    assert main([str(opus), "--output", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(os.listdir(target)) == ["model.ckpt"]
    assert load_checkpoint(target / "model.ckpt")["imported_from"]["source"] == str(opus)
    assert sorted(os.listdir(target.parent)) == ["model"]  # no staging or old directory beside it


def _failing_rename(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Path.rename fails at its `call`-th call (1-based) from now on, as a full or read-only disk would."""
    calls = {"n": 0}
    real = Path.rename

    def rename(self: Path, target: Path) -> Path:
        calls["n"] += 1
        if calls["n"] == call:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)


@pytest.mark.parametrize(
    "failure",
    [
        "torch.save",
        "interrupted save",
        "rename into place",
        "rename of the old output",
        "rename of the new one",
        "full disk",
    ],
)
@pytest.mark.parametrize("previous", [False, True], ids=["new output", "forced over an import"])
def test_no_failure_leaves_anything_staged_or_the_previous_output_changed(
    opus: Path, tmp_path: Path, capsys, monkeypatch, full_disk, failure: str, previous: bool
) -> None:
    if failure in ("rename of the old output", "rename of the new one") and not previous:
        pytest.skip("a new output is renamed once")
    output = tmp_path / "out" / "model"
    if previous:
        assert main([str(opus), "--output", str(output)]) == 0
        capsys.readouterr()
    before = _tree(tmp_path)
    if failure == "torch.save":

        def save(checkpoint: object, path: Path) -> None:
            Path(path).write_bytes(b"half")
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

        monkeypatch.setattr(torch, "save", save)
    elif failure == "interrupted save":

        def interrupted(checkpoint: object, path: Path) -> None:
            Path(path).write_bytes(b"half")
            raise KeyboardInterrupt

        monkeypatch.setattr(torch, "save", interrupted)
    elif failure == "full disk":
        real_save = torch.save

        def through_python(checkpoint: object, path: Path) -> None:  # torch's own writer bypasses `open`
            with open(path, "wb") as handle:
                real_save(checkpoint, handle)

        monkeypatch.setattr(torch, "save", through_python)
        full_disk(tmp_path / "out", 10_000)
    else:
        _failing_rename(monkeypatch, 1 if failure != "rename of the new one" else 2)
    argv = [str(opus), "--output", str(output), *(["--force"] if previous else [])]
    if failure == "interrupted save":
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    else:
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert _tree(tmp_path) == before  # the source, the previous output, and no hidden staging directory
