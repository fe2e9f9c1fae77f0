"""Lightning tasks on a character-level copy task: losses, metrics, BLEU, checkpoint contents."""

from __future__ import annotations

import functools
import math
import types

import lightning as L
import pytest
import torch

from tests.helpers.tasks import BOS, EOS, PAD, TINY, CharTokenizer, CopyData, cpu_trainer, translation_task
from transformer.training import ClassificationTask, TranslationTask
from transformer.training.optim import adamw
from transformer.training.schedules import cosine_with_warmup


def test_hparams_are_plain_data() -> None:
    task = translation_task(label_smoothing=0.2)
    assert set(task.hparams) == {
        "config",
        "label_smoothing",
        "decoding",
        "test_decoding",
        "val_bleu_every_n_epochs",
        "init_from",
        "finetune",
        "compile",
        "activation_checkpointing",
        "low_precision_residual",
        "fused_loss",
    }
    assert task.hparams.config == TINY and task.hparams.label_smoothing == 0.2
    assert task.hparams.activation_checkpointing is False  # a plain bool, off by default
    assert task.hparams.low_precision_residual == "auto"  # on when training on a GPU
    assert task.hparams.decoding["beam_size"] == 1
    assert task.hparams.test_decoding == task.hparams.decoding  # defaults to the validation settings
    beam = translation_task(test_decoding={"beam_size": 4})
    assert beam.hparams.test_decoding == {**beam.hparams.decoding, "beam_size": 4}


def test_loss_does_not_depend_on_padding() -> None:
    task = translation_task().eval()
    batch = CopyData()._collate([(0, "abc"), (1, "abcabc")])
    padded = {
        k: torch.nn.functional.pad(v, (0, 3), value=PAD) if v.dim() == 2 else v for k, v in batch.items()
    }
    a, b = task._token_loss(batch), task._token_loss(padded)
    torch.testing.assert_close(a.loss, b.loss)
    assert a.n_tokens.item() == b.n_tokens.item() == 4 + 7


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"val_bleu_every_n_epochs": 0}, "val_bleu_every_n_epochs"),
        ({"decoding": {"beam": 4}}, "decoding"),
        ({"test_decoding": {"beam": 4}}, "test_decoding"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        translation_task(**kwargs)


def test_bad_model_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        TranslationTask({**TINY, "n_heads": 3})


def test_training_step_overfits_one_batch() -> None:
    task = translation_task()
    optimizer = adamw(task.model, lr=1e-2)
    batch = CopyData()._collate([(0, "abcd"), (1, "dcba"), (2, "bad")])
    losses = []
    for _ in range(80):
        out = task._token_loss(batch)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert task._token_loss(batch).n_correct.item() == 5 + 5 + 4  # every token right


def test_translation_logs_loss_metrics_and_bleu(tmp_path) -> None:
    data = CopyData()
    task = translation_task()
    trainer = cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=3)
    trainer.fit(task, datamodule=data)
    metrics = trainer.callback_metrics
    expected = ("train/loss", "val/loss", "val/ppl", "val/token_acc", "val/bleu", "val/chrf", "val/bleu_best")
    for name in (*expected, "val/exact_match", "train/tokens_per_s", "train/pad_ratio"):
        assert name in metrics, name
    assert metrics["val/bleu_best"] >= metrics["val/bleu"]
    assert 0 < metrics["train/pad_ratio"] < 1
    assert math.isclose(metrics["val/ppl"], math.exp(metrics["val/nll"]), rel_tol=1e-5)
    (result,) = trainer.test(task, datamodule=data, verbose=False)
    assert {"test/bleu", "test/chrf", "test/loss", "test/exact_match", "test/ppl", "test/token_acc"} <= set(
        result
    )


def test_exact_match_and_bleu_of_perfect_hypotheses(tmp_path) -> None:
    data = CopyData(n_eval=8)
    data.texts["test"] = [f"sentence number {i} has five words" for i in range(8)]
    task = translation_task()
    trainer = cpu_trainer(tmp_path)
    task.trainer = trainer
    trainer.datamodule = data  # what fit/test set; here the scoring is checked on its own
    scores = task._score_hypotheses("test", dict(enumerate(data.references("test"))))
    assert scores["exact_match"] == 100.0 and scores["bleu"] == pytest.approx(100.0)
    hypotheses = {0: "zzz", **{i: r for i, r in enumerate(data.references("test")) if i}}
    assert task._score_hypotheses("test", hypotheses)["exact_match"] == pytest.approx(100.0 * 7 / 8)


def test_val_bleu_every_n_epochs(tmp_path) -> None:
    task = translation_task(val_bleu_every_n_epochs=2)
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    trainer.fit(task, datamodule=CopyData())
    assert "val/loss" in trainer.callback_metrics and "val/bleu" not in trainer.callback_metrics


def test_checkpoint_is_plain_and_self_describing(tmp_path) -> None:
    task = translation_task(run_config={"model": {"config": TINY}, "seed": 1})
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    trainer.fit(task, datamodule=CopyData())
    path = tmp_path / "x.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # refuses anything but plain data and tensors
    assert checkpoint["config"] == {"model": {"config": TINY}, "seed": 1}
    assert checkpoint["hyper_parameters"]["config"] == TINY
    assert not any("_orig_mod" in k for k in checkpoint["state_dict"])
    assert "bleu_best" in checkpoint
    restored = TranslationTask.load_from_checkpoint(path)
    for name, value in task.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], value)


def test_compiled_checkpoint_has_no_prefix(tmp_path) -> None:
    task = translation_task(compile=True)
    task.configure_model()
    task.on_save_checkpoint(checkpoint := {"state_dict": task.state_dict()})
    assert checkpoint["state_dict"].keys() == TranslationTask(TINY).state_dict().keys()


def test_cosine_total_steps_come_from_the_trainer(tmp_path) -> None:
    task = TranslationTask(
        TINY,
        optimizer=functools.partial(adamw, lr=1e-3),
        scheduler=functools.partial(cosine_with_warmup, warmup_steps=2, total_steps=None),
    )
    trainer = cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(task, datamodule=CopyData())
    (config,) = trainer.lr_scheduler_configs
    assert config.interval == "step"
    assert config.scheduler.lr_lambdas[0].total_steps == 6
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # decayed to the end


def test_classification_task(tmp_path) -> None:
    task = ClassificationTask(
        {**TINY, "n_decoder_layers": 0}, num_classes=2, optimizer=functools.partial(adamw, lr=3e-3)
    )
    data = CopyData(classify=True)
    trainer = cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=4)
    trainer.fit(task, datamodule=data)
    metrics = trainer.callback_metrics
    for name in ("train/loss", "train/acc", "val/loss", "val/acc", "val/f1", "val/acc_best"):
        assert name in metrics, name
    assert metrics["val/acc_best"] >= metrics["val/acc"]
    (result,) = trainer.test(task, datamodule=data, verbose=False)
    assert {"test/acc", "test/f1", "test/loss"} <= set(result)


@pytest.mark.parametrize("before", ["validate", "test"])
def test_fit_after_validate_or_test_on_the_same_task(tmp_path, before: str) -> None:
    """Evaluating first (inference mode: its metric states become inference tensors), then fitting."""
    task = ClassificationTask(
        {**TINY, "n_decoder_layers": 0}, num_classes=2, optimizer=functools.partial(adamw, lr=3e-3)
    )
    data = CopyData(classify=True)
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    getattr(trainer, before)(task, datamodule=data, verbose=False)
    trainer.fit(task, datamodule=data)
    assert trainer.global_step == 2 and "val/acc" in trainer.callback_metrics


def test_classification_token_dropout_pads_ordinary_tokens_in_training_only() -> None:
    task = ClassificationTask({**TINY, "n_decoder_layers": 0}, num_classes=2, token_dropout=0.3)
    config = task.model.config
    src = torch.randint(3, config.src_vocab_size, (64, 40))
    src[:, 0], src[:, 30], src[:, 31:] = config.bos_id, config.eos_id, config.pad_id
    torch.manual_seed(0)
    task.train()
    dropped = task.drop_tokens(src)
    changed = dropped.ne(src)
    assert dropped[changed].eq(config.pad_id).all()  # dropped tokens become padding
    assert not changed[:, [0, *range(30, 40)]].any()  # BOS, EOS and padding stay
    assert abs(changed[:, 1:30].float().mean().item() - 0.3) < 0.03  # each ordinary token with p = 0.3
    task.eval()
    assert torch.equal(task.drop_tokens(src), src)
    with pytest.raises(ValueError, match="token_dropout"):
        ClassificationTask({**TINY, "n_decoder_layers": 0}, num_classes=2, token_dropout=1.0)


def test_classification_rdrop_adds_the_symmetric_kl_of_two_dropout_passes() -> None:
    """R-Drop: in training the batch goes through twice (two dropout masks); the loss is the cross
    entropy over both copies plus rdrop times their symmetric KL. Evaluation is one plain pass."""
    import torch.nn.functional as F

    from transformer.losses import symmetric_kl

    config = {**TINY, "n_decoder_layers": 0, "dropout": 0.3}
    task = ClassificationTask(config, num_classes=3, label_smoothing=0.1, rdrop=0.7)
    src = torch.randint(3, CharTokenizer.vocab_size, (5, 9))
    src[:, 0] = task.model.config.bos_id
    labels = torch.tensor([0, 1, 2, 1, 0])
    outputs = []
    task.model.register_forward_hook(lambda module, args, out: outputs.append((args[0], out)))
    task.train()
    loss = task._step("train", {"src": src, "label": labels})
    ((seen, both),) = outputs
    assert torch.equal(seen, torch.cat([src, src]))  # one forward pass over the doubled batch
    first, second = both.chunk(2)
    assert not torch.allclose(first, second)  # two dropout masks
    cross_entropy = F.cross_entropy(both, labels.repeat(2), label_smoothing=0.1)
    torch.testing.assert_close(loss, cross_entropy + 0.7 * symmetric_kl(first, second))
    task.eval()
    outputs.clear()
    with torch.no_grad():
        loss = task._step("val", {"src": src, "label": labels})
    ((seen, logits),) = outputs
    assert torch.equal(seen, src)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=0.1))
    with pytest.raises(ValueError, match="rdrop"):
        ClassificationTask(config, num_classes=2, rdrop=-0.1)


def test_classification_adversarial_adds_the_loss_at_the_fast_gradient_perturbation() -> None:
    """Adversarial training (Miyato et al., 2017): the training loss is the cross entropy plus the cross
    entropy with each sentence's token embeddings moved along the gradient of that loss, by `adversarial`
    times their norm (padding untouched). Checked against the gradient taken by hand through embeddings
    swapped for a leaf tensor. Evaluation is one plain pass."""
    import torch.nn.functional as F
    from torch import nn

    config = {**TINY, "n_decoder_layers": 0, "dropout": 0.0}
    torch.manual_seed(0)
    task = ClassificationTask(config, num_classes=3, label_smoothing=0.1, adversarial=0.05)
    src = torch.randint(4, CharTokenizer.vocab_size, (4, 7))
    src[:, 0] = BOS
    src[1, 4], src[1, 5:] = EOS, PAD
    labels = torch.tensor([0, 1, 2, 1])
    task.train()
    loss = task._step("train", {"src": src, "label": labels})

    class Fixed(nn.Module):
        """Stands in for the embedding table: returns the given (B, S, D) tensor."""

        def __init__(self, value: torch.Tensor) -> None:
            super().__init__()
            self.value = value

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.value

    table = task.model.src_embed.embedding
    embeddings = table(src).detach().requires_grad_()
    task.model.src_embed.embedding = Fixed(embeddings)
    clean = F.cross_entropy(task.model(src), labels, label_smoothing=0.1)
    clean.backward()
    grad = embeddings.grad  # (B, S, D)
    assert grad[1, 5:].abs().max() == 0  # padding gets no gradient
    keep = src.ne(PAD).unsqueeze(-1)
    size = (embeddings.detach() * keep).norm(dim=(1, 2), keepdim=True)
    perturbation = 0.05 * size * grad / grad.norm(dim=(1, 2), keepdim=True)
    task.model.src_embed.embedding = Fixed(embeddings.detach() + perturbation)
    adversarial = F.cross_entropy(task.model(src), labels, label_smoothing=0.1)
    assert adversarial > clean  # the perturbation raises the loss
    torch.testing.assert_close(loss, clean.detach() + adversarial.detach())
    task.model.src_embed.embedding = table

    calls = []
    task.model.register_forward_hook(lambda module, args, out: calls.append(out))
    task.eval()
    with torch.no_grad():
        val_loss = task._step("val", {"src": src, "label": labels})
    assert len(calls) == 1
    torch.testing.assert_close(val_loss, F.cross_entropy(calls[0], labels, label_smoothing=0.1))
    with pytest.raises(ValueError, match="adversarial"):
        ClassificationTask(config, num_classes=2, adversarial=-0.1)


def test_fp16_mixed_precision_scales_the_loss_and_skips_overflowing_steps(tmp_path) -> None:
    """`trainer.precision=16-mixed`: fp16 autocast with dynamic loss scaling. A scale so large that the
    gradients overflow makes the GradScaler skip those steps and back off (weights untouched, no NaN
    reaches them) until the scale fits; the NaN guard, which watches the loss, counts none of this as a
    fault. On the CPU Lightning swaps the 16-mixed flag for bf16, so the fp16 plugin is built here."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from transformer.training.callbacks import NonFiniteLossGuard

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=10_000)
    guard = NonFiniteLossGuard(action="skip")  # it would count (not raise on) a step it took for a fault
    steps: list[tuple[float, float, bool]] = []  # (scale before, scale after, weights changed) per batch

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.scale = scaler.get_scale()
            self.weights = [p.detach().clone() for p in module.parameters()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            changed = any(not torch.equal(a, p) for a, p in zip(self.weights, module.parameters()))
            steps.append((self.scale, scaler.get_scale(), changed))

    task = translation_task()
    first = next(m for m in task.model.modules() if isinstance(m, torch.nn.Linear))
    dtypes: set[torch.dtype] = set()
    first.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    before = {k: v.clone() for k, v in task.state_dict().items()}
    trainer = cpu_trainer(
        tmp_path,
        max_steps=24,
        max_epochs=10,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        callbacks=[guard, Snapshot()],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(task, datamodule=CopyData())
    assert torch.float16 in dtypes
    assert scaler.get_scale() < 2.0**24  # overflowing steps were skipped and the scale lowered
    assert guard.skipped == 0 and math.isfinite(float(trainer.callback_metrics["train/loss"]))
    overflowed = [changed for before_scale, after_scale, changed in steps if after_scale < before_scale]
    taken = [changed for before_scale, after_scale, changed in steps if after_scale == before_scale]
    assert overflowed and taken and len(overflowed) + len(taken) == len(steps)
    assert not any(overflowed)  # a step whose gradients overflowed left every weight as it was
    assert all(taken)  # and every step that fitted updated them
    after = task.state_dict()
    assert all(value.isfinite().all() for value in after.values() if value.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the steps that fit were taken


def test_bf16_mixed_precision_clips_gradients_with_the_fused_optimizer(tmp_path) -> None:
    """`trainer=gpu` (bf16-mixed) with gradient clipping keeps the fused AdamW (no loss scale: its in-step
    unscaling has nothing to undo; Lightning's plugin would refuse to clip it, an fp16 rule) and still
    clips: every step's gradients reach the optimizer with norm `gradient_clip_val`. 16-mixed, whose
    GradScaler must unscale before clipping, takes the foreach kernel. Lightning builds the same plugins
    on the CPU, so this runs here."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    norms: list[float] = []

    class Norms(L.Callback):  # the gradients the optimizer stepped with (zeroed only before the next step)
        def on_train_batch_end(self, trainer, module, *args) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    task = translation_task()
    trainer = cpu_trainer(
        tmp_path,
        max_steps=3,
        limit_val_batches=0,
        gradient_clip_val=0.01,
        precision="bf16-mixed",
        callbacks=[Norms()],
    )
    trainer.fit(task, datamodule=CopyData())
    assert trainer.global_step == 3
    assert trainer.optimizers[0].defaults["fused"] is True
    assert norms == [pytest.approx(0.01, rel=1e-3)] * 3
    task = translation_task()
    scaler = torch.amp.GradScaler("cpu")
    trainer = cpu_trainer(
        tmp_path, max_steps=1, gradient_clip_val=1.0, plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    trainer.fit(task, datamodule=CopyData())
    assert trainer.optimizers[0].defaults["fused"] is False


def test_fp16_clipping_with_a_forced_fused_optimizer_names_the_keys(tmp_path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    task = TranslationTask(TINY, optimizer=functools.partial(adamw, lr=1e-3, fused=True))
    scaler = torch.amp.GradScaler("cpu")
    trainer = cpu_trainer(
        tmp_path, max_steps=1, gradient_clip_val=1.0, plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    with pytest.raises(ValueError, match=r"model\.optimizer\.fused=true .* trainer\.gradient_clip_val=null"):
        trainer.fit(task, datamodule=CopyData())


def test_tokens_per_s_is_the_previous_steps_real_tokens_over_the_time_between_steps(
    tmp_path, monkeypatch
) -> None:
    """README: `train/tokens_per_s` = non-pad source + target tokens per second and process, data loading
    included. With a clock that advances 0.25 s per training step, the value logged at step k is the
    non-pad src + tgt_out tokens of batch k-1 divided by 0.25; the first step of an epoch logs nothing."""
    from transformer.training import base

    ticks = iter(range(10_000))
    monkeypatch.setattr(base, "time", types.SimpleNamespace(perf_counter=lambda: 0.25 * next(ticks)))
    pad = CharTokenizer.pad_id
    real: list[int] = []
    logged: list[float | None] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            real.append(int(batch["src"].ne(pad).sum() + batch["tgt_out"].ne(pad).sum()))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get("train/tokens_per_s")
            logged.append(None if value is None or batch_idx == 0 else float(value))

    trainer = cpu_trainer(
        tmp_path, max_steps=4, limit_val_batches=0, callbacks=[Record()], log_every_n_steps=1
    )
    trainer.fit(translation_task(), datamodule=CopyData())
    assert len(real) == 4 and len(set(real)) > 1  # batches of different sizes: the value follows them
    assert logged[1:] == [pytest.approx(tokens / 0.25) for tokens in real[:-1]]


def test_ema_averages_the_weights_and_keeps_the_position_tables_exact(tmp_path) -> None:
    """callbacks=[default,ema]: validation runs on averaged weights, but on the exact sinusoidal table.
    Averaging a constant buffer as Lightning does by default (decay * ema + (1 - decay) * x) moves it by
    rounding from the first step on, so validation used other positions than a checkpoint rebuilds."""
    from transformer.positional import sinusoidal_table
    from transformer.training.callbacks import EMAWeightAveraging

    seen: list[tuple[bool, bool]] = []  # per validation: (table exact, weights differ from the raw ones)

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            self.raw = [p.detach().clone() for p in module.parameters()]

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, *args) -> None:
            if batch_idx == 0:
                table = module.model.src_embed.positional.table
                exact = torch.equal(table, sinusoidal_table(*table.shape))
                averaged = any(not torch.equal(r, p) for r, p in zip(self.raw, module.parameters()))
                seen.append((exact, averaged))

    task = translation_task()
    trainer = cpu_trainer(tmp_path, max_epochs=3, callbacks=[Watch(), EMAWeightAveraging(decay=0.9)])
    trainer.fit(task, datamodule=CopyData())
    assert seen == [(True, True)] * 3
