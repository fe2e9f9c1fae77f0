"""Dynamic batching: per model a bounded queue of requests and ONE worker thread that takes requests
until a token budget or a short wait is reached, groups them by decoding settings, calls the model once
per group and hands each request exactly its slice of the results.

Source tokens are estimated from characters (`len(text) // 4 + 2` a segment: the inference API gives no
tokenizer, and tokenizing twice would cost the worker what it saves). A request is never split: one
larger than the budget is a model call of its own. Sampling requests with a `seed` run alone with their
own generator, so the same request and seed give the same output whatever else arrives; a failing model
call fails only the requests of its group (a request the model refuses as invalid, `InferenceError`, is
retried alone so that only it fails), and the worker goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from transformer.inference import InferenceError, Segment
from transformer.search.decoding import DecodingSettings
from transformer.serving.config import BatchingSettings
from transformer.serving.metrics import Metrics

log = logging.getLogger(__name__)

__all__ = [
    "DeadlineExceeded",
    "Job",
    "ModelCallError",
    "ModelWorker",
    "QueueFull",
    "ShuttingDown",
    "estimated_tokens",
]


class QueueFull(Exception):
    """The model's queue holds `queue_size` requests already (the client should retry later: 429)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before the model started on it (504)."""


class ModelCallError(Exception):
    """The model call of the request's group failed (500); the message names the exception."""


class ShuttingDown(Exception):
    """The server stopped before the model took the request (503)."""


def estimated_tokens(item: str | Segment) -> int:
    text = item.text if isinstance(item, Segment) else item
    return len(text) // 4 + 2  # about four characters a BPE token, plus BOS and EOS


@dataclass(eq=False)
class Job:
    """One request's work: its inputs (segments, or texts to classify), its decoding settings (None for a
    classifier), its sampling seed, its deadline (`time.monotonic()`), the future of its outputs."""

    inputs: Sequence[str | Segment]
    settings: DecodingSettings | None = None
    seed: int | None = None
    deadline: float = float("inf")
    future: Future = field(default_factory=Future)

    @property
    def cost(self) -> int:
        return sum(estimated_tokens(item) for item in self.inputs)

    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal keys decode together (DecodingSettings is a mapping, not hashable: its items
        are); a seeded sampling request is a group of its own."""
        settings = () if self.settings is None else tuple(self.settings.items())
        alone = self.seed is not None and self.settings is not None and self.settings.sampling
        return (settings, id(self) if alone else None)


class ModelWorker:
    """The queue and the worker thread of one model (a `Translator` or a `Classifier`)."""

    def __init__(
        self,
        model_id: str,
        model: Any,
        limits: BatchingSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_id = model_id
        self.model = model
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=limits.queue_size)
        self._carry: Job | None = None  # taken from the queue, over the last batch's budget: next batch's
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"model-worker-{model_id}", daemon=True)
        self._depth = metrics.queue_depth.labels(model_id)
        self._batch_segments = metrics.batch_segments.labels(model_id)
        self._batch_requests = metrics.batch_requests.labels(model_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the model call under way, then end the thread; requests still queued fail (503)."""
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> Future:
        """Queue `job` (QueueFull when the queue is full); its future gets its outputs, in input order."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are waiting for model {self.model_id}") from None
        self._depth.set(self.queue.qsize())
        return job.future

    # the worker thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                jobs = self._collect()
                if jobs:
                    self._run_batch(jobs)
            except Exception:  # never dies: a bug here must not stop the model answering
                log.exception("Model %s: the worker's batch failed", self.model_id)
        self._fail_waiting()

    def _collect(self) -> list[Job]:
        """Requests until the token budget or `max_wait_ms` after the first one."""
        first = self._carry or self._take(timeout=0.2)
        self._carry = None
        if first is None:
            return []
        jobs, tokens = [first], first.cost
        until = self.clock() + self.limits.max_wait_ms / 1000
        while tokens < self.limits.max_batch_tokens:
            job = self._take(timeout=until - self.clock())
            if job is None:
                break
            if tokens + job.cost > self.limits.max_batch_tokens:
                self._carry = job  # the first of the next batch
                break
            jobs.append(job)
            tokens += job.cost
        return jobs

    def _take(self, timeout: float) -> Job | None:
        try:
            job = self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return None
        self._depth.set(self.queue.qsize())
        return job

    def _run_batch(self, jobs: list[Job]) -> None:
        now = self.clock()
        live = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue  # its client gave up (deadline or disconnect) before it started: skipped
            if now > job.deadline:
                job.future.set_exception(DeadlineExceeded("the request's deadline passed in the queue"))
                continue
            live.append(job)
        groups: dict[tuple[Any, ...], list[Job]] = {}
        for job in live:
            groups.setdefault(job.group_key(), []).append(job)
        for group in groups.values():
            self._run_group(group)

    def _run_group(self, group: list[Job]) -> None:
        try:
            outputs = self._call(group)
        except InferenceError as err:  # the model refuses an input: find whose, alone
            if len(group) > 1:
                for job in group:
                    self._run_group([job])
                return
            group[0].future.set_exception(err)
            return
        except Exception as err:
            self.metrics.model_errors.labels(self.model_id).inc()
            log.exception("Model %s: a call for %d request(s) failed", self.model_id, len(group))
            failure = ModelCallError(f"model {self.model_id} failed: {type(err).__name__}: {err}")
            for job in group:
                job.future.set_exception(failure)
            return
        start = 0
        for job in group:
            job.future.set_result(outputs[start : start + len(job.inputs)])
            start += len(job.inputs)

    def _call(self, group: list[Job]) -> list[Any]:
        inputs = [item for job in group for item in job.inputs]
        self._batch_segments.observe(len(inputs))
        self._batch_requests.observe(len(group))
        settings, seed = group[0].settings, group[0].seed
        if settings is None:
            outputs = self.model.predict(list(inputs))
        else:
            generator = None
            if seed is not None and settings.sampling:
                generator = torch.Generator(device=self.model.device).manual_seed(seed)
            outputs = self.model.translate(list(inputs), settings, generator=generator)
        if len(outputs) != len(inputs):  # an invariant of the inference API
            raise RuntimeError(f"{len(inputs)} inputs gave {len(outputs)} outputs")
        return outputs

    def _fail_waiting(self) -> None:
        for job in [self._carry, *self._drain()]:
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(ShuttingDown("the server is shutting down"))

    def _drain(self) -> list[Job]:
        jobs = []
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                return jobs
