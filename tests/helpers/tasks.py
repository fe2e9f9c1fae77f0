"""A character-level copy task for the Lightning tasks: tokenizer, DataModule, tiny model, quiet trainer."""

from __future__ import annotations

import functools

import lightning as L
import torch
from torch.utils.data import DataLoader

from transformer.training import TranslationTask
from transformer.training.optim import adamw
from transformer.training.schedules import inverse_sqrt

PAD, BOS, EOS = 0, 1, 2
ALPHABET = "abcdefgh"


class CharTokenizer:
    """The Tokenizer protocol on characters: ids 4.. are letters."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS
    vocab_size = 4 + len(ALPHABET)

    def encode(self, text: str) -> list[int]:
        return [BOS, *(4 + ALPHABET.index(c) for c in text), EOS]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= 4:
                out.append(ALPHABET[i - 4])
        return "".join(out)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


class CopyData(L.LightningDataModule):
    """Copy random letter strings; the contract's batch layout, splits 'train', 'val', 'test'."""

    def __init__(self, n_train: int = 256, n_eval: int = 32, batch_size: int = 32, classify: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tokenizer = self.src_tokenizer = self.tgt_tokenizer = CharTokenizer()
        self.classify = classify
        self.texts = {
            split: [
                "".join(
                    ALPHABET[int(i)]
                    for i in torch.randint(0, 4, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
                )
                for _ in range(n)
            ]
            for split, n in (("train", n_train), ("val", n_eval), ("test", n_eval))
        }
        self.batch_size = batch_size

    def references(self, split: str) -> list[str]:
        return self.texts[split]

    def _collate(self, items: list[tuple[int, str]]) -> dict[str, torch.Tensor]:
        ids = [self.tokenizer.encode(t) for _, t in items]
        batch = {"src": _pad(ids), "id": torch.tensor([i for i, _ in items])}
        if self.classify:  # label: does the string contain an "a"?
            batch["label"] = torch.tensor([int("a" in t) for _, t in items])
        else:
            batch["tgt_in"] = _pad([r[:-1] for r in ids])
            batch["tgt_out"] = _pad([r[1:] for r in ids])
        return batch

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        data = list(enumerate(self.texts[split]))
        return DataLoader(data, batch_size=self.batch_size, shuffle=shuffle, collate_fn=self._collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


TINY = {
    "src_vocab_size": CharTokenizer.vocab_size,
    "d_model": 32,
    "n_heads": 2,
    "n_encoder_layers": 1,
    "n_decoder_layers": 1,
    "d_ff": 64,
    "dropout": 0.0,
    "max_len": 32,
}


def cpu_trainer(tmp_path, **kwargs) -> L.Trainer:
    """A CPU trainer for one epoch without logger, progress bar, summary, checkpoints or sanity check."""
    defaults = dict(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def translation_task(**kwargs) -> TranslationTask:
    """The TINY model as a TranslationTask: AdamW at 3e-3, inverse square root after 10 warmup steps."""
    return TranslationTask(
        TINY,
        optimizer=functools.partial(adamw, lr=3e-3),
        scheduler=functools.partial(inverse_sqrt, warmup_steps=10),
        **kwargs,
    )


def logged_training_step(
    task: TranslationTask, batch: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """One `training_step` of `task` (a throwaway: its `log` is replaced) and its backward pass, without a
    Trainer: the values it logs (train/*, and "returned loss") and every parameter's gradient."""
    logged: dict[str, torch.Tensor] = {}
    task.log = lambda name, value, **_: logged.__setitem__(name, value.detach().clone())  # type: ignore[method-assign]
    task._on_progress_bar = lambda *args: None  # type: ignore[method-assign]
    task.zero_grad(set_to_none=True)
    loss = task.training_step(batch, 0)
    loss.backward()
    logged["returned loss"] = loss.detach().clone()
    return logged, {name: p.grad for name, p in task.named_parameters()}
