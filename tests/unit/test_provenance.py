"""What a checkpoint was imported from travels with fine-tuning: `init_origin` reads the start's own
`imported_from` or, for a fine-tuned import fine-tuned again, the one its start recorded; a task keeps its
`started_from` through save, resume and save again; a restored checkpoint's `origin` is either."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.helpers.tasks import TINY
from transformer.evaluation.init_from import imported_note, init_origin
from transformer.evaluation.restore import RestoredModel
from transformer.training import TranslationTask
from transformer.training.optim import adamw
from transformer.training.schedules import inverse_sqrt

IMPORTED = {"source": "Helsinki-NLP/opus-mt-de-en", "architecture": "MarianMTModel", "transformers": "5.0"}


def _save(path: Path, **keys) -> Path:
    torch.save({"state_dict": {"model.x": torch.zeros(2)}, **keys}, path)
    return path


def test_init_origin_names_the_import_through_a_chain_of_fine_tunings(tmp_path: Path) -> None:
    imported = _save(tmp_path / "imported.ckpt", imported_from={**IMPORTED, "labels": ["a", "b"]})
    first = init_origin(imported)
    assert first == {"init_from": str(imported.resolve()), "imported_from": IMPORTED}  # labels left out
    tuned = _save(tmp_path / "tuned.ckpt", started_from=first)
    assert init_origin(tuned) == {"init_from": str(tuned.resolve()), "imported_from": IMPORTED}
    scratch = _save(tmp_path / "scratch.ckpt")
    assert init_origin(scratch) == {"init_from": str(scratch.resolve())}
    assert imported_note(first) == " (imported from Helsinki-NLP/opus-mt-de-en)"
    assert imported_note(init_origin(scratch)) == "" and imported_note(None) == ""


def test_a_task_keeps_started_from_through_save_and_resume() -> None:
    def task() -> TranslationTask:
        return TranslationTask(
            TINY,
            optimizer=functools.partial(adamw, lr=1e-3),
            scheduler=functools.partial(inverse_sqrt, warmup_steps=10),
        )

    started = {"init_from": "/abs/imported.ckpt", "imported_from": IMPORTED}
    first = task()
    first.started_from = started
    saved = {"state_dict": first.state_dict()}
    first.on_save_checkpoint(saved)
    assert saved["started_from"] == started
    resumed = task()  # a resumed run does not read init_from again: the checkpoint's record stays
    resumed.on_load_checkpoint(saved)
    again = {"state_dict": resumed.state_dict()}
    resumed.on_save_checkpoint(again)
    assert again["started_from"] == started
    plain = {"state_dict": task().state_dict()}
    task().on_save_checkpoint(plain)
    assert "started_from" not in plain  # trained from scratch: nothing recorded


def test_origin_is_the_checkpoints_own_import_or_its_starts() -> None:
    def restored(**keys) -> RestoredModel:
        return RestoredModel(
            task="translation", model=torch.nn.Linear(1, 1), hparams={}, run_config={}, **keys
        )

    assert restored(imported_from=IMPORTED).origin == IMPORTED
    assert restored(started_from={"init_from": "/a.ckpt", "imported_from": IMPORTED}).origin == IMPORTED
    assert restored(started_from={"init_from": "/a.ckpt"}).origin is None and restored().origin is None
