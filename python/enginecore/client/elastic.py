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

``ElasticScaler`` (the sync client's ``scale_elastic_ep``) and
``AsyncElasticScaler`` (the asyncio client's ``scale_elastic_ep_async``) share
every step but how they wait. Each client owns one; it reads and changes the
client's rank lists and config through ``ScalableClient``, and spawns and retires
ranks through the client's launcher (``EngineLauncher``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Protocol

from enginecore.client.engine_launcher import EngineLauncher
from enginecore.client.request_router import RequestRouter
from enginecore.config import EngineConfig
from enginecore.errors import EngineDeadError
from enginecore.protocol import engine_identity

logger = logging.getLogger(__name__)


class ScalableClient(Protocol):
    """What a rescale uses of the multiprocess client (client/mp_client.py); the
    ranks' processes, handshake and generation are its launcher's
    (client/engine_launcher.py)."""

    config: EngineConfig
    num_engines: int
    num_gpu_blocks: int
    ranks: list[int]
    identities: list[bytes]
    router: RequestRouter
    launcher: EngineLauncher | None
    _owner: bool
    _dead: bool

    def _check_alive(self) -> None: ...


class SyncScalableClient(ScalableClient, Protocol):
    _send_lock: threading.Lock

    def _call(self, engine: int | None, method: str, args: tuple,
              timeout: float | None) -> Any: ...
    def _call_nowait(self, engine: int | None, method: str, args: tuple) -> Any: ...


class AsyncScalableClient(ScalableClient, Protocol):
    _ainput: Any

    async def _call_async(self, engine: int | None, method: str, args: tuple) -> Any: ...


class ElasticSteps:
    """The steps of a rescale, shared by both clients' scalers."""

    def __init__(self, client: ScalableClient) -> None:
        self.client = client
        self._lock = threading.Lock()

    @property
    def launcher(self) -> EngineLauncher:
        """The client's launcher (``_check_scalable`` made sure it has its own)."""
        launcher = self.client.launcher
        assert launcher is not None
        return launcher

    def _check_scalable(self, new_size: int) -> bool:
        """Validate; False when there is nothing to do."""
        c = self.client
        c._check_alive()
        if not isinstance(new_size, int) or new_size < 1:
            raise ValueError(f"new_size must be an int >= 1, got {new_size!r}")
        if c.launcher is None or c.launcher.coordinator is None:
            raise ValueError("elastic scaling needs data_parallel_size >= 2 with the internal "
                             "load balancer at start-up (a DP coordinator)")
        if not c._owner or len(c.launcher.front_ends) > 1:
            raise NotImplementedError("elastic scaling from a client with attached front-ends "
                                      "(client_count > 1) is not supported yet")
        if c.launcher.num_local_engines < c.num_engines:
            raise NotImplementedError("elastic scaling with headless (remote) ranks is not "
                                      "supported yet")
        return new_size != c.num_engines

    def _resize_config(self, new_size: int) -> None:
        c = self.client
        self.launcher.dp_generation += 1
        pc = dataclasses.replace(c.config.parallel_config, data_parallel_size=new_size,
                                 data_parallel_size_local=new_size)
        c.config = dataclasses.replace(c.config, parallel_config=pc)

    def _new_rank_config(self) -> Any:
        """The new ranks' config: the new size, and the running ranks' KV cache size."""
        c = self.client
        base = self.launcher.engine_config()
        cc = dataclasses.replace(base.cache_config, num_gpu_blocks_override=c.num_gpu_blocks)
        return dataclasses.replace(base, cache_config=cc)

    def _prepare_scale_up(self, new_size: int) -> tuple[Any, list[int], list[Any]]:
        """Spawn the new ranks (handshake socket, ranks, processes); with Ray the
        actors start in ``_start_ray_ranks`` instead."""
        c, launcher = self.client, self.launcher
        new_ranks = list(range(c.num_engines, new_size))
        self._resize_config(new_size)
        if launcher.ray is not None:
            return None, new_ranks, []
        config = self._new_rank_config()
        handshake, address = launcher.bind_handshake()
        try:
            procs = launcher.spawn_ranks(new_ranks, address, config)
        except BaseException:
            handshake.close(linger=0)
            raise
        launcher.procs.extend(procs)
        return handshake, new_ranks, procs

    def _add_ranks(self, new_ranks: list[int]) -> None:
        c = self.client
        with c.router.lock:
            c.ranks += new_ranks
            c.identities += [engine_identity(r) for r in new_ranks]
            c.router.add_engines(len(new_ranks))
            c.num_engines = self.launcher.num_local_engines = len(c.ranks)

    def _start_drain(self, new_size: int) -> list[int]:
        c = self.client
        with c.router.lock:
            c.router.active = list(range(new_size))  # no new requests for the leaving ranks
        return list(range(new_size, c.num_engines))

    def _drained(self, leaving: list[int], deadline: float, drain_timeout_s: float) -> bool:
        c = self.client
        if c._dead:
            raise EngineDeadError()
        left = c.router.held_by(leaving)
        if left == 0:
            return True
        if time.monotonic() > deadline:
            with c.router.lock:
                c.router.active = list(range(c.num_engines))
            raise TimeoutError(f"ranks {leaving} still hold {left} requests after "
                               f"{drain_timeout_s:g} s (drain_timeout_s); scaling cancelled")
        return False

    def _leave(self, leaving: list[int]) -> list[Any]:
        # Their input connections close as they exit: not a death for the watcher.
        c, launcher = self.client, self.launcher
        launcher.watch.expected_disconnects += len(leaving)
        if launcher.ray is not None:
            launcher.ray.leaving(leaving)
            procs = []
        else:
            procs = [launcher.procs[e] for e in leaving]
        launcher.leaving.update(procs)  # their exit is expected, not a death
        self._resize_config(c.num_engines - len(leaving))
        return procs

    def _reap(self, procs: list[Any], new_size: int, timeout_s: float) -> None:
        c, launcher = self.client, self.launcher
        if launcher.ray is not None:
            launcher.ray.remove(c.ranks[new_size:], timeout_s)
        for proc in procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                logger.warning("%s did not exit after leaving; terminating it", proc.name)
                proc.terminate()
                proc.join(timeout=10)
        with c.router.lock:
            del c.ranks[new_size:], c.identities[new_size:]
            c.router.keep_engines(new_size)
            launcher.procs[:] = [p for p in launcher.procs if p not in procs]
            c.num_engines = launcher.num_local_engines = new_size
        # The procs stay in launcher.leaving: the monitor may still be looking at their exit.

    def _log_scaled(self, old: int, t0: float) -> None:
        c = self.client
        logger.info("data parallel scaled %d -> %d ranks in %.2f s (generation %d)", old,
                    c.num_engines, time.monotonic() - t0, self.launcher.dp_generation)


class ElasticScaler(ElasticSteps):
    """The sync client's (``SyncMPClient.scale_elastic_ep``)."""

    client: SyncScalableClient

    def __init__(self, client: SyncScalableClient) -> None:
        super().__init__(client)

    def scale(self, new_size: int, drain_timeout_s: float = 300.0,
              timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving."""
        c = self.client
        if not self._check_scalable(new_size):
            return
        launcher = self.launcher
        old, t0 = c.num_engines, time.monotonic()
        with self._lock:
            if new_size > old:
                handshake, new_ranks, procs = self._prepare_scale_up(new_size)
                rescale: list[Any] = []

                def commit() -> None:
                    rescale.append(c._call_nowait(None, "reinitialize_distributed",
                                                  (new_size, launcher.dp_generation)))

                if handshake is None:  # Ray: the actors get INIT up front
                    assert launcher.ray is not None
                    launcher.ray.start(self._new_rank_config(), new_ranks,
                                       launcher.init_message(), timeout_s, before_wait=commit)
                    rescale[0].result(timeout=timeout_s)
                    with c._send_lock:
                        launcher.front_ends.await_hellos(len(new_ranks), timeout_s)
                    self._add_ranks(new_ranks)
                    self._log_scaled(old, t0)
                    return
                try:
                    # Commit once every new rank has its INIT.
                    launcher.handshake(handshake, timeout_s, new_ranks,
                                       dict(zip(new_ranks, procs)), commit)
                    rescale[0].result(timeout=timeout_s)
                    with c._send_lock:
                        launcher.front_ends.await_hellos(len(new_ranks), timeout_s)
                finally:
                    handshake.close(linger=0)
                self._add_ranks(new_ranks)
            else:
                leaving = self._start_drain(new_size)
                deadline = time.monotonic() + drain_timeout_s
                while not self._drained(leaving, deadline, drain_timeout_s):
                    time.sleep(0.02)
                procs = self._leave(leaving)
                c._call(None, "reinitialize_distributed", (new_size, launcher.dp_generation),
                        timeout_s)
                self._reap(procs, new_size, timeout_s)
        self._log_scaled(old, t0)


class AsyncElasticScaler(ElasticSteps):
    """The asyncio client's (``AsyncMPClient.scale_elastic_ep_async``): the same
    steps, waited for on its event loop."""

    client: AsyncScalableClient

    def __init__(self, client: AsyncScalableClient) -> None:
        super().__init__(client)

    async def scale_async(self, new_size: int, drain_timeout_s: float = 300.0,
                          timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving."""
        c = self.client
        if not self._check_scalable(new_size):
            return
        launcher = self.launcher
        old, t0 = c.num_engines, time.monotonic()
        loop = asyncio.get_running_loop()
        if new_size > old:
            handshake, new_ranks, procs = self._prepare_scale_up(new_size)
            rescale: list[Any] = []

            def commit() -> None:  # runs on the handshake thread: hand it to the loop
                rescale.append(asyncio.run_coroutine_threadsafe(c._call_async(
                    None, "reinitialize_distributed", (new_size, launcher.dp_generation)), loop))

            try:
                if handshake is None:  # Ray: the actors get INIT up front
                    assert launcher.ray is not None
                    await asyncio.to_thread(launcher.ray.start, self._new_rank_config(),
                                            new_ranks, launcher.init_message(), timeout_s,
                                            commit)
                else:
                    await asyncio.to_thread(launcher.handshake, handshake, timeout_s, new_ranks,
                                            dict(zip(new_ranks, procs)), commit)
                await asyncio.wait_for(asyncio.wrap_future(rescale[0]), timeout_s)
                for _ in new_ranks:  # their input sockets say hello
                    await asyncio.wait_for(c._ainput.recv_multipart(), timeout_s)
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
            await asyncio.wait_for(c._call_async(
                None, "reinitialize_distributed", (new_size, launcher.dp_generation)), timeout_s)
            await asyncio.to_thread(self._reap, procs, new_size, timeout_s)
        self._log_scaled(old, t0)
