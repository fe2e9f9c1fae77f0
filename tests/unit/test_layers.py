"""FeedForward variants and single encoder/decoder layers against torch.nn's layers with copied weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.attention import KVCache
from transformer.layers import DecoderLayer, EncoderLayer, FeedForward

D, H, FF = 16, 4, 32


def _load_from_torch(ours: nn.Module, reference: nn.Module) -> None:
    """Copy a torch.nn.Transformer{Encoder,Decoder}Layer's weights into ours (names differ slightly)."""
    renames = {
        "linear1": "feed_forward.linear1",
        "linear2": "feed_forward.linear2",
        "multihead_attn": "cross_attn",
    }
    state = {}
    for name, tensor in reference.state_dict().items():
        head, _, rest = name.partition(".")
        state[f"{renames.get(head, head)}.{rest}"] = tensor
    ours.load_state_dict(state)  # strict: every parameter of ours is covered


def test_feed_forward_formulas() -> None:
    x = torch.randn(2, 3, D)
    relu = FeedForward(D, FF, dropout=0.0)
    expected = relu.linear2(torch.relu(relu.linear1(x)))
    torch.testing.assert_close(relu(x), expected)
    gelu = FeedForward(D, FF, dropout=0.0, activation="gelu")
    torch.testing.assert_close(gelu(x), gelu.linear2(F.gelu(gelu.linear1(x))))
    swiglu = FeedForward(D, FF, dropout=0.0, activation="swiglu")
    assert swiglu.gate is not None
    torch.testing.assert_close(swiglu(x), swiglu.linear2(F.silu(swiglu.linear1(x)) * swiglu.gate(x)))
    with pytest.raises(ValueError, match="'tanh'"):
        FeedForward(D, FF, activation="tanh")  # type: ignore[arg-type]


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_torch(norm_first: bool) -> None:
    reference = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    ours = EncoderLayer(D, H, FF, dropout=0.0, norm_first=norm_first)
    _load_from_torch(ours, reference)
    x = torch.randn(3, 7, D)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = padding[2, 2:] = True
    reference.eval()  # eval takes torch's fused fast path: the strictest reference
    expected = reference(x, src_key_padding_mask=padding)
    out, weights = ours(x, padding)
    assert weights is None
    keep = ~padding  # torch's fast path may zero padded rows; only real positions are defined
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch_and_its_cache(norm_first: bool) -> None:
    reference = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    ours = DecoderLayer(D, H, FF, dropout=0.0, norm_first=norm_first).eval()
    _load_from_torch(ours, reference)
    x, memory = torch.randn(2, 6, D), torch.randn(2, 5, D)
    memory_padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    expected = reference(
        x, memory, tgt_mask=causal, memory_key_padding_mask=memory_padding, tgt_is_causal=True
    )
    out, _, _ = ours(x, memory, memory_padding)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    # the same positions fed one (then two) at a time through the caches
    self_cache, cross_cache = KVCache(), KVCache(static=True)
    pieces = []
    for start, stop in [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]:
        piece, _, _ = ours(
            x[:, start:stop], memory, memory_padding, self_cache=self_cache, cross_cache=cross_cache
        )
        pieces.append(piece)
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=1e-5, rtol=1e-5)


def test_layers_return_per_head_weights_when_asked() -> None:
    layer = DecoderLayer(D, H, FF, dropout=0.0).eval()
    x, memory = torch.randn(2, 4, D), torch.randn(2, 3, D)
    _, self_weights, cross_weights = layer(x, memory, need_weights=True)
    assert self_weights is not None and cross_weights is not None
    assert self_weights.shape == (2, H, 4, 4) and cross_weights.shape == (2, H, 4, 3)
    assert torch.all(self_weights.triu(1) == 0)  # causal
    torch.testing.assert_close(cross_weights.sum(-1), torch.ones(2, H, 4))


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_only_in_training(norm_first: bool) -> None:
    """In eval mode a layer with dropout computes what the same weights compute with dropout=0."""
    x, memory = torch.randn(2, 5, D), torch.randn(2, 4, D)
    memory_padding = torch.tensor([[False] * 4, [False] * 2 + [True] * 2])
    for kind, run in (
        (EncoderLayer, lambda m: m(x)[0]),
        (DecoderLayer, lambda m: m(x, memory, memory_padding)[0]),
    ):
        layer = kind(D, H, FF, dropout=0.5, attention_dropout=0.5, norm_first=norm_first)
        plain = kind(D, H, FF, dropout=0.0, attention_dropout=0.0, norm_first=norm_first)
        plain.load_state_dict(layer.state_dict())  # the same weights: dropout has none
        expected = run(plain)
        assert not torch.equal(run(layer), run(layer))  # training: a new mask each call
        assert not torch.allclose(run(layer), expected)
        layer.eval()
        torch.testing.assert_close(run(layer), expected)


def test_dropout_mask_rate_scale_and_fused_residual() -> None:
    from transformer.layers import Dropout

    torch.manual_seed(0)
    dropout = Dropout(0.1)
    x, residual = torch.randn(200, 500, requires_grad=True), torch.randn(200, 500, requires_grad=True)
    out = dropout(x, residual)
    out.backward(torch.ones_like(out))
    mask = x.grad  # d out / d x: the mask the forward pass used, 0 or 1 / (1 - p')
    p = 6554 / 2**16  # 0.1 rounded to 16 bits
    values = mask.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - p))
    assert abs((mask == 0).float().mean().item() - p) < 0.005
    torch.testing.assert_close(out, residual + x * mask)
    assert torch.all(residual.grad == 1)
    dropout.eval()
    assert torch.equal(dropout(x, residual), residual + x) and dropout(x) is x
    assert torch.equal(Dropout(0.0)(x), x) and torch.all(Dropout(1.0)(x) == 0)
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)


def test_memory_group_shares_one_memory_row_per_group() -> None:
    """memory_group=g (beams of a sentence) = every row with its own copy of the memory."""
    layer = DecoderLayer(D, H, FF, dropout=0.0).eval()
    x, memory = torch.randn(6, 2, D), torch.randn(2, 5, D)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    grouped = layer(x, memory, padding, self_cache=KVCache(), cross_cache=KVCache(static=True),
                    need_weights=True, memory_group=3)  # fmt: skip
    repeated = layer(x, memory.repeat_interleave(3, 0), padding.repeat_interleave(3, 0),
                     self_cache=KVCache(), cross_cache=KVCache(static=True), need_weights=True)  # fmt: skip
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
