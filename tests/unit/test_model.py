"""Seq2SeqTransformer / Encoder / TransformerClassifier: torch.nn parity, masking, caching, tying."""

import re

import pytest
import torch
from torch import nn

from transformer.config import TransformerConfig
from transformer.model import Encoder, Seq2SeqTransformer, TransformerClassifier

PAD = 0
POSITIONALS = ["sinusoidal", "learned", "rope"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def _config(**overrides: object) -> TransformerConfig:
    values: dict[str, object] = {
        "src_vocab_size": 23,
        "tgt_vocab_size": 19,
        "d_model": 16,
        "n_heads": 4,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "d_ff": 32,
        "dropout": 0.0,
        "max_len": 40,
        "tie_embeddings": "decoder",
    }
    values.update(overrides)
    return TransformerConfig(**values)  # type: ignore[arg-type]


def _batch(vocab: int, lengths: list[int], width: int) -> torch.Tensor:
    """Right-padded (B, width) token ids (no specials) with the given non-pad lengths."""
    tokens = torch.randint(3, vocab, (len(lengths), width))
    for row, length in enumerate(lengths):
        tokens[row, length:] = PAD
    return tokens


def _torch_name(name: str) -> str:
    """torch.nn.Transformer* parameter name -> ours (the attention modules share torch's names)."""
    name = re.sub(r"\.linear([12])\.", r".feed_forward.linear\1.", name)
    return name.replace(".multihead_attn.", ".cross_attn.")


def _copy_from_torch(ours: nn.Module, reference: nn.Module) -> None:
    state = {_torch_name(name): tensor for name, tensor in reference.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(not name.startswith(("encoder.", "decoder.")) for name in missing), missing


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer_with_copied_weights(norm_first: bool) -> None:
    config = _config(norm_first=norm_first)
    ours = Seq2SeqTransformer(config).eval()
    reference = nn.Transformer(
        config.d_model, config.n_heads, config.n_encoder_layers, config.n_decoder_layers, config.d_ff,
        dropout=0.0, batch_first=True, norm_first=norm_first,
    ).eval()  # fmt: skip
    if not norm_first:  # torch always adds a final norm per stack; the paper's post-LN has none
        reference.encoder.norm = reference.decoder.norm = None
    _copy_from_torch(ours, reference)

    src = _batch(config.src_vocab_size, [7, 4, 1], width=7)
    tgt_in = _batch(config.tgt_vocab_size, [5, 6, 2], width=6)
    src_mask, tgt_mask = src.eq(PAD), tgt_in.eq(PAD)
    hidden = reference(
        ours.src_embed(src),
        ours.tgt_embed(tgt_in),
        tgt_mask=torch.ones(6, 6, dtype=torch.bool).triu(1),
        src_key_padding_mask=src_mask,
        tgt_key_padding_mask=tgt_mask,
        memory_key_padding_mask=src_mask,
        tgt_is_causal=True,
    )
    expected = ours.output_projection(hidden)
    logits = ours(src, tgt_in)
    assert logits.shape == (3, 6, config.tgt_vocab_size)
    keep = ~tgt_mask  # torch also masks target pads as keys; real positions never see them anyway
    torch.testing.assert_close(logits[keep], expected[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        ours(src, tgt_in, return_hidden=True)[keep], hidden[keep], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_matches_torch_transformer_encoder(norm_first: bool) -> None:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    reference = nn.TransformerEncoder(
        layer, num_layers=3, norm=nn.LayerNorm(16) if norm_first else None, enable_nested_tensor=False
    ).eval()
    with torch.no_grad():  # give the final norm non-trivial parameters so that copying it matters
        for param in reference.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    ours = Encoder(16, 4, 32, n_layers=3, dropout=0.0, norm_first=norm_first).eval()
    ours.load_state_dict({_torch_name(f".{name}")[1:]: t for name, t in reference.state_dict().items()})
    x = torch.randn(3, 8, 16)
    padding = torch.zeros(3, 8, dtype=torch.bool)
    padding[0, 6:] = padding[2, 1:] = True
    keep = ~padding
    torch.testing.assert_close(
        ours(x, padding)[keep], reference(x, src_key_padding_mask=padding)[keep], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_no_information_from_future_target_tokens(positional: str, norm_first: bool) -> None:
    model = Seq2SeqTransformer(_config(positional=positional, norm_first=norm_first)).eval()
    src = _batch(23, [6, 3], width=6)
    tgt_in = _batch(19, [8, 8], width=8)
    changed = tgt_in.clone()
    changed[:, 5:] = torch.randint(3, 19, (2, 3))
    before, after = model(src, tgt_in), model(src, changed)
    torch.testing.assert_close(before[:, :5], after[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("positional", POSITIONALS)
def test_appending_padding_leaves_real_positions_unchanged(positional: str) -> None:
    model = Seq2SeqTransformer(_config(positional=positional, norm_first=positional == "rope")).eval()
    src = _batch(23, [6, 3, 5], width=6)
    tgt_in = _batch(19, [4, 7, 1], width=7)
    logits = model(src, tgt_in)
    padded = model(nn.functional.pad(src, (0, 9), value=PAD), nn.functional.pad(tgt_in, (0, 4), value=PAD))
    assert padded.shape == (3, 11, 19)
    keep = tgt_in.ne(PAD)
    torch.testing.assert_close(padded[:, :7][keep], logits[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_incremental_decoding_equals_full_recomputation(positional: str, norm_first: bool) -> None:
    model = Seq2SeqTransformer(_config(positional=positional, norm_first=norm_first)).eval()
    src = _batch(23, [6, 2], width=6)
    tgt_in = _batch(19, [9, 9], width=9)
    full = model(src, tgt_in)
    memory = model.encode(src)
    cache = model.new_cache()
    pieces = []
    for start, stop in [(0, 1), (1, 2), (2, 5), (5, 6), (6, 9)]:  # single steps and a chunk (prefill)
        assert cache.offset == start
        pieces.append(model.decode(tgt_in[:, start:stop], memory, src.eq(PAD), cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_reorder_selects_and_repeats_rows() -> None:
    model = Seq2SeqTransformer(_config(positional="rope")).eval()
    src = _batch(23, [6, 2, 4], width=6)
    tgt_in = _batch(19, [5, 5, 5], width=5)
    full = model(src, tgt_in)
    memory, cache = model.encode(src), model.new_cache()
    model.decode(tgt_in[:, :3], memory, src.eq(PAD), cache)
    index = torch.tensor([2, 0, 2])
    cache.reorder(index)
    step = model.decode(tgt_in[index, 3:], memory, src.eq(PAD)[index], cache)
    torch.testing.assert_close(step, full[index, 3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_beam_layout_cache_equals_recomputing_each_beam(positional: str, norm_first: bool) -> None:
    """select_beams: a sentence's beams share one cache row whose keys are never moved; each step's
    logits equal running the decoder over that beam's whole prefix, through parents that repeat, skip
    and reorder beams, and sentences that leave."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_config(positional=positional, norm_first=norm_first)).eval()
    src = _batch(23, [6, 2, 4], width=6)
    memory, src_mask = model.encode(src), src.eq(PAD)
    cache = model.new_cache()
    sentences = torch.arange(3)  # the original sentence of each cache row
    prefixes = torch.randint(3, 19, (3, 1, 1))  # (n, beams, t) tokens of each beam
    model.decode(prefixes[:, 0], memory, src_mask, cache)  # the first step: one hypothesis per sentence
    steps = [  # (parents (n', g'), kept rows of the current sentences)
        (torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 0]]), torch.arange(3)),
        (torch.tensor([[2, 0, 0], [1, 1, 2], [0, 1, 2]]), torch.arange(3)),
        (torch.tensor([[1, 2, 1], [0, 0, 0]]), torch.tensor([0, 2])),  # sentence 1 is done
        (torch.tensor([[2, 1, 0]]), torch.tensor([1])),
    ]
    for parents, kept in steps:
        cache.select_beams(parents, kept)
        sentences = sentences[kept]
        prefixes = prefixes[kept].gather(1, parents.unsqueeze(-1).expand(-1, -1, prefixes.shape[-1]))
        new_tokens = torch.randint(3, 19, (*parents.shape, 1))
        prefixes = torch.cat([prefixes, new_tokens], dim=-1)  # (n', g', t + 1)
        assert cache.offset == prefixes.shape[-1] - 1
        step = model.decode(new_tokens.view(-1, 1), memory[sentences], src_mask[sentences], cache)
        rows = sentences.repeat_interleave(parents.shape[1])
        full = model(src[rows], prefixes.view(rows.numel(), -1))[:, -1:]  # (n' * g', 1, V)
        torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="select_beams"):
        cache.reorder(torch.tensor([0]))
    with pytest.raises(ValueError, match="one position per step"):
        model.decode(prefixes[0, :, -2:], memory[sentences], src_mask[sentences], cache)


def test_the_cache_keeps_the_source_mask_of_its_first_call_as_an_additive_mask() -> None:
    """Like the memory, the source padding mask is read once, kept in attention's additive form and
    reordered with the cross-attention caches (rows that leave, the beam layout's sentences): a later
    call's mask is not read, and the steps equal those given the right mask each time."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_config()).eval()
    src = _batch(23, [6, 2, 4], width=6)
    memory, src_mask = model.encode(src), src.eq(PAD)
    tokens = torch.randint(3, 19, (3, 3))
    cache = model.new_cache()
    model.decode(tokens[:, :1], memory, src_mask, cache)
    assert cache.source_mask is not None and cache.source_mask.dtype == torch.float32
    assert torch.equal(cache.source_mask.isneginf(), src_mask)
    kept = torch.tensor([2, 0])
    cache.reorder(kept)
    assert torch.equal(cache.source_mask.isneginf(), src_mask[kept])
    ignored = torch.ones_like(src_mask[kept])  # every key masked: would give other outputs if read
    step = model.decode(tokens[kept, 1:2], memory[kept], ignored, cache)
    full = model(src[kept], tokens[kept, :2])[:, -1:]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_cache()
        model.decode(tokens[:, :1], memory, src_mask, cache)
    assert cache.source_mask is not None and cache.source_mask.dtype == torch.bfloat16


def test_embedding_tying() -> None:
    none = Seq2SeqTransformer(_config(tie_embeddings="none"))
    decoder = Seq2SeqTransformer(_config(tie_embeddings="decoder"))
    shared = Seq2SeqTransformer(_config(tie_embeddings="all", tgt_vocab_size=23))
    assert none.tgt_embed.embedding.weight is not none.output_projection.weight
    assert decoder.tgt_embed.embedding.weight is decoder.output_projection.weight
    assert decoder.src_embed.embedding.weight is not decoder.output_projection.weight
    assert shared.src_embed.embedding.weight is shared.output_projection.weight
    assert shared.tgt_embed.embedding.weight is shared.output_projection.weight
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(none) - count(decoder) == 19 * 16
    with pytest.raises(ValueError, match="tie_embeddings"):
        _config(tie_embeddings="all")  # 23 != 19


def test_initialisation_and_embedding_scale() -> None:
    model = Seq2SeqTransformer(_config(positional="learned"))
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(param == 0), name
    weight = model.encoder.layers[0].feed_forward.linear1.weight  # (d_ff, D): xavier bound sqrt(6 / 48)
    assert weight.abs().max() <= (6 / 48) ** 0.5 and weight.std() > 0.1
    # sinusoidal: token 0-row gets embedding * sqrt(D) + PE(0) = embedding * 4 + [0, 1, 0, 1, ...]
    sinusoidal = Seq2SeqTransformer(_config()).eval()
    x = sinusoidal.src_embed(torch.tensor([[5]]))
    expected = sinusoidal.src_embed.embedding.weight[5] * 4 + torch.tensor([0.0, 1.0] * 8)
    torch.testing.assert_close(x[0, 0], expected)


@pytest.mark.parametrize("tie", ["none", "all"])
def test_normal_embedding_init_gives_unit_variance_after_the_sqrt_d_scaling(tie: str) -> None:
    """embedding_init="normal": token embeddings (and a projection tied to them) ~ N(0, D^-0.5), so that
    embedding * sqrt(D) has unit variance; learned positions and every other matrix stay Xavier."""
    torch.manual_seed(0)
    D, V = 64, 4000
    config = dict(src_vocab_size=V, d_model=D, n_heads=4, d_ff=128, positional="learned", tie_embeddings=tie)
    xavier = Seq2SeqTransformer(TransformerConfig(**config))
    normal = Seq2SeqTransformer(TransformerConfig(**config, embedding_init="normal"))
    embeddings = [normal.src_embed.embedding.weight, normal.tgt_embed.embedding.weight]
    for weight in embeddings:
        assert abs(weight.std().item() * D**0.5 - 1.0) < 0.02 and abs(weight.mean().item()) < 0.01
    assert abs(xavier.src_embed.embedding.weight.std().item() - (2 / (V + D)) ** 0.5) < 1e-3
    assert (normal.output_projection.weight is embeddings[1]) == (tie == "all")
    if tie == "none":  # an untied projection is an ordinary Xavier matrix
        assert normal.output_projection.weight.abs().max() <= (6 / (V + D)) ** 0.5
    positions = normal.src_embed.positional.embedding.weight  # (max_len, D) learned positions
    assert positions.abs().max() <= (6 / sum(positions.shape)) ** 0.5
    feed_forward = normal.encoder.layers[0].feed_forward.linear1.weight
    assert feed_forward.abs().max() <= (6 / (D + 128)) ** 0.5
    encoder_only = TransformerConfig(**{**config, "n_decoder_layers": 0}, embedding_init="normal")
    classifier = TransformerClassifier(encoder_only, 2)
    assert abs(classifier.src_embed.embedding.weight.std().item() * D**0.5 - 1.0) < 0.02
    with pytest.raises(ValueError, match="embedding_init"):
        TransformerConfig(src_vocab_size=V, embedding_init="uniform")


def test_attention_maps() -> None:
    model = Seq2SeqTransformer(_config()).eval()
    src = _batch(23, [5, 3], width=5)
    tgt_in = _batch(19, [4, 4], width=4)
    maps = model.attention_maps(src, tgt_in)
    assert [len(maps[key]) for key in ("encoder_self", "decoder_self", "cross")] == [2, 2, 2]
    assert maps["encoder_self"][0].shape == (2, 4, 5, 5)
    assert maps["decoder_self"][1].shape == (2, 4, 4, 4)
    assert maps["cross"][0].shape == (2, 4, 4, 5)
    assert torch.all(maps["cross"][1][1, :, :, 3:] == 0)  # the padded source keys get no weight
    torch.testing.assert_close(maps["cross"][0].sum(-1), torch.ones(2, 4, 4))


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_classifier_pools_each_sentence_alone(pooling: str) -> None:
    """The pooled vector of each sentence, recomputed from its own unpadded hidden states."""
    model = TransformerClassifier(_config(n_decoder_layers=0), num_classes=3, pooling=pooling).eval()  # type: ignore[arg-type]
    src = _batch(23, [6, 2, 4], width=6)
    logits = model(src)
    for row, length in enumerate([6, 2, 4]):
        alone = src[row : row + 1, :length]
        hidden = model.encoder(model.src_embed(alone), alone.eq(PAD))[0]  # (length, D)
        pooled = {"cls": hidden[0], "mean": hidden.mean(0), "max": hidden.max(0).values}[pooling]
        torch.testing.assert_close(logits[row], model.head(pooled), atol=1e-5, rtol=1e-5)


def test_seq2seq_needs_a_decoder() -> None:
    with pytest.raises(ValueError, match="n_decoder_layers"):
        Seq2SeqTransformer(_config(n_decoder_layers=0))


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_classifier_ignores_padding(pooling: str) -> None:
    config = _config(n_decoder_layers=0, positional="rope")
    model = TransformerClassifier(config, num_classes=3, pooling=pooling).eval()  # type: ignore[arg-type]
    src = _batch(23, [6, 2, 4], width=6)
    logits = model(src)
    assert logits.shape == (3, 3)
    torch.testing.assert_close(model(nn.functional.pad(src, (0, 5))), logits, atol=1e-5, rtol=1e-5)
    assert len(model.attention_maps(src)["encoder_self"]) == 2
    with pytest.raises(ValueError, match="pooling"):
        TransformerClassifier(config, 3, pooling="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_classes"):
        TransformerClassifier(config, 1)


def test_classifier_learns_a_toy_task() -> None:
    """Label = whether token 5 occurs: needs attention across positions and the pooling."""
    config = _config(n_encoder_layers=1, n_decoder_layers=0)
    model = TransformerClassifier(config, num_classes=2, pooling="mean")
    src = _batch(23, [int(n) for n in torch.randint(2, 9, (64,))], width=8)
    labels = src.eq(5).any(dim=1).long()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(src), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    assert (model(src).argmax(-1) == labels).float().mean() == 1.0


@pytest.mark.parametrize(
    "overrides", [{}, {"norm_first": True, "positional": "rope"}, {"positional": "learned"}]
)
def test_packed_tokens_give_the_padded_numbers_and_gradients(overrides: dict[str, object]) -> None:
    """pack_tokens (position-wise layers on non-pad tokens only) changes nothing at real positions."""
    model = Seq2SeqTransformer(_config(**overrides))
    src = _batch(23, [6, 3, 1, 5], width=6)
    tgt_in = _batch(19, [4, 7, 1, 2], width=7)
    keep = tgt_in.ne(PAD)
    results = {}
    for pack in (True, False):
        model.pack_tokens = pack
        model.zero_grad()
        hidden = model(src, tgt_in, return_hidden=True, positions=keep)  # (N, D)
        model.output_projection(hidden).logsumexp(-1).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        logits = model(src, tgt_in)
        assert logits.shape == (4, 7, 19)
        results[pack] = (hidden, logits[keep], model.encode(src)[src.ne(PAD)], grads)
    for packed, padded in zip(results[True][:3], results[False][:3]):
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for packed, padded in zip(results[True][3], results[False][3]):
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)
    model.pack_tokens = None  # the default: packs on the CPU, not on a GPU (measured slower there)
    assert model.packing_on(torch.device("cpu")) and not model.packing_on(torch.device("cuda"))
    model.pack_tokens = True
    assert model.packing_on(torch.device("cuda"))
    odd = keep.clone()
    odd[0, 1] = False  # positions that are not each row's prefix
    torch.testing.assert_close(
        model(src, tgt_in, positions=odd), model(src, tgt_in)[odd], atol=1e-5, rtol=1e-5
    )
