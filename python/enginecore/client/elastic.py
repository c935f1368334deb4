"""Elastic data parallel: grow or shrink the set of ranks while serving.

Scale-up (prepare, then commit): spawn the new ranks with the KV cache size the
running ones have (no profiling), and once they have their INIT ask every
running rank to ``reinitialize_distributed(new_size, generation)``. Running
ranks agree on it at a step boundary (an agreed call, like pause), leave the
old DP group and meet the new ranks in the next generation's group; only then
do the new ranks report READY and start taking requests.

Scale-down: the leaving ranks (the highest) get no new requests and drain the
ones they hold; then every rank agrees on the rescale, the leaving ones exit
and the rest form the smaller group. No request is lost either way.

``scale_elastic_ep`` (sync client) and ``scale_elastic_ep_async`` (asyncio
client) share every step but how they wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any

from enginecore.errors import EngineDeadError
from enginecore.protocol import engine_identity

logger = logging.getLogger(__name__)


class _ElasticSteps:
    """The steps of a rescale, on the multiprocess client (``self``)."""

    def _check_scalable(self: Any, new_size: int) -> bool:
        """Validate; False when there is nothing to do."""
        self._check_alive()
        if not isinstance(new_size, int) or new_size < 1:
            raise ValueError(f"new_size must be an int >= 1, got {new_size!r}")
        if self.coordinator is None:
            raise ValueError("elastic scaling needs data_parallel_size >= 2 with the internal "
                             "load balancer at start-up (a DP coordinator)")
        if not self._owner or len(self._front_ends) > 1:
            raise NotImplementedError("elastic scaling from a client with attached front-ends "
                                      "(client_count > 1) is not supported yet")
        if self.num_local_engines < self.num_engines:
            raise NotImplementedError("elastic scaling with headless (remote) ranks is not "
                                      "supported yet")
        return new_size != self.num_engines

    def _resize_config(self: Any, new_size: int) -> None:
        self._dp_generation += 1
        pc = dataclasses.replace(self.config.parallel_config, data_parallel_size=new_size,
                                 data_parallel_size_local=new_size)
        self.config = dataclasses.replace(self.config, parallel_config=pc)

    def _new_rank_config(self: Any) -> Any:
        """The new ranks' config: the new size, and the running ranks' KV cache size."""
        base = self._engine_config()
        cc = dataclasses.replace(base.cache_config, num_gpu_blocks_override=self.num_gpu_blocks)
        return dataclasses.replace(base, cache_config=cc)

    def _prepare_scale_up(self: Any, new_size: int) -> tuple[Any, list[int], list[Any]]:
        """Spawn the new ranks (handshake socket, ranks, processes); with Ray the
        actors start in ``_start_ray_ranks`` instead."""
        new_ranks = list(range(self.num_engines, new_size))
        self._resize_config(new_size)
        if self._ray is not None:
            return None, new_ranks, []
        config = self._new_rank_config()
        handshake, address = self._bind_handshake()
        try:
            procs = self._spawn_ranks(new_ranks, address, config)
        except BaseException:
            handshake.close(linger=0)
            raise
        self.procs.extend(procs)
        return handshake, new_ranks, procs

    def _add_ranks(self: Any, new_ranks: list[int]) -> None:
        with self._live_lock:
            self.ranks += new_ranks
            self.identities += [engine_identity(r) for r in new_ranks]
            self._load += [0] * len(new_ranks)
            self.num_engines = self.num_local_engines = len(self.ranks)
            self._active = list(range(self.num_engines))

    def _start_drain(self: Any, new_size: int) -> list[int]:
        with self._live_lock:
            self._active = list(range(new_size))  # no new requests for the leaving ranks
        return list(range(new_size, self.num_engines))

    def _drained(self: Any, leaving: list[int], deadline: float, drain_timeout_s: float) -> bool:
        if self._dead:
            raise EngineDeadError()
        left = sum(self._load[e] for e in leaving)
        if left == 0:
            return True
        if time.monotonic() > deadline:
            with self._live_lock:
                self._active = list(range(self.num_engines))
            raise TimeoutError(f"ranks {leaving} still hold {left} requests after "
                               f"{drain_timeout_s:g} s (drain_timeout_s); scaling cancelled")
        return False

    def _leave(self: Any, leaving: list[int]) -> list[Any]:
        # Their input connections close as they exit: not a death for the watcher.
        self._expected_disconnects += len(leaving)
        if self._ray is not None:
            self._ray.leaving(leaving)
            procs = []
        else:
            procs = [self.procs[e] for e in leaving]
        self._leaving.update(procs)  # their exit is expected, not a death
        self._resize_config(self.num_engines - len(leaving))
        return procs

    def _reap(self: Any, procs: list[Any], new_size: int, timeout_s: float) -> None:
        if self._ray is not None:
            self._ray.remove(self.ranks[new_size:], timeout_s)
        for proc in procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                logger.warning("%s did not exit after leaving; terminating it", proc.name)
                proc.terminate()
                proc.join(timeout=10)
        with self._live_lock:
            del self.ranks[new_size:], self.identities[new_size:], self._load[new_size:]
            self.procs[:] = [p for p in self.procs if p not in procs]
            self.num_engines = self.num_local_engines = new_size
        # The procs stay in _leaving: the monitor may still be looking at their exit.

    def _log_scaled(self: Any, old: int, t0: float) -> None:
        logger.info("data parallel scaled %d -> %d ranks in %.2f s (generation %d)", old,
                    self.num_engines, time.monotonic() - t0, self._dp_generation)


class ElasticScaling(_ElasticSteps):
    """``scale_elastic_ep`` for the sync multiprocess client."""

    def scale_elastic_ep(self: Any, new_size: int, drain_timeout_s: float = 300.0,
                         timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving."""
        if not self._check_scalable(new_size):
            return
        old, t0 = self.num_engines, time.monotonic()
        with self._scale_lock:
            if new_size > old:
                handshake, new_ranks, procs = self._prepare_scale_up(new_size)
                rescale: list[Any] = []

                def commit() -> None:
                    rescale.append(self._call_nowait(None, "reinitialize_distributed",
                                                     (new_size, self._dp_generation)))

                if handshake is None:  # Ray: the actors get INIT up front
                    self._ray.start(self._new_rank_config(), new_ranks, self._init_message(),
                                    timeout_s, before_wait=commit)
                    rescale[0].result(timeout=timeout_s)
                    with self._send_lock:
                        self._await_input_sockets(len(new_ranks), timeout_s)
                    self._add_ranks(new_ranks)
                    self._log_scaled(old, t0)
                    return
                try:
                    # Commit once every new rank has its INIT.
                    self._handshake(handshake, timeout_s, new_ranks, dict(zip(new_ranks, procs)),
                                    commit)
                    rescale[0].result(timeout=timeout_s)
                    with self._send_lock:
                        self._await_input_sockets(len(new_ranks), timeout_s)
                finally:
                    handshake.close(linger=0)
                self._add_ranks(new_ranks)
            else:
                leaving = self._start_drain(new_size)
                deadline = time.monotonic() + drain_timeout_s
                while not self._drained(leaving, deadline, drain_timeout_s):
                    time.sleep(0.02)
                procs = self._leave(leaving)
                self._call(None, "reinitialize_distributed", (new_size, self._dp_generation),
                           timeout_s)
                self._reap(procs, new_size, timeout_s)
        self._log_scaled(old, t0)

    @property
    def _scale_lock(self: Any) -> threading.Lock:
        lock = self.__dict__.get("_scale_lock_")
        if lock is None:
            lock = self.__dict__.setdefault("_scale_lock_", threading.Lock())
        return lock


class AsyncElasticScaling(_ElasticSteps):
    """``scale_elastic_ep_async`` for the asyncio multiprocess client."""

    async def scale_elastic_ep_async(self: Any, new_size: int, drain_timeout_s: float = 300.0,
                                     timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving."""
        if not self._check_scalable(new_size):
            return
        old, t0 = self.num_engines, time.monotonic()
        loop = asyncio.get_running_loop()
        if new_size > old:
            handshake, new_ranks, procs = self._prepare_scale_up(new_size)
            rescale: list[Any] = []

            def commit() -> None:  # runs on the handshake thread: hand it to the loop
                rescale.append(asyncio.run_coroutine_threadsafe(self._call_async(
                    None, "reinitialize_distributed", (new_size, self._dp_generation)), loop))

            try:
                if handshake is None:  # Ray: the actors get INIT up front
                    await asyncio.to_thread(self._ray.start, self._new_rank_config(), new_ranks,
                                            self._init_message(), timeout_s, commit)
                else:
                    await asyncio.to_thread(self._handshake, handshake, timeout_s, new_ranks,
                                            dict(zip(new_ranks, procs)), commit)
                await asyncio.wait_for(asyncio.wrap_future(rescale[0]), timeout_s)
                for _ in new_ranks:  # their input sockets say hello
                    await asyncio.wait_for(self._ainput.recv_multipart(), timeout_s)
            finally:
                if handshake is not None:
                    handshake.close(linger=0)
            self._add_ranks(new_ranks)
        else:
            leaving = self._start_drain(new_size)
            deadline = time.monotonic() + drain_timeout_s
            while not self._drained(leaving, deadline, drain_timeout_s):
                await asyncio.sleep(0.02)
            procs = self._leave(leaving)
            await asyncio.wait_for(self._call_async(
                None, "reinitialize_distributed", (new_size, self._dp_generation)), timeout_s)
            await asyncio.to_thread(self._reap, procs, new_size, timeout_s)
        self._log_scaled(old, t0)
