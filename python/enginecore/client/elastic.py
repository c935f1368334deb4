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
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from enginecore.errors import EngineDeadError

logger = logging.getLogger(__name__)


class ElasticScaling:
    """``scale_elastic_ep`` for the sync multiprocess client."""

    _scale_lock = threading.Lock()

    def scale_elastic_ep(self: Any, new_size: int, drain_timeout_s: float = 300.0,
                         timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving."""
        self._check_alive()
        old = self.num_engines
        if not isinstance(new_size, int) or new_size < 1:
            raise ValueError(f"new_size must be an int >= 1, got {new_size!r}")
        if self.coordinator is None:
            raise ValueError("elastic scaling needs data_parallel_size >= 2 with the internal "
                             "load balancer at start-up (a DP coordinator)")
        if not self._owner or len(self._front_ends) > 1:
            raise NotImplementedError("elastic scaling from a client with attached front-ends "
                                      "(client_count > 1) is not supported yet")
        if self._ray is not None:
            raise NotImplementedError("elastic scaling with data_parallel_backend='ray' is not "
                                      "supported yet")
        if self.num_local_engines < old:
            raise NotImplementedError("elastic scaling with headless (remote) ranks is not "
                                      "supported yet")
        if new_size == old:
            return
        t0 = time.monotonic()
        with self._scale_lock:
            if new_size > old:
                self._scale_up(new_size, timeout_s)
            else:
                self._scale_down(new_size, drain_timeout_s, timeout_s)
        logger.info("data parallel scaled %d -> %d ranks in %.2f s (generation %d)", old,
                    new_size, time.monotonic() - t0, self._dp_generation)

    def _resize_config(self: Any, new_size: int) -> None:
        self._dp_generation += 1
        pc = dataclasses.replace(self.config.parallel_config, data_parallel_size=new_size,
                                 data_parallel_size_local=new_size)
        self.config = dataclasses.replace(self.config, parallel_config=pc)

    def _scale_up(self: Any, new_size: int, timeout_s: float) -> None:
        old = self.num_engines
        new_ranks = list(range(old, new_size))
        self._resize_config(new_size)
        cc = dataclasses.replace(self._spawn_config.cache_config,
                                 num_gpu_blocks_override=self.num_gpu_blocks)
        config = dataclasses.replace(self._spawn_config, cache_config=cc,
                                     parallel_config=self.config.parallel_config)
        handshake, address = self._bind_handshake()
        rescale: list[Any] = []
        try:
            procs = self._spawn_ranks(new_ranks, address, config)
            self.procs.extend(procs)
            # Commit once every new rank has its INIT: the running ranks then agree on
            # the rescale and meet the new ones in the new group.
            self._handshake(handshake, timeout_s, new_ranks, dict(zip(new_ranks, procs)),
                            lambda: rescale.append(self._call_nowait(
                                None, "reinitialize_distributed",
                                (new_size, self._dp_generation))))
            rescale[0].result(timeout=timeout_s)
            with self._send_lock:
                self._await_input_sockets(len(new_ranks), timeout_s)
        finally:
            handshake.close(linger=0)
        from enginecore.protocol import engine_identity

        with self._live_lock:
            self.ranks += new_ranks
            self.identities += [engine_identity(r) for r in new_ranks]
            self._load += [0] * len(new_ranks)
            self.num_engines = self.num_local_engines = new_size
            self._active = list(range(new_size))

    def _scale_down(self: Any, new_size: int, drain_timeout_s: float, timeout_s: float) -> None:
        old = self.num_engines
        leaving = list(range(new_size, old))
        with self._live_lock:
            self._active = list(range(new_size))  # no new requests for the leaving ranks
        deadline = time.monotonic() + drain_timeout_s
        next_log = time.monotonic() + 5
        while any(self._load[e] for e in leaving):
            if self._dead:
                raise EngineDeadError()
            now = time.monotonic()
            if now > deadline:
                with self._live_lock:
                    self._active = list(range(old))
                raise TimeoutError(
                    f"ranks {leaving} still hold {sum(self._load[e] for e in leaving)} requests "
                    f"after {drain_timeout_s:g} s (drain_timeout_s); scaling cancelled")
            if now > next_log:
                logger.info("draining ranks %s: %d requests left", leaving,
                            sum(self._load[e] for e in leaving))
                next_log = now + 5
            time.sleep(0.02)
        leaving_procs = [self.procs[e] for e in leaving]
        self._leaving.update(leaving_procs)  # their exit is expected, not a death
        self._resize_config(new_size)
        self._call(None, "reinitialize_distributed", (new_size, self._dp_generation),
                   timeout_s)
        for proc in leaving_procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                logger.warning("%s did not exit after leaving; terminating it", proc.name)
                proc.terminate()
                proc.join(timeout=10)
        with self._live_lock:
            del self.ranks[new_size:], self.identities[new_size:], self._load[new_size:]
            self.procs[:] = [p for p in self.procs if p not in leaving_procs]
            self.num_engines = self.num_local_engines = new_size
        self._leaving.difference_update(leaving_procs)
