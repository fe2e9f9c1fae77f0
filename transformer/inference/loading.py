"""Checkpoints -> what the inference API decodes with: the restored network (averaged over a run's last
checkpoints, or several checkpoints as one `Ensemble`), its tokenizers (read from the checkpoint, no
datamodule built), its batching settings, and the device; every failure one `InferenceError` naming the file.

The checks are the ones `evaluate.py` makes (`transformer.cli.evaluate_steps`), said in terms of files
and arguments instead of config keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from data.tokenization import tokenizer_from_json
from transformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint
from transformer.evaluation.restore import RestoredModel, last_checkpoints, lora_settings, restore_model
from transformer.inference.languages import TargetLanguages
from transformer.inference.outputs import InferenceError
from transformer.search.ensemble import Ensemble

__all__ = [
    "Loaded",
    "as_paths",
    "check_shared_labels",
    "combined",
    "device_of",
    "languages_of",
    "load",
    "max_tokens_of",
    "target_languages_of",
]

# The datamodules' own defaults for what a checkpoint's data section may leave out (an imported model's):
# data.datamodules cannot be imported here (Lightning); tests/unit/test_inference.py checks they agree.
DATA_DEFAULTS: dict[str, dict[str, int]] = {
    "translation": {"max_len": 256, "max_tokens": 4096},
    "classification": {"max_len": 128, "max_tokens": 4096},
}


@dataclass
class Loaded:
    """Checkpoint(s) restored for decoding: the model to run (one network or an `Ensemble`), the first
    member's restored parts, the files read, the tokenizers by side and the batching settings."""

    paths: list[Path]
    restored: list[RestoredModel]
    model: nn.Module
    tokenizers: dict[str, Any]  # "src" and "tgt" (the same object for a joint vocabulary)
    max_len: int  # a source longer than this is cut to it (EOS kept), as evaluation cuts it
    eval_max_tokens: int  # the checkpoint's token budget of one evaluation batch

    @property
    def first(self) -> RestoredModel:
        return self.restored[0]

    @property
    def languages(self) -> tuple[str | None, str | None]:
        """(source, target) language codes when the checkpoint's data section names them."""
        return languages_of(self.first)

    @property
    def target_languages(self) -> TargetLanguages:
        """The languages the model translates into: its labels (multilingual), else its target code."""
        return target_languages_of(self.first, self.paths[0])


def languages_of(restored: RestoredModel) -> tuple[str | None, str | None]:
    """(source, target) language codes when the checkpoint's data section names them."""
    data = restored.run_config.get("data") or {}
    codes = (data.get("src_lang"), data.get("tgt_lang"))
    if codes == ("src", "tgt"):  # aiayn-import's placeholders: the model did not say
        return None, None
    return tuple(code if isinstance(code, str) else None for code in codes)  # type: ignore[return-value]


def target_languages_of(restored: RestoredModel, path: Path | str) -> TargetLanguages:
    """What a restored translation checkpoint translates into: its labels, else its target code."""
    return TargetLanguages.of(restored.language_labels, languages_of(restored)[1], path)


def check_shared_labels(restored: Sequence[RestoredModel], names: Sequence[Path | str]) -> None:
    """InferenceError naming the first member of an ensemble whose target-language labels differ from the
    first member's (`names`: how each member is named in the message)."""
    for other, name in zip(restored[1:], names[1:]):
        if other.language_labels != restored[0].language_labels:
            raise InferenceError(
                f"checkpoint {name} has the target-language labels {_labels_text(other)} but {names[0]} has "
                f"{_labels_text(restored[0])}: the members of an ensemble must share their labels"
            )


def as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """One path, or a non-empty sequence of them, as a list of `Path`s."""
    if isinstance(paths, (str, Path)):
        return [Path(paths).expanduser()]
    if not isinstance(paths, Sequence) or not paths:
        raise InferenceError(f"give a checkpoint path or a non-empty list of them, got {paths!r}")
    for path in paths:
        if not isinstance(path, (str, Path)):
            raise InferenceError(f"a checkpoint path must be a str or Path, got {path!r}")
    return [Path(path).expanduser() for path in paths]


def device_of(device: str | torch.device) -> torch.device:
    """`device` as a torch device ("auto": CUDA when available, else the CPU)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InferenceError(f"device={device!r} is not a device ({err})") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        raise InferenceError(f"device={device} but CUDA is not available here (use device='cpu')")
    return found


def load(
    paths: Sequence[Path],
    task: str,
    *,
    weights: Sequence[float] | None = None,
    average_last: int | None = None,
) -> Loaded:
    """The checkpoint(s) of `paths` for `task` ("translation" or "classification"); several paths are an
    ensemble (translation only), `average_last` averages one run's last N checkpoints."""
    if average_last is not None and len(paths) > 1:
        raise InferenceError("average_last averages one run's checkpoints: give a single checkpoint path")
    members = [_restore(path, average_last) for path in paths]
    restored = [member for member, _ in members]
    files = [path for _, read in members for path in read]
    for member, path in zip(restored, paths):
        if member.task != task:
            raise InferenceError(f"checkpoint {path} is a {member.task} checkpoint, not a {task} one")
    model = combined(restored, paths, weights)
    tokenizers = _tokenizers(restored[0], paths[0])
    data = restored[0].run_config.get("data") or {}
    defaults = DATA_DEFAULTS[task]
    max_len = data.get("max_len") or defaults["max_len"]
    budget = data.get("eval_max_tokens") or data.get("max_tokens") or defaults["max_tokens"]
    return Loaded(files, restored, model, tokenizers, int(max_len), int(budget))


def max_tokens_of(value: int | None, loaded_budget: int, max_len: int) -> int:
    """The token budget of one batch: `value`, else the checkpoint's own; at least `max_len` (the longest
    source, once cut, must fit in a batch of its own)."""
    if value is None:
        return loaded_budget
    if isinstance(value, bool) or not isinstance(value, int) or value < max_len:
        raise InferenceError(
            f"max_tokens must be an integer >= the checkpoint's max_len ({max_len}): the longest source "
            f"must fit in a batch, got {value!r}"
        )
    return value


def _restore(path: Path, average_last: int | None) -> tuple[RestoredModel, list[Path]]:
    """The checkpoint at `path` restored (or the average of its run's last `average_last`) and its files."""
    try:
        if average_last is None:
            return restore_model(load_checkpoint(path), path), [path]
        files = last_checkpoints(path.parent if path.is_file() else path, average_last)
        averaged = average_checkpoints(files)
        if lora_settings(averaged.get("hyper_parameters") or {}, files[-1]) is not None:
            # the mean of B A over checkpoints is not the product of the mean B and the mean A
            raise InferenceError(
                f"average_last={average_last}: {files[-1]} is a LoRA fine-tuning checkpoint, whose "
                "adapters cannot be averaged factor by factor; load one checkpoint (without average_last)"
            )
        return restore_model(averaged, files[-1]), files
    except InferenceError:
        raise
    except (CheckpointError, ValueError) as err:
        raise InferenceError(str(err) if str(path) in str(err) else f"{path}: {err}") from None


def combined(
    restored: Sequence[RestoredModel],
    paths: Sequence[Path],
    weights: Iterable[float] | None,
    weights_key: str = "weights",
) -> nn.Module:
    """The one model, or an `Ensemble` of translation checkpoints of one task with the same labels and
    tokenizers (`weights`: one per checkpoint, default equal; `weights_key` names them in messages, as the
    caller's user knows them). InferenceError naming both checkpoints, or the weights, and what differs:
    the inference API's `load` and evaluate.py's `ensemble_of` check an ensemble here alike."""
    if len(restored) == 1:
        if weights is not None:
            raise InferenceError(
                f"{weights_key} needs a list of checkpoints: weights are for an ensemble of several"
            )
        return restored[0].model
    first, first_path = restored[0], paths[0]
    for other, path in zip(restored[1:], paths[1:]):
        if other.task != first.task:
            raise InferenceError(f"{path} is a {other.task} checkpoint, {first_path} a {first.task} one")
    check_shared_labels(restored, paths)  # before the tokenizers, which hold the labels
    for other, path in zip(restored[1:], paths[1:]):
        if other.tokenizers != first.tokenizers:
            raise InferenceError(
                f"checkpoints {path} and {first_path} have different tokenizers: an ensemble averages "
                "distributions over one vocabulary"
            )
    if first.task != "translation":
        raise InferenceError(f"ensembles decode translations; {first_path} is a {first.task} checkpoint")
    values = None if weights is None else list(weights)
    if values is not None and any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in values):
        raise InferenceError(f"{weights_key} must be numbers, got {values}")
    try:
        return Ensemble([member.model for member in restored], values)
    except ValueError as err:  # its messages name the weights `ensemble_weights`
        raise InferenceError(str(err).replace("ensemble_weights", weights_key)) from None


def _labels_text(restored: RestoredModel) -> str:
    labels = (restored.language_labels or {}).get("labels")
    if not isinstance(labels, Mapping) or not labels:
        return "none (a bilingual model)"
    return ", ".join(f"{lang}: {label}" for lang, label in sorted(labels.items()))


def _tokenizers(restored: RestoredModel, path: Path) -> dict[str, Any]:
    """The checkpoint's tokenizers by side ("src", "tgt"), checked against its model's vocabulary."""
    saved = restored.tokenizers
    if not saved:
        raise InferenceError(
            f"checkpoint {path} carries no tokenizer: it cannot be decoded with the vocabulary it was "
            "trained with"
        )
    try:
        built = {side: tokenizer_from_json(text) for side, text in saved.items()}
    except Exception as err:  # `tokenizers` raises a bare Exception for a bad JSON
        raise InferenceError(f"checkpoint {path}: its tokenizer cannot be read ({err})") from None
    tokenizers = {"src": built["joint"], "tgt": built["joint"]} if "joint" in built else built
    if set(tokenizers) != {"src", "tgt"}:
        raise InferenceError(f"checkpoint {path}: its tokenizers are {sorted(saved)}, not joint or src + tgt")
    expected = restored.model.config.src_vocab_size
    if tokenizers["src"].vocab_size != expected:
        raise InferenceError(
            f"checkpoint {path}: its tokenizer has {tokenizers['src'].vocab_size} tokens but its model "
            f"expects {expected}"
        )
    return tokenizers
