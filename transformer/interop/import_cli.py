"""`aiayn-import`: a pretrained transformers model -> a checkpoint of ours.

    aiayn-import SOURCE --output DIR [--num-classes N] [--force]

SOURCE is a local directory written by `save_pretrained` (an OPUS-MT model: MarianMTModel with its
source.spm, target.spm and vocab.json; or a BERT-family encoder: BertForSequenceClassification, BertModel,
DistilBERT's, with tokenizer.json or vocab.txt) or a Hugging Face hub id (downloaded when the hub is
reachable). A BERT-family model becomes a classification checkpoint; one without a classification head
gets a new one for `--num-classes N` classes.
DIR/model.ckpt then works as a checkpoint train.py wrote: `evaluate.py ckpt_path=DIR/model.ckpt`, the
exports, ensembles and distillation. Bad input (an architecture ours cannot represent, a directory without
tokenizer files, an unreachable hub, an output directory that is not empty) ends with one `error:` line,
exit status 1, and nothing written.

The output never touches the source: an output directory that is, holds or lies inside the directory
imported from (a hub id's downloaded snapshot included; symlinks resolved) is refused. `--force` replaces
only an earlier import's output, a directory holding `model.ckpt` alone; any other file in it is named
and refused.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transformer.interop.export_cli import OneLineParser
from transformer.interop.source import IMPORT_FILES, ExportError, check_output, write_failure

__all__ = ["main"]

# the files an import reads (weights in either format; OPUS-MT's *.spm, BERT's vocab.txt)
_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "pytorch_model.bin",
    "*.spm",
    "*.json",
    "*.txt",
]


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="aiayn-import",
        description="Import a pretrained transformers model (Marian / OPUS-MT translation, BERT-family "
        "classifiers) as a checkpoint.",
    )
    parser.add_argument(
        "source", help="a save_pretrained directory, or a hub id such as Helsinki-NLP/opus-mt-de-en"
    )
    parser.add_argument(
        "--output", required=True, type=Path, help="the directory to create (it holds model.ckpt)"
    )
    parser.add_argument(
        "--num-classes",
        type=int,
        default=None,
        metavar="N",
        help="a BERT-family model without a classification head (BertModel): a new head for N classes",
    )
    parser.add_argument("--force", action="store_true", help="replace an output directory that is not empty")
    return parser


def _local(source: str) -> Path:
    """`source` as a local directory: itself, or the hub snapshot downloaded for it."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise ExportError(f"{source} is not a directory (nor a hub id of the form owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=source, allow_patterns=_FILES))
    except Exception as err:  # offline, unknown repository, gated model: all mean "not from the hub now"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(
            f"cannot get {source} from the Hugging Face hub ({reason}): download it where the hub is "
            "reachable (save_pretrained) and pass that directory"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        local = Path(args.source).expanduser()
        # before any download; a hub id's snapshot directory is checked again once downloaded
        check_output(
            args.output, force=args.force, source=local if local.is_dir() else None, owned=IMPORT_FILES
        )
        try:
            import sentencepiece  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as missing:
            raise ExportError(f"{missing.name} is not installed: pip install -e '.[export]'") from None
        from transformers.utils import logging as hf_logging

        from transformer.interop.import_hf import import_hf

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        directory = _local(args.source)
        check_output(args.output, force=args.force, source=directory, owned=IMPORT_FILES)
        checkpoint = import_hf(
            directory, args.output, source=args.source, force=args.force, num_classes=args.num_classes
        )
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a full disk (also as torch.save reports it), an unreadable file
        line = write_failure(err, args.output, f"cannot import {args.source}")
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    print(f"imported {args.source} as {checkpoint}")
    print(import_summary(checkpoint))
    return 0


def import_summary(path: Path) -> str:
    """What an imported checkpoint holds, a few indented lines: architecture and sizes, languages,
    vocabulary, parameters, the decoding defaults it took, and (a classifier) whether its head was kept."""
    from transformer.checkpoint import load_checkpoint
    from transformer.evaluation.restore import checkpoint_decoding

    checkpoint = load_checkpoint(path, mmap=True)
    hparams, imported = checkpoint["hyper_parameters"], checkpoint.get("imported_from") or {}
    config = hparams["config"]
    data = (checkpoint.get("config") or {}).get("data") or {}
    tensors = {  # tied embeddings are one tensor under several names (torch.save keeps them shared)
        (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)): t.numel()
        for k, t in checkpoint["state_dict"].items()
        if k.startswith("model.")
    }
    parameters = sum(tensors.values())
    classifier = "class_names" in checkpoint or "new_head" in imported
    layers = (
        f"{config['n_encoder_layers']} layers"
        if classifier
        else f"{config['n_encoder_layers']} encoder + {config['n_decoder_layers']} decoder layers"
    )
    joint = config.get("src_vocab_size") == config.get("tgt_vocab_size", config.get("src_vocab_size"))
    vocab = (
        f"{config['src_vocab_size']}"
        if classifier or joint
        else f"{config['src_vocab_size']} source / {config['tgt_vocab_size']} target"
    )
    kind = "WordPiece" if classifier else "SentencePiece"
    lines = [
        f"  architecture: {imported.get('architecture')} -> ours, {layers}, d_model {config['d_model']}, "
        f"{config['n_heads']} heads, d_ff {config['d_ff']}, max_len {config['max_len']}",
        f"  vocabulary: {kind}, {vocab} tokens; {parameters:,} parameters",
        f"  read with transformers {imported.get('transformers')}, revision "
        f"{imported.get('revision') or 'none (a local directory)'}",
    ]
    if classifier:
        names = checkpoint.get("class_names") or imported.get("labels") or []
        head = (
            "new (initialized here, to be fine-tuned)" if imported.get("new_head") else "kept from the source"
        )
        lines.append(f"  classification head: {head}; {len(names)} classes {list(names)}")
    else:
        languages = f"{data.get('src_lang')} -> {data.get('tgt_lang')}"
        if (data.get("src_lang"), data.get("tgt_lang")) == ("src", "tgt"):
            languages = "not named by the source (src -> tgt)"
        decoding = checkpoint_decoding(hparams)
        normalization = decoding.length_normalization
        lines.append(f"  languages: {languages}")
        labels = (checkpoint.get("language_labels") or {}).get("labels") or {}
        if labels:  # a multilingual model (issue 65): which label `target_lang` puts first in the source
            shown = ", ".join(sorted(labels)[:12]) + (
                f", ... ({len(labels)} in all)" if len(labels) > 12 else ""
            )
            lines.append(
                f"  target languages: {shown}; choose one with translate.target_lang=CODE (its label, e.g. "
                f"{labels[sorted(labels)[0]]}, goes first in the source)"
            )
        lines.append(
            f"  decoding defaults (the source's generation settings): beam {decoding.beam_size}, "
            f"length penalty {decoding.length_penalty} ({normalization} "
            f"normalization), max length {decoding.max_len_a} * source + {decoding.max_len_b}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
