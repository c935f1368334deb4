"""Admission and draining: the bounded queue, and the requests a shutdown must end.

Every generation an HTTP request starts is registered here while it runs, so

- a server at its bound answers 429 at once (``--max-queued-requests``): the bound
  is what the engine can run at once (``max_num_seqs`` x data-parallel ranks,
  shared among the API server processes) plus the queue allowed on top; a
  request of ``n`` samples or ``k`` prompts counts ``n x k``;
- a draining server (SIGTERM) refuses new work with 503, and when the drain
  time is up aborts what is left in the engine, whose streams then end with a
  final event (finish_reason ``abort``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from enginecore.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)


class Ticket:
    """One admitted request; ``release()`` once (later calls do nothing)."""

    __slots__ = ("admission", "request_ids", "weight")

    def __init__(self, admission: Admission, request_ids: list[str], weight: int) -> None:
        self.admission: Admission | None = admission
        self.request_ids = request_ids
        self.weight = weight

    def release(self) -> None:
        if self.admission is not None:
            self.admission._release(self)
            self.admission = None


class Admission:
    def __init__(self, engine: Any, capacity: int | None,
                 flags: str = "--max-sequences-in-flight / --max-queued-requests") -> None:
        """``capacity``: sequences this process may hold at once (None: no bound)."""
        self.engine = engine
        self.capacity = capacity
        self.flags = flags
        self.in_flight = 0
        self._ids: dict[str, int] = {}
        self.draining = False

    def admit(self, request_ids: list[str], weight: int) -> Ticket:
        """Register a request's generations (429 at the bound, 503 while draining);
        the caller releases the ticket when they have ended."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.capacity is not None and weight > self.capacity:
            raise APIError(429, f"this request asks for {weight} sequences (prompts x n), "
                           f"more than the server's bound of {self.capacity} sequences in "
                           f"flight ({self.flags})", headers={"Retry-After": "1"})
        if self.capacity is not None and self.in_flight + weight > self.capacity:
            raise APIError(429, f"the server is at its bound of {self.capacity} queued and "
                           f"running sequences ({self.flags}); retry later",
                           headers={"Retry-After": "1"})
        self.in_flight += weight
        for rid in request_ids:
            self._ids[rid] = weight
        return Ticket(self, request_ids, weight)

    def _release(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.weight
        for rid in ticket.request_ids:
            self._ids.pop(rid, None)

    @property
    def live_request_ids(self) -> list[str]:
        return list(self._ids)

    async def abort_all(self) -> None:
        """End every live generation (drain deadline): the engine finishes them with
        ``abort``, and their handlers send the final event."""
        ids = self.live_request_ids
        if not ids:
            return
        logger.warning("shutdown: aborting %d requests still running after the drain "
                       "timeout", len(ids))
        try:
            await self.engine.abort(ids)
        except Exception as e:  # noqa: BLE001 - a dead engine ends them anyway
            logger.warning("shutdown: abort failed (%s)", e)

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight, False at the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight
