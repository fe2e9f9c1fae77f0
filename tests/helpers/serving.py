"""The server in tests: a translation model worth comparing outputs of (`served_run`), an app served by
uvicorn in a thread on 127.0.0.1 (a free port), settings from a few values, a free port, and the lines
`evaluate.py translate.input=FILE` writes (what every served translation must equal)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from data.synthetic import make_synthetic_splits
from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT
from tests.helpers.trained import train_run
from transformer.serving.config import ServeSettings

# The quickstart experiment shrunk less than tests/helpers/trained.py's TINY_QUICKSTART (whose model
# answers "." to every sentence): ~20 s on 2 CPU cores for a model that writes sentences (test BLEU ~9),
# different ones for different inputs, so that comparing served outputs with evaluate.py's compares something
SERVED_QUICKSTART = [
    "data.synthetic_sizes.train=1500",
    "data.synthetic_sizes.val=30",
    "data.synthetic_sizes.test=40",
    "model.config.d_model=64",
    "model.config.n_heads=2",
    "model.config.d_ff=128",
    "model.optimizer.lr=3e-3",
    "model.scheduler.warmup_steps=20",
    "trainer.max_epochs=10",
    "trainer.num_sanity_val_steps=0",
]


@pytest.fixture(scope="session")
def served_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of SERVED_QUICKSTART (checkpoints/last.ckpt)."""
    root = tmp_path_factory.mktemp("served")
    return train_run(root / "run", root / "cache", SERVED_QUICKSTART)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def settings(models: dict[str, str | list[str]], **values: Any) -> ServeSettings:
    """ServeSettings for `models` (id -> checkpoint(s)); `batching` and the other keys as serve.yaml's."""
    entries = [{"id": model_id, "checkpoint": path} for model_id, path in models.items()]
    return ServeSettings.from_dict({"models": entries, **values})


@contextlib.contextmanager
def serving(app: Any, timeout: float = 60.0) -> Iterator[str]:
    """`app` behind uvicorn on 127.0.0.1 in a thread; yields its base URL; stops it (gracefully) after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def source_lines(count: int, seed: int = 5) -> list[str]:
    """`count` English sentences of the synthetic task (the quickstart's source side), none of them blank."""
    english, _ = make_synthetic_splits(seed, {"test": count})["test"]
    return list(english)


def evaluate_translations(checkpoint: Path, lines: list[str], folder: Path, *overrides: str) -> list[str]:
    """What `evaluate.py ckpt_path=CKPT translate.input=FILE [decode.*]` prints for `lines`, a line each."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "input.txt"
    source.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    args = [f"ckpt_path={checkpoint}", f"translate.input={source}", "progress=false", *overrides]
    args.append(f"hydra.run.dir={folder / 'run'}")
    result = run_script("evaluate.py", args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert len(out) == len(lines), result.stdout[-2000:]
    return out
