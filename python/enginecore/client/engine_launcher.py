"""How a multiprocess client starts its engines: the DP coordinator, the
front-ends' sockets, engine processes (or Ray actors) and their handshake, the
monitor that turns a dead engine into ``EngineDeadError`` for every waiter, and
their teardown. The client that starts the engines owns one ``EngineLauncher``
(``client.launcher``); elastic scaling (client/elastic.py) spawns and retires
ranks through it."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from enginecore import _native
from enginecore.client.engine_watch import EngineWatch, WatchedClient
from enginecore.client.ray_engines import RayEngines
from enginecore.client.remote_front_end import FrontEnds, FrontEndSockets, bind_front_end
from enginecore.client.sockets import Addresses, rank_devices
from enginecore.config import EngineConfig
from enginecore.executor.abstract import Executor
from enginecore.interrupts import children_ignore_sigint
from enginecore.protocol import (
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeMessage,
    HandshakeReady,
)
from enginecore.transport import (
    curve_wanted,
    default_key_file,
    make_keys,
    secure_server,
    write_rank_keys,
)

logger = logging.getLogger(__name__)

Process = multiprocessing.process.BaseProcess


def _log_level(engine_log_level: int | None) -> int:
    """The engines log at the given level, or at this process's."""
    if engine_log_level is not None:
        return engine_log_level
    return logging.getLogger().getEffectiveLevel()


def _running(proc: Process) -> bool:
    """Alive by its sentinel: ``is_alive()`` says True forever for a child that
    something else in the process reaped first (its exit code is then lost)."""
    return proc.is_alive() and not multiprocessing.connection.wait([proc.sentinel], 0)


def exit_code_unreaped(proc: Process, wait_s: float = 1.0) -> int | None:
    """The exit code of a child whose sentinel is ready, read without reaping it.
    ``proc.exitcode`` reaps (waitpid); a second thread reaping the same child at the
    same moment (the owner's own ``proc.join()``) gets ECHILD, and multiprocessing
    then loses the code for good: ``exitcode`` None, ``is_alive()`` True. waitid with
    WNOWAIT leaves the child for its owner. Negative: the signal that ended it, as
    multiprocessing reports it. None if it is not known within ``wait_s`` (the
    sentinel closes a moment before the child can be waited for)."""
    waitid = getattr(os, "waitid", None)
    deadline = time.monotonic() + wait_s
    while True:
        if waitid is None or proc.pid is None:
            return proc.exitcode
        try:
            status = waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already: by its owner, whose code it is
            code = proc.exitcode
            if code is not None or time.monotonic() >= deadline:
                return code
        else:
            if status is not None:
                exited = status.si_code == os.CLD_EXITED
                return status.si_status if exited else -status.si_status
            if time.monotonic() >= deadline:
                return None
        time.sleep(0.01)


class LaunchingClient(WatchedClient, Protocol):
    """What the launcher reads of the client that owns it (client/mp_client.py).
    ``config`` is read each time: an elastic rescale replaces it."""

    config: EngineConfig
    ranks: list[int]
    num_engines: int


class EngineLauncher:
    """The engines behind one owning client: where they connect, their processes
    (or actors), the coordinator and, for lockstep ranks, their group's store."""

    def __init__(self, client: LaunchingClient, ctx: zmq.Context, transport: str) -> None:
        self.client = client
        self.ctx = ctx
        pc = client.config.parallel_config
        self.num_local_engines = min(pc.data_parallel_size_local, client.num_engines)
        if pc.data_parallel_backend == "ray":
            # Ray places every rank (on this node or others): all are ours, over TCP.
            self.num_local_engines = client.num_engines
            transport = "tcp"
        if self.num_local_engines < client.num_engines:
            # Some ranks are headless engines elsewhere: they reach us over TCP.
            transport = "tcp"
        self.addresses = Addresses(transport, pc.data_parallel_address)
        # TCP: CurveZMQ with keys made for this launch; only holders of the client
        # key (our engines, handed it out of band) get past the handshake.
        tc = client.config.transport_config
        self.curve = make_keys() if transport == "tcp" and curve_wanted(tc) else None
        self.front_ends = FrontEnds()
        self.watch = EngineWatch(client, ctx, self.front_ends, self.curve)
        self.procs: list[Process] = []
        self.ray: RayEngines | None = None
        # Data parallel behind one load balancer: the coordinator process, and for
        # lockstep ranks the store their process group meets at.
        self.coordinator: Process | None = None
        self.coord_addresses: dict[str, str] | None = None
        self.dp_store: Any = None
        self.dp_store_address: str | None = None
        self.dp_generation = 0  # bumped by each rescale
        # Processes that leave in a rescale: their exit is no death.
        self.leaving: set[Process] = set()
        self._spawn_args: dict[str, Any] = {}
        self._handshakes = 0
        self._monitor: threading.Thread | None = None
        self._monitor_stop_r: Any = None
        self._monitor_stop_w: Any = None

    # -- start-up ----------------------------------------------------------------------------
    def start(self, client_count: int, local_clients: int,
              executor_class: type[Executor] | None, log_stats: bool, timeout_s: float,
              engine_log_level: int | None) -> tuple[int, int]:
        """Coordinator, front-ends (the first ``local_clients`` bound here, the rest
        reserved for other processes), engines, watchers; (num_gpu_blocks,
        max_model_len) of the engines."""
        c = self.client
        if c.num_engines > 1:
            self._start_coordinator(engine_log_level)
        tc = c.config.transport_config
        for i in range(client_count):
            if i < local_clients:
                self.front_ends.add(bind_front_end(
                    self.ctx, self.addresses.bind, i, tc, self.curve, self.addresses.transport))
            else:  # bound in another process (MPClient.connect)
                self.front_ends.add(FrontEndSockets(
                    None, None, self.addresses.reserve(f"input{i}.sock"),
                    self.addresses.reserve(f"output{i}.sock")))
        if c.config.parallel_config.data_parallel_backend == "ray":
            sizes = self._start_ray(executor_class, log_stats, timeout_s, engine_log_level)
        else:
            sizes = self._start_processes(executor_class, log_stats, timeout_s,
                                          engine_log_level)
        self._start_monitor()
        if self.num_local_engines < c.num_engines or self.ray is not None:
            self.watch.watch_disconnects()
        return sizes

    def _start_coordinator(self, engine_log_level: int | None) -> None:
        from enginecore.core.dp_coordinator import start_coordinator

        config = self.client.config
        pc = config.parallel_config
        names = ("status", "wave_request", "engine_input", "engine_output")
        if self.addresses.dir is not None:
            bind = {n: f"ipc://{os.path.join(self.addresses.dir, 'coord-' + n)}.sock"
                    for n in names}
        else:
            bind = dict.fromkeys(names, f"tcp://{self.addresses.host}")
        self.coordinator, self.coord_addresses = start_coordinator(
            pc.data_parallel_size, pc.data_parallel_lockstep, bind, _log_level(engine_log_level),
            config.transport_config.max_message_bytes, self.curve, self.addresses.dir)
        if pc.data_parallel_lockstep:
            from enginecore.core.dp_group import host_store

            self.dp_store, self.dp_store_address = host_store(pc.data_parallel_address)
        logger.info("DP coordinator pid %d (%s ranks)", self.coordinator.pid,
                    "lockstep" if pc.data_parallel_lockstep else "independent")

    def _start_processes(self, executor_class: type[Executor] | None, log_stats: bool,
                         timeout_s: float, engine_log_level: int | None) -> tuple[int, int]:
        """Spawn one engine per local data-parallel rank and run the handshake with all."""
        c = self.client
        config, level = self.engine_config(), _log_level(engine_log_level)
        self._spawn_args = dict(executor_class=executor_class, log_stats=log_stats,
                                handshake_timeout_s=timeout_s, log_level=level)
        headless = self.num_local_engines < c.num_engines
        if headless and self.curve is not None:
            # The ranks elsewhere get their keys out of band: this 0600 file (or its
            # content in ENGINECORE_CURVE_KEYS), copied by whoever starts them.
            path = write_rank_keys(self.curve, config.transport_config.curve_key_file
                                   or default_key_file(config))
            self.addresses.remove_at_cleanup(path)
            logger.warning("CURVE keys for the headless ranks of this launch: %s (0600)", path)
        handshake, hs_address = self.bind_handshake(
            config.parallel_config.data_parallel_rpc_port if headless else 0)
        try:
            local = c.ranks[: self.num_local_engines]
            self.procs.extend(self.spawn_ranks(local, hs_address, config))
            ready = self.handshake(handshake, timeout_s, c.ranks, dict(zip(local, self.procs)))
            first = ready[c.ranks[0]]
            self.front_ends.await_hellos(c.num_engines, timeout_s)
        finally:
            handshake.close(linger=0)
        return first.num_gpu_blocks, first.max_model_len

    def engine_config(self) -> EngineConfig:
        """The config the engines get: this process's hot-path choice, the ranks' keys."""
        config = self.client.config
        if config.use_native is None:
            # The engines follow this process's hot-path choice (env or set_native).
            config = dataclasses.replace(config, use_native=_native._enabled and
                                         _native._ext is not None)
        if self.curve is not None:
            # The ranks' CURVE keys ride in their config (the spawn pipe, Ray's
            # arguments), never over a socket; the server secret stays here.
            config = dataclasses.replace(config, transport_config=dataclasses.replace(
                config.transport_config, curve_keys=self.curve.for_ranks()))
        return config

    def bind_handshake(self, port: int = 0) -> tuple[zmq.Socket, str]:
        """A fresh handshake ROUTER (one per start and per scale-up) and its address."""
        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.setsockopt(zmq.LINGER, 0)
        secure_server(handshake, self.curve)
        self._handshakes += 1
        try:
            return handshake, self.addresses.bind(
                handshake, f"handshake{self._handshakes}.sock", port)
        except BaseException:
            handshake.close(linger=0)
            raise

    def spawn_ranks(self, ranks: list[int], hs_address: str, config: EngineConfig,
                    ) -> list[Process]:
        """One engine process per rank, told to say HELLO at ``hs_address``."""
        from enginecore.core.engine_process import run_engine_core

        devices = rank_devices(config)
        ctx = multiprocessing.get_context("spawn")
        procs = []
        for rank in ranks:
            rank_config = dataclasses.replace(
                config, parallel_config=dataclasses.replace(
                    config.parallel_config, data_parallel_rank=rank))
            proc = ctx.Process(
                target=run_engine_core, name=f"EngineCore_DP{rank}",
                kwargs=dict(config=rank_config, handshake_address=hs_address,
                            engine_index=rank, parent_pid=os.getpid(),
                            ipc_dir=self.addresses.dir,
                            visible_devices=devices[rank % len(devices)] if devices else None,
                            **self._spawn_args),
                daemon=True)
            with children_ignore_sigint():
                proc.start()
            procs.append(proc)
        return procs

    def init_message(self) -> bytes:
        """INIT: where an engine connects, and the parallel settings."""
        pc = self.client.config.parallel_config
        coord = self.coord_addresses or {}
        return msgspec.msgpack.encode(HandshakeInit(
            self.front_ends.input_addresses, self.front_ends.output_addresses,
            pc.data_parallel_rank, pc.data_parallel_size,
            coordinator_input_address=coord.get("engine_input"),
            coordinator_output_address=coord.get("engine_output"),
            dp_store_address=self.dp_store_address, dp_group_generation=self.dp_generation))

    def _start_ray(self, executor_class: type[Executor] | None, log_stats: bool,
                   timeout_s: float, engine_log_level: int | None) -> tuple[int, int]:
        """Ranks as Ray actors: addresses known up front, no handshake socket."""
        c = self.client
        self.ray = RayEngines(executor_class, log_stats, _log_level(engine_log_level))
        sizes = self.ray.start(self.engine_config(), c.ranks, self.init_message(), timeout_s)
        self.front_ends.await_hellos(c.num_engines, timeout_s)
        self.ray.watch(self.watch.announce_dead)
        return sizes

    def handshake(self, handshake: zmq.Socket, timeout_s: float, ranks: list[int],
                  local: dict[int, Process],
                  on_all_hello: Callable[[], None] | None = None,
                  ) -> dict[int, HandshakeReady]:
        """HELLO -> INIT -> READY with ``ranks``; ``on_all_hello()`` runs once every
        one of them has its INIT (an elastic scale-up triggers the rescale there)."""
        decoder = msgspec.msgpack.Decoder(HandshakeMessage)
        init = self.init_message()
        said_hello: set[int] = set()
        ready: dict[int, HandshakeReady] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(ranks):
            if time.monotonic() > deadline:
                missing = ", ".join(
                    f"engine {i} ({f'pid {local[i].pid}' if i in local else 'headless'}) did "
                    f"not send {'READY' if i in said_hello else 'HELLO'}"
                    for i in ranks if i not in ready)
                raise TimeoutError(f"handshake timed out after {timeout_s:g} s "
                                   f"(handshake_timeout_s): {missing}")
            for i, proc in local.items():
                if i not in ready and not proc.is_alive():
                    raise RuntimeError(
                        f"engine {i} (pid {proc.pid}) exited with code {proc.exitcode} before "
                        f"sending {'READY' if i in said_hello else 'HELLO'}; see its log above")
            if not handshake.poll(200):
                continue
            frames = handshake.recv_multipart()
            try:
                identity, payload = frames
                msg = decoder.decode(payload)
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("dropped a malformed handshake message (%d frames): %s",
                               len(frames), e)
                continue
            if isinstance(msg, HandshakeHello):
                said_hello.add(msg.engine_index)
                handshake.send_multipart([identity, init])
                if on_all_hello is not None and said_hello >= set(ranks):
                    on_all_hello()
                    on_all_hello = None
            elif isinstance(msg, HandshakeReady):
                ready[msg.engine_index] = msg
            elif isinstance(msg, HandshakeFailed):
                raise RuntimeError(f"engine {msg.engine_index} failed to start: {msg.error}")
        return ready

    # -- liveness and teardown -----------------------------------------------------------------
    def watched(self) -> list[Process]:
        """The processes whose exit is a death: engines (not leaving ones), coordinator."""
        procs = [p for p in self.procs if p not in self.leaving]
        return procs + ([self.coordinator] if self.coordinator is not None else [])

    def _start_monitor(self) -> None:
        """Turn an engine (or the coordinator) dying into ENGINE_CORE_DEAD on our
        own output sockets. Ranks leaving in a rescale exit without alarm."""
        # Both ends kept here: the read end closing when the thread ends would make
        # stop_engines' send a BrokenPipeError.
        self._monitor_stop_r, self._monitor_stop_w = multiprocessing.Pipe(duplex=False)
        stop_r = self._monitor_stop_r
        # Held weakly: a client dropped without shutdown (and collected) stops it.
        self_ref = weakref.ref(self)

        def monitor() -> None:
            while True:
                launcher = self_ref()
                if launcher is None or launcher.client._closed:
                    return
                watched = {p.sentinel: p for p in launcher.watched()}
                del launcher
                # Re-read the set now and then: a rescale adds and removes ranks.
                ready = multiprocessing.connection.wait([*watched, stop_r], timeout=0.5)
                if stop_r in ready:
                    return
                launcher = self_ref()
                if launcher is None or launcher.client._closed:
                    return
                died = [watched[s] for s in ready if watched[s] not in launcher.leaving]
                if died:
                    break
            launcher.watch.announce_dead(", ".join(
                f"{p.name} (pid {p.pid}) died with exit code {exit_code_unreaped(p)}"
                for p in died))

        self._monitor = threading.Thread(target=monitor, daemon=True, name="enginecore-monitor")
        self._monitor.start()

    def stop_engines(self) -> None:
        """Stop the watchers, then the engines and the coordinator (SIGTERM: they
        shut down cleanly; SIGKILL for one that ignores it)."""
        if self._monitor_stop_w is not None:
            self._monitor_stop_w.send(b"x")
        if self.coordinator is not None and self.coordinator.is_alive():
            self.coordinator.terminate()
        if self.ray is not None:
            self.ray.shutdown()
        for proc in self.procs:
            if _running(proc):
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=10)
            if _running(proc):
                logger.warning("%s ignored SIGTERM; killing it", proc.name)
                proc.kill()
                proc.join(timeout=5)
        if self.coordinator is not None:
            self.coordinator.join(timeout=5)
        self.dp_store = None
