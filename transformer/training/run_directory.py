"""A run directory that already holds an earlier run (a fixed `hydra.run.dir=runs/wmt14`, a cluster job
requeued with the same command): continue it, as fairseq continues from `checkpoint_last.pt`, or refuse
with one line; never train over its checkpoints or overwrite its results.

Plain paths only (no Lightning, no Hydra): `train.py` asks before it builds anything.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RunDirectoryError", "checkpoint_to_continue", "earlier_logs"]

LAST = "last.ckpt"


class RunDirectoryError(Exception):
    """The run directory holds an earlier run that this run would overwrite."""


def checkpoint_to_continue(output_dir: Path, ckpt_path: str | None, train: bool) -> str | None:
    """The checkpoint this run starts from: `ckpt_path` if given, else the directory's own
    `checkpoints/last.ckpt` when it has one (the earlier run continues; training that already reached
    its end only tests again). Raises RunDirectoryError where the run would overwrite an earlier one:
    training from another checkpoint (or from scratch) over checkpoints it did not write, or a test-only
    run over an earlier run's `metrics.json`.
    """
    checkpoint_dir = output_dir / "checkpoints"
    earlier = sorted(p.name for p in checkpoint_dir.glob("*.ckpt")) if checkpoint_dir.is_dir() else []
    if not train:
        if (output_dir / "metrics.json").is_file():
            raise RunDirectoryError(
                f"{output_dir} holds the results of an earlier run (metrics.json), which this test-only run "
                "would overwrite: choose another hydra.run.dir"
            )
        return ckpt_path
    if ckpt_path is None and LAST in earlier:
        return str(checkpoint_dir / LAST)
    if earlier and (ckpt_path is None or Path(ckpt_path).resolve().parent != checkpoint_dir.resolve()):
        to_continue = LAST if LAST in earlier else earlier[-1]
        starting = "from scratch" if ckpt_path is None else f"from ckpt_path={ckpt_path}"
        raise RunDirectoryError(
            f"{output_dir} holds checkpoints of an earlier run ({', '.join(earlier)}), which training "
            f"{starting} would overwrite: continue that run with ckpt_path={checkpoint_dir / to_continue}, "
            "or choose another hydra.run.dir"
        )
    return ckpt_path


def earlier_logs(output_dir: Path) -> list[Path]:
    """Logger files an earlier run left without a checkpoint to continue from (it was stopped before its
    first one): a run that starts over there logs its own steps in their place."""
    return sorted(p for p in (output_dir / "csv" / "metrics.csv", output_dir / "metrics.json") if p.is_file())
