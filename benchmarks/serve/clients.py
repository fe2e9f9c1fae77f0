"""The load generator: `clients` threads on 127.0.0.1, each with one keep-alive HTTP connection, sending
single-segment POST /v1/translate requests one after another until `requests` have been sent or the time
limit has passed (bounded in count and in time). Every answer is kept: its status, its latency (send to
last byte) and its translation."""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Load:
    """What one load run got back: request index -> translation (200s), latencies (s) of the 200s,
    statuses, the first error messages, the run's wall time and the requests not sent (time limit)."""

    translations: dict[int, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    not_sent: int = 0

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200) + self.not_sent

    def percentile_ms(self, q: int) -> float:
        """The q-th percentile latency of the answered requests, ms (NaN with fewer than two)."""
        if len(self.latencies) < 2:
            return float("nan")
        return 1000 * statistics.quantiles(self.latencies, n=100, method="inclusive")[q - 1]


def post(connection: http.client.HTTPConnection, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    payload = json.dumps(body).encode()
    connection.request("POST", "/v1/translate", payload, {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, {"error": {"message": data[:200].decode(errors="replace")}}


def run_load(
    port: int,
    model: str,
    sentences: Sequence[str],
    requests: int,
    clients: int,
    options: Mapping[str, Any],
    limit_s: float,
) -> Load:
    """Request i translates sentences[i % len(sentences)] alone, with the decoding `options`."""
    load, lock, counter = Load(), threading.Lock(), itertools.count()
    deadline = time.monotonic() + limit_s

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=max(limit_s, 1))
        try:
            while time.monotonic() < deadline:
                with lock:
                    index = next(counter)
                if index >= requests:
                    return
                body = {"model": model, "segments": [sentences[index % len(sentences)]], **options}
                start = time.perf_counter()
                try:
                    status, answer = post(connection, body)
                except (OSError, http.client.HTTPException) as err:
                    connection.close()  # a fresh connection for the next request
                    status, answer = 0, {"error": {"message": f"{type(err).__name__}: {err}"}}
                latency = time.perf_counter() - start
                with lock:
                    load.statuses[status] += 1
                    if status == 200:
                        load.latencies.append(latency)
                        load.translations[index] = answer["translations"][0]["translation"]
                    elif len(load.errors) < 5:
                        load.errors.append(f"{status}: {answer.get('error', {}).get('message', answer)}")
        finally:
            connection.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + 120)  # a request in flight finishes
    load.wall_s = time.perf_counter() - start
    load.not_sent = max(0, requests - sum(load.statuses.values()))
    return load
