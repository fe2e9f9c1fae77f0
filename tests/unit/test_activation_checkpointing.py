"""Activation checkpointing (`model.activation_checkpointing`): each encoder / decoder layer recomputed in
the backward pass gives the same loss and gradients (dropout included), keeps far fewer activations for
backward (counted with saved_tensors_hooks, padded and packed, in the model and through the task's
training loss), and stays out of evaluation and decoding."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import pytest
import torch

from transformer.config import TransformerConfig
from transformer.losses import label_smoothed_cross_entropy
from transformer.model import Seq2SeqTransformer, TransformerClassifier
from transformer.search.decoding import greedy_search
from transformer.stacks import checkpoint_layers
from transformer.training.translation import TranslationTask

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 40


def _config(**overrides: object) -> TransformerConfig:
    values: dict[str, object] = {
        "src_vocab_size": VOCAB,
        "d_model": 32,
        "n_heads": 4,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "d_ff": 64,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "max_len": 32,
    }
    values.update(overrides)
    return TransformerConfig(**values)  # type: ignore[arg-type]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (6, 11), generator=generator)
    tgt = torch.randint(4, VOCAB, (6, 10), generator=generator)
    src[2:, 7:], tgt[3:, 6:] = 0, 0  # padding: both the padded and the packed paths have work to do
    return src, tgt[:, :-1], tgt[:, 1:]


def _loss_and_grads(model: torch.nn.Module, checkpointing: bool, pack: bool) -> tuple[float, dict]:
    checkpoint_layers(model, checkpointing)
    model.pack_tokens = pack
    model.zero_grad()
    src, tgt_in, tgt_out = _batch()
    torch.manual_seed(7)  # the same dropout masks, if checkpointing replays the RNG as it must
    logits = model(src, tgt_in)
    out = label_smoothed_cross_entropy(
        logits[tgt_out.ne(0)], tgt_out[tgt_out.ne(0)], ignore_index=0, label_smoothing=0.1
    )
    out.loss.backward()
    return out.loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("overrides", [{}, {"norm_first": True}, {"positional": "rope"}])
@pytest.mark.parametrize("pack", [False, True])
def test_same_loss_and_gradients_with_dropout(overrides: dict[str, object], pack: bool) -> None:
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_config(**overrides)).train()
    loss, grads = _loss_and_grads(model, False, pack)
    loss_ckpt, grads_ckpt = _loss_and_grads(model, True, pack)
    assert loss_ckpt == pytest.approx(loss, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, atol=1e-6, rtol=0, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


def _long_batch() -> dict[str, torch.Tensor]:
    """48 right-padded rows of up to 33 source and 30 target tokens: activations dominate the saved
    tensors, and both the padded and the packed paths have padding to skip."""
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (48, 33), generator=generator)
    tgt = torch.randint(4, VOCAB, (48, 31), generator=generator)
    for row in range(48):
        src[row, 33 - row % 9 :] = 0
        tgt[row, 31 - row % 7 :] = 0
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def _saved_bytes(forward: Callable[[], object], parameters: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the tensors (other than parameters) autograd keeps for the backward pass of `forward()`,
    counted with saved_tensors_hooks, each storage once."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    return sum(size for pointer, size in saved.items() if pointer not in weights)


def _model_saved_bytes(model: Seq2SeqTransformer, checkpointing: bool, pack: bool) -> int:
    checkpoint_layers(model, checkpointing)
    model.pack_tokens = pack
    batch = _long_batch()
    return _saved_bytes(lambda: model(batch["src"], batch["tgt_in"]), model.parameters())


@pytest.mark.parametrize("pack", [False, True])
def test_far_fewer_activations_are_kept_for_backward(pack: bool) -> None:
    """Padded (the GPU's layout) and packed (`pack_tokens=True`, the CPU default) alike."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_config(n_encoder_layers=4, n_decoder_layers=4, max_len=64)).train()
    plain, checkpointed = _model_saved_bytes(model, False, pack), _model_saved_bytes(model, True, pack)
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def test_classifier_layers_are_checkpointed_and_decoding_is_unchanged() -> None:
    torch.manual_seed(0)
    classifier = TransformerClassifier(_config(n_decoder_layers=0), num_classes=3)
    assert checkpoint_layers(classifier) == 2
    model = Seq2SeqTransformer(_config(dropout=0.0, attention_dropout=0.0)).eval()
    src = _batch()[0]
    before = greedy_search(model, src)
    assert checkpoint_layers(model) == 4
    assert torch.equal(greedy_search(model, src), before)  # eval and no_grad: layers run plainly


@pytest.mark.parametrize("pack", [None, False])
def test_task_turns_it_on(pack: bool | None) -> None:
    """The task's training loss keeps far fewer activations with `activation_checkpointing=True` than
    without, packed (the CPU default, pack_tokens=None) or padded: the setting reaches the layers that run."""
    config = vars(_config(n_encoder_layers=4, n_decoder_layers=4, max_len=64))
    saved = {}
    for enabled in (False, True):
        torch.manual_seed(0)
        task = TranslationTask(config, activation_checkpointing=enabled).train()
        task.configure_model()
        task.model.pack_tokens = pack
        assert task.model.packing_on(torch.device("cpu")) is (pack is None)
        loss = functools.partial(task._token_loss, _long_batch())
        saved[enabled] = _saved_bytes(loss, task.parameters())
    assert saved[True] < 0.5 * saved[False], saved
