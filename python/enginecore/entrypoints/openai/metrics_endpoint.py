"""/metrics: the front-end's prometheus_client collectors (enginecore/frontend/metrics.py)
plus the server's request counter, in Prometheus text format.

With several API server processes (``--api-server-count``) prometheus_client
runs in multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before
any server process imports prometheus_client, every process writes its
samples to files there, and /metrics (whichever process answers) merges all
processes' files, so counters count every process's requests.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    generate_latest,
)

from enginecore.entrypoints.openai.metrics_names import rename_exposition

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class MetricsEndpoint:
    """Renders /metrics and counts HTTP requests by route and status."""

    def __init__(self, routes: list[str], registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.routes = frozenset(routes)
        self.requests = _request_counter(registry)
        self.prefix = "enginecore"  # --metrics-prefix (metrics_names.py)

    def render(self) -> tuple[bytes, str]:
        if multiprocess_mode():
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            text = generate_latest(merged)
        else:
            text = generate_latest(self.registry)
        return rename_exposition(text, self.prefix), CONTENT_TYPE_LATEST

    def wrap(self, app: Any) -> Any:
        counter = self.requests
        routes = self.routes
        children: dict[tuple[str, str, int], Any] = {}

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope["path"]
            route = path if path in routes else "other"

            async def send_counting(message: Any) -> None:
                if message["type"] == "http.response.start":
                    key = (scope["method"], route, message["status"])
                    child = children.get(key)
                    if child is None:
                        child = children[key] = counter.labels(key[0], key[1], str(key[2]))
                    child.inc()
                await send(message)

            await app(scope, receive, send_counting)

        return counted


_counters: dict[int, Counter] = {}


def _request_counter(registry: CollectorRegistry) -> Counter:
    """One counter per registry (tests build several apps in one process)."""
    counter = _counters.get(id(registry))
    if counter is None:
        counter = _counters[id(registry)] = Counter(
            "enginecore:http_requests", "HTTP requests answered, by route and status.",
            ["method", "route", "status"], registry=registry)
    return counter
