"""What every export reads from a checkpoint, and the one way every export writes its directory.

`load_source` restores a translation checkpoint with the evaluation code (`transformer.evaluation.restore`,
safe `weights_only=True` loading) and collects what a deployed model needs besides its weights: tokenizer
JSON(s) (an imported OPUS-MT model's: its SentencePiece pair, `data.sentencepiece_pair`), decoding settings,
scores, where an imported model came from. `staged_output` writes into a temporary directory beside the
output and renames it into place at the end, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch

from data.sentencepiece_pair import SentencePiecePair, SentencePieceSide
from transformer.checkpoint import load_checkpoint
from transformer.config import TransformerConfig
from transformer.disk import human_size, tensor_bytes
from transformer.evaluation.restore import DATAMODULES, checkpoint_decoding, restore_model
from transformer.model import Seq2SeqTransformer

__all__ = [
    "EXPORT_FILES",
    "IMPORTED_CHECKPOINT",
    "IMPORT_FILES",
    "ExportError",
    "ExportSource",
    "check_output",
    "load_source",
    "staged_output",
    "write_failure",
    "write_imported",
]

IMPORTED_CHECKPOINT = "model.ckpt"  # the file aiayn-import writes in its output directory
# What each command writes in its output directory, and so all that its --force may replace there
IMPORT_FILES = frozenset({IMPORTED_CHECKPOINT})
EXPORT_FILES = frozenset(
    {
        "README.md",  # the model card, both targets
        # --to hf: transformers' files (versions 4 and 5), our tokenizer's or an import's SentencePiece pair
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "source.spm", "target.spm",
        "vocab.json", "target_vocab.json",
        # --to ctranslate2: the model, its vocabularies and the tokenizer files beside them
        "model.bin", "shared_vocabulary.json", "shared_vocabulary.txt", "source_vocabulary.json",
        "source_vocabulary.txt", "target_vocabulary.json", "target_vocabulary.txt", "source_tokenizer.json",
        "target_tokenizer.json",
    }
)  # fmt: skip

SPECIAL_TOKENS = {"pad_id": "<pad>", "bos_id": "<s>", "eos_id": "</s>"}  # data.tokenization's specials
# an imported Marian model's (data.sentencepiece_pair): no <s>, the decoder starts from the pad token
MARIAN_SPECIAL_TOKENS = {"pad_id": "<pad>", "bos_id": "<pad>", "eos_id": "</s>"}


class ExportError(ValueError):
    """A checkpoint or a setting that the requested export target cannot take, or a bad output path."""


@dataclass
class ExportSource:
    """A translation checkpoint, restored: the network (eval mode, CPU) and what travels with it."""

    path: Path
    model: Seq2SeqTransformer
    # {"joint": JSON} or {"src": JSON, "tgt": JSON}: `tokenizers` BPE, or both sides of an imported model's
    # SentencePiece pair (then `sentencepiece` holds the pair)
    tokenizers: dict[str, str]
    decoding: dict[str, Any]  # the settings the run's test step decoded with
    hparams: dict[str, Any]
    run_config: dict[str, Any]
    scores: dict[str, float] = field(default_factory=dict)  # this checkpoint's own metrics, when known
    global_step: int | None = None
    epoch: int | None = None
    sentencepiece: SentencePiecePair | None = None  # an imported (OPUS-MT) model's tokenizers, else None
    imported_from: dict[str, Any] | None = None  # aiayn-import's provenance (source, transformers version)
    started_from: dict[str, Any] | None = None  # a fine-tuning run's model.init_from and its provenance
    language_labels: dict[str, Any] | None = None  # a multilingual model's (`restore.saved_language_labels`)

    @property
    def origin(self) -> dict[str, Any] | None:
        """What the weights were imported from: this checkpoint, or the start of its fine-tuning run."""
        return self.imported_from or (self.started_from or {}).get("imported_from")

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    @property
    def joint_vocabulary(self) -> bool:
        if self.sentencepiece is not None:
            return self.sentencepiece.target_vocab is None
        return "joint" in self.tokenizers

    @property
    def src_tokenizer_json(self) -> str:
        return self.tokenizers["joint" if "joint" in self.tokenizers else "src"]

    @property
    def tgt_tokenizer_json(self) -> str:
        return self.tokenizers["joint" if "joint" in self.tokenizers else "tgt"]

    def vocabulary(self, side: str) -> list[str]:
        """The tokens of the "src" or "tgt" tokenizer in id order (position i holds the token of id i when the
        ids run 0..n-1, which `load_source` checks)."""
        pair = self.sentencepiece
        if pair is not None:
            vocab = pair.vocab if side == "src" or pair.target_vocab is None else pair.target_vocab
        else:
            text = self.src_tokenizer_json if side == "src" else self.tgt_tokenizer_json
            vocab = tokenizers.Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
        return [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]


def load_source(path: str | Path) -> ExportSource:
    """Restore a translation checkpoint for export; any other kind is refused with an `ExportError`
    (a missing, truncated or unsafe file with `transformer.checkpoint.CheckpointError`)."""
    path = Path(path)
    checkpoint = load_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, Mapping) and "mask_prob" in hparams:
        raise ExportError(
            f"checkpoint {path} is a masked-LM pretraining checkpoint (MaskedLMTask): only translation "
            "(encoder-decoder) checkpoints can be exported"
        )
    restored = restore_model(checkpoint, path)
    if restored.task != "translation" or not isinstance(restored.model, Seq2SeqTransformer):
        raise ExportError(
            f"checkpoint {path} is a {restored.task} checkpoint: only translation (encoder-decoder) "
            "checkpoints can be exported to transformers or CTranslate2"
        )
    saved = restored.datamodule_state.get("tokenizers")
    if not isinstance(saved, Mapping) or not (set(saved) == {"joint"} or set(saved) == {"src", "tgt"}):
        raise ExportError(
            f"checkpoint {path} carries no tokenizer ({DATAMODULES['translation']} state 'tokenizers' "
            "with 'joint' or 'src' + 'tgt'): it was not written by train.py"
        )
    pair = _sentencepiece_pair(path, saved)
    imported_from = checkpoint.get("imported_from")
    source = ExportSource(
        path=path,
        model=restored.model,
        tokenizers={side: str(text) for side, text in saved.items()},
        decoding=checkpoint_decoding(restored.hparams),
        hparams=restored.hparams,
        run_config=restored.run_config,
        scores=_own_scores(path, checkpoint),
        global_step=restored.global_step,
        epoch=restored.epoch,
        sentencepiece=pair,
        imported_from=dict(imported_from) if isinstance(imported_from, Mapping) else None,
        started_from=restored.started_from,
        language_labels=restored.language_labels,
    )
    _check_tokenizers(source)
    return source


def _sentencepiece_pair(path: Path, saved: Mapping[str, Any]) -> SentencePiecePair | None:
    """The SentencePiece pair of an imported model (both sides hold the same pair), or None for our BPE."""
    kinds = {SentencePieceSide.is_json(str(text)) for text in saved.values()}
    if kinds == {False}:
        return None
    if kinds != {True} or set(saved) != {"src", "tgt"}:
        raise ExportError(f"checkpoint {path} mixes a SentencePiece tokenizer with a BPE one")
    src, tgt = (SentencePieceSide.from_json(str(saved[side])).pair for side in ("src", "tgt"))
    if src.to_state() != tgt.to_state():
        raise ExportError(f"checkpoint {path}: its source and target SentencePiece tokenizers differ")
    return src


def _check_tokenizers(source: ExportSource) -> None:
    """Token ids only mean something under the tokenizer the model was trained with: sizes and specials."""
    config = source.config
    specials = SPECIAL_TOKENS if source.sentencepiece is None else MARIAN_SPECIAL_TOKENS
    for side, size in (("src", config.src_vocab_size), ("tgt", config.tgt_vocab_size)):
        vocabulary = source.vocabulary(side)
        if len(vocabulary) != size:
            raise ExportError(
                f"checkpoint {source.path}: its {side} tokenizer has {len(vocabulary)} tokens but the model "
                f"{size} ({side}_vocab_size)"
            )
        if source.sentencepiece is not None and _ids(source.sentencepiece, side) != list(range(size)):
            raise ExportError(
                f"checkpoint {source.path}: the ids of its {side} vocabulary do not run 0..{size - 1}"
            )
        for key, token in specials.items():
            if vocabulary[getattr(config, key)] != token:
                raise ExportError(
                    f"checkpoint {source.path}: {key}={getattr(config, key)} is "
                    f"{vocabulary[getattr(config, key)]!r} in its {side} tokenizer, expected {token!r}"
                )


def _ids(pair: SentencePiecePair, side: str) -> list[int]:
    vocab = pair.vocab if side == "src" or pair.target_vocab is None else pair.target_vocab
    return sorted(vocab.values())


def _own_scores(path: Path, checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """This checkpoint's validation score (from its checkpoint callback's state) and, when the run's
    `metrics.json` names this file as the run's best checkpoint, the test metrics of that run."""
    scores: dict[str, float] = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, Mapping) and state.get("monitor") and state.get("current_score") is not None:
            value = state["current_score"]
            scores[str(state["monitor"])] = float(value.item() if isinstance(value, torch.Tensor) else value)
    metrics_file = path.resolve().parent.parent / "metrics.json"
    if metrics_file.is_file():
        try:
            metrics = json.loads(metrics_file.read_text())
        except (OSError, ValueError):
            return scores
        best = metrics.get("best_ckpt_path") if isinstance(metrics, dict) else None
        if best and Path(best).resolve() == path.resolve():
            scores.update(
                {
                    key: float(value)
                    for key, value in metrics.items()
                    if key.startswith("test/") and isinstance(value, (int, float))
                }
            )
    return scores


@contextmanager
def staged_output(
    output: str | Path,
    *,
    force: bool = False,
    what: str = "the export",
    owned: Collection[str] = EXPORT_FILES,
) -> Iterator[Path]:
    """A fresh temporary directory beside `output` to write into; renamed to `output` on success.

    An `output` that exists and is not an empty directory is refused unless `force`, and even then unless
    it holds nothing but files named in `owned` (what this command writes: `check_output`); a forced one is
    replaced only once the new directory is complete. An `output` that is a symlink to a directory is
    written through: the link stays, its target is the directory replaced. On any failure (the final
    renames included) the temporary directory and the parent directories made for it are removed,
    `output` is untouched, and the error names `what` was written to `output` (`transformer.disk`: a full
    disk ends aiayn-export with one line).
    """
    output = Path(output)
    check_output(output, force=force, owned=owned)
    final = output.resolve()  # a symlink's target (check_output refused a dangling one and a loop)
    made = [p for p in (final.parent, *final.parent.parents) if not p.exists()]
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = _fresh_directory(final, ".tmp")
    except OSError as err:
        _remove_empty(made)
        err.add_note(f"while writing {what} to {output}")
        raise
    try:
        yield staging
        _swap(staging, final, output, force=force, owned=owned)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        if isinstance(err, Exception):
            err.add_note(f"while writing {what} to {output}")
        raise


def _swap(staging: Path, final: Path, output: Path, *, force: bool, owned: Collection[str]) -> None:
    """Rename the complete `staging` to `final`; a (forced) existing `final` goes only after the new one is
    in place, and comes back if that rename fails."""
    if not final.exists():
        staging.rename(final)
        return
    check_output(output, force=force, owned=owned)  # again: files may have appeared while we wrote
    old = _fresh_directory(final, ".old")
    moved = False
    try:
        final.rename(old / final.name)
        moved = True
        staging.rename(final)
    except BaseException:
        if moved:  # the previous output comes back
            (old / final.name).rename(final)
        with suppress(OSError):
            old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_imported(checkpoint: Mapping[str, Any], output: str | Path, *, force: bool = False) -> Path:
    """`output`/model.ckpt holding `checkpoint` (an imported model: Marian or BERT-family), written whole
    or not at all (`staged_output`); returns its path. `force` replaces only an earlier import's output (a
    directory holding model.ckpt alone)."""
    size = human_size(tensor_bytes(checkpoint["state_dict"]))
    what = f"the imported checkpoint of {size}"
    with staged_output(output, force=force, what=what, owned=IMPORT_FILES) as staging:
        torch.save(checkpoint, staging / IMPORTED_CHECKPOINT)
    return Path(output) / IMPORTED_CHECKPOINT


def _remove_empty(directories: list[Path]) -> None:
    """Remove the directories (innermost first) that an export made and left empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def _fresh_directory(output: Path, suffix: str) -> Path:
    """A new hidden directory beside `output`, with the permissions the umask gives (not mkdtemp's 0700:
    it becomes the output)."""
    while True:
        candidate = output.parent / f".{output.name}.{uuid.uuid4().hex[:8]}{suffix}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate


def check_output(
    output: Path,
    *,
    force: bool,
    keep: Path | None = None,
    source: Path | None = None,
    owned: Collection[str] = EXPORT_FILES,
) -> None:
    """Refuse an output path that cannot be written safely: a file, a dangling symlink or a symlink loop;
    one that holds `keep` (the checkpoint being exported: --force would delete it); one that is, holds or
    lies inside `source` (the directory being imported); a non-empty directory without `force`; and, with
    `force`, a directory holding anything but regular files named in `owned` (what this command writes:
    --force replaces an earlier output of the same command, never a directory of the user's)."""
    try:
        resolved = output.resolve(strict=False)
        exists = output.exists()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python < 3.13's symlink loop
        raise ExportError(f"output {output} cannot be resolved ({err})") from None
    if output.is_symlink() and not exists:
        raise ExportError(
            f"output {output} is a symlink to {os.readlink(output)}, which does not exist (or is a loop): "
            "give a directory"
        )
    if exists and not output.is_dir():
        raise ExportError(f"output {output} exists and is not a directory")
    if keep is not None and resolved in keep.resolve().parents:
        raise ExportError(f"output directory {output} holds the checkpoint {keep}: choose another directory")
    if source is not None:
        inside = source.resolve()
        if resolved == inside or inside in resolved.parents or resolved in inside.parents:
            how = "is" if resolved == inside else ("lies inside" if inside in resolved.parents else "holds")
            raise ExportError(
                f"output directory {output} {how} the directory imported from ({source}): choose another "
                "directory (nothing was written)"
            )
    if not exists or not any(output.iterdir()):
        return
    if not force:
        raise ExportError(f"output directory {output} exists and is not empty (pass --force to replace it)")
    for entry in sorted(output.iterdir()):
        if entry.name not in owned or entry.is_symlink() or not entry.is_file():
            raise ExportError(
                f"output directory {output} holds {entry.name}, which this command does not write: --force "
                f"replaces only an earlier output of it ({', '.join(sorted(owned)[:4])}"
                f"{', ...' if len(owned) > 4 else ''}); choose another directory or remove it yourself"
            )


def write_failure(err: Exception, output: Path, action: str) -> str | None:
    """The one `error:` line (without the prefix) for `err`, raised while an export or import wrote `output`:
    a full disk (also as safetensors, CTranslate2 or torch.save report it) or another OSError, named with
    `action`; None for anything else (a bug: the caller re-raises it)."""
    from transformer.disk import disk_full_line

    full = disk_full_line(err, output, then="free some space, then run the same command again")
    if full is None and not isinstance(err, OSError):
        return None
    return full or f"{action}: {err}"
