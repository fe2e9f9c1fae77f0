"""`finetune.freeze`'s start-of-run line: what is frozen and what trains, by module, with parameter counts;
with tied embeddings `finetune.freeze=encoder` freezes the decoder's embedding and the output projection too
(one matrix), and the line says so."""

from __future__ import annotations

import pytest
import torch

from transformer.config import TransformerConfig
from transformer.lora import FinetuneSettings
from transformer.model import Seq2SeqTransformer
from transformer.training.finetune import apply_finetune, parameter_counts

SIZES = dict(src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2, n_encoder_layers=1,
             n_decoder_layers=1, d_ff=32)  # fmt: skip


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_freezing_the_encoder_with_tied_embeddings_freezes_the_output_projection_and_says_so() -> None:
    model = Seq2SeqTransformer(TransformerConfig(**SIZES, tie_embeddings="all"))
    line = apply_finetune(model, FinetuneSettings.from_values({"freeze": "encoder"}))
    embedding = model.output_projection.weight
    assert not embedding.requires_grad  # the decoder's input and output matrices stop training
    assert all(p.requires_grad for p in model.decoder.parameters())
    trainable, total = parameter_counts(model)
    assert trainable == _numel(model.decoder) and total == _numel(model)
    frozen_encoder = _numel(model.encoder)
    assert line == (
        f"Fine-tuning (finetune.freeze=encoder): {trainable} trainable of {total} parameters; frozen: "
        f"output_projection {embedding.numel()}, encoder {frozen_encoder}; trainable: decoder {trainable}; "
        "tied: one (50, 16) tensor in output_projection, src_embed, tgt_embed (frozen in all of them)"
    )


@pytest.mark.parametrize("tie", ["none", "decoder"])
def test_without_tying_to_the_source_the_decoders_embedding_keeps_training(tie: str) -> None:
    model = Seq2SeqTransformer(TransformerConfig(**SIZES, tie_embeddings=tie))
    line = apply_finetune(model, FinetuneSettings.from_values({"freeze": "encoder"}))
    assert model.output_projection.weight.requires_grad and not any(
        p.requires_grad for p in [*model.encoder.parameters(), *model.src_embed.parameters()]
    )
    src = _numel(model.src_embed)
    assert f"frozen: src_embed {src}, encoder {_numel(model.encoder)}; trainable: " in line
    assert ("tied: one (50, 16) tensor in output_projection, tgt_embed (trainable" in line) == (
        tie == "decoder"
    )
