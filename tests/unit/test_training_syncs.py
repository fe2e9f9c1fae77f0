"""The training step reads nothing back to the host except when the logs are written (`log_every_n_steps`):
token counts and throughput stay device tensors, the non-finite-loss guard decides on the device (fused
AdamW skips a bad step itself), and the progress bar shows values read back at those steps only. Counted
on the CPU, on the GPU's code path (padded batches, no token packing), with the calls that would make a
GPU wait (`tests/helpers/syncs.py`); moving a CPU batch to the CPU is not one of them."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from data.batching import TranslationCollator
from tests.helpers.syncs import is_sync
from tests.helpers.tasks import PAD, TINY, CopyData, cpu_trainer
from transformer.packing import BatchPacking
from transformer.training import TranslationTask
from transformer.training.callbacks import (
    EMAWeightAveraging,
    NonFiniteLossGuard,
    RichProgressBar,
    SaveOnSignal,
)
from transformer.training.optim import adamw

pytestmark = pytest.mark.usefixtures("one_thread")


class _PerBatch(TorchFunctionMode, L.Callback):
    """Counts host reads per training batch (index 0: everything before the first batch)."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)
        self.per_batch = [0]

    def on_train_batch_start(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.per_batch.append(0)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs) and getattr(func, "__name__", "") not in ("to", "cpu"):
            self.per_batch[-1] += 1
        return func(*args, **kwargs)


class _HostPackedCopyData(CopyData):
    """CopyData whose batches carry the packing the collator builds on the host (`data.packing=true`), in
    a loader worker, as on a GPU: the collator's nonzero on host tensors is no device read, but in the
    main process the counter would count it (and a shuffling sampler's permutation read as it refills
    the worker's queue)."""

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            list(enumerate(self.texts[split])), self.batch_size, collate_fn=self._collate, num_workers=1
        )

    def _collate(self, items: list[tuple[int, str]]) -> dict[str, torch.Tensor]:
        batch = super()._collate(items)
        rows = [self.tokenizer.encode(text) for _, text in items]
        examples = [{"src_ids": ids, "tgt_ids": ids, "id": i} for i, ids in enumerate(rows)]
        collated = TranslationCollator(PAD, packing=True)(examples)
        assert all(torch.equal(collated[k], batch[k]) for k in ("src", "tgt_in", "tgt_out"))
        return {**batch, "packing": collated["packing"]}


def _fit_and_count(
    tmp_path, task: TranslationTask, *callbacks: L.Callback, data: type[CopyData] = CopyData, **trainer_args
) -> list[int]:
    """Train `task` 12 steps (2 epochs of 8 batches, logs written every 4 steps) on the GPU's code path;
    the host reads of each batch (1 .. 12), checked: none between log writes, some at them."""
    task.model.pack_tokens = False  # the GPU's path
    counter, progress = _PerBatch(), RichProgressBar()
    trainer = cpu_trainer(
        tmp_path,
        max_steps=12,
        max_epochs=2,  # 8 batches each: the epoch ends at a log write
        limit_val_batches=0,
        log_every_n_steps=4,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=True,
        callbacks=[NonFiniteLossGuard(action="stop"), *callbacks, counter, progress],
        **trainer_args,
    )
    with counter:
        trainer.fit(task, datamodule=data())
    assert trainer.global_step == 12
    reads = counter.per_batch[1:]  # batch 1 .. 12
    assert [n for i, n in enumerate(reads, start=1) if i % 4] == [0] * 9, reads
    assert all(reads[i - 1] > 0 for i in (4, 8, 12)), reads  # the logger and the guard read then
    shown = progress.get_metrics(trainer, task)
    assert {"loss", "tokens/s"} <= shown.keys() and all(
        isinstance(shown[k], float) for k in ("loss", "tokens/s")
    )
    return reads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_steps_between_log_writes_read_nothing_back(tmp_path, compiled: bool) -> None:
    torch.manual_seed(0)
    task = TranslationTask(
        {**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3), compile=compiled
    )
    task.compile_backend = "eager"
    _fit_and_count(tmp_path, task)


@pytest.mark.parametrize("fused", [False, True], ids=["plain-loss", "fused-loss"])
def test_host_packed_steps_read_nothing_back_between_log_writes(tmp_path, monkeypatch, fused: bool) -> None:
    """`data.packing=true` (the packed path on a GPU, its packing built on the host) and
    `model.fused_loss`: every step takes the batch's packing, and still no host read between log writes."""
    taken = []
    from_collated = BatchPacking.from_collated
    monkeypatch.setattr(BatchPacking, "from_collated", lambda *a: taken.append(1) or from_collated(*a))
    torch.manual_seed(0)
    task = TranslationTask(
        {**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3), fused_loss=fused
    )
    _fit_and_count(tmp_path, task, data=_HostPackedCopyData)
    assert len(taken) == 12


@pytest.mark.parametrize("ema", [False, True], ids=["plain", "ema"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_default_gpu_configuration_reads_nothing_back_between_log_writes(
    tmp_path, precision: str, ema: bool
) -> None:
    """`trainer=gpu` is bf16-mixed with `gradient_clip_val: 1.0`: clipping keeps the fused AdamW (which skips
    a bad step on the guard's device flag), the clip norm stays on the device, and the EMA of the weights
    (`callbacks=[default,ema]`) updates without reading its step count back."""
    torch.manual_seed(0)
    task = TranslationTask({**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3))
    averaging = [EMAWeightAveraging(decay=0.9)] if ema else []
    _fit_and_count(tmp_path, task, *averaging, precision=precision, gradient_clip_val=1.0)


def test_under_ddp_the_ranks_agree_only_at_log_writes(tmp_path, monkeypatch) -> None:
    """`trainer=ddp` on one process made to look like rank 0 of 2: the guard's flag meets the other ranks'
    in a device all-reduce every step (never read back), and the decisions that must be read (does any
    rank stop for a signal: `reduce_boolean_decision`, which reads its all-reduced flag back as DDP does)
    come only at log writes, like Lightning's own SIGTERM broadcast (read back with `.item()`; before
    every batch without `SaveOnSignal`)."""
    reduced: list[int] = []  # the optimizer step of each all-reduce of the guard's flag
    decided: list[int] = []  # ... and of each reduce_boolean_decision
    broadcasts: list[int] = []  # the optimizer steps before each of Lightning's SIGTERM broadcasts
    trainer_box: list[L.Trainer] = []

    def all_reduce(tensor: torch.Tensor, op: object = None, **kwargs: object) -> None:
        assert tensor.device.type == "cpu" and tensor.dtype == torch.int32  # the flag, on the device
        reduced.append(trainer_box[0].global_step + 1)

    def reduce_boolean_decision(strategy: object, decision: bool, all: bool = True) -> bool:
        decided.append(trainer_box[0].global_step)
        return bool(torch.tensor(int(decision)))  # DDP: a device tensor all-reduced, then read back

    def broadcast(tensor: torch.Tensor, src: int = 0, **kwargs: object) -> None:
        broadcasts.append(trainer_box[0].global_step)  # rank 0's flag stays as it is

    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    monkeypatch.setattr(SingleDeviceStrategy, "reduce_boolean_decision", reduce_boolean_decision)

    class Remember(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, *args) -> None:  # type: ignore[no-untyped-def]
            trainer_box.append(trainer)

    torch.manual_seed(0)
    task = TranslationTask({**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3))
    saver = SaveOnSignal(tmp_path / "checkpoints")
    _fit_and_count(tmp_path, task, Remember(), saver, precision="bf16-mixed", gradient_clip_val=1.0)
    assert reduced == list(range(1, 13))
    assert decided == [4, 8, 12]
    assert broadcasts == [4, 8]  # before the batch after a log write (Lightning's: before every batch)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch's sync debug mode watches CUDA only)"
)
@pytest.mark.parametrize("data", [CopyData, _HostPackedCopyData], ids=["padded", "host-packed"])
@pytest.mark.parametrize("ema", [False, True], ids=["plain", "ema"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_steps_between_log_writes_do_not_synchronize(
    tmp_path, precision: str, ema: bool, data: type[CopyData]
) -> None:
    """On a GPU, torch's own sync debug mode agrees: no synchronizing call in a step between log writes,
    with `trainer=gpu`'s precision and clipping, with and without the EMA, on padded batches and on
    batches packed on the host (`data.packing=true`)."""
    import warnings

    class WatchBetweenLogWrites(L.Callback):
        def __init__(self) -> None:
            self.caught: list[list[str]] = []
            self._recorder = None

        def on_train_batch_start(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_step >= 1 and (trainer.global_step + 1) % 4:
                self._recorder = warnings.catch_warnings(record=True)
                self.caught.append(self._recorder.__enter__())
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, *args) -> None:  # type: ignore[no-untyped-def]
            if self._recorder is not None:
                torch.cuda.set_sync_debug_mode("default")
                self._recorder.__exit__(None, None, None)
                self._recorder = None

    torch.manual_seed(0)
    task = TranslationTask({**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3))
    watch = WatchBetweenLogWrites()
    trainer = cpu_trainer(
        tmp_path,
        accelerator="gpu",
        devices=1,
        max_steps=12,
        max_epochs=2,
        limit_val_batches=0,
        log_every_n_steps=4,
        logger=CSVLogger(tmp_path),
        precision=precision,
        gradient_clip_val=1.0,
        callbacks=[
            NonFiniteLossGuard(action="stop"),
            *([EMAWeightAveraging(decay=0.9)] if ema else []),
            watch,
        ],
    )
    trainer.fit(task, datamodule=data())
    assert len(watch.caught) >= 6
    syncs = [str(w.message) for step in watch.caught for w in step if "synchroniz" in str(w.message)]
    assert not syncs, syncs[:3]


def test_without_a_terminal_the_bar_logs_plain_lines_and_reads_nothing_more(tmp_path, caplog) -> None:
    """Output to a file (pytest captures it: no terminal): a line per batch with `log_every_s=0`, each with
    the epoch, batch, step and the bar's values, one per validation with its metrics; the same host reads as
    the bar alone (none between log writes)."""
    torch.manual_seed(0)
    task = TranslationTask({**TINY, "dropout": 0.1}, optimizer=functools.partial(adamw, lr=1e-3))
    task.model.pack_tokens = False  # the GPU's path
    counter, progress = _PerBatch(), RichProgressBar(log_every_s=0)
    trainer = cpu_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=1,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=True,
        callbacks=[counter, progress],
    )
    with caplog.at_level("INFO", logger="transformer.training.callbacks"), counter:
        trainer.fit(task, datamodule=CopyData())
    assert progress.plain
    lines = [r.getMessage() for r in caplog.records if r.name == "transformer.training.callbacks"]
    batches = [line for line in lines if " · batch " in line]
    assert [line.split(" · ")[:3] for line in batches] == [
        [f"epoch {e}/2", f"batch {b}/4", f"step {4 * (e - 1) + b}"] for e in (1, 2) for b in (1, 2, 3, 4)
    ]
    assert all(" · loss " in line and " · tokens/s " in line for line in batches[2:]), batches
    validated = [line for line in lines if "validated" in line]
    assert [line.split(":")[0] for line in validated] == [
        "epoch 1/2 validated at step 4",
        "epoch 2/2 validated at step 8",
    ]
    assert all(" val/loss " in line and " val/bleu " in line for line in validated)
    reads = counter.per_batch[1:]
    assert [n for i, n in enumerate(reads, start=1) if i % 2] == [0] * 4, reads


def test_the_bar_refuses_a_negative_interval() -> None:
    with pytest.raises(ValueError, match=r"callbacks.rich_progress_bar.log_every_s: seconds >= 0, got -1"):
        RichProgressBar(log_every_s=-1)
