"""A full disk under any write ends in one line naming the path, the cause, the free space and what needed
writing (`transformer.disk`), the writer removes its half-written output, and earlier files stay whole.

The disk fills in-process: the `full_disk` fixture (tests/helpers/disk.py) makes every write to a file under
one directory fail with ENOSPC once a byte budget is spent (open / io.open / os.fdopen, so Python writes,
torch.save, matplotlib and forked worker processes all meet it). The end-to-end run on a real full
filesystem is tests/integration/test_disk_full.py.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import re
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from data import cache, prepare
from data.bpe_cache import load_bpe, save_bpe
from data.sources import DataError
from data.tokenization import train_bpe
from transformer import disk
from transformer.cli import errors
from transformer.config import TransformerConfig
from transformer.evaluation.report_sections import ReportOptions
from transformer.evaluation.reports import ReportInputs, write_translation_outputs
from transformer.evaluation.scoring import TranslationResult
from transformer.interop.source import staged_output
from transformer.model import Seq2SeqTransformer
from transformer.training.checkpoint_io import (
    AtomicCheckpointIO,
    atomic_torch_save,
    check_room_for_checkpoint,
)
from transformer.training.loggers import CSVLogger
from transformer.training.optim import adamw

FREE = r"\(\d+(\.\d)? (bytes|kB|MB|GB) free\)"


def _raised(call: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def _no_temp_files(directory: Path) -> None:
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")], sorted(directory.rglob("*"))


# --- the one line -----------------------------------------------------------------------------------


def _nested() -> BaseException:
    """torch's own form: its RuntimeError raised while handling the OSError of the write."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as err:
        err.add_note("while writing the checkpoint of 12.8 MB to /runs/a/checkpoints/epoch_001.ckpt")
        return err


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            _nested,
            r"^/runs/a/checkpoints/epoch_001\.ckpt: no space left on device .*"
            r" writing the checkpoint of 12\.8 MB$",
        ),
        (
            lambda: RuntimeError(
                "tokenizing in 2 processes failed: ['OSError: [Errno 28] No space left on device']"
            ),
            r"^/where: no space left on device",
        ),
        (
            lambda: Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
            r"^/where: no space left on device",
        ),
        (
            lambda: OSError(errno.ENOSPC, "No space left on device", "/data/x.arrow"),
            r"^/data/x\.arrow: no space",
        ),
        (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), r"^/where: disk quota exceeded$"),
        (
            lambda: OSError(errno.EROFS, "Read-only file system", "/ro/f"),
            r"^/ro/f: read-only file system; choose a ",
        ),
        (lambda: sqlite3.OperationalError("database or disk is full"), r"^/where: no space left on device"),
    ],
)
def test_one_line_names_the_path_the_cause_the_free_space_and_what(make: Callable, expected: str) -> None:
    line = disk.disk_full_line(make(), "/where")
    assert line is not None and re.search(expected, line), line
    assert "\n" not in line
    if "no space" in line:
        assert re.search(FREE, line), line


@pytest.mark.parametrize(
    "err",
    [
        OSError(errno.ENOENT, "No such file or directory", "/x"),
        RuntimeError("[Errno 2] gone"),
        ValueError("1"),
    ],
)
def test_other_errors_are_not_a_full_disk(err: BaseException) -> None:
    assert disk.disk_full_line(err, "/where") is None
    assert errors.disk_full_exit(err) is None


def test_the_exit_is_one_error_line_and_the_traceback_goes_to_the_log_file(tmp_path: Path) -> None:
    handler = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        try:
            raise _nested()
        except RuntimeError as err:
            exit_ = errors.disk_full_exit(err, tmp_path)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert exit_ is not None
    message = str(exit_.code)
    assert message.startswith("error: /runs/a/checkpoints/epoch_001.ckpt: no space left on device (")
    assert "run the same command again" in message and "\n" not in message
    logged = (tmp_path / "train.log").read_text()
    assert (
        "Traceback" in logged and "OSError: [Errno 28]" in logged and "while writing the checkpoint" in logged
    )


# --- checkpoints ----------------------------------------------------------------------------------------


def test_checkpoint_writer_leaves_the_earlier_checkpoint_whole(tmp_path: Path, full_disk: Callable) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    io_plugin = AtomicCheckpointIO()
    io_plugin.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1}, path)
    earlier = path.read_bytes()
    full_disk(tmp_path, 10_000)  # less than the next checkpoint (about 400 kB)
    err = _raised(lambda: io_plugin.save_checkpoint({"state_dict": {"w": torch.ones(100_000)}}, path))
    assert path.read_bytes() == earlier
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left
    line = disk.disk_full_line(err)
    assert line is not None and line.startswith(f"{path}: no space left on device (")
    assert line.endswith("writing the checkpoint of 400.0 kB"), line


def test_a_new_checkpoint_that_does_not_fit_leaves_nothing(tmp_path: Path, full_disk: Callable) -> None:
    full_disk(tmp_path, 1000)
    path = tmp_path / "epoch_001.ckpt"
    err = _raised(lambda: atomic_torch_save({"w": torch.ones(10_000)}, path))
    assert list(tmp_path.iterdir()) == []
    assert disk.disk_full_line(err, tmp_path).startswith(f"{path}: no space left on device")  # type: ignore[union-attr]


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(100, 100)  # 40.4 kB of weights
        self.optimizer_factory = functools.partial(adamw, lr=1e-3)


def test_a_run_that_cannot_hold_one_checkpoint_is_refused_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = L.Trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints")], logger=False, enable_progress_bar=False
    )
    task = _Tiny()
    check_room_for_checkpoint(trainer, task)  # this disk has room
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**5, 10**5)
    )
    err = _raised(lambda: check_room_for_checkpoint(trainer, task))
    line = errors.disk_full(err)
    # weights 40.4 kB + AdamW's two moments 80.8 kB = 121.2 kB > 100 kB free
    assert line is not None and line.startswith(
        f"{tmp_path / 'checkpoints'}: no space left on device (100.0 kB free)"
    )
    assert "writing the first checkpoint of 121.2 kB (weights 40.4 kB, optimizer state 80.8 kB)" in line


# --- the prepared-data cache and tokenizers -----------------------------------------------------------------


def test_cache_builder_in_two_processes_removes_its_entry(
    tmp_path: Path, full_disk: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "CHUNK_ROWS", 4)  # 16 rows: two worker processes
    raw = datasets.Dataset.from_dict({"src": [f"a b c {i}" for i in range(16)]})

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        return {"src_ids": [[1, *range(3, 40), 2] for _ in batch["src"]]}

    def build(directory: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        dataset, _ = prepare.tokenize_split(
            raw, encode, ["src"], ["src_ids"], max_len=64, drop_long=True, dtype="uint16",
            directory=directory, workers=2,
        )  # fmt: skip
        return dataset, {}

    full_disk(tmp_path, 300)
    err = _raised(lambda: cache.load_or_build(tmp_path, "train", "k" * 64, build))
    assert "tokenizing in 2 processes failed" in str(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks"]  # no entry, no half-built one
    line = disk.disk_full_line(err, tmp_path / "elsewhere")
    entry = tmp_path / f"train-{'k' * 16}"
    assert line is not None and line.startswith(f"{entry}: no space left on device (")
    assert line.endswith(f"writing the data cache entry {entry.name}")


def test_cache_builder_in_one_process_is_a_data_error_naming_the_disk(
    tmp_path: Path, full_disk: Callable
) -> None:
    raw = datasets.Dataset.from_dict({"src": [f"a b c {i}" for i in range(16)]})

    def build(directory: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        encode = lambda b: {"src_ids": [[1, 5, 2] for _ in b["src"]]}  # noqa: E731
        dataset, _ = prepare.tokenize_split(
            raw, encode, ["src"], ["src_ids"], max_len=8, drop_long=True, dtype="uint16", directory=directory
        )
        return dataset, {}

    full_disk(tmp_path, 100)
    err = _raised(lambda: cache.load_or_build(tmp_path, "test", "c" * 64, build))
    assert isinstance(err, DataError)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks"]
    message = str(errors.user_error(err).code)
    assert message.startswith(f"error: {tmp_path / ('test-' + 'c' * 16)}: no space left on device (")


def test_tokenizer_save_keeps_the_earlier_tokenizer(tmp_path: Path, full_disk: Callable) -> None:
    path = tmp_path / "tokenizers" / "tokenizer.json"
    first = train_bpe(["a b c", "b c d"] * 10, 40)
    save_bpe(first, path, "one")
    full_disk(tmp_path, 50)
    err = _raised(lambda: save_bpe(train_bpe(["x y z w"] * 10, 40), path, "two"))
    assert load_bpe(path, "one") is not None  # the earlier tokenizer and its stamp are whole
    _no_temp_files(tmp_path)
    line = disk.disk_full_line(err)
    assert line is not None and line.startswith(f"{path}: no space left on device (") and "kB" in line


# --- run files and loggers ------------------------------------------------------------------------------


def test_metrics_json_and_config_keep_the_earlier_file(tmp_path: Path, full_disk: Callable) -> None:
    path = disk.write_text(tmp_path / "metrics.json", json.dumps({"step": 1}), "the run's metrics.json")
    full_disk(tmp_path, 5)
    err = _raised(
        lambda: disk.write_text(path, json.dumps({"step": 2, "more": "x" * 100}), "the run's metrics.json")
    )
    assert json.loads(path.read_text()) == {"step": 1}
    _no_temp_files(tmp_path)
    assert disk.disk_full_line(err).endswith("writing the run's metrics.json")  # type: ignore[union-attr]


def test_csv_log_keeps_its_earlier_rows(tmp_path: Path, full_disk: Callable) -> None:
    logger = CSVLogger(save_dir=tmp_path, name="csv", version="")
    logger.log_metrics({"train/loss": 2.0}, step=0)
    logger.save()
    path = tmp_path / "csv" / "metrics.csv"
    earlier = path.read_text()
    full_disk(tmp_path, 10)
    for step in range(1, 30):
        logger.log_metrics({"train/loss": 1.0, "val/bleu": 3.0}, step=step)
    err = _raised(logger.save)
    assert path.read_text() == earlier
    _no_temp_files(tmp_path)
    assert re.search(r"writing the CSV log of \d", disk.disk_full_line(err) or ""), disk.disk_full_line(err)


# --- evaluate.py's outputs and the exporter --------------------------------------------------------------


def test_evaluation_outputs_remove_the_file_that_did_not_fit(tmp_path: Path, full_disk: Callable) -> None:
    result = TranslationResult(
        {"test/bleu": 1.0}, {"bleu": "b", "chrf": "c"}, ["1 2"], ["a b"], ["a c"], [[5, 6, 2]], [0.0]
    )
    config = TransformerConfig(
        src_vocab_size=20, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1
    )
    full_disk(tmp_path, 3000)  # the text files fit, the first figure does not
    err = _raised(
        lambda: write_translation_outputs(
            tmp_path,
            result,
            ReportInputs(
                info={},
                model=Seq2SeqTransformer(config),
                encode_source=lambda text: [1, 5, 6, 2],
                id_to_token=lambda i: f"w{i}",
                curves={},
                curves_source=None,
                options=ReportOptions(attention_examples=1),
            ),
            decoding={},
        )
    )
    line = disk.disk_full_line(err)
    assert line is not None and re.search(
        r": no space left on device .* writing the figure \S+\.png$", line
    ), line
    figure = Path(line.split(": no space")[0])
    assert not figure.exists() and not (tmp_path / "report.md").exists()
    assert json.loads((tmp_path / "metrics.json").read_text())["test/bleu"] == 1.0  # earlier files whole
    assert (tmp_path / "hypotheses.txt").read_text() == "a c\n"
    _no_temp_files(tmp_path)


def test_export_removes_the_directory_it_made(tmp_path: Path) -> None:
    output = tmp_path / "new" / "deeper" / "hf"

    def serialize(staging: Path) -> None:
        (staging / "config.json").write_text("{}")
        # safetensors' own error (raised from Rust), as on a real full filesystem
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    def export() -> None:
        with staged_output(output, what="the transformers export of 1.2 MB") as staging:
            serialize(staging)

    err = _raised(export)
    assert list(tmp_path.iterdir()) == []  # neither the staging directory nor the parents it made
    line = errors.disk_full(err)
    assert line is not None and line.startswith(f"{output}: no space left on device (")
    assert "writing the transformers export of 1.2 MB;" in line


def test_export_cli_ends_in_one_line_and_writes_nothing(
    tmp_path: Path, full_disk: Callable, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from transformer.interop.export_cli import main

    tokenizer = train_bpe(["one two three", "eins zwei drei"] * 20, 60)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
    )
    model = Seq2SeqTransformer(config)
    checkpoint = tmp_path / "model.ckpt"
    torch.save(  # the layout train.py writes (as tests/helpers/exports.py's save_checkpoint)
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"config": config.to_dict(), "decoding": {"beam_size": 1}},
            "TranslationDataModule": {"tokenizers": {"joint": tokenizer.to_json()}},
            "config": {"model": {"_target_": "transformer.training.TranslationTask"}, "data": {}},
        },
        checkpoint,
    )
    out = tmp_path / "exports"
    full_disk(out, 3000)
    assert main([str(checkpoint), "--to", "hf", "--output", str(out / "hf")]) == 1
    stderr = capsys.readouterr().err
    assert stderr.count("error:") == 1 and stderr.startswith(
        f"error: {out / 'hf'}: no space left on device ("
    ), stderr
    assert "writing the transformers export of" in stderr and "Traceback" not in stderr
    assert not out.exists()  # the export directory and the parent it made are gone
