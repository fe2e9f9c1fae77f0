"""The FastAPI app: `create_app(settings, models)`. Models not handed in loaded are loaded in a background
thread once the app starts (`/ready` answers 503 until every one is); each model gets its queue and worker
(`batching.ModelWorker`); every error answers with the JSON error body (`errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from starlette.middleware.cors import CORSMiddleware

from transformer.inference import InferenceError
from transformer.serving.batching import (
    DeadlineExceeded,
    Job,
    ModelCallError,
    ModelWorker,
    QueueFull,
    ShuttingDown,
)
from transformer.serving.config import ModelSettings, ServeSettings
from transformer.serving.errors import ServeError, install_handlers
from transformer.serving.metrics import CONTENT_TYPE_LATEST, Metrics
from transformer.serving.middleware import BodyLimit, KeyCheck, RequestMetrics
from transformer.serving.models import Served, check_model, load_model
from transformer.serving.schemas import (
    ClassifyRequest,
    TranslateRequest,
    prediction_json,
    translation_json,
)

log = logging.getLogger(__name__)

__all__ = ["PAGE", "State", "create_app"]

PAGE = Path(__file__).with_name("page.html")
_POLL_S = 0.25  # how often a waiting request looks whether its client is still there


class State:
    """The models of one app: loaded ones with their workers, those still loading, those that failed."""

    def __init__(self, settings: ServeSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.served: dict[str, Served] = {}
        self.workers: dict[str, ModelWorker] = {}
        self.failed: dict[str, str] = {}
        self.lock = threading.Lock()
        self.closed = False  # the app stopped: a model the loader finishes after it gets no worker

    def add(self, served: Served) -> None:
        worker = ModelWorker(served.settings.id, served.model, self.settings.batching, self.metrics)
        with self.lock:
            if self.closed:
                return
            worker.start()
            self.workers[served.settings.id] = worker
            self.served[served.settings.id] = served

    def pending(self) -> list[str]:
        with self.lock:
            return [m.id for m in self.settings.models if m.id not in self.served]

    def stop(self) -> None:
        with self.lock:
            self.closed = True
            workers = list(self.workers.values())
        for worker in workers:
            worker.stop()


def create_app(
    settings: ServeSettings,
    models: Mapping[str, Any] | None = None,
    *,
    load: Callable[[ModelSettings], Any] = load_model,
    page: Path = PAGE,
) -> FastAPI:
    """The server's app for `settings`; `models`: id -> a loaded `Translator` / `Classifier` (the others are
    loaded with `load` in a background thread after start-up)."""
    metrics = Metrics()
    state = State(settings, metrics)
    given = dict(models or {})

    def load_the_rest() -> None:
        for entry in settings.models:
            if entry.id in given:
                continue
            try:
                state.add(check_model(entry, load(entry)))
                log.info("Model %s loaded (%s)", entry.id, ", ".join(entry.checkpoint))
            except Exception as err:  # reported by /ready (serve.py loads before listening instead)
                log.exception("Model %s failed to load", entry.id)
                with state.lock:
                    state.failed[entry.id] = " ".join(str(err).split())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for entry in settings.models:
            if entry.id in given:
                state.add(check_model(entry, given[entry.id]))
        loader = threading.Thread(target=load_the_rest, name="model-loader", daemon=True)
        loader.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(
        title="aiayn serve",
        summary="Translation and classification with the models of configs/serve.yaml",
        lifespan=lifespan,
    )
    app.state.serve = state
    install_handlers(app)
    _routes(app, state, page)
    # the last one added runs first: CORS (preflights answered), metrics, the key, the body's size
    limit = max(1 << 20, 8 * settings.batching.max_chars + (64 << 10))
    app.add_middleware(BodyLimit, limit=limit)
    if settings.api_key is not None:
        app.add_middleware(KeyCheck, api_key=settings.api_key)
    app.add_middleware(RequestMetrics, metrics=metrics)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


def _routes(app: FastAPI, state: State, page: Path) -> None:
    limits = state.settings.batching

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "models still loading (or failed to load)"}})
    async def ready() -> dict[str, Any]:
        with state.lock:
            failed = dict(state.failed)
        if failed:
            raise ServeError(503, "failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
        pending = state.pending()
        if pending:
            raise ServeError(503, f"loading: {', '.join(pending)}")
        return {"status": "ready", "models": [m.id for m in state.settings.models]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        with state.lock:
            served = [state.served[m.id] for m in state.settings.models if m.id in state.served]
        return {"models": [s.description() for s in served]}

    @app.post("/v1/translate")
    async def translate(body: TranslateRequest, request: Request) -> dict[str, Any]:
        start = time.monotonic()
        served = _model(state, body.model, "translation")
        _check_size(len(body.segments), body.characters(), limits.max_segments, limits.max_chars)
        try:
            settings = served.decoding(body.options())
            served.check_seed(settings, body.seed)
        except InferenceError as err:
            seeded = {"seed": body.seed} if body.seed is not None else {}
            raise _invalid(err, {**body.options(), **seeded}) from None
        for lang, field in body.target_langs(served.target_lang):
            try:
                served.check_target_lang(lang, field)
            except InferenceError as err:
                raise ServeError(422, " ".join(str(err).split()), field) from None
        job = Job(body.inputs(served.target_lang), settings, body.seed, deadline=start + limits.timeout_s)
        outputs = await _outputs(state.workers[served.settings.id], job, request)
        return {
            "model": body.model,
            "translations": [translation_json(t) for t in outputs],
            "time_ms": (time.monotonic() - start) * 1000,
        }

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
        start = time.monotonic()
        served = _model(state, body.model, "classification")
        _check_size(len(body.segments), body.characters(), limits.max_segments, limits.max_chars)
        job = Job(list(body.segments), None, None, deadline=start + limits.timeout_s)
        outputs = await _outputs(state.workers[served.settings.id], job, request)
        return {
            "model": body.model,
            "predictions": [prediction_json(p) for p in outputs],
            "time_ms": (time.monotonic() - start) * 1000,
        }

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=FileResponse, include_in_schema=False)
    async def index() -> Any:
        if not page.is_file():
            raise ServeError(404, "the page is not installed (transformer/serving/page.html)")
        return FileResponse(page, media_type="text/html; charset=utf-8")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> JSONResponse:
        raise ServeError(404, "no favicon")


def _model(state: State, model_id: str, task: str) -> Served:
    with state.lock:
        served = state.served.get(model_id)
    known = [m.id for m in state.settings.models]
    if model_id not in known:
        raise ServeError(404, f"unknown model {model_id!r}; the models are: {', '.join(known)}", "model")
    if served is None:
        raise ServeError(
            503, f"model {model_id!r} is not loaded yet (GET /ready)", headers={"Retry-After": "1"}
        )
    if served.task != task:
        other = "/v1/classify" if served.task == "classification" else "/v1/translate"
        raise ServeError(422, f"model {model_id!r} is a {served.task} model: send it to {other}", "model")
    return served


def _check_size(segments: int, characters: int, max_segments: int, max_chars: int) -> None:
    if segments > max_segments:
        raise ServeError(413, f"{segments} segments in one request; at most {max_segments}", "segments")
    if characters > max_chars:
        raise ServeError(413, f"{characters} characters in one request; at most {max_chars}", "segments")


def _invalid(err: InferenceError, options: Mapping[str, Any]) -> ServeError:
    """A request the model refuses: 422 naming the option the message starts with (if one)."""
    message = " ".join(str(err).split())
    named = sorted(  # a name as a word ("beam_size must ...") or with its value ("beam_size=4 ...")
        (name for name in options if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)),
        key=lambda name: not message.startswith(name),  # the option the message is about first
    )
    field = {"search": "sampling"}.get(named[0], named[0]) if named else None  # the request's own name
    return ServeError(422, message, field)


async def _outputs(worker: ModelWorker, job: Job, request: Request) -> list[Any]:
    """Queue `job` and wait for its outputs: 429 when the queue is full, 504 past its deadline; a client
    that goes away takes its job out of the queue (a started job finishes, unread)."""
    try:
        future = asyncio.wrap_future(worker.submit(job))
    except QueueFull as err:
        raise ServeError(429, f"{err}: retry later", headers={"Retry-After": "1"}) from None
    try:
        while not future.done():
            left = job.deadline - time.monotonic()
            if left <= 0:
                raise ServeError(504, f"no answer within batching.timeout_s={worker.limits.timeout_s} s")
            await asyncio.wait({future}, timeout=min(left, _POLL_S))
            if not future.done() and await request.is_disconnected():
                raise ServeError(499, "the client closed the connection")
    finally:
        if not future.done():
            future.cancel()  # a job not started is skipped by the worker
    try:
        return future.result()
    except QueueFull as err:
        raise ServeError(429, str(err), headers={"Retry-After": "1"}) from None
    except DeadlineExceeded as err:
        raise ServeError(504, str(err)) from None
    except InferenceError as err:
        raise ServeError(422, " ".join(str(err).split()), "segments") from None
    except ModelCallError as err:
        raise ServeError(500, str(err)) from None
    except ShuttingDown as err:
        raise ServeError(503, str(err)) from None
