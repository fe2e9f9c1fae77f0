"""The residual stream in the autocast dtype (`transformer.norm`, `model.low_precision_residual`): LayerNorm
in low precision with float32 statistics, the stream's dtype through a model, the same model outside
autocast, and the switch a task turns on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.embedding import Embedder
from transformer.layers import DecoderLayer, EncoderLayer
from transformer.norm import LayerNorm, residual_in_autocast_dtype

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


def _norm(d: int = 64) -> LayerNorm:
    torch.manual_seed(0)
    norm = LayerNorm(d)
    nn.init.normal_(norm.weight, 1.0, 0.2)
    nn.init.normal_(norm.bias, 0.0, 0.2)
    return norm


def test_layer_norm_is_torch_s_unless_switched_and_under_autocast() -> None:
    norm, x = _norm(), torch.randn(3, 5, 64)
    reference = nn.LayerNorm(64)
    reference.load_state_dict(norm.state_dict())  # the same parameters, the same state dict keys
    assert torch.equal(norm(x), reference(x))
    norm.in_autocast_dtype = True
    assert torch.equal(norm(x), reference(x))  # no autocast: float32, as before
    with torch.autocast("cpu", dtype=BF16):
        assert norm(x.to(BF16)).dtype == BF16
        assert norm(x).dtype == torch.float32  # a float32 input is left to autocast's own policy


def test_low_precision_layer_norm_keeps_float32_statistics() -> None:
    """Inputs with a large common offset: statistics summed in bf16 would lose the spread entirely."""
    norm = _norm()
    norm.in_autocast_dtype = True
    x = (1000.0 + 8.0 * torch.randn(16, 64)).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        out = norm(x)
    expected = F.layer_norm(x.float(), (64,), norm.weight, norm.bias, norm.eps)  # all in float32
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_low_precision_layer_norm_keeps_its_epsilon() -> None:
    """BERT's 1e-12, or any eps (`norm_eps`), holds in the low-precision path too: a row of tiny spread,
    where eps dominates the variance, normalises as torch's LayerNorm with that eps."""
    norm = LayerNorm(64, eps=0.25)
    norm.in_autocast_dtype = True
    x = (0.1 * torch.randn(8, 64)).to(BF16)  # variance ~0.01: eps 0.25 shrinks the output ~5x
    with torch.autocast("cpu", dtype=BF16):
        out = norm(x)
    expected = F.layer_norm(x.float(), (64,), norm.weight, norm.bias, 0.25)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=1e-2)
    default_eps = F.layer_norm(x.float(), (64,), norm.weight, norm.bias, 1e-5)
    assert (expected - default_eps).abs().max() > 1.0  # the eps matters here


@contextlib.contextmanager
def _watched(model: nn.Module) -> Iterator[set[torch.dtype]]:
    """The dtypes each embedder and layer of `model` hands to the next, while the context is open."""
    seen: set[torch.dtype] = set()

    def hook(module: nn.Module, args: object, out: object) -> None:
        seen.add((out[0] if isinstance(out, tuple) else out).dtype)

    stream = (Embedder, EncoderLayer, DecoderLayer)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, stream)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _stream_dtypes(model: nn.Module) -> set[torch.dtype]:
    """Over one training forward under bf16 autocast."""
    src = tiny_sources(4, vocab=24)
    with _watched(model) as seen, torch.autocast("cpu", dtype=BF16):
        model(src, src)
    return seen


def test_the_residual_stream_in_bf16_only_when_switched_on() -> None:
    model = tiny_seq2seq(0, vocab=24).train()
    assert _stream_dtypes(model) == {torch.float32}  # autocast's own policy
    assert residual_in_autocast_dtype(model) == 2 + 2 * 2 + 3 * 2  # embedders, LayerNorms (post-LN)
    assert _stream_dtypes(model) == {BF16}
    residual_in_autocast_dtype(model, False)
    assert _stream_dtypes(model) == {torch.float32}


def test_a_switched_model_trains_close_to_the_float32_stream() -> None:
    """The loss and every gradient of one training step, bf16 stream against float32 stream (the same
    weights, dropout off): close, finite, and the same parameters get gradients."""
    src = tiny_sources(8, vocab=24)

    def step(switched: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = tiny_seq2seq(0, vocab=24, dropout=0.0).train()
        residual_in_autocast_dtype(model, switched)
        with torch.autocast("cpu", dtype=BF16):
            logits = model(src, src)
        loss = F.cross_entropy(logits.float().flatten(0, 1), src.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (loss32, grads32), (loss16, grads16) = step(False), step(True)
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    assert grads16.keys() == grads32.keys()
    for name, grad in grads16.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
        cosine = F.cosine_similarity(grad.flatten(), grads32[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))


def test_outside_autocast_a_switched_model_is_unchanged() -> None:
    """Evaluation and decoding in float32: the switch changes no bit."""
    src = tiny_sources(4, vocab=24)
    model = tiny_seq2seq(0, vocab=24).eval()
    with torch.no_grad():
        before = model(src, src)
        residual_in_autocast_dtype(model)
        assert torch.equal(model(src, src), before)


@pytest.mark.parametrize("pack", [None, False])  # None: packed, as the CPU runs; False: padded, as a GPU
def test_the_task_switches_its_model(pack: bool | None) -> None:
    from transformer.training.translation import TranslationTask

    config = {"src_vocab_size": 24, "d_model": 32, "n_heads": 4, "n_encoder_layers": 2, "n_decoder_layers": 2,
              "d_ff": 64, "max_len": 64}  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    src, tgt = (
        torch.randint(4, 24, (6, 9), generator=generator),
        torch.randint(4, 24, (6, 8), generator=generator),
    )
    src[::2, 6:], tgt[::2, 5:] = 0, 0  # padding for the packed path to skip
    batch = {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
    dtypes = {}
    for switched in (False, True):
        task = TranslationTask(config, low_precision_residual=switched).train()
        task.configure_model()
        task.model.pack_tokens = pack
        with _watched(task.model) as seen, torch.autocast("cpu", dtype=BF16):
            loss = task._token_loss(batch).loss
        loss.backward()
        dtypes[switched] = seen
        assert torch.isfinite(loss)
    assert dtypes == {False: {torch.float32}, True: {BF16}}
    with pytest.raises(ValueError, match=r"model\.low_precision_residual must be true, false or auto"):
        TranslationTask(config, low_precision_residual="yes").configure_model()


@pytest.mark.parametrize(("device", "switched"), [("cpu", False), ("cuda", True)])
def test_auto_switches_the_residual_stream_on_a_gpu_only(device: str, switched: bool) -> None:
    """`model.low_precision_residual=auto` (the default) follows the trainer's device, read before the model
    moves there (Lightning calls configure_model on the CPU-built module)."""
    from types import SimpleNamespace

    from transformer.training.translation import TranslationTask

    config = {"src_vocab_size": 24, "d_model": 32, "n_heads": 4, "n_encoder_layers": 1, "n_decoder_layers": 1,
              "d_ff": 64, "max_len": 64}  # fmt: skip
    task = TranslationTask(config)
    assert task.hparams.low_precision_residual == "auto"
    task._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
    task.configure_model()
    norms = [module for module in task.model.modules() if isinstance(module, LayerNorm)]
    assert norms and all(norm.in_autocast_dtype is switched for norm in norms)
