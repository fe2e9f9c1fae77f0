"""`aiayn-lora`: a LoRA fine-tuning checkpoint (`finetune=lora`) as a plain merged checkpoint, or as its
adapters alone, which load back on the checkpoint they were trained on.

    aiayn-lora merge LORA.ckpt --output MERGED.ckpt [--force]
    aiayn-lora save-adapter LORA.ckpt --output ADAPTER.pt [--force]
    aiayn-lora apply ADAPTER.pt --base BASE.ckpt --output LORA.ckpt [--force]

`merge`: every adapter folded into the weight it updates (W + alpha / rank B A), the fine-tuning run's
settings, tokenizers and provenance kept, its training state (optimizer, schedule, loops, callbacks)
dropped; `finetune.lora.rank` is 0 in it, so every reader sees a plain model (evaluate.py and the others
merged on load already: the same numbers).

`save-adapter`: the LoRA matrices A and B alone, plus what LoRA trained besides them (a classifier's new
head), the LoRA settings, the fine-tuning run's hyperparameters (decoding, pooling) and the base's identity:
a SHA-256 digest of the base weights (every model weight but the adapters and what trained besides them,
by name, dtype, shape and bytes), with the base's path and provenance for the messages. A small file:
kilobytes for the megabytes of a checkpoint.

`apply`: the adapter on BASE (refused in one line unless BASE's weights have the adapter's digest),
written as a LoRA checkpoint with BASE's tokenizers and provenance, which evaluate.py, the inference API,
ensembles and aiayn-export use as the original fine-tuning checkpoint (`merge` makes it plain).
Every failure is one `error:` line and exit status 1; nothing is written unless whole (a temporary file
renamed), and an existing output is replaced only with `--force`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.evaluation.restore import (
    CLASS_NAMES_KEY,
    DATAMODULES,
    lora_settings,
    restore_model,
    saved_class_names,
    task_of,
)
from transformer.interop.export_cli import OneLineParser
from transformer.interop.source import write_failure

__all__ = ["adapter_of", "apply_adapter", "base_digest", "main", "merged_checkpoint"]

ADAPTER_FORMAT = "aiayn-lora-adapter"
_PREFIX = "model."
_PARAMETRIZED = ".parametrizations."
_TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks")
# what LoRA trains besides the adapters, by task (the tasks' `trainable_modules`: a classifier's new head)
_TRAINED_BESIDES = {"translation": (), "classification": ("head",)}


class LoraError(ValueError):
    """A LoRA file that cannot be used as asked: one line naming the file and what was expected."""


def _lora_checkpoint(path: Path) -> dict[str, Any]:
    checkpoint = load_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if lora_settings(hparams, path) is None:
        raise LoraError(
            f"checkpoint {path} has no LoRA adapters (its finetune.lora.rank is 0 or unset): it is a plain "
            "checkpoint already (train with finetune=lora to get adapters)"
        )
    return checkpoint


def _plain_name(key: str) -> str:
    """A parametrized weight's name as the plain module names it: `a.parametrizations.w.original` -> `a.w`."""
    head, _, tail = key.partition(_PARAMETRIZED)
    return f"{head}.{tail.removesuffix('.original')}"


def _weight_of(key: str) -> str:
    """The plain name of the weight an adapter tensor updates: `a.parametrizations.w.0.lora_A.q` -> `a.w`."""
    head, _, tail = key.partition(_PARAMETRIZED)
    return f"{head}.{tail.split('.', 1)[0]}"


def _is_adapter(key: str) -> bool:
    return _PARAMETRIZED in key and not key.endswith(".original")


def _trained_besides(key: str, task: str) -> bool:
    name = key.removeprefix(_PREFIX)
    return any(name == m or name.startswith(f"{m}.") for m in _TRAINED_BESIDES[task])


def _base_weights(state_dict: Mapping[str, torch.Tensor], task: str) -> dict[str, torch.Tensor]:
    """The weights LoRA kept frozen, under their plain names: a LoRA checkpoint's originals and other
    model weights, or a plain checkpoint's model weights; without what trained besides the adapters."""
    return {
        _plain_name(key) if _PARAMETRIZED in key else key: value
        for key, value in state_dict.items()
        if key.startswith(_PREFIX) and not _is_adapter(key) and not _trained_besides(key, task)
    }


def base_digest(state_dict: Mapping[str, torch.Tensor], task: str) -> str:
    """SHA-256 of the base weights (`_base_weights`): names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(_base_weights(state_dict, task).items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def merged_checkpoint(path: Path) -> dict[str, Any]:
    """The LoRA checkpoint at `path` with its adapters merged into plain weights (see the module doc)."""
    checkpoint = _lora_checkpoint(path)
    restored = restore_model(checkpoint, path)  # adds the adapters, loads, merges them
    merged = {k: v for k, v in checkpoint.items() if k not in _TRAINING_STATE}
    others = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(_PREFIX)}
    merged["state_dict"] = {**others, **{_PREFIX + k: v for k, v in restored.model.state_dict().items()}}
    hparams = dict(checkpoint["hyper_parameters"])
    finetune = dict(hparams.get("finetune") or {})
    lora = dict(finetune.get("lora") or {})
    merged["lora_merged"] = {"from": str(path.resolve()), "lora": dict(lora)}
    finetune["lora"] = {**lora, "rank": 0}
    hparams["finetune"] = finetune
    merged["hyper_parameters"] = hparams
    return merged


def adapter_of(path: Path) -> dict[str, Any]:
    """The adapter file's content for the LoRA checkpoint at `path` (see the module doc)."""
    checkpoint = _lora_checkpoint(path)
    task = task_of(checkpoint, path)
    state = checkpoint["state_dict"]
    hparams = checkpoint["hyper_parameters"]
    started = checkpoint.get("started_from") or {}
    return {
        "format": ADAPTER_FORMAT,
        "version": 1,
        "task": task,
        "lora": dict(hparams["finetune"]["lora"]),
        "freeze": hparams["finetune"].get("freeze", "none"),
        "hyper_parameters": dict(hparams),
        "adapters": {k: v.clone() for k, v in state.items() if _is_adapter(k)},
        "trained": {k: v.clone() for k, v in state.items() if _trained_besides(k, task)},
        # the head's classes, which the run's data named (the base may call them LABEL_0, ...)
        "class_names": saved_class_names(checkpoint) if task == "classification" else None,
        "base": {
            "digest": base_digest(state, task),
            "init_from": started.get("init_from"),
            "imported_from": started.get("imported_from"),
        },
        "lora_checkpoint": str(path.resolve()),
    }


def _adapter(path: Path) -> dict[str, Any]:
    try:
        adapter = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LoraError(f"adapter {path} does not exist") from None
    except Exception as err:  # truncated, not a torch file, a refused global: one line
        raise LoraError(
            f"adapter {path} cannot be read as an aiayn-lora adapter ({type(err).__name__})"
        ) from None
    if not isinstance(adapter, dict) or adapter.get("format") != ADAPTER_FORMAT:
        raise LoraError(
            f"{path} is not an adapter written by aiayn-lora save-adapter (no format {ADAPTER_FORMAT!r})"
        )
    return adapter


def apply_adapter(adapter_path: Path, base_path: Path) -> dict[str, Any]:
    """The LoRA checkpoint of the adapter at `adapter_path` on the base checkpoint at `base_path`: refused
    (LoraError) unless the base's weights have the adapter's digest and the same task."""
    adapter = _adapter(adapter_path)
    base = load_checkpoint(base_path)
    task = task_of(base, base_path)
    if lora_settings(base.get("hyper_parameters") or {}, base_path) is not None:
        raise LoraError(
            f"base {base_path} is a LoRA checkpoint itself: give the plain checkpoint it started from"
        )
    expected = adapter["base"]["digest"]
    if task != adapter["task"] or base_digest(base["state_dict"], task) != expected:
        trained_on = adapter["base"].get("init_from") or "a checkpoint not recorded"
        raise LoraError(
            f"adapter {adapter_path} was not trained on {base_path}: its base weights have another digest "
            f"(the adapter's base: {trained_on}, weights sha256 {expected[:12]}...)"
        )
    frozen = {
        key: value
        for key, value in base["state_dict"].items()
        if key.startswith(_PREFIX) and not _trained_besides(key, task)
    }
    parametrized = {_weight_of(k) for k in adapter["adapters"]}
    state = {k: v for k, v in base["state_dict"].items() if not k.startswith(_PREFIX)}
    for key, value in frozen.items():
        if key in parametrized:
            module, _, weight = key.rpartition(".")
            state[f"{module}{_PARAMETRIZED}{weight}.original"] = value
        else:
            state[key] = value
    state.update(adapter["adapters"])
    state.update(adapter["trained"])
    checkpoint = {k: v for k, v in base.items() if k not in _TRAINING_STATE}
    checkpoint.update(
        state_dict=state,
        hyper_parameters=dict(adapter["hyper_parameters"]),
        started_from={
            "init_from": str(base_path.resolve()),
            **({"imported_from": base["imported_from"]} if base.get("imported_from") else {}),
        },
    )
    checkpoint.pop("imported_from", None)  # trained since: its provenance is the start's (started_from)
    if adapter.get("class_names"):
        checkpoint[CLASS_NAMES_KEY] = list(adapter["class_names"])
        if isinstance(checkpoint.get(DATAMODULES[task]), Mapping):
            checkpoint[DATAMODULES[task]] = {
                **checkpoint[DATAMODULES[task]],
                "class_names": adapter["class_names"],
            }
    restore_model(checkpoint, base_path)  # the same checks evaluate.py makes: it loads and merges
    return checkpoint


def _check_output(output: Path, force: bool) -> None:
    if output.is_dir():
        raise LoraError(f"--output {output} is a directory (give the path of the file to write)")
    if output.exists() and not force:
        raise LoraError(f"--output {output} exists (--force replaces it)")
    if not output.parent.is_dir():
        raise LoraError(f"--output {output}: the folder {output.parent} does not exist")


def _write(value: Any, output: Path, force: bool, what: str) -> None:
    """torch.save to `output` through a temporary file beside it, renamed when whole."""
    _check_output(output, force)
    partial = output.with_name(f".{output.name}.partial")
    try:
        torch.save(value, partial)
        partial.replace(output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    print(f"wrote {what}: {output} ({output.stat().st_size:,} bytes)")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="aiayn-lora", description="LoRA checkpoints: merge, save or apply adapters.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("merge", help="a plain checkpoint with the adapters merged into the weights")
    merge.add_argument("checkpoint", type=Path)
    save = commands.add_parser("save-adapter", help="the adapters alone, with the base's digest")
    save.add_argument("checkpoint", type=Path)
    apply = commands.add_parser("apply", help="an adapter on its base checkpoint -> a LoRA checkpoint")
    apply.add_argument("adapter", type=Path)
    apply.add_argument("--base", type=Path, required=True)
    for command in (merge, save, apply):
        command.add_argument("--output", type=Path, required=True)
        command.add_argument("--force", action="store_true", help="replace an existing output file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_output(args.output, args.force)  # before any work
        if args.command == "merge":
            _write(merged_checkpoint(args.checkpoint), args.output, args.force, "the merged checkpoint")
        elif args.command == "save-adapter":
            _write(adapter_of(args.checkpoint), args.output, args.force, "the adapter")
        else:
            checkpoint = apply_adapter(args.adapter, args.base)
            _write(checkpoint, args.output, args.force, "the LoRA checkpoint")
    except (LoraError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a full disk (as torch.save reports it), a folder that cannot be written
        line = write_failure(err, args.output, f"cannot write {args.output}")
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
