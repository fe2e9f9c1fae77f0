"""Where configs of earlier versions find the sweep callbacks (`_target_:
transformer.cli.sweep_callbacks.ResumeOptunaStudy` / `.SweepEndLines`): they live in `transformer.cli.sweeps`,
and these names stay so that such configs still compose and run. Nothing in the package imports this file."""

from transformer.cli.sweeps import ResumeOptunaStudy, SweepEndLines

__all__ = ["ResumeOptunaStudy", "SweepEndLines"]
