"""Which engine each live request of a multiprocess client is on.

Internal load balancing: live requests per engine, and who owns which; new
requests go to the active engines (not to ranks being removed in a rescale), to
the one the DP coordinator's counts say is least loaded when there is one
(client/dp_link.py), else to the one with the fewest of ours. Thread-safe: the
sync client's callers and its output reader share it.
"""

from __future__ import annotations

import threading
from typing import Any

from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest


class RequestRouter:
    def __init__(self, num_engines: int, client_index: int) -> None:
        self.client_index = client_index
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.load = [0] * num_engines
        self.active = list(range(num_engines))
        self._engine_of: dict[str, int] = {}
        # The coordinator link (balancing from its counts, waves); None without one.
        self.link: Any = None

    def register(self, request: EngineCoreRequest) -> int:
        """Track a new request and pick its engine (least loaded); its index."""
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        if request.request_id.startswith("\x00"):
            raise ValueError("request ids may not begin with a NUL character")
        link = self.link
        with self.lock:
            if request.request_id in self.live:
                raise ValueError(f"request id {request.request_id!r} is already live")
            self.live.add(request.request_id)
            engine = request.data_parallel_rank
            if engine is None or engine not in self.active:
                engine = (link.pick(self.active, self.load) if link is not None
                          else min(self.active, key=self.load.__getitem__))
            self.load[engine] += 1
            self._engine_of[request.request_id] = engine
        request.client_index = self.client_index
        if link is not None:
            request.current_wave = link.current_wave_for_request()
        return engine

    def sent(self, engine: int, request: EngineCoreRequest) -> None:
        if self.link is not None:
            self.link.sent_to(engine, request.current_wave)

    def forget(self, request_id: str) -> None:
        with self.lock:
            self._drop(request_id)

    def forget_finished(self, outs: EngineCoreOutputs) -> None:
        finished = [o.request_id for o in outs.outputs if o.finish_reason is not None]
        if finished:
            with self.lock:
                for rid in finished:
                    self._drop(rid)

    def _drop(self, request_id: str) -> None:
        self.live.discard(request_id)
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self.load[engine] -= 1

    def owners(self, request_ids: list[str]) -> dict[int, list[str]]:
        """engine -> the ids it owns (an unknown id goes to every engine)."""
        per_engine: dict[int, list[str]] = {}
        with self.lock:
            for rid in request_ids:
                owner = self._engine_of.get(rid)
                targets = [owner] if owner is not None else range(len(self.load))
                for e in targets:
                    per_engine.setdefault(e, []).append(rid)
        return per_engine

    # -- rescaling (client/elastic.py); callers hold ``lock`` ----------------------------------
    def add_engines(self, count: int) -> None:
        self.load += [0] * count
        self.active = list(range(len(self.load)))

    def keep_engines(self, count: int) -> None:
        del self.load[count:]

    def held_by(self, engines: list[int]) -> int:
        """Live requests on these engines (a drain waits for 0)."""
        return sum(self.load[e] for e in engines)
