"""What `train.py` checks before it reads any data: the config's sections and the numbers typed by hand,
the run directory (writable; continued or refused when it holds an earlier run) and the checkpoint to
resume from (readable, the same task and network shape)."""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from transformer.checkpoint import files_in_hint, load_checkpoint
from transformer.cli.errors import ConfigError
from transformer.cli.process import local_rank
from transformer.training.compiling import compile_unavailable, fused_loss_conflict, is_compile_mode
from transformer.training.run_directory import RunDirectoryError, checkpoint_to_continue, earlier_logs

log = logging.getLogger("train")


def check_config(cfg: DictConfig) -> None:
    for key in ("data", "model", "trainer", "paths"):
        if cfg.get(key) is None:
            raise ConfigError(f"the config has no `{key}` section (pick one: {key}=NAME, see configs/{key}/)")
    for key in ("train", "test"):
        if not isinstance(cfg.get(key), bool):
            raise ConfigError(f"`{key}` must be true or false, got {cfg.get(key)!r}")
    if cfg.get("ckpt_path") is not None and not Path(cfg.ckpt_path).is_file():
        if Path(cfg.ckpt_path).is_dir():
            raise ConfigError(
                f"ckpt_path={cfg.ckpt_path} is a directory: {files_in_hint(Path(cfg.ckpt_path))}"
            )
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} is not a file (give the path of a .ckpt to resume from)"
        )
    if cfg.get("seed") is not None and (isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int)):
        raise ConfigError(f"`seed` must be an integer or null, got {cfg.seed!r}")
    data_max_len = cfg.data.get("max_len")
    model_max_len = cfg.model.get("config", {}).get("max_len")
    if isinstance(data_max_len, int) and isinstance(model_max_len, int) and data_max_len > model_max_len:
        raise ConfigError(
            f"data.max_len ({data_max_len}) exceeds model.config.max_len ({model_max_len}): "
            "the model would get sequences longer than its positions"
        )
    check_trainer_keys(cfg)
    check_numbers(cfg)
    check_compile(cfg)


def check_trainer_keys(cfg: DictConfig) -> None:
    """Every `trainer.*` key is an argument of the Trainer class (a misspelled one, added with `+` as
    Hydra suggests, would otherwise fail only once the data is prepared), with a "did you mean"."""
    trainer = cfg.get("trainer")
    try:
        target = hydra.utils.get_class(str(trainer.get("_target_")))
        parameters = inspect.signature(target.__init__).parameters
    except Exception:  # no or another `_target_`: building it reports that
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    known = [name for name in parameters if name != "self"]
    for name in trainer:
        if str(name).startswith("_") or name in known:
            continue
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"did you mean trainer.{close[0]}?" if close else "see configs/trainer/default.yaml"
        raise ConfigError(f"trainer.{name} is not an argument of {target.__name__} ({hint})")


def check_compile(cfg: DictConfig) -> None:
    """`model.compile` is true, false or layers, `model.activation_checkpointing` true or false,
    `model.low_precision_residual` true, false or auto, `model.fused_loss` true or false (and false with a
    compiled step), and
    torch.compile can run on the run's device (a supported Python; inductor's C++ compiler on the CPU,
    Triton on CUDA)."""
    value = OmegaConf.select(cfg, "model.activation_checkpointing", default=None)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"`model.activation_checkpointing` must be true or false, got {value!r}")
    value = OmegaConf.select(cfg, "model.low_precision_residual", default=None)
    if value is not None and not (isinstance(value, bool) or value == "auto"):
        raise ConfigError(f"`model.low_precision_residual` must be true, false or auto, got {value!r}")
    fused_loss = OmegaConf.select(cfg, "model.fused_loss", default=None)
    if fused_loss is not None and not isinstance(fused_loss, bool):
        raise ConfigError(f"`model.fused_loss` must be true or false, got {fused_loss!r}")
    compile_mode = OmegaConf.select(cfg, "model.compile", default=None)
    if compile_mode is not None and not is_compile_mode(compile_mode):
        raise ConfigError(
            f"`model.compile` must be true (the training step), layers (each encoder / decoder layer) or "
            f"false, got {compile_mode!r}"
        )
    if fused_loss and (conflict := fused_loss_conflict(compile_mode)):
        raise ConfigError(conflict)
    if not compile_mode:
        return
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="auto"))
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        device = "cuda"
    elif accelerator in ("cpu", "auto"):
        device = "cpu"
    else:  # a GPU run without a GPU: Lightning's own error says so
        return
    reason = compile_unavailable(device)
    if reason is not None:
        setting = str(compile_mode).lower()
        raise ConfigError(f"`model.compile`={setting} cannot work here: {reason} (set model.compile=false)")


# key -> (kind, lowest allowed, lowest is allowed): the Trainer's numbers, which Lightning checks late or
# not at all, and this script's own. Components check their own values (the optimizer its `lr`, the
# schedule its `warmup_steps`, the datamodule its `max_tokens`) when `build` instantiates them.
NUMBERS = {
    "trainer.max_epochs": (int, -1, True),
    "trainer.max_steps": (int, -1, True),
    "trainer.accumulate_grad_batches": (int, 1, True),
    "trainer.gradient_clip_val": (float, 0.0, True),
    "trainer.check_val_every_n_epoch": (int, 1, True),
    "trainer.val_check_interval": (float, 0.0, False),
    "trainer.num_sanity_val_steps": (int, -1, True),
    # how long a DDP collective waits for the other processes (0 would fail every collective at once)
    "trainer.strategy.timeout.seconds": (float, 0.0, False),
    "num_threads": (int, 1, True),
}


def check_numbers(cfg: DictConfig) -> None:
    for key, (kind, low, inclusive) in NUMBERS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        numeric = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not numeric or not math.isfinite(value):
            raise ConfigError(f"`{key}` must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ConfigError(f"`{key}` must be {bound}, got {value!r}")
    check_max_time(cfg)
    check_trainer_choices(cfg)


_TIME_UNITS = ("days", "hours", "minutes", "seconds")


def check_max_time(cfg: DictConfig) -> None:
    """`trainer.max_time` as Lightning's Timer reads it: DD:HH:MM:SS or a mapping of time units (it
    passes other values to the Trainer, which fails without naming the key)."""
    value = OmegaConf.select(cfg, "trainer.max_time", default=None)
    if value is None:
        return
    if isinstance(value, str) and len(parts := value.split(":")) == 4 and all(p.isdigit() for p in parts):
        return
    if (
        OmegaConf.is_dict(value)
        and value
        and all(
            unit in _TIME_UNITS and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for unit, n in value.items()
        )
    ):
        return
    raise ConfigError(
        f"`trainer.max_time` must be DD:HH:MM:SS (e.g. 00:12:00:00), a mapping of {', '.join(_TIME_UNITS)} "
        f"(e.g. {{hours: 12}}) or null, got {value!r}"
    )


def check_trainer_choices(cfg: DictConfig) -> None:
    """`trainer.devices`, `trainer.plugins` and the DDP backend, which Lightning refuses without naming
    the key (the GPU device parser: "invalid literal for int()") or only once the processes start, and a
    GPU trainer where there is no GPU (Lightning says so only after the data is prepared)."""
    devices = OmegaConf.select(cfg, "trainer.devices", default=None)
    ok_int = isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or devices == -1)
    ok_str = isinstance(devices, str) and (
        devices == "auto" or all(part.strip().lstrip("-").isdigit() for part in devices.split(","))
    )
    ok_list = OmegaConf.is_list(devices) and all(isinstance(d, int) and d >= 0 for d in devices)
    if devices is not None and not (ok_int or ok_str or ok_list):
        raise ConfigError(
            f"`trainer.devices` must be an integer >= 1, -1 (all), 'auto' or a list of device ids, "
            f"got {devices!r}"
        )
    plugins = OmegaConf.select(cfg, "trainer.plugins", default=None)
    if plugins is not None and not OmegaConf.is_list(plugins):
        raise ConfigError(
            f"`trainer.plugins` must be a list of plugin configs (_target_: ...), got {plugins!r}"
        )
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="auto"))
    if accelerator in ("gpu", "cuda") and not _gpu_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator} needs a GPU, and torch {torch.__version__} sees none here "
            "(torch.cuda.is_available() is False): train on the CPU with trainer=default"
        )
    backend = OmegaConf.select(cfg, "trainer.strategy.process_group_backend", default=None)
    names = [part.split(":")[-1] for part in str(backend).split(",")]
    if backend is not None and not all(name in ("gloo", "nccl", "mpi", "ucc", "xccl") for name in names):
        raise ConfigError(
            f"`trainer.strategy.process_group_backend` must be gloo, nccl, mpi, ucc or xccl, got {backend!r}"
        )


def _gpu_available() -> bool:
    """A CUDA GPU, or Apple's, which Lightning's accelerator=gpu also takes."""
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available())


def continue_earlier_run(cfg: DictConfig) -> None:
    """A run directory that holds an earlier run: continue from its `checkpoints/last.ckpt` (fairseq's
    `checkpoint_last.pt` rule: a requeued command goes on where it stopped) or refuse to overwrite it."""
    output_dir = Path(cfg.paths.output_dir)
    try:
        ckpt_path = checkpoint_to_continue(output_dir, cfg.get("ckpt_path"), train=cfg.train)
    except RunDirectoryError as err:
        raise ConfigError(str(err)) from err
    if ckpt_path != cfg.get("ckpt_path"):
        log.info("Continuing the earlier run in %s from %s", output_dir, ckpt_path)
        with open_dict(cfg):
            cfg.ckpt_path = ckpt_path
    elif ckpt_path is None and local_rank() == 0 and (logs := earlier_logs(output_dir)):
        log.warning(
            "%s holds logs of an earlier run that saved no checkpoint (%s): starting over, this run's "
            "logs replace them",
            output_dir,
            ", ".join(str(p.relative_to(output_dir)) for p in logs),
        )


def check_output_dir(path: Path) -> None:
    """Fail before any work if the run directory cannot be written (read-only, or under a file)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"paths.output_dir={path} is not writable: {err.strerror or err}") from err


def peek_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint's plain data (memory-mapped: tensors are not read). One that cannot be read so is
    loaded by `transformer.checkpoint.load_checkpoint`, whose CheckpointError says why: truncated or
    corrupt, or refused for holding code (as evaluate.py says it)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # the reason comes from load_checkpoint, below
        pass
    return load_checkpoint(path)


_SHAPE_KEYS = (
    "src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers",
    "d_ff", "positional", "max_len", "tie_embeddings", "norm_first",
)  # fmt: skip


def check_checkpoint_fits(cfg: DictConfig, checkpoint: Mapping[str, Any]) -> None:
    """`ckpt_path` must hold the same task and network shape as this run builds (vocabulary included)."""
    saved_target = ((checkpoint.get("config") or {}).get("model") or {}).get("_target_")
    # by class name: the module path of a task may have moved since the checkpoint was written
    saved_kind, our_kind = (str(t).rsplit(".", 1)[-1] for t in (saved_target, cfg.model.get("_target_")))
    if saved_target and saved_kind != our_kind:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} holds a {saved_kind.removesuffix('Task').lower()} model "
            f"({saved_kind}); this run builds {our_kind} (pick the matching experiment=/model=)"
        )
    saved = (checkpoint.get("hyper_parameters") or {}).get("config") or {}
    ours = OmegaConf.to_container(cfg.model.get("config") or {}, resolve=True)
    differ = [
        f"{key}={saved[key]!r} in the checkpoint, {ours[key]!r} here"
        for key in _SHAPE_KEYS
        if key in saved and key in ours and saved[key] != ours[key]
    ]
    if differ:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} does not fit model.config: {'; '.join(differ)} "
            "(a checkpoint of another model or vocabulary)"
        )
