"""The probe inside each process that bench_data.py measures, run by its path (`python .../probe.py
OVERRIDES`, the measured repository first on PYTHONPATH): runs train.py of a repository (ours or a
baseline's worktree) and writes, at exit, when the first training step started, peak RSS, RssAnon and how
many examples it tokenized and tokenizers it trained (one JSON file per process, DDP ranks included)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _process_start() -> float:
    """When this process started (epoch seconds), from /proc; now where /proc is missing."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def run_child(script: Path) -> None:
    """Run train.py of the repository in $BENCH_DATA_REPO, counting tokenizer work; write a JSON report.

    `script` (this file) stays sys.argv[0]: Lightning starts the DDP ranks with it.
    """
    import atexit
    import resource
    import types

    start = _process_start()
    out_dir, repo = Path(os.environ["BENCH_DATA_OUT"]), os.environ["BENCH_DATA_REPO"]
    import lightning.pytorch as pl

    first_step: list[float] = []

    class FirstStepTimer(pl.Callback):
        """Notes when the first training batch starts (added to the run with a Hydra override)."""

        def on_train_batch_start(self, *args: Any) -> None:
            first_step[:] = first_step or [time.time()]

    counts = {"tokenized": 0, "tokenizers_trained": 0}  # examples tokenized, tokenizers trained
    _count_calls(counts)

    def report() -> None:
        status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        anon_kb = int(fields.get("RssAnon", "0 kB").split()[0])
        result = {
            "rank": int(os.environ.get("LOCAL_RANK", "0")),
            "data_package": str(Path(sys.modules["data"].__file__).parent),
            "pid": os.getpid(),
            "first_step_s": first_step[0] - start if first_step else None,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_anon_mb": anon_kb / 1024,
            **counts,
        }
        (out_dir / f"rank{result['rank']}-{os.getpid()}.json").write_text(json.dumps(result))

    atexit.register(report)
    # train.py runs as __main__ (Hydra finds its configs next to it; `__main__.FirstStepTimer` resolves),
    # while sys.argv[0] stays this file: Lightning starts the DDP ranks with it (runpy would change it)
    path = Path(repo) / "train.py"
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=str(path), __spec__=None, FirstStepTimer=FirstStepTimer)
    sys.modules["__main__"] = main
    sys.argv = [str(script), *sys.argv[1:]]
    exec(compile(path.read_text(), str(path), "exec"), main.__dict__)


def _count_calls(counts: dict[str, int]) -> None:
    """Count the examples this process tokenizes and the tokenizers it trains (ours and older revisions)."""
    import datasets

    import data.datamodules
    import data.tokenization

    # the measured repository's data.prepare as its datamodules imported it (a module or, since the
    # redesign, a package); not `import data.prepare`: for an older revision, the editable install would
    # find ours
    prepare = sys.modules.get("data.prepare")
    if prepare is not None:
        tokenize_split = prepare.tokenize_split

        def counting_tokenize(raw: Any, *args: Any, **kwargs: Any) -> Any:
            counts["tokenized"] += len(raw)
            return tokenize_split(raw, *args, **kwargs)

        prepare.tokenize_split = counting_tokenize
    else:
        dataset_map = datasets.Dataset.map

        def counting_map(self: Any, *args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("desc", "")).startswith("Tokenizing"):
                counts["tokenized"] += len(self)
            return dataset_map(self, *args, **kwargs)

        datasets.Dataset.map = counting_map  # before the prepared-data cache: Dataset.map tokenized
    for module in (data.tokenization, data.datamodules):
        if hasattr(module, "train_bpe"):
            train_bpe = module.train_bpe

            def counting_train(*args: Any, _train: Any = train_bpe, **kwargs: Any) -> Any:
                counts["tokenizers_trained"] += 1
                return _train(*args, **kwargs)

            module.train_bpe = counting_train


if __name__ == "__main__":
    run_child(Path(__file__).resolve())
