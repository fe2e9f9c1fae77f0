"""`model.compile=true` (`transformer.training.compiling`): the translation training step's forward and loss
(dropout on, label smoothing, padded batches) compile to one graph with no graph break, bucketed batches
of many shapes compile it at most 3 times, the compiled loss and gradients are the eager ones, and the
log says how long compiling took. `model.compile=layers` (`transformer.stacks.compile_layers`): one graph
per stack, reused by its layers and by every batch shape, the same numbers. Dynamo's cheap `eager` /
`aot_eager` backends keep this fast on the CPU.
"""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
import torch._dynamo

from data.batching import TokenBudgetBatchSampler, TranslationCollator
from tests.helpers.tasks import TINY, CopyData, cpu_trainer
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


def _task(compile: bool | str = False, **kwargs) -> TranslationTask:
    task = TranslationTask(
        {**CONFIG, **kwargs},
        optimizer=functools.partial(adamw, lr=1e-3),
        label_smoothing=0.1,
        compile=compile,
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
    trainer = cpu_trainer(tmp_path, max_steps=6, limit_val_batches=1, val_check_interval=3)
    with caplog.at_level(logging.INFO, logger="transformer.training.compiling"):
        trainer.fit(task, datamodule=CopyData(n_train=128, batch_size=16))
    assert trainer.global_step == 6
    assert 1 <= task._compiled_step.compilations <= 3
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(lines) == task._compiled_step.compilations
    assert "compiled the training step (forward and label-smoothed loss) in" in lines[0]
    assert not torch._dynamo.utils.counters["graph_break"]
    assert "val/bleu" in trainer.callback_metrics  # validation decoded eagerly


# --- model.compile=layers: regional compilation -----------------------------------------------------------


def test_compiled_layers_compile_once_per_stack_over_bucketed_batches() -> None:
    """`compile=layers`: the encoder's layers share one graph and the decoder's another (their copies
    reuse it), bucketed batches of many shapes add none, nothing breaks the graphs (fullgraph), and a first
    batch whose source and target lengths are equal does not make them equal for good (the lengths are
    marked dynamic, not duck-sized into one symbol)."""
    torch.manual_seed(0)
    task = _task(compile="layers")
    task.compile_backend, task.compile_fullgraph = "eager", True
    task._compile()
    batches = _bucketed_batches(30)
    first = next(b for b in batches if pad_length(b["src"], 0).shape == pad_length(b["tgt_in"], 0).shape)
    batches = [first, *batches]
    assert len({(tuple(b["src"].shape), tuple(b["tgt_in"].shape)) for b in batches}) >= 15
    for batch in batches:
        task._token_loss(batch).loss.backward()
        task._compiled_step.finished()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # one encoder, one decoder layer
    assert task._compiled_step.compilations == 1  # both in the first step
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_compiled_layers_give_the_eager_loss_and_gradients(checkpointing: bool) -> None:
    """Without dropout, the padded step with compiled layers (aot_eager: traced forward and backward
    graphs) computes the eager step's loss and gradients, also inside activation checkpointing; the
    model's decoding and evaluation passes stay eager."""
    torch.manual_seed(0)
    task = _task(dropout=0.0, compile="layers")
    batch = _bucketed_batches(1)[0]
    eager = task._token_loss(batch)
    eager.loss.backward()
    expected = {name: p.grad.clone() for name, p in task.named_parameters()}
    task.zero_grad()
    task.compile_backend = "aot_eager"
    task._compile()
    task.model.encoder.activation_checkpointing = task.model.decoder.activation_checkpointing = checkpointing
    compiled = task._token_loss(batch)
    compiled.loss.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    torch.testing.assert_close(compiled.loss, eager.loss)
    for name, p in task.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        task.eval()
        task.model(batch["src"], batch["tgt_in"])
        task.model.train()
        task.model(batch["src"], batch["tgt_in"])  # training mode without a graph: eager too
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_fit_with_compiled_layers_logs_the_time(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    task = _task(compile="layers")
    task.compile_backend, task.compile_fullgraph = "eager", True
    trainer = cpu_trainer(tmp_path, max_steps=6, limit_val_batches=1, val_check_interval=3)
    with caplog.at_level(logging.INFO, logger="transformer.training.compiling"):
        trainer.fit(task, datamodule=CopyData(n_train=128, batch_size=16))
    assert trainer.global_step == 6
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert lines and "compiled the training step's layers in" in lines[0]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert "val/bleu" in trainer.callback_metrics


def test_the_classifier_trains_with_compiled_encoder_layers(tmp_path) -> None:
    """`model.compile=layers` on the encoder-only classifier: its encoder's layers share one graph."""
    from transformer.training import ClassificationTask

    task = ClassificationTask(
        {**TINY, "n_decoder_layers": 0},
        num_classes=2,
        optimizer=functools.partial(adamw, lr=3e-3),
        compile="layers",
    )
    task.compile_backend, task.compile_fullgraph = "eager", True
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=4, limit_val_batches=1)
    trainer.fit(task, datamodule=CopyData(classify=True))
    assert trainer.global_step == 4 and "val/acc" in trainer.callback_metrics
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_task_refuses_another_compile_setting() -> None:
    with pytest.raises(ValueError, match="compile must be true, false or 'layers', got 'fast'"):
        _task(compile="fast")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"compile": "maybe"},
            "`model.compile` must be true (the training step), layers (each encoder / decoder layer) or "
            "false, got 'maybe'",
        ),
        (
            {"compile": 1},
            "`model.compile` must be true (the training step), layers (each encoder / decoder "
            "layer) or false, got 1",
        ),
        ({"activation_checkpointing": 1}, "`model.activation_checkpointing` must be true or false, got 1"),
        (
            {"low_precision_residual": "yes"},
            "`model.low_precision_residual` must be true, false or auto, got 'yes'",
        ),
        ({"compile": True}, "`model.compile`=true cannot work here: no compiler (set model.compile=false)"),
        (
            {"compile": "layers"},
            "`model.compile`=layers cannot work here: no compiler (set model.compile=false)",
        ),
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


def test_inductor_compiles_without_size_guards_from_mix_order_fusion(monkeypatch) -> None:
    """The compiled step and layers ask Inductor for the mix-order reduction's non-strict mode, whose size
    check guarded the step on an H200 (a recompilation when a batch crossed 5 * 2**20 elements); the
    installed torch knows the option; another backend is given no options (it takes none)."""
    from torch._inductor import config

    from transformer import stacks
    from transformer.inductor import compile_options
    from transformer.training import compiling

    assert hasattr(config.triton, "mix_order_reduction_non_strict_mode")
    assert compile_options("inductor") == {"options": {"triton.mix_order_reduction_non_strict_mode": True}}
    assert compile_options("eager") == compile_options("aot_eager") == {}

    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    for backend in ("inductor", "eager"):
        compiling.CompiledStep(lambda x: x, "step", backend=backend)
        stacks.CompiledLayerCall(torch.nn.Linear, backend)
    assert [call.get("options") for call in calls] == [
        {"triton.mix_order_reduction_non_strict_mode": True},
        {"triton.mix_order_reduction_non_strict_mode": True},
        None,
        None,
    ]
