"""Training entry point: Hydra config -> datamodule -> task -> Trainer -> fit -> test -> metrics.json.

    python train.py [experiment=NAME] [group=option ...] [key=value ...]
    python train.py -m hparams_search=NAME     # or a grid: -m model.config.d_model=128,256 seed=1,2

`train(cfg)` is importable (tests, sweeps); `main()` is the command line. The datamodule is prepared
first because the model's vocabulary sizes and special ids come from its tokenizer(s).
"""

from __future__ import annotations

import os

# Before torch is imported (OpenMP reads it once): idle OpenMP threads sleep instead of spinning.
# On a shared or busy CPU, spinning threads that wait for a descheduled peer made every
# elementwise op up to 100x slower; sleeping costs little when the cores are idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib
import ctypes
import inspect
import json
import logging
import math
import sys
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf, open_dict

from data.sources import DataError
from transformer.checkpoint import CheckpointError
from transformer.cli import errors as cli
from transformer.cli.arguments import ArgumentError, check_arguments
from transformer.training.run_directory import RunDirectoryError, checkpoint_to_continue, earlier_logs

log = logging.getLogger("train")

PROJECT_ROOT = Path(__file__).resolve().parent
CONFIGS = PROJECT_ROOT / "configs"


class ConfigError(Exception):
    """A config value that cannot work: reported as one line naming the key, exit status 1."""


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit and/or test as `cfg` says; returns the final metrics (also written to <run dir>/metrics.json)."""
    _check(cfg)
    _check_numbers(cfg)
    if cfg.get("train") or cfg.get("test"):
        _check_output_dir(Path(cfg.paths.output_dir))
        _continue_earlier_run(cfg)
    _set_process_switches(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    checkpoint = _peek_checkpoint(cfg.ckpt_path) if cfg.get("ckpt_path") else None

    datamodule = _instantiate(cfg.data, "data")
    if checkpoint is not None and type(datamodule).__qualname__ in checkpoint:
        # the checkpoint's tokenizer(s) win over the cache: the weights were trained with them
        datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])
    if _local_rank() == 0:  # DDP workers started later find the tokenizer(s) in the cache
        datamodule.prepare_data()
    # Every split this run needs, now: with paths.cache_dir they are tokenized once into the cache, here,
    # before Lightning starts the other DDP ranks, which then only memory-map them (as later runs do).
    # Prepare-only (train=false test=false) fills the cache with all of them.
    stages = [stage for stage in ("fit", "test") if cfg.get("train" if stage == "fit" else "test")]
    for stage in stages or [None]:
        datamodule.setup(stage)
    _fill_from_data(cfg, datamodule)
    if not cfg.train and not cfg.test:  # prepare-only: data and tokenizer cached for later runs
        log.info("Data prepared (train=false, test=false): nothing else to do")
        return {"run_dir": str(cfg.paths.output_dir)}

    if checkpoint is not None:
        _check_checkpoint_fits(cfg, checkpoint)
    task = _instantiate(cfg.model, "model")
    _check_optimizer(task)
    if cfg.get("train") and checkpoint is None and hasattr(task, "load_init_from"):
        _load_init_from(task, datamodule)
    task.run_config = _resolved(cfg)  # stored in every checkpoint
    callbacks = _instantiate_group(cfg.get("callbacks"), "callbacks")
    loggers = _instantiate_group(_with_wandb_id(cfg, checkpoint), "logger")
    if not loggers:  # Lightning refuses a learning-rate monitor with nothing to log to
        callbacks = [c for c in callbacks if type(c).__name__ != "LearningRateMonitor"]
    trainer: L.Trainer = _instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)
    _set_matmul_precision(cfg, trainer)

    output_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        log.info("Resolved config:\n%s", OmegaConf.to_yaml(task.run_config))
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(task.run_config))
    for logger in trainer.loggers:
        logger.log_hyperparams(task.run_config)

    metrics: dict[str, Any] = {}
    if cfg.get("train"):
        with _lightning_refusals():
            trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics.update(_floats(trainer.callback_metrics))
    checkpoint_callback = trainer.checkpoint_callback
    best = checkpoint_callback.best_model_path if checkpoint_callback is not None else ""
    last = _last_checkpoint(trainer)  # read before testing, which resets callbacks without a monitor
    if cfg.get("test"):
        test_ckpt = best or (None if cfg.get("train") else cfg.get("ckpt_path"))
        if test_ckpt:
            log.info("Testing checkpoint %s", test_ckpt)
        else:
            log.warning(
                "No best checkpoint to test (checkpointing off or nothing saved): testing current weights"
            )
        with _lightning_refusals():
            trainer.test(task, datamodule=datamodule, ckpt_path=test_ckpt)
        metrics.update(_floats(trainer.callback_metrics))
    metrics.update(
        best_ckpt_path=best or None,
        best_model_score=_float(checkpoint_callback.best_model_score) if checkpoint_callback else None,
        last_ckpt_path=last,
        epoch=trainer.current_epoch,
        global_step=trainer.global_step,
        run_dir=str(output_dir),
    )
    if trainer.is_global_zero:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


# --- checks and process-wide switches ---------------------------------------------------------------


def _check(cfg: DictConfig) -> None:
    for key in ("data", "model", "trainer", "paths"):
        if cfg.get(key) is None:
            raise ConfigError(f"the config has no `{key}` section (pick one: {key}=NAME, see configs/{key}/)")
    for key in ("train", "test"):
        if not isinstance(cfg.get(key), bool):
            raise ConfigError(f"`{key}` must be true or false, got {cfg.get(key)!r}")
    if cfg.get("ckpt_path") is not None and not Path(cfg.ckpt_path).is_file():
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


# key -> (kind, lowest allowed, lowest is allowed): values typed by hand on the command line
_NUMBERS = {
    "model.optimizer.lr": (float, 0.0, False),
    "model.optimizer.weight_decay": (float, 0.0, True),
    "model.scheduler.warmup_steps": (int, 0, True),
    "data.max_tokens": (int, 1, True),
    "trainer.max_epochs": (int, -1, True),
    "trainer.max_steps": (int, -1, True),
    "trainer.accumulate_grad_batches": (int, 1, True),
    "trainer.gradient_clip_val": (float, 0.0, True),
    "trainer.check_val_every_n_epoch": (int, 1, True),
    "trainer.val_check_interval": (float, 0.0, False),
    "trainer.num_sanity_val_steps": (int, -1, True),
    "num_threads": (int, 1, True),
}


def _check_numbers(cfg: DictConfig) -> None:
    for key, (kind, low, inclusive) in _NUMBERS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        numeric = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not numeric or not math.isfinite(value):
            raise ConfigError(f"`{key}` must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ConfigError(f"`{key}` must be {bound}, got {value!r}")


def _continue_earlier_run(cfg: DictConfig) -> None:
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
    elif ckpt_path is None and _local_rank() == 0 and (logs := earlier_logs(output_dir)):
        log.warning(
            "%s holds logs of an earlier run that saved no checkpoint (%s): starting over, this run's "
            "logs replace them",
            output_dir,
            ", ".join(str(p.relative_to(output_dir)) for p in logs),
        )


def _check_output_dir(path: Path) -> None:
    """Fail before any work if the run directory cannot be written (read-only, or under a file)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"paths.output_dir={path} is not writable: {err.strerror or err}") from err


_SHAPE_KEYS = (
    "src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers",
    "d_ff", "positional", "max_len", "tie_embeddings", "norm_first",
)  # fmt: skip


def _check_checkpoint_fits(cfg: DictConfig, checkpoint: Mapping[str, Any]) -> None:
    """`ckpt_path` must hold the same task and network shape as this run builds (vocabulary included)."""
    saved_target = ((checkpoint.get("config") or {}).get("model") or {}).get("_target_")
    if saved_target and saved_target != cfg.model.get("_target_"):
        saved_kind, our_kind = (t.rsplit(".", 1)[-1] for t in (saved_target, str(cfg.model.get("_target_"))))
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


def _check_optimizer(task: Any) -> None:
    """Build the optimizer once now: a bad `model.optimizer` value fails before anything is written."""
    factory = getattr(task, "optimizer_factory", None)
    if factory is None:
        return
    try:
        optimizer = factory(task.model)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build `model.optimizer`: {type(err).__name__}: {err}") from err
    scheduler = getattr(task, "scheduler_factory", None)
    if scheduler is None:
        return
    keywords = getattr(scheduler, "keywords", {})
    kwargs = {}
    if "total_steps" in inspect.signature(scheduler).parameters and keywords.get("total_steps") is None:
        kwargs["total_steps"] = (keywords.get("warmup_steps") or 0) + 1  # the task fills in the real one
    try:
        scheduler(optimizer, **kwargs)
    except (TypeError, ValueError) as err:
        message = _naming_key(str(err), "model.scheduler", keywords)
        raise ConfigError(f"cannot build `model.scheduler`: {type(err).__name__}: {message}") from err


def _naming_key(message: str, key: str, node: Mapping[str, Any]) -> str:
    """ "vocab_size must ..." from the component built from `node` as "`data.vocab_size` must ..."."""
    first, _, rest = message.partition(" ")
    return f"`{key}.{first}` {rest}" if rest and first.split(".", 1)[0] in node else message


def _load_init_from(task: Any, datamodule: Any) -> None:
    """`model.init_from`: the pretrained encoder, checked (task, tokenizer, shapes) before anything is
    written."""
    try:
        task.load_init_from(datamodule.state_dict().get("tokenizers"))
    except CheckpointError as err:
        raise ConfigError(str(err)) from err


@contextlib.contextmanager
def _lightning_refusals() -> Iterator[None]:
    """Settings Lightning checks only once the loop starts (e.g. `trainer.val_check_interval` larger than
    an epoch) end the run with one line, like those checked up front."""
    try:
        yield
    except (MisconfigurationException, ValueError) as err:
        frames = traceback.extract_tb(err.__traceback__)
        raised_by_lightning = bool(frames) and frames[-1].filename.startswith(_LIGHTNING_DIR)
        if isinstance(err, MisconfigurationException) or raised_by_lightning:
            raise ConfigError(f"the trainer refused the config: {' '.join(str(err).split())}") from err
        raise


_LIGHTNING_DIR = str(Path(L.__file__).parent)


def _set_process_switches(cfg: DictConfig) -> None:
    if cfg.get("matmul_precision") and cfg.matmul_precision not in ("highest", "high", "medium"):
        raise ConfigError(f"matmul_precision must be highest, high or medium, got {cfg.matmul_precision!r}")
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    if cfg.get("tune_malloc"):
        _tune_malloc()


def _set_matmul_precision(cfg: DictConfig, trainer: L.Trainer) -> None:
    """A GPU switch (TF32 matmuls): on the CPU, "high" made training steps 2x slower and memory grow
    with every new batch shape (oneDNN's lower-precision path), so CPU runs keep torch's default."""
    if cfg.get("matmul_precision") and isinstance(trainer.accelerator, CUDAAccelerator):
        torch.set_float32_matmul_precision(cfg.matmul_precision)


def _tune_malloc() -> None:
    """glibc: serve large tensors from the heap and never trim it, so that the big activation buffers
    are reused across steps instead of being unmapped and page-faulted in again (shared/PERF.md)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from <malloc.h>
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


# --- building objects from the config ----------------------------------------------------------------


def _instantiate(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` with plain containers, turning failures into one line naming `key`."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"`{key}` needs a `_target_` (the class to build), got {node!r}")
    _check_types(OmegaConf.to_container(node, resolve=True), key)
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__ or err
        message = _naming_key(str(cause), key, node)
        raise ConfigError(
            f"cannot build `{key}` ({node._target_}): {type(cause).__name__}: {message}"
        ) from err


def _check_types(value: Any, key: str) -> None:
    """Every `_target_` in the tree gets values of the types its signature declares."""
    if isinstance(value, Mapping):
        if isinstance(value.get("_target_"), str):
            try:
                target = hydra.utils.get_object(value["_target_"])
            except Exception:  # not importable: instantiating it reports that
                target = None
            if target is not None:
                if value.get("_partial_"):  # null arguments of a partial: the caller may fill them in
                    value = {name: item for name, item in value.items() if item is not None}
                try:
                    check_arguments(target, value, key)
                except ArgumentError as err:
                    raise ConfigError(str(err)) from err
        for name, item in value.items():
            _check_types(item, f"{key}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_types(item, f"{key}[{index}]")


def _instantiate_group(node: DictConfig | None, key: str) -> list[Any]:
    """Callbacks / loggers: a mapping of name -> config with `_target_`; null entries are switched off."""
    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise ConfigError(f"`{key}` must be a mapping of name -> config, got {node!r}")
    built = []
    for name, conf in node.items():
        if conf is None:
            continue
        if isinstance(conf, DictConfig) and "_target_" not in conf:
            # e.g. `callbacks=none` with an experiment that still sets `callbacks.early_stopping.patience`
            log.warning("%s.%s has no _target_ (only %s): skipped", key, name, OmegaConf.to_container(conf))
            continue
        built.append(_instantiate(conf, f"{key}.{name}"))
    return built


def _fill_from_data(cfg: DictConfig, datamodule: Any) -> None:
    """Write the tokenizer's vocabulary sizes and special ids (and the classes) into `cfg.model`."""
    fields = {"pad_id": datamodule.pad_id, "bos_id": datamodule.bos_id, "eos_id": datamodule.eos_id}
    extra = {}
    if hasattr(datamodule, "tgt_vocab_size"):
        fields.update(src_vocab_size=datamodule.src_vocab_size, tgt_vocab_size=datamodule.tgt_vocab_size)
    else:
        fields.update(src_vocab_size=datamodule.vocab_size, tgt_vocab_size=datamodule.vocab_size)
        if _accepts(cfg.model.get("_target_"), "num_classes"):  # not masked-LM pretraining
            extra["num_classes"] = datamodule.num_classes
    with open_dict(cfg):
        for name, value in fields.items():
            current = cfg.model.config.get(name)
            if current is not None and current != value:
                raise ConfigError(
                    f"model.config.{name}={current} disagrees with the data ({value}); leave it unset"
                )
            cfg.model.config[name] = value
        for name, value in extra.items():
            cfg.model[name] = value


def _accepts(target: Any, name: str) -> bool:
    """Whether the class or function `target` (a `_target_` string) takes a `name` argument; True when it
    cannot be imported, so that instantiating it reports the problem."""
    try:
        return name in inspect.signature(hydra.utils.get_object(str(target))).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return True


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    """The newest checkpoint: what a checkpoint callback without a monitor (or `save_last`) wrote."""
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "") or (
            callback.best_model_path if getattr(callback, "monitor", None) is None else ""
        )
        if path:
            return path
    return None


def _peek_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint's plain data (memory-mapped: tensors are not read)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated, not a checkpoint, unsafe pickle: one line, nothing trained
        first_line = (str(err).strip().splitlines() or [""])[0]  # weights_only refusals run to pages
        raise ConfigError(f"cannot read ckpt_path={path}: {type(err).__name__}: {first_line}") from err


def _with_wandb_id(cfg: DictConfig, checkpoint: Mapping[str, Any] | None) -> DictConfig | None:
    """Resuming from a checkpoint continues its wandb run unless `logger.wandb.id` is set."""
    loggers = cfg.get("logger")
    run_id = checkpoint.get("wandb_run_id") if checkpoint else None
    if loggers and run_id and loggers.get("wandb") and loggers.wandb.get("id") is None:
        with open_dict(loggers):
            loggers.wandb.id = run_id
        log.info("Resuming wandb run %s", run_id)
    return loggers


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as plain data, every interpolation resolved (Hydra's own node left out)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


def _float(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return number if math.isfinite(number) else None


def _floats(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    return {name: _float(value) for name, value in metrics.items()}


# --- command line ------------------------------------------------------------------------------------


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    if in_sweep:
        _group_wandb_runs(cfg)
        job = _SweepJob(hydra_cfg.job.num, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir))
        _SWEEP_JOBS.append(job)
    failed = True
    try:
        metrics = train(cfg)
        objective = _objective(cfg, metrics, needed=in_sweep and _sweeper_uses_objective(hydra_cfg))
        failed = False
    except (ConfigError, DataError, FloatingPointError) as err:  # bad data files; a NaN/inf loss stop
        log.error("%s", err)
        if in_sweep:  # one failed job: the sweeper records it (Optuna: a FAIL trial) and goes on
            job.error = str(err)
            raise
        raise SystemExit(f"error: {err}") from None
    except Exception as err:
        if in_sweep:  # the sweeper keeps only the message: the traceback goes to the job's log file
            log.exception("The job failed")
            job.error = f"{type(err).__name__}: {_first_line(err)}"
            # Hydra keeps the exception until the next job has run: free what its frames hold
            # (activations on the GPU after an out-of-memory error) so that the next job gets it
            traceback.clear_frames(err.__traceback__)
        raise
    finally:
        if in_sweep:  # the jobs share this process: each ends its own wandb run, or the next reuses it
            _finish_wandb_run(failed)
    if rank_zero_only.rank == 0:
        width = max((len(k) for k in metrics), default=0)
        for name, value in sorted(metrics.items()):
            print(
                f"{name:<{width}}  {value:.4f}" if isinstance(value, float) else f"{name:<{width}}  {value}"
            )
        print(f"run directory: {HydraConfig.get().runtime.output_dir}")
    return objective


def _objective(cfg: DictConfig, metrics: Mapping[str, Any], needed: bool) -> float | None:
    """The value of `optimized_metric`, what a sweeper optimizes. A run without it (one that ended
    before its first validation, e.g. `trainer.max_steps=20`) is fine on its own, and a failed trial
    in a sweep whose sweeper needs the value (Optuna; a grid needs none)."""
    name = cfg.get("optimized_metric") if cfg.get("train") else None
    if not name or metrics.get(name) is not None:
        return metrics.get(name) if name else None
    validated = sorted(k for k in metrics if k.startswith("val/"))
    if validated:
        problem = f"optimized_metric={name} was not logged; the validation logged {', '.join(validated)}"
    else:
        problem = (
            f"no validation ran before training ended at step {metrics.get('global_step')}, "
            f"so optimized_metric={name} has no value"
        )
    if needed:
        raise ConfigError(problem)
    (log.warning if validated else log.info)("%s", problem[0].upper() + problem[1:])
    return None


def _sweeper_uses_objective(hydra_cfg: DictConfig) -> bool:
    """Whether the sweeper reads the jobs' return values: every sweeper but Hydra's grid (BasicSweeper)."""
    return not str(hydra_cfg.sweeper.get("_target_", "")).endswith(".BasicSweeper")


@dataclass
class _SweepJob:
    """One job of a sweep run in this process, for the summary when the sweep fails."""

    num: int
    overrides: list[str]
    output_dir: Path
    error: str | None = None


_SWEEP_JOBS: list[_SweepJob] = []


def _sweep_failure(err: BaseException) -> str:
    """One line on a sweep that stopped with `err`: how many jobs failed, the first one's error, where
    the logs are."""
    failed = [job for job in _SWEEP_JOBS if job.error is not None]
    if not failed:
        return f"the sweep failed after {len(_SWEEP_JOBS)} jobs: {type(err).__name__}: {_first_line(err)}"
    first = failed[0]
    logs = first.output_dir.parent / "*" / "train.log"
    if len(failed) == len(_SWEEP_JOBS):
        what = f"every job of the sweep failed ({len(failed)} of {len(_SWEEP_JOBS)})"
    else:
        what = f"{len(failed)} of the sweep's {len(_SWEEP_JOBS)} jobs failed"
    which = "the first, job" if len(failed) > 1 else "job"
    overrides = " ".join(first.overrides) or "no overrides"
    return f"{what}; {which} {first.num} ({overrides}): {first.error}; logs: {logs}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def _group_wandb_runs(cfg: DictConfig) -> None:
    """In a sweep every job is its own wandb run, grouped under the sweep directory's name (the study
    name for `hparams_search`) unless `logger.wandb.group` is set."""
    wandb = (cfg.get("logger") or {}).get("wandb")
    if wandb is not None and not wandb.get("group"):
        with open_dict(wandb):
            wandb.group = Path(HydraConfig.get().sweep.dir).name


def _finish_wandb_run(failed: bool) -> None:
    wandb = sys.modules.get("wandb")  # imported only if a wandb logger was built
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)


def main() -> None:
    """`python train.py ...`: configs resolve paths against the repository root unless PROJECT_ROOT is set."""
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    # each job of a sweep logged its error and traceback: the sweep ends in one line
    cli.run(_hydra_main, CONFIGS, lambda err: _sweep_failure(err) if _SWEEP_JOBS else None)


if __name__ == "__main__":
    main()
