"""Serving entry point: configs/serve.yaml -> settings checked -> port bound -> models loaded -> HTTP.

    python serve.py 'models=[{id: en-de, checkpoint: PATH}]' [port=8000] [host=127.0.0.1]
    python serve.py --config-dir DIR --config-name NAME       # a serve config of your own

`serve(cfg)` is importable; `main()` is the command line. Everything that can be wrong with the config (a
key, a checkpoint, a device, the port) ends with one `error:` line before anything listens: the port is
bound first and kept for uvicorn, then the models load, then uvicorn listens on the bound socket.
SIGTERM or Ctrl-C: uvicorn stops accepting, finishes the requests in flight, and the command exits 0.
The app is `transformer.serving`; docs/serving.md has the endpoints.
"""

from __future__ import annotations

import os

# Before torch is imported (OpenMP reads it once): idle OpenMP threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import errno
import logging
import signal
import socket
from pathlib import Path
from typing import Any

import hydra
import uvicorn
from omegaconf import DictConfig, OmegaConf

from transformer.cli import errors
from transformer.serving.app import create_app
from transformer.serving.config import ServeConfigError, ServeSettings
from transformer.serving.models import check_model, load_model

log = logging.getLogger("serve")

PROJECT_ROOT = Path(__file__).resolve().parent
# the keys of serve.yaml that are Hydra's, not the server's
_NOT_SERVE_KEYS = ("paths", "task_name")


def serve(cfg: DictConfig) -> None:
    """Check the config, bind the port, load the models, serve until SIGTERM / Ctrl-C."""
    values: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    settings = ServeSettings.from_dict({k: v for k, v in values.items() if k not in _NOT_SERVE_KEYS})
    sock = bind(settings.host, settings.port)
    try:
        models = {}
        for entry in settings.models:
            log.info("Loading model %s from %s on %s", entry.id, ", ".join(entry.checkpoint), entry.device)
            models[entry.id] = check_model(entry, load_model(entry)).model
        app = create_app(settings, models)
        config = uvicorn.Config(
            app,
            log_config=None,  # Hydra's logging: the console and logs/serve/runs/<time>/serve.log
            timeout_graceful_shutdown=int(settings.batching.timeout_s) + 5,
        )
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        log.info("Serving %s on http://%s:%d", ", ".join(models), _shown(host), port)
        # uvicorn restores the handlers it found and raises the signal again once it has shut down:
        # these make that a normal exit (status 0) instead of a death by SIGTERM / KeyboardInterrupt
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
        server.run(sockets=[sock])
        if not server.started:
            raise SystemExit("error: the server did not start (its log has the reason)")
        log.info("Server stopped")
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening (uvicorn listens on it once the models are loaded)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ServeConfigError(f"host={host} is not an address of this machine ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ServeConfigError(
                f"port={port} is in use on {host} (another server?): choose another port"
            ) from None
        raise ServeConfigError(f"host={host} port={port} cannot be bound: {err.strerror}") from None
    return sock


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@hydra.main(version_base="1.3", config_path="configs", config_name="serve")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except (*errors.USER_ERRORS, ValueError) as err:  # ServeConfigError and InferenceError are ValueErrors
        raise errors.user_error(err) from None
    except KeyboardInterrupt:  # Ctrl-C while the models load (once serving, uvicorn takes it: exit 0)
        raise SystemExit(130) from None


def main() -> None:
    """`python serve.py ...`: paths resolve against the repository root unless PROJECT_ROOT is set."""
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    errors.run(_hydra_main, PROJECT_ROOT / "configs", lambda err: None)


if __name__ == "__main__":
    main()
