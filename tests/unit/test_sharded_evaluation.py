"""Sharded evaluation without the slow DDP run: `gather_decoded` in a real two-process gloo group with
uneven shares (counts and widths), and the metrics of a split with fewer batches than ranks, whose last
batch a rank left without one repeats (it must not count twice in `test/loss`, in any task).

The ranks of the second test are run one after the other in this process, each with its rank's sampler;
their metric states are then added up, which is what torchmetrics' sync across processes does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from data.batching import ClassificationCollator, TokenBudgetBatchSampler, TranslationCollator
from tests.helpers.evaluation import SHORT, detokenize, detokenize_batch, tiny_config
from transformer.training import ClassificationTask, MaskedLMTask, TranslationTask
from transformer.training.translation import gather_decoded

PAD, BOS, EOS = 0, 1, 2

# rank -> its decoded batches [(ids, tokens)]: rank 0 three sentences in two batches (widths 3 and 5),
# rank 1 one sentence of width 2
SHARES: dict[int, list[tuple[list[int], list[list[int]]]]] = {
    0: [([4, 0], [[5, 6, EOS], [7, EOS, PAD]]), ([2], [[8, 9, 10, 11, EOS]])],
    1: [([1], [[12, EOS]])],
}


def _gather_in_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        parts = [(torch.tensor(ids), torch.tensor(tokens)) for ids, tokens in SHARES[rank]]
        ids, tokens = gather_decoded(parts, PAD, torch.device("cpu"))
        torch.save({"ids": ids, "tokens": tokens}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gather_decoded_keeps_no_padding_of_the_shorter_share(tmp_path: Path) -> None:
    """Every rank gets every sentence once, in rank order, padded to the widest (5) only: no filler ids
    (-1) and no filler rows from the share with fewer sentences, no columns cut from the wider one."""
    torch.multiprocessing.start_processes(
        _gather_in_rank,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        start_method="fork",  # the test module is already imported: no second interpreter start-up
    )
    expected_tokens = torch.tensor(
        [[5, 6, EOS, PAD, PAD], [7, EOS, PAD, PAD, PAD], [8, 9, 10, 11, EOS], [12, EOS, PAD, PAD, PAD]]
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["ids"].tolist() == [4, 0, 2, 1], rank
        assert torch.equal(got["tokens"], expected_tokens), (rank, got["tokens"])


def test_gather_decoded_in_one_process_is_its_own_batches_padded() -> None:
    parts = [(torch.tensor(ids), torch.tensor(tokens)) for ids, tokens in SHARES[0]]
    ids, tokens = gather_decoded(parts, PAD, torch.device("cpu"))
    assert ids.tolist() == [4, 0, 2] and tokens.shape == (3, 5) and tokens[1].tolist() == [7, EOS, 0, 0, 0]


# --- a split with fewer batches than ranks -------------------------------------------------------------


def test_the_sampler_says_which_rank_repeats_another() -> None:
    samplers = [
        TokenBudgetBatchSampler([5, 7], 100, shuffle=False, num_replicas=3, rank=r, even_batches=False)
        for r in range(3)
    ]
    assert [list(s) for s in samplers] == [[[0]], [[1]], [[1]]]
    assert [s.repeats_another_rank for s in samplers] == [False, False, True]
    even = TokenBudgetBatchSampler([5, 7, 6], 100, shuffle=False, num_replicas=2, rank=1, even_batches=False)
    assert not even.repeats_another_rank  # batches cut in two: one each, none repeated


class _Tokenizer:
    decode_batch = staticmethod(detokenize_batch)


class _Split(L.LightningDataModule):
    """The test split of `examples` (copy task) batched by the evaluation sampler of rank `rank` of
    `world`, as the real datamodules batch it (`even_batches=False`)."""

    def __init__(self, examples: list[list[int]], rank: int, world: int) -> None:
        super().__init__()
        self.examples = [
            {"src_ids": [BOS, *e, EOS], "tgt_ids": [BOS, *e, EOS], "id": i} for i, e in enumerate(examples)
        ]
        self.rank, self.world = rank, world
        self.tgt_tokenizer = _Tokenizer()

    def test_dataloader(self) -> DataLoader:
        sampler = TokenBudgetBatchSampler(
            [len(e["src_ids"]) for e in self.examples], 1000, shuffle=False,
            num_replicas=self.world, rank=self.rank, even_batches=False,
        )  # fmt: skip
        return DataLoader(self.examples, batch_sampler=sampler, collate_fn=TranslationCollator(PAD))

    def references(self, split: str) -> list[str]:
        return [detokenize(e["tgt_ids"][1:]) for e in self.examples]


class _MeanStates(L.Callback):
    """The test token means' states (sum of weighted values, sum of weights) before the epoch's end
    computes and resets them: what a process contributes to the synced mean."""

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.value = float(pl_module.test_means.loss.mean_value)
        self.weight = float(pl_module.test_means.loss.weight)


def _states(task: TranslationTask, data: _Split) -> _MeanStates:
    states = _MeanStates()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[states],
    )  # fmt: skip
    trainer.test(task, datamodule=data, verbose=False)
    return states


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_a_repeated_last_batch_does_not_count_twice_in_the_token_means() -> None:
    task = TranslationTask(tiny_config(), decoding=SHORT)
    examples = [[5, 6, 7, 8, 9], [10, 11]]  # two sentences, three ranks: ranks 1 and 2 get the same batch
    ranks = [_states(task, _Split(examples, rank, 3)) for rank in range(3)]
    alone = _states(task, _Split(examples, 0, 1))
    total_weight = sum(r.weight for r in ranks)
    assert total_weight == alone.weight  # every target token once
    assert sum(r.value for r in ranks) / total_weight == pytest.approx(alone.value / alone.weight)


class _Labelled(L.LightningDataModule):
    """Classification examples (sentences of 20 tokens, labels 0/1) batched for rank `rank` of `world`."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        rows = [[5 + (i + j) % 9 for j in range(18 + 2 * i)] for i in range(2)]
        self.examples = [{"src_ids": [BOS, *r, EOS], "label": i, "id": i} for i, r in enumerate(rows)]
        self.rank, self.world = rank, world

    def test_dataloader(self) -> DataLoader:
        sampler = TokenBudgetBatchSampler(
            [len(e["src_ids"]) for e in self.examples], 1000, shuffle=False,
            num_replicas=self.world, rank=self.rank, even_batches=False,
        )  # fmt: skip
        return DataLoader(self.examples, batch_sampler=sampler, collate_fn=ClassificationCollator(PAD))


class _LossWeight(L.Callback):
    """The weight (examples or masked tokens) the test loss of a process holds before the epoch ends."""

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.weight = float(pl_module.metrics["test_loss"].weight)


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
@pytest.mark.parametrize("kind", ["classification", "masked_lm"])
def test_a_repeated_last_batch_adds_nothing_to_the_other_tasks_metrics(kind: str) -> None:
    """Classification (loss, accuracy, F1) and masked-LM (loss, accuracy): the rank that repeats another's
    batch adds nothing to the metrics that are synced across ranks; the others add their share."""
    config = tiny_config(n_decoder_layers=0, tie_embeddings="none", src_vocab_size=20)
    torch.manual_seed(0)
    task = ClassificationTask(config, num_classes=2) if kind == "classification" else MaskedLMTask(config)
    weights = []
    for rank in range(3):
        weight = _LossWeight()
        trainer = L.Trainer(
            accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[weight],
        )  # fmt: skip
        trainer.test(task, datamodule=_Labelled(rank, 3), verbose=False)
        weights.append(weight.weight)
    assert weights[0] > 0 and weights[1] > 0 and weights[2] == 0, weights
