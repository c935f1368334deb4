"""/health that tells the truth: the engine loop must have answered a ping lately.

A background task sends the ``echo`` utility call every ``interval_s``; the busy
loop of every engine answers it between steps (a data-parallel ping waits for
all ranks). /health is 200 while the last answer is younger than ``bound_s``
and the engine is not known dead; otherwise 503. So a hung engine (SIGSTOP, a
step that never returns) turns /health 503 within ``bound_s`` plus one
interval, a killed one at once (the client's process monitor marks it dead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from enginecore.errors import EngineDeadError

logger = logging.getLogger(__name__)


class EngineHealth:
    def __init__(self, engine: Any, interval_s: float = 0.5, bound_s: float = 3.0) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.bound_s = bound_s
        self.last_answer = time.monotonic()  # start-up: the engine just said READY
        self.dead: str | None = None
        self._task: asyncio.Task | None = None
        self._pings = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _ping(self) -> None:
        self._pings += 1
        client = self.engine.engine_core
        await client.call_utility_async("echo", self._pings)

    async def _run(self) -> None:
        waiting: asyncio.Future | None = None
        try:
            while self.dead is None:
                if waiting is None:
                    waiting = asyncio.ensure_future(self._ping())
                done, _ = await asyncio.wait({waiting}, timeout=self.interval_s)
                if not done:
                    continue  # still unanswered; the bound decides when that is unhealthy
                try:
                    waiting.result()
                    self.last_answer = time.monotonic()
                except EngineDeadError as e:
                    self.dead = str(e) or "the engine is dead"
                except Exception as e:  # noqa: BLE001 - a failed ping is an unhealthy engine
                    logger.warning("health ping failed: %s", e)
                waiting = None
                await asyncio.sleep(self.interval_s)
        finally:
            # Stopped (server shutdown) with a ping in flight: the client's shutdown
            # fails it with EngineDeadError, which nobody is left to read.
            if waiting is not None:
                waiting.cancel()
                waiting.add_done_callback(_read_outcome)

    def status(self) -> tuple[bool, str]:
        """(healthy, why not)."""
        if self.dead is not None:
            return False, self.dead
        if getattr(self.engine, "errored", False):
            return False, "the engine is dead"
        age = time.monotonic() - self.last_answer
        if age > self.bound_s:
            return False, f"the engine loop has not answered a ping for {age:.1f} s"
        return True, ""


def _read_outcome(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
