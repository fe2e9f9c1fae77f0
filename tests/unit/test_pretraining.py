"""Masked-LM pretraining (`MaskedLMTask`) and fine-tuning its encoder (`ClassificationTask.init_from`)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn import functional as F

from tests.helpers.tasks import TINY, CopyData, cpu_trainer
from transformer.checkpoint import CheckpointError
from transformer.config import TransformerConfig
from transformer.evaluation.init_from import load_pretrained_encoder
from transformer.evaluation.restore import task_of
from transformer.model import TransformerClassifier, TransformerMaskedLM
from transformer.training import ClassificationTask, MaskedLMTask
from transformer.training.optim import adamw

ENCODER = {**TINY, "n_decoder_layers": 0}
UNK = 3


def _batch(config: TransformerConfig, rows: int = 400, length: int = 40, eos: int = 30) -> torch.Tensor:
    """(rows, length): BOS, ordinary tokens, EOS at `eos`, then padding."""
    src = torch.randint(UNK + 1, config.src_vocab_size, (rows, length))
    src[:, 0], src[:, eos], src[:, eos + 1 :] = config.bos_id, config.eos_id, config.pad_id
    return src


def test_masking_picks_ordinary_tokens_and_splits_them_80_10_10() -> None:
    task = MaskedLMTask({**ENCODER, "src_vocab_size": 1000}, mask_prob=0.15)
    config = task.model.config
    src = _batch(config)
    masked, picked = task.mask_tokens(src, torch.Generator().manual_seed(0))
    assert not picked[:, [0, *range(30, 40)]].any()  # never BOS, EOS or padding
    assert torch.equal(masked[~picked], src[~picked])  # only picked tokens change
    assert abs(picked[:, 1:30].float().mean().item() - 0.15) < 0.01
    n = picked.sum().item()
    to_mask = masked[picked].eq(UNK).float().sum().item() / n
    kept = masked[picked].eq(src[picked]).float().sum().item() / n
    assert abs(to_mask - 0.8) < 0.03 and abs(kept - 0.1) < 0.03  # the rest (~10%) random tokens
    assert masked[picked].ge(UNK).all()  # random replacements are never pad/BOS/EOS
    again, picked_again = task.mask_tokens(src, torch.Generator().manual_seed(0))
    assert torch.equal(again, masked) and torch.equal(picked_again, picked)  # eval masks are reproducible
    with pytest.raises(ValueError, match="mask_prob"):
        MaskedLMTask(ENCODER, mask_prob=0.0)


def test_masked_lm_logits_are_the_tied_projection_of_the_picked_positions() -> None:
    config = TransformerConfig.from_dict({**ENCODER, "norm_first": True})
    model = TransformerMaskedLM(config).eval()
    torch.nn.init.normal_(model.lm_bias)
    src = _batch(config, rows=3, length=12, eos=9)
    positions = torch.zeros_like(src, dtype=torch.bool)
    positions[0, 2], positions[1, 5], positions[2, 1] = True, True, True
    hidden, _ = model.encode(src)  # (B, S, D)
    rows = model.lm_transform(hidden[[0, 1, 2], [2, 5, 1]])  # (3, D)
    expected = rows @ model.src_embed.embedding.weight.T + model.lm_bias  # (3, V)
    torch.testing.assert_close(model(src, positions), expected)
    # the classifier's encoder parameters have the same names, so they carry over
    classifier_keys = set(TransformerClassifier(config, 2).state_dict())
    shared = {k for k in model.state_dict() if k.startswith(("src_embed.", "encoder."))}
    assert shared and shared <= classifier_keys


def test_masked_lm_learns_and_reports_loss(tmp_path) -> None:
    task = MaskedLMTask(ENCODER, mask_prob=0.3, optimizer=functools.partial(adamw, lr=3e-3))
    data = CopyData(classify=True)  # the labels are ignored
    trainer = cpu_trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    trainer.fit(task, datamodule=data)
    metrics = trainer.callback_metrics
    for name in ("train/loss", "train/acc", "val/loss", "val/acc", "val/loss_best"):
        assert name in metrics, name
    # letters 'a'-'d' only: a trained model beats the uniform guess over the 12 ids (ln 12 = 2.48)
    assert float(metrics["val/loss"]) < 1.6
    (result,) = trainer.test(task, datamodule=data, verbose=False)
    assert {"test/loss", "test/acc"} <= set(result)


def _pretrained(tmp_path, tokenizers: dict | None = None, **config) -> tuple[MaskedLMTask, str]:
    task = MaskedLMTask({**ENCODER, **config})
    with torch.no_grad():
        for p in task.model.parameters():
            p.add_(torch.randn_like(p))  # unlike any fresh initialization
    path = tmp_path / "pretrained.ckpt"
    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}
    if tokenizers is not None:
        checkpoint["ClassificationDataModule"] = {"tokenizers": tokenizers}
    torch.save(checkpoint, path)
    return task, str(path)


def test_init_from_copies_the_encoder_and_keeps_a_fresh_head(tmp_path) -> None:
    pretrained, path = _pretrained(tmp_path, tokenizers={"src": "{json}"})
    task = ClassificationTask(ENCODER, num_classes=2, init_from=path)
    head = {k: v.clone() for k, v in task.model.head.state_dict().items()}
    assert task.load_init_from({"src": "{json}"}) == len(
        [k for k in pretrained.model.state_dict() if k.startswith(("src_embed.", "encoder."))]
    )
    ours = task.model.state_dict()
    for key, value in pretrained.model.state_dict().items():
        if key.startswith(("src_embed.", "encoder.")):
            assert torch.equal(ours[key], value), key
    for key, value in head.items():
        assert torch.equal(ours[f"head.{key}"], value)
    assert ClassificationTask(ENCODER, num_classes=2).load_init_from() == 0  # no init_from: nothing


def test_init_from_refuses_what_does_not_fit(tmp_path) -> None:
    _, path = _pretrained(tmp_path, tokenizers={"src": "{json}"})
    classifier = TransformerClassifier(TransformerConfig.from_dict(ENCODER), 2)
    with pytest.raises(CheckpointError, match="another tokenizer"):
        load_pretrained_encoder(classifier, path, {"src": "{other json}"})
    wider = TransformerClassifier(TransformerConfig.from_dict({**ENCODER, "d_ff": 128}), 2)
    with pytest.raises(CheckpointError, match=r"encoder.layers.0.*\(64, 32\) vs \(128, 32\)"):
        load_pretrained_encoder(wider, path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained_encoder(classifier, tmp_path / "missing.ckpt")
    # a classification checkpoint is not a pretrained encoder (that is what ckpt_path= resumes)
    task = ClassificationTask(ENCODER, num_classes=2)
    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}
    torch.save(checkpoint, tmp_path / "cls.ckpt")
    with pytest.raises(CheckpointError, match="not a masked-LM pretraining checkpoint"):
        load_pretrained_encoder(classifier, tmp_path / "cls.ckpt")


def test_a_pretraining_checkpoint_is_not_evaluated_as_a_classifier(tmp_path) -> None:
    _, path = _pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="masked-LM pretraining checkpoint"):
        task_of(torch.load(path, weights_only=True), path)


def test_loss_is_cross_entropy_over_the_picked_tokens_only() -> None:
    task = MaskedLMTask(ENCODER, mask_prob=0.5).eval()
    src = _batch(task.model.config, rows=8, length=30, eos=24)
    loss, acc, n = task._loss({"src": src}, torch.Generator().manual_seed(3))
    masked, picked = task.mask_tokens(src, torch.Generator().manual_seed(3))
    logits = task.model(masked, picked)
    assert n == int(picked.sum()) > 0
    torch.testing.assert_close(loss, F.cross_entropy(logits, src[picked]))
    torch.testing.assert_close(acc, logits.argmax(-1).eq(src[picked]).float().mean())
