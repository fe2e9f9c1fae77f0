"""Training entry point: config -> checks -> datamodule -> task -> Trainer -> fit -> test -> metrics.json.

    python train.py [experiment=NAME] [group=option ...] [key=value ...]
    python train.py -m hparams_search=NAME     # or a grid: -m model.config.d_model=128,256 seed=1,2

`train(cfg)` is importable (tests, sweeps); `main()` is the command line. The steps are in
`transformer.cli` (checks, build, process, sweeps, results, errors); this file is the order they run in.
"""

from __future__ import annotations

import os

# Before torch is imported (OpenMP reads it once): idle OpenMP threads sleep instead of spinning.
# On a shared or busy CPU, spinning threads that wait for a descheduled peer made every
# elementwise op up to 100x slower; sleeping costs little when the cores are idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import logging
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from transformer.cli import build, checks, console, errors, init_from, process, results, sweeps
from transformer.cli.distill import synthetic
from transformer.cli.errors import ConfigError
from transformer.disk import write_text
from transformer.training.checkpoint_io import check_room_for_checkpoint
from transformer.training.peers import stop_on_lost_peer

log = logging.getLogger("train")

PROJECT_ROOT = Path(__file__).resolve().parent


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit and/or test as `cfg` says; returns the final metrics (also written to <run dir>/metrics.json)."""
    checks.check_config(cfg)
    if cfg.train or cfg.test:
        checks.check_output_dir(Path(cfg.paths.output_dir))
        checks.continue_earlier_run(cfg)
    process.set_process_switches(cfg)
    console.quiet_lightning()
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    checkpoint = checks.peek_checkpoint(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    # a translation run fine-tuning `model.init_from`: its model config and tokenizer(s) are the run's
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    init_state = init_from.take_init_from(cfg, checkpoint, init_from.explicit_keys(overrides))

    # distillation / back-translation: checked, then translated (under DDP by every process, started
    # now) or reused from the cache, before the data is prepared on the synthetic pairs
    plan = synthetic.make_plan(cfg) if synthetic.wanted(cfg) else None
    trainer = build.build_trainer(cfg, checkpoint) if plan and (cfg.train or cfg.test) else None
    if plan is not None:
        synthetic.add_synthetic_pairs(cfg, plan, trainer)
        del plan  # the teachers' weights: not needed while the student trains
    datamodule = prepare_data(cfg, checkpoint, init_state)
    if not cfg.train and not cfg.test:  # prepare-only: data and tokenizer cached for later runs
        log.info("Data prepared (train=false, test=false): nothing else to do")
        return {"run_dir": str(cfg.paths.output_dir)}
    task = build.build_task(cfg, datamodule, checkpoint)
    trainer = trainer or build.build_trainer(cfg, checkpoint)
    if cfg.train and trainer.is_global_zero:  # refuse now if not even one checkpoint fits
        check_room_for_checkpoint(trainer, task)

    output_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_text(output_dir / "config.yaml", OmegaConf.to_yaml(task.run_config), "the run's config.yaml")
        if cfg.get("print_config"):
            log.info("Resolved config:\n%s", OmegaConf.to_yaml(task.run_config))
        else:
            overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
            log.info("%s", console.config_message(output_dir / "config.yaml", overrides))
    for logger in trainer.loggers:
        logger.log_hyperparams(task.run_config)
    with console.sampler_resumes(checkpoint, datamodule):  # Lightning's "not resumable" is untrue for it
        metrics = {**fit_and_test(cfg, trainer, task, datamodule), "run_dir": str(output_dir)}
    if trainer.is_global_zero:
        text = json.dumps(metrics, indent=2, sort_keys=True) + "\n"
        write_text(output_dir / "metrics.json", text, "the run's metrics.json")  # whole or the earlier one
    return metrics


def prepare_data(
    cfg: DictConfig, checkpoint: Mapping[str, Any] | None, init_state: Mapping[str, Any] | None = None
) -> Any:
    """The datamodule with its tokenizer(s) (the checkpoint's when resuming; `init_state`'s when fine-tuning
    `model.init_from`: its tokenizers, JSON by side, and a multilingual model's labels) and every split
    this run needs, set up now: with `paths.cache_dir`
    they are tokenized once into the cache, here, before Lightning starts the other DDP ranks, which then
    only memory-map them (as later runs do)."""
    datamodule = build.instantiate(cfg.data, "data")
    try:
        if checkpoint is not None and type(datamodule).__qualname__ in checkpoint:
            # the checkpoint's tokenizer(s) win over the cache: the weights were trained with them
            datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])
        elif init_state is not None:  # the weights of init_from were trained with them: none trained here
            datamodule.load_state_dict(dict(init_state))
    except ValueError as err:  # the run's pairs or labels against the model's (data.pairs, data.labels)
        raise ConfigError(str(err)) from None
    if process.local_rank() == 0:  # DDP workers started later find the tokenizer(s) in the cache
        datamodule.prepare_data()
    stages = [stage for stage, wanted in (("fit", cfg.train), ("test", cfg.test)) if wanted]
    for stage in stages or [None]:  # prepare-only (train=false test=false) caches every split
        datamodule.setup(stage)
    return datamodule


def fit_and_test(cfg: DictConfig, trainer: L.Trainer, task: Any, datamodule: Any) -> dict[str, Any]:
    """`trainer.fit`, then `trainer.test` on the best checkpoint; the final metrics and checkpoints."""
    metrics: dict[str, Any] = {}
    if cfg.train:
        with errors.lightning_refusals(), stop_on_lost_peer(trainer):
            trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics.update(results.floats(trainer.callback_metrics))
    checkpoint_callback = trainer.checkpoint_callback
    best = checkpoint_callback.best_model_path if checkpoint_callback is not None else ""
    last = results.last_checkpoint(trainer)  # read before testing, which resets callbacks without a monitor
    if cfg.test:
        test_ckpt = best or (None if cfg.train else cfg.get("ckpt_path"))
        if test_ckpt:
            log.info("Testing checkpoint %s", test_ckpt)
        else:
            log.warning(
                "No best checkpoint to test (checkpointing off or nothing saved): testing current weights"
            )
        with errors.lightning_refusals(), stop_on_lost_peer(trainer):
            trainer.test(task, datamodule=datamodule, ckpt_path=test_ckpt)
        metrics.update(results.floats(trainer.callback_metrics))
    best_score = checkpoint_callback.best_model_score if checkpoint_callback is not None else None
    return {
        **metrics,
        "best_ckpt_path": best or None,
        "best_model_score": results.as_float(best_score),
        "last_ckpt_path": last,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


# the jobs of this command's sweep (one object per run of this file: `main()` below)
JOBS = sweeps.SweepJobs()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    job = JOBS.start(cfg, hydra_cfg) if hydra_cfg.mode == RunMode.MULTIRUN else None
    try:
        metrics = train(cfg)
        objective = sweeps.objective(
            cfg, metrics, needed=job is not None and sweeps.sweeper_uses_objective(hydra_cfg)
        )
    except errors.USER_ERRORS as err:  # a bad value or data file; a NaN/inf loss stop
        message = errors.disk_full(err) or str(err)  # the data cache on a full disk
        log.error("%s", message)
        if job is not None:  # one failed job: the sweeper records it (Optuna: a FAIL trial) and goes on
            job.fail(message)
            raise
        raise SystemExit(f"error: {message}") from None
    except Exception as err:
        full = errors.disk_full(err, cfg.paths.output_dir)  # any write on a full disk: one line, too
        if job is not None:  # the sweeper keeps only the message: the traceback goes to the job's log file
            if full is None:
                log.exception("The job failed")
            else:  # a full disk is the user's to fix, as a bad value: one line on the console
                log.error("%s", full)
                errors.traceback_to_log_file(full)
            job.fail(full or f"{type(err).__name__}: {errors.first_line(err)}")
            # Hydra keeps the exception until the next job has run: free what its frames hold
            # (activations on the GPU after an out-of-memory error) so that the next job gets it
            traceback.clear_frames(err.__traceback__)
        elif full is not None:
            raise errors.disk_full_exit(err, cfg.paths.output_dir) from None
        raise
    finally:
        if job is not None:  # the jobs share this process: each ends its own wandb run, or the next reuses it
            job.finish()
    if rank_zero_only.rank == 0:
        results.print_metrics(metrics, f"run directory: {hydra_cfg.runtime.output_dir}")
    return objective


def main() -> None:
    """`python train.py ...`: configs resolve paths against the repository root unless PROJECT_ROOT is set."""
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    # each job of a sweep logged its error and traceback: the sweep ends in one line
    JOBS.clear()
    errors.run(_hydra_main, PROJECT_ROOT / "configs", JOBS.failure_summary)


if __name__ == "__main__":
    main()
