"""A Hugging Face `transformers` directory -> a checkpoint of ours (`aiayn-import`, docs/pretrained.md).

`import_hf` reads the directory's config.json and hands it to its format: a MarianMTModel (OPUS-MT's)
becomes a translation checkpoint here (`transformer.interop.marian.from_marian`: the one mapping that
export shares), a BERT-family classifier a classification checkpoint (`transformer.interop.import_bert`).
`tests/unit/test_import_marian.py` checks an imported model against transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import MarianMTModel

from data.labels import LABELS_KEY
from data.sentencepiece_pair import SentencePiecePair, SentencePieceSide
from transformer.interop.bert import BERT_MODEL_TYPES
from transformer.interop.import_bert import import_bert
from transformer.interop.marian import MARIAN_BUFFERS, decoding_from_marian, from_marian, marian_refusal
from transformer.interop.source import ExportError, write_imported
from transformer.interop.weights import check_weights
from transformer.model import Seq2SeqTransformer

__all__ = ["import_hf"]


def import_hf(
    directory: str | Path,
    output: str | Path,
    *,
    source: str | None = None,
    force: bool = False,
    num_classes: int | None = None,
) -> Path:
    """A transformers MarianMTModel directory (OPUS-MT's `save_pretrained` layout: config.json, weights,
    source.spm, target.spm, vocab.json) -> `output`/model.ckpt, a checkpoint of ours as train.py writes one:
    the weights (`from_marian`), the model config, the tokenizer pair (`data.sentencepiece_pair`), the
    decoding of its generation settings (`decoding_from_marian`) and where it came from. `source` names the
    origin (a hub id; default: the directory). Anything ours cannot represent is refused with an
    `ExportError` naming it, before anything is written; the output directory appears only once complete
    (`staged_output`).

    A BERT-family directory (model_type bert / distilbert) becomes a classification checkpoint instead
    (`transformer.interop.import_bert`); `num_classes` gives one without a classification head a new head."""
    directory = Path(directory)
    config = _read_config(directory)
    model_type = getattr(config, "model_type", None)
    if model_type in BERT_MODEL_TYPES:
        return import_bert(directory, output, config, source=source, force=force, num_classes=num_classes)
    if model_type != "marian":
        raise ExportError(
            f"cannot import {directory}: model_type={model_type!r}: only Marian (OPUS-MT) translation models "
            f"and BERT-family classifiers ({', '.join(BERT_MODEL_TYPES)}) can be imported"
        )
    if num_classes is not None:
        raise ExportError(f"--num-classes is for BERT-family classifiers; {directory} is a Marian model")
    return _import_marian(directory, output, config, source=source, force=force)


def _read_config(directory: Path) -> Any:
    """The directory's config.json as transformers reads it (`AutoConfig`), or an ExportError naming why."""
    import transformers

    if not (directory / "config.json").is_file():
        raise ExportError(f"{directory} has no config.json: not a transformers model directory")
    try:
        return transformers.AutoConfig.from_pretrained(directory)
    except Exception as unreadable:  # an unknown model_type, a malformed file, a value of the wrong type
        # all its lines: the detail may be on the second (huggingface_hub's strict dataclasses)
        reason = " ".join(str(unreadable).split())[:300] or type(unreadable).__name__
        raise ExportError(f"cannot import {directory}: its config.json cannot be read ({reason})") from None


def _import_marian(
    directory: Path, output: str | Path, config: Any, *, source: str | None, force: bool
) -> Path:
    """`import_hf` of a Marian (OPUS-MT) directory whose config.json was read: checked, converted, written."""
    import transformers

    refusal = marian_refusal(config)
    if refusal is not None:
        raise ExportError(f"cannot import {directory}: {refusal}")
    pair = _sentencepiece_pair(directory)
    model = _marian_model(directory, config, pair)
    try:  # generate()'s own settings: beam size, len ** alpha normalization (docs/pretrained.md)
        decoding = decoding_from_marian(directory)
    except ValueError as bad:
        raise ExportError(f"cannot import {directory}: {bad}") from None
    provenance = {
        "source": source or str(directory),
        "architecture": "MarianMTModel",
        "revision": getattr(config, "_commit_hash", None),
        "transformers": transformers.__version__,
    }
    checkpoint = _translation_checkpoint(model, pair, decoding, _languages(directory), provenance)
    return write_imported(checkpoint, output, force=force)


def _sentencepiece_pair(directory: Path) -> SentencePiecePair:
    """The directory's SentencePiece models and vocabulary (`data.sentencepiece_pair`), or an ExportError."""
    try:
        return SentencePiecePair.from_directory(directory)
    except FileNotFoundError as missing:
        raise ExportError(f"cannot import {directory}: no tokenizer ({missing})") from None
    except (ValueError, RuntimeError, OSError) as bad:
        raise ExportError(f"cannot import {directory}: its tokenizer files cannot be read ({bad})") from None


def _marian_model(directory: Path, config: Any, pair: SentencePiecePair) -> Seq2SeqTransformer:
    """Ours holding the directory's Marian weights (`from_marian`), the weights checked against the config
    before anything is allocated and the vocabulary against the config after."""
    check_weights(directory, MarianMTModel, config, computed=MARIAN_BUFFERS)  # before allocating
    model = from_marian(MarianMTModel.from_pretrained(directory).eval(), str(directory))
    ours = model.config
    if (pair.pad_id, pair.eos_id, pair.vocab_size) != (ours.pad_id, ours.eos_id, ours.tgt_vocab_size):
        raise ExportError(
            f"cannot import {directory}: its vocabulary (pad {pair.pad_id}, eos {pair.eos_id}, "
            f"{pair.vocab_size} tokens) does not match its config (pad {ours.pad_id}, eos {ours.eos_id}, "
            f"{ours.tgt_vocab_size} tokens)"
        )
    return model


def _translation_checkpoint(
    model: Seq2SeqTransformer,
    pair: SentencePiecePair,
    decoding: dict[str, Any],
    languages: dict[str, str],
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """A TranslationTask checkpoint of `model` as train.py writes one: its tokenizer pair, its decoding, a
    data section for evaluation on parallel files in `languages`, where it came from (`provenance`) and, for
    a multilingual model, its target-language labels (the vocabulary's `>>xxx<<` codes: `target_lang`
    chooses one)."""
    ours = model.config
    tokenizers = {side: SentencePieceSide(pair, side).to_json() for side in ("src", "tgt")}
    labels = pair.language_labels()
    checkpoint = {
        "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()},
        "hyper_parameters": {
            "config": ours.to_dict(),
            "decoding": decoding,
            "label_smoothing": 0.1,
        },
        "tokenizers": tokenizers,  # read by programs (transformer.inference); the same object: stored once
        "TranslationDataModule": {"tokenizers": tokenizers},
        "config": {
            "model": {"_target_": "transformer.training.TranslationTask"},
            # evaluation reads text from data.data_dir ({split}.{lang}[.gz], e.g. Multi30k's files)
            "data": {
                "_target_": "data.datamodules.TranslationDataModule",
                "source": "parallel",
                "data_dir": None,
                **languages,
                "max_len": min(256, ours.max_len),
            },
        },
        "imported_from": provenance,
        "global_step": 0,
        "epoch": 0,
    }
    if labels is not None:
        checkpoint[LABELS_KEY] = labels.to_state()
    return checkpoint


def _languages(directory: Path) -> dict[str, str]:
    """src_lang / tgt_lang from a Marian tokenizer_config.json (OPUS-MT's have them), else src / tgt."""
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    src, tgt = settings.get("source_lang"), settings.get("target_lang")
    ok = isinstance(src, str) and isinstance(tgt, str) and src and tgt and src != tgt
    return {"src_lang": src, "tgt_lang": tgt} if ok else {"src_lang": "src", "tgt_lang": "tgt"}
