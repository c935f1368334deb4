"""Per-request scheduling events for the front-end's metrics (``log_stats`` only).

The scheduler notes when it took a request (QUEUED), when it admitted it to run
(SCHEDULED: the first time, and again after a preemption) and when it preempted
it (PREEMPTED). Each event travels to the request's front-end as an output with
no tokens, owed with the step's outputs like an abort: the per-step native loops
never see it, and without ``log_stats`` nothing is sent at all. The front-end
turns them into queue-time and prefill-time histograms (``frontend/metrics.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from enginecore.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from enginecore.request import Request

_QUEUED = EngineCoreEventType.QUEUED
_SCHEDULED = EngineCoreEventType.SCHEDULED
_PREEMPTED = EngineCoreEventType.PREEMPTED


class RequestEvents:
    def __init__(self, owe_output: Callable[[int, EngineCoreOutput], None]) -> None:
        self._owe = owe_output
        # Requests never scheduled yet: when the scheduler took them.
        self._queued_at: dict[str, float] = {}

    def queued(self, request: Request) -> None:
        self._queued_at[request.request_id] = time.monotonic()

    def scheduled(self, request: Request) -> None:
        now = time.monotonic()
        queued = self._queued_at.pop(request.request_id, None)
        events = [EngineCoreEvent(_SCHEDULED, now)]
        if queued is not None:
            events.insert(0, EngineCoreEvent(_QUEUED, queued))
        self._owe(request.client_index, EngineCoreOutput(request.request_id, [], events=events))

    def preempted(self, request: Request) -> None:
        self._owe(request.client_index, EngineCoreOutput(
            request.request_id, [], events=[EngineCoreEvent(_PREEMPTED, time.monotonic())]))

    def forget(self, request_id: str) -> None:
        self._queued_at.pop(request_id, None)
