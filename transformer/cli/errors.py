"""The command-line edge shared by `train.py` and `evaluate.py`: a Hydra entry point whose composition
errors (unknown key, group or option) and job set-up failures (a run directory under a file) end in one
`error:` line and exit status 1, never a traceback or Hydra's multi-line report.

With `sweep_callbacks.py`, the only modules of `transformer/` that import Hydra; the entry points import
this one, nothing else does.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

__all__ = ["one_line", "run"]


def run(hydra_main: Callable[[], object], configs: Path, on_error: Callable[[Exception], str | None]) -> None:
    """Call the `@hydra.main` function `hydra_main`; `on_error` may turn any other exception into the
    one line to print (None: it is not a user error, the traceback stays)."""
    # Hydra then raises composition errors instead of printing them over several lines
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as err:
        raise SystemExit(f"error: {one_line(str(err))}") from None
    except Exception as err:
        message = on_error(err)
        if message is not None:
            raise SystemExit(f"error: {message}") from None
        if _raised_by_hydra(err):  # e.g. `logger=null`, or hydra.run.dir under a file
            nulls = [
                a for a in sys.argv[1:] if a.endswith("=null") and (configs / a[:-5].lstrip("+")).is_dir()
            ]
            hint = f" ({nulls[0]}: a config group is removed with ~{nulls[0][:-5]})" if nulls else ""
            raise SystemExit(f"error: {one_line(str(err))}{hint}") from None
        raise


def _raised_by_hydra(err: BaseException) -> bool:
    """Whether `err` comes from Hydra composing the config or setting up the job, before any code of the
    job itself (`_hydra_main`) ran."""
    frames = traceback.extract_tb(err.__traceback__)
    hydra_dir = str(Path(hydra.__file__).parent)
    in_hydra = any(f.filename.startswith(hydra_dir) for f in frames)
    in_job = any(f.name == "_hydra_main" for f in frames)
    return in_hydra and not in_job and isinstance(err, (ValueError, OSError))


def one_line(message: str) -> str:
    """Hydra's multi-line message as one line: option lists joined, the config search path left out."""
    parts: list[str] = []
    options: list[str] = []
    for line in message.splitlines():
        text = line.strip()
        if text.startswith("Config search path"):
            break
        if line.startswith("\t") and parts:  # one available option per line
            options.append(text)
            continue
        if options:
            parts[-1] += " " + ", ".join(options)
            options = []
        if text and not text.startswith(("full_key:", "object_type=")):
            parts.append(text)
    if options:
        parts[-1] += " " + ", ".join(options)
    return " ".join(parts)
