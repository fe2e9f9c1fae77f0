"""`model.compile=true` (`transformer.training.compiling`): the translation training step's forward and loss
(dropout on, label smoothing, padded batches) compile to one graph with no graph break, bucketed batches
of many shapes compile it at most 3 times, the compiled loss and gradients are the eager ones, and the
log says how long compiling took. Dynamo's cheap `eager` / `aot_eager` backends keep this fast on the CPU.
"""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
import torch._dynamo

from data.batching import TokenBudgetBatchSampler, TranslationCollator
from tests.unit.test_tasks import TINY, CopyData, _trainer
from transformer.training import TranslationTask
from transformer.training.compiling import pad_length
from transformer.training.optim import adamw

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {**TINY, "d_model": 32, "n_heads": 4, "n_encoder_layers": 2, "n_decoder_layers": 2, "dropout": 0.1}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _task(**kwargs) -> TranslationTask:
    task = TranslationTask(
        {**CONFIG, **kwargs}, optimizer=functools.partial(adamw, lr=1e-3), label_smoothing=0.1
    )
    return task.train()


def _bucketed_batches(n_batches: int, max_tokens: int = 256) -> list[dict[str, torch.Tensor]]:
    """Batches as training makes them: examples of Multi30k-like lengths (6 to 30 tokens, the target about
    the source's length) grouped by the project's token-budget sampler and padded by its collator."""
    rng = random.Random(0)
    examples = []
    for i in range(400):
        n = rng.randint(4, 28)
        m = max(2, n + rng.randint(-3, 3))
        src = [rng.randint(4, 11) for _ in range(n)] + [2]
        tgt = [1] + [rng.randint(4, 11) for _ in range(m)] + [2]
        examples.append({"src_ids": src, "tgt_ids": tgt, "id": i})
    lengths = [max(len(e["src_ids"]), len(e["tgt_ids"])) for e in examples]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=0)
    collate = TranslationCollator(pad_id=0)
    return [collate([examples[i] for i in batch]) for batch in list(sampler)[:n_batches]]


def test_the_training_forward_and_loss_are_one_graph_without_breaks() -> None:
    torch.manual_seed(0)
    task = _task()
    batch = _bucketed_batches(1)[0]
    assert batch["src"].eq(0).any() and batch["tgt_out"].eq(0).any()  # padded
    explained = torch._dynamo.explain(task._padded_token_loss)(
        batch["src"], batch["tgt_in"], batch["tgt_out"]
    )
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    # the CPU default packs eagerly; forced on, tracing still takes the padded layout; activation
    # checkpointing (torch.utils.checkpoint) is traced into the same graph
    task.model.pack_tokens = True
    task.model.encoder.activation_checkpointing = task.model.decoder.activation_checkpointing = True
    torch._dynamo.reset()
    explained = torch._dynamo.explain(task._padded_token_loss)(
        batch["src"], batch["tgt_in"], batch["tgt_out"]
    )
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_bucketed_batches_compile_the_step_at_most_three_times() -> None:
    torch.manual_seed(0)
    task = _task()
    task.compile_backend, task.compile_fullgraph = "eager", True  # a graph break would raise
    task._compile()
    batches = _bucketed_batches(30)
    shapes = {(tuple(b["src"].shape), tuple(b["tgt_in"].shape)) for b in batches}
    assert len(shapes) >= 15  # many batch sizes and lengths
    for batch in batches:
        out = task._token_loss(batch)
        out.loss.backward()
        task._compiled_step.finished()
    assert 1 <= task._compiled_step.compilations <= 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_compiled_step_gets_lengths_padded_to_a_multiple_of_8() -> None:
    """One alignment for every batch (`compiling.LENGTH_MULTIPLE`): each input's length is rounded up with
    pads; a length that already is a multiple is passed through as it is."""
    task = _task()
    task._compile()
    seen: list[tuple[int, ...]] = []
    task._compiled_step = lambda *tensors: seen.append(tuple(t.size(1) for t in tensors)) or None
    batches = _bucketed_batches(10)
    for batch in batches:
        task._token_loss(batch)
    assert len(seen) == len(batches)
    for batch, lengths in zip(batches, seen):
        raw = (batch["src"].size(1), batch["tgt_in"].size(1), batch["tgt_out"].size(1))
        assert lengths == tuple(-(-n // 8) * 8 for n in raw), (raw, lengths)
    ids = torch.tensor([[5, 6, 7, 2, 0, 0, 0, 0]])
    assert pad_length(ids, 0) is ids
    assert pad_length(ids[:, :5], 0).tolist() == [[5, 6, 7, 2, 0, 0, 0, 0]]


def test_the_compiled_loss_and_gradients_are_the_eager_ones() -> None:
    """Without dropout (no random draws to compare) the compiled padded step computes the eager packed
    step's loss, NLL, accuracy counts and gradients."""
    torch.manual_seed(0)
    task = _task(dropout=0.0)
    batch = _bucketed_batches(1)[0]
    eager = task._token_loss(batch)  # the CPU's packed path
    eager.loss.backward()
    expected = {name: p.grad.clone() for name, p in task.named_parameters()}
    task.zero_grad()
    task.compile_backend = "aot_eager"  # traced forward and backward graphs, run without codegen
    task._compile()
    compiled = task._token_loss(batch)
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss)
    torch.testing.assert_close(compiled.nll, eager.nll)
    assert int(compiled.n_tokens) == int(eager.n_tokens) and int(compiled.n_correct) == int(eager.n_correct)
    for name, p in task.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_fit_compiles_once_logs_the_time_and_keeps_eager_evaluation(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    task = _task()
    task.compile_backend, task.compile_fullgraph = "eager", True
    task.hparams.compile = True
    trainer = _trainer(tmp_path, max_steps=6, limit_val_batches=1, val_check_interval=3)
    with caplog.at_level(logging.INFO, logger="transformer.training.compiling"):
        trainer.fit(task, datamodule=CopyData(n_train=128, batch_size=16))
    assert trainer.global_step == 6
    assert 1 <= task._compiled_step.compilations <= 3
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(lines) == task._compiled_step.compilations
    assert "compiled the training step (forward and label-smoothed loss) in" in lines[0]
    assert not torch._dynamo.utils.counters["graph_break"]
    assert "val/bleu" in trainer.callback_metrics  # validation decoded eagerly


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"compile": "maybe"}, "`model.compile` must be true or false, got 'maybe'"),
        ({"activation_checkpointing": 1}, "`model.activation_checkpointing` must be true or false, got 1"),
        ({"compile": True}, "`model.compile`=true cannot work here: no compiler (set model.compile=false)"),
    ],
)
def test_settings_that_cannot_work_stop_before_training(monkeypatch, overrides, expected) -> None:
    from omegaconf import OmegaConf

    from transformer.cli import checks
    from transformer.cli.errors import ConfigError

    monkeypatch.setattr(
        checks, "compile_unavailable", lambda device: "no compiler" if device == "cpu" else None
    )
    cfg = OmegaConf.create({"model": {"compile": False, **overrides}, "trainer": {"accelerator": "cpu"}})
    with pytest.raises(ConfigError) as raised:
        checks.check_compile(cfg)
    assert str(raised.value) == expected


def test_compile_is_available_on_this_machine() -> None:
    """The CI machine has a C++ compiler: inductor can run on its CPU (`compile_unavailable` says None)."""
    from transformer.training.compiling import compile_unavailable

    assert compile_unavailable("cpu") is None
