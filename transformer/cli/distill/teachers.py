"""The models that make synthetic training pairs: distillation's teachers (an ensemble) and
back-translation's reverse model, loaded and checked against each other and against the student's data
before any work, and the function that translates one chunk of sentences with them.

Every refusal is one line naming the config key and the file: a missing or unreadable checkpoint, one of
the other task, of the wrong language direction, with another tokenizer than its peers, or trained on
other data than the student's (`data.source`). A model imported by `aiayn-import` (OPUS-MT) teaches as one
trained here: its own SentencePiece pair encodes the sources and decodes its translations, so the student
gets text; its direction is checked (its tokenizer config's languages), its `data.source` is not (that
only says how `evaluate.py` reads text), and it ensembles only with models of its vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.cli.errors import ConfigError
from transformer.cli.evaluate_steps import build_datamodule, device_from_name, ensemble_of
from transformer.cli.text_translation import translator_of
from transformer.evaluation.restore import RestoredModel, restore_model
from transformer.evaluation.scoring import checkpoint_decoding
from transformer.search.decoding import DecodingSettings

log = logging.getLogger("train")

# the student's data settings a teacher must share (besides the direction): what its text is
_SHARED_DATA = ("source",)


@dataclass
class Teachers:
    """Models decoded as one (a single model or an `Ensemble`), their tokenizers (a datamodule built as
    `evaluate.py` builds it) and the decoding settings; `digest` identifies all of it for the cache. They
    translate through the inference API (`transformer.inference.Translator`), as evaluate.py does."""

    key: str  # the config key that named the models, e.g. "distill.teachers"
    paths: list[Path]
    model: torch.nn.Module
    datamodule: Any
    decoding: DecodingSettings
    device: torch.device
    digest: str

    def to(self, device: torch.device) -> None:
        """Decode on `device` (under DDP: this process's own)."""
        self.model.to(device)
        self.device = device

    def chunk_function(self, seed: int) -> Callable[[int, Sequence[str]], list[str]]:
        """`translate(chunk index, sentences) -> translations`: the same output for the same chunk
        whatever was translated before (sampling draws from a generator seeded by `seed` and the chunk)."""
        translator = translator_of(self.model, self.datamodule, self.decoding, self.device)
        settings = dataclasses.replace(self.decoding, alignments=False)  # the corpus is text only

        def translate(index: int, texts: Sequence[str]) -> list[str]:
            generator = None
            if self.decoding.sampling:
                generator = torch.Generator(self.device).manual_seed(seed * 1_000_003 + index)
            translations = translator.translate(texts, settings, generator=generator)
            return [" ".join(t.text.splitlines()) for t in translations]  # one line per sentence, always

        return translate


Translator = Teachers  # the name this module's users knew it by (one class: the inference API's is another)


def load_translator(
    key: str,
    paths: Sequence[str | Path],
    *,
    direction: tuple[str, str],
    data: Mapping[str, Any],
    decode_values: Mapping[str, Any] | None,
    weights: Sequence[float] | None = None,
    max_tokens: int | None = None,
    device: str = "auto",
) -> Teachers:
    """The checkpoints of `paths` (config key `key`) as one translator from `direction` (src, tgt), checked
    against the student's `data` settings; `decode_values` over the first checkpoint's test decoding."""
    if not paths:
        raise ConfigError(f"{key} names no checkpoint")
    files = [Path(str(path)).expanduser() for path in paths]
    loaded = [_restore(key, path) for path in files]
    restored = [member for member, _ in loaded]
    for (member, imported), path in zip(loaded, files):
        _check_member(key, member, path, direction, data, imported=imported)
    first_tokenizers = restored[0].tokenizers
    for (member, imported), path in zip(loaded[1:], files[1:]):
        if member.tokenizers != first_tokenizers:
            hint = "train the teachers with the same data settings"
            if imported or loaded[0][1]:  # an OPUS-MT vocabulary: only models started from it share it
                hint = "ensemble an imported model only with models fine-tuned from it (model.init_from)"
            raise ConfigError(
                f"{key}: {path} has another tokenizer than {files[0]}: an ensemble averages distributions "
                f"over one vocabulary ({hint})"
            )
    try:
        model = ensemble_of(restored, files, weights)
        datamodule = build_datamodule(restored[0], {"eval_max_tokens": max_tokens}, files[0])
        decoding = DecodingSettings.from_values(
            decode_values, checkpoint_decoding(restored[0].hparams), prefix=f"{key.split('.')[0]}.decode."
        )
    except (CheckpointError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None
    target = device_from_name(device)
    model.to(target).eval()
    return Teachers(key, files, model, datamodule, decoding, target, _digest(restored, weights))


def _restore(key: str, path: Path) -> tuple[RestoredModel, bool]:
    """The checkpoint's model, and whether `aiayn-import` made it (an OPUS-MT model: `imported_from`)."""
    try:
        checkpoint = load_checkpoint(path)
        return restore_model(checkpoint, path), bool(checkpoint.get("imported_from"))
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_member(
    key: str,
    member: RestoredModel,
    path: Path,
    direction: tuple[str, str],
    data: Mapping[str, Any],
    *,
    imported: bool = False,
) -> None:
    """One checkpoint fits: a translation model of `direction`, trained on the student's kind of data.
    An imported model's data section only says how `evaluate.py` reads text (its languages are its
    tokenizer config's): what it was trained on is not ours to compare, only its direction."""
    if member.task != "translation":
        raise ConfigError(
            f"{key}: {path} is a {member.task} checkpoint; it must translate (a translation run)"
        )
    saved = member.run_config.get("data") or {}
    src, tgt = saved.get("src_lang"), saved.get("tgt_lang")
    if (src, tgt) != direction:
        unknown = " (its tokenizer_config.json names no source_lang / target_lang)"
        raise ConfigError(
            f"{key}: {path} translates {src} -> {tgt}, but this needs {direction[0]} -> {direction[1]} "
            f"(wrong language direction){unknown if imported and (src, tgt) == ('src', 'tgt') else ''}"
        )
    if imported:
        return
    for name in _SHARED_DATA:
        if name in saved and name in data and saved[name] != data[name]:
            raise ConfigError(
                f"{key}: {path} was trained with data.{name}={saved[name]}, this run has "
                f"data.{name}={data[name]}: the student's data settings contradict the teacher's"
            )


def _digest(restored: Sequence[RestoredModel], weights: Sequence[float] | None) -> str:
    """A hash of every model's weights (in state-dict order), tokenizers and ensemble weights: the same
    models give the same digest whatever their files are called."""
    digest = hashlib.sha256(repr(None if weights is None else list(weights)).encode())
    for member in restored:
        for name, tensor in member.model.state_dict().items():
            digest.update(name.encode())
            digest.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digest.update(repr(sorted(member.tokenizers.items())).encode())
    return digest.hexdigest()
