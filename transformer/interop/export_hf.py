"""Checkpoint -> a Hugging Face `transformers` directory: MarianMTModel, fast tokenizer, generation config.

`export_hf` writes our model as a MarianMTModel (`transformer.interop.marian.to_marian`: the one mapping
that import shares, the weight names, the permutation of the model dimension that turns our interleaved
sinusoids into Marian's layout, the configs). Every export is compared with the checkpoint once written
(`transformer.interop.check`); `tests/unit/test_export.py` checks logits and greedy search against ours.
An imported model exported again keeps its SentencePiece files for transformers' MarianTokenizer
(`write_marian_tokenizer`) and its decoder's start from the pad token (`tests/unit/test_export_imported.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from transformers import GenerationConfig, MarianMTModel, PreTrainedTokenizerFast

from transformer.disk import human_size, tensor_bytes
from transformer.interop.card import write_model_card
from transformer.interop.check import TOLERANCE, Exported, probe_batch, reference_log_probs
from transformer.interop.marian import ACTIVATIONS, to_marian
from transformer.interop.source import ExportError, ExportSource, staged_output

__all__ = ["export_hf", "generation_config", "hf_refusal", "write_marian_tokenizer"]


def hf_refusal(source: ExportSource) -> str | None:
    """Why `source` cannot become a Marian model exactly (one line naming the setting), or None."""
    config = source.config
    if config.norm_first:
        return "model.config.norm_first=true (pre-LN): transformers' Marian is post-LN only"
    if config.positional != "sinusoidal":
        return f"model.config.positional={config.positional}: transformers' Marian has sinusoids only"
    if config.embedding_norm:
        return "model.config.embedding_norm=true: transformers' Marian has no LayerNorm on the embeddings"
    if config.norm_eps != 1e-5:
        return f"model.config.norm_eps={config.norm_eps}: transformers' Marian's LayerNorms use 1e-5"
    if config.activation not in ACTIVATIONS:
        return f"model.config.activation={config.activation}: transformers' Marian has no gated feed-forward"
    # separate vocabularies: an imported model's MarianTokenizer has both (target_vocab.json), our BPE's not
    if source.sentencepiece is None and not source.joint_vocabulary:
        return (
            "separate source and target tokenizers: a transformers translation pipeline encodes and decodes "
            "with one tokenizer (train with a joint vocabulary, or export with --to ctranslate2)"
        )
    return None


def generation_config(source: ExportSource) -> GenerationConfig:
    """The checkpoint's test-time decoding as `transformers` generation settings.

    Not expressible there, and so only approximated (README "Export and deploy"): the per-sentence length
    limit floor(max_len_a * source length + max_len_b) (a global max_length = the model's max_len is
    used), and the length penalty's formula where the checkpoint decodes with GNMT's ((5 + len) / 6) **
    alpha (the same alpha is written for transformers' len ** alpha; a checkpoint with
    `length_normalization: power`, an imported model's, is exact).
    """
    config, decoding = source.config, source.decoding
    beam = decoding.get("search") != "greedy" and int(decoding.get("beam_size", 1)) > 1
    settings: dict[str, Any] = {
        "decoder_start_token_id": config.bos_id,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "forced_eos_token_id": config.eos_id,
        "suppress_tokens": sorted({config.pad_id, config.bos_id}),  # ours never emits them either
        "max_length": config.max_len + 1,  # the start token + at most max_len tokens, as ours caps it
        "num_beams": int(decoding.get("beam_size", 1)) if beam else 1,
        "do_sample": False,
    }
    if beam:
        settings.update(length_penalty=float(decoding.get("length_penalty", 1.0)), early_stopping=False)
    return GenerationConfig(**settings)


def fast_tokenizer(source: ExportSource) -> PreTrainedTokenizerFast:
    """Our `tokenizers` BPE as a transformers fast tokenizer: <s> ... </s> on encoding (its own post-
    processor), detokenization by its own decoder, and no "clean-up" of spaces (ours does none)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(source.src_tokenizer_json),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=source.config.max_len,
    )


def write_marian_tokenizer(source: ExportSource, directory: Path) -> None:
    """An imported model's SentencePiece pair as OPUS-MT ships it, for transformers' `MarianTokenizer`:
    its two SentencePiece models and vocabulary (vocabularies: vocab.json and target_vocab.json) as they
    were imported, and a tokenizer_config.json naming the class, the languages and the special tokens
    (Marian has no <s>)."""
    pair = source.sentencepiece
    assert pair is not None
    data = source.run_config.get("data") or {}
    (directory / "source.spm").write_bytes(pair.source_model)
    (directory / "target.spm").write_bytes(pair.target_model)
    vocabularies = {"vocab.json": pair.vocab}
    if pair.target_vocab is not None:
        vocabularies["target_vocab.json"] = pair.target_vocab
    for name, vocab in vocabularies.items():
        text = json.dumps(vocab, ensure_ascii=False, indent=2)
        (directory / name).write_text(text + "\n", encoding="utf-8")
    settings = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": data.get("src_lang"),
        "target_lang": data.get("tgt_lang"),
        "separate_vocabs": pair.target_vocab is not None,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": source.config.max_len,
    }
    text = json.dumps(settings, indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class by the name both transformers 4 and 5 know: version 5 writes its new
    `TokenizersBackend`, which version 4's AutoTokenizer cannot resolve; `PreTrainedTokenizerFast` is the
    same class in version 5 (an alias) and the fast tokenizer in version 4."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_hf(source: ExportSource, output: str | Path, *, force: bool = False) -> Exported:
    """Write `source` as a transformers directory at `output` (see the module docstring), checked
    against the checkpoint once written (`transformer.interop.check`)."""
    refusal = hf_refusal(source)
    if refusal is not None:
        raise ExportError(f"cannot export {source.path} to transformers: {refusal}")
    marian = to_marian(source.model)
    marian.generation_config = generation_config(source)
    tokenizer = fast_tokenizer(source) if source.sentencepiece is None else None
    size = human_size(tensor_bytes(marian.state_dict()))
    with staged_output(output, force=force, what=f"the transformers export of {size}") as staging:
        marian.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
            _portable_tokenizer_class(staging / "tokenizer_config.json")
        else:  # an imported model: its SentencePiece files, read by MarianTokenizer
            write_marian_tokenizer(source, staging)
        write_model_card(source, staging / "README.md", target="hf")
        difference = _check(source, staging)
        if tokenizer is None:
            _check_marian_tokenizer(source, staging)
    return Exported(Path(output), difference, "log-probabilities of the files loaded back, on a probe batch")


def _check_marian_tokenizer(source: ExportSource, directory: Path) -> None:
    """MarianTokenizer, loaded back from the written files, must encode a text made of the vocabulary's own
    pieces (drawn with a fixed seed) and decode the probe batch's targets as the checkpoint's tokenizer does;
    otherwise the export fails."""
    import warnings

    from transformers import MarianTokenizer

    pair = source.sentencepiece
    assert pair is not None
    with warnings.catch_warnings():
        # MarianTokenizer's Moses punctuation normalizer is never used here (the check encodes SentencePiece
        # pieces), so its "Recommended: pip install sacremoses." is noise on every export of an import
        warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
        tokenizer = MarianTokenizer.from_pretrained(directory)
    pieces = [piece for piece in pair.vocab if piece not in ("</s>", "<unk>", "<pad>") and ">>" not in piece]
    drawn = torch.randint(0, len(pieces), (32,), generator=torch.Generator().manual_seed(0)).tolist()
    text = "".join(pieces[i] for i in drawn).replace("\u2581", " ").strip()
    _, tgt = probe_batch(source.config)
    targets = tgt.tolist()
    labels = pair.language_labels()
    labelled = [labels.labelled(text, lang) for lang in labels.languages] if labels is not None else []
    if any(tokenizer(item).input_ids != pair.encode_source(item) for item in [text, *labelled]) or [
        tokenizer.decode(row, skip_special_tokens=True) for row in targets
    ] != [pair.decode(row) for row in targets]:
        raise ExportError(
            f"the exported MarianTokenizer does not encode or decode as {source.path}'s tokenizer: nothing "
            "written"
        )


def _check(source: ExportSource, directory: Path) -> float:
    """Max |log p| difference between the saved directory (loaded back) and the checkpoint, at every
    real target position and vocabulary entry of `probe_batch`; above TOLERANCE the export fails."""
    src, tgt = probe_batch(source.config)
    ours = reference_log_probs(source.model, src, tgt)  # (B, T - 1, V)
    marian = MarianMTModel.from_pretrained(directory).eval()
    pad = source.config.pad_id
    with torch.no_grad():
        logits = marian(input_ids=src, attention_mask=src.ne(pad), decoder_input_ids=tgt[:, :-1]).logits
    real = tgt[:, 1:].ne(pad)  # (B, T - 1): positions that predict a real token
    difference = (logits.float().log_softmax(-1) - ours)[real].abs().max().item()
    if not difference <= TOLERANCE:
        raise ExportError(
            f"the exported model's log-probabilities differ from {source.path}'s by {difference:.2e} "
            f"(more than {TOLERANCE}) on a probe batch: nothing written"
        )
    return difference
