"""How a multiprocess client starts its engines: the DP coordinator, engine
processes (or Ray actors) and their handshake, and the watchers that turn a
dead engine into ``EngineDeadError`` for every waiter (mixed into ``MPClient``)."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq

from enginecore import _native
from enginecore.client.sockets import rank_devices
from enginecore.config import EngineConfig
from enginecore.interrupts import children_ignore_sigint
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeMessage,
    HandshakeReady,
)
from enginecore.transport import (
    default_key_file,
    secure_client,
    secure_server,
    write_rank_keys,
)

logger = logging.getLogger(__name__)


def _log_level(engine_log_level: int | None) -> int:
    """The engines log at the given level, or at this process's."""
    if engine_log_level is not None:
        return engine_log_level
    return logging.getLogger().getEffectiveLevel()

class EngineLauncher:
    """Start-up and liveness of the engines behind an ``MPClient`` (``self``)."""

    def _start_coordinator(self, engine_log_level: int | None) -> None:
        from enginecore.core.dp_coordinator import start_coordinator

        pc = self.config.parallel_config
        names = ("status", "wave_request", "engine_input", "engine_output")
        if self._addresses.dir is not None:
            bind = {n: f"ipc://{os.path.join(self._addresses.dir, 'coord-' + n)}.sock"
                    for n in names}
        else:
            bind = dict.fromkeys(names, f"tcp://{self._addresses.host}")
        self.coordinator, self._coord_addresses = start_coordinator(
            pc.data_parallel_size, pc.data_parallel_lockstep, bind, _log_level(engine_log_level),
            self.config.transport_config.max_message_bytes, self._curve, self._addresses.dir)
        if pc.data_parallel_lockstep:
            from enginecore.core.dp_group import host_store

            self._dp_store, self._dp_store_address = host_store(pc.data_parallel_address)
        logger.info("DP coordinator pid %d (%s ranks)", self.coordinator.pid,
                    "lockstep" if pc.data_parallel_lockstep else "independent")

    def _connect_coordinator(self) -> None:
        if self._coord_addresses is not None:
            from enginecore.client.dp_link import CoordinatorLink

            self.router.link = CoordinatorLink(self.ctx, self._coord_addresses,
                                         self.config.parallel_config.data_parallel_lockstep,
                                         self._curve)

    # -- start-up ----------------------------------------------------------------------------
    def _start_engine(self, executor_class, log_stats, timeout_s, engine_log_level) -> None:
        """Spawn one engine per data-parallel rank and run the handshake with all."""
        config, level = self._engine_config(), _log_level(engine_log_level)
        self._spawn_args = dict(executor_class=executor_class, log_stats=log_stats,
                                handshake_timeout_s=timeout_s, log_level=level)
        headless = self.num_local_engines < self.num_engines
        if headless and self._curve is not None:
            # The ranks elsewhere get their keys out of band: this 0600 file (or its
            # content in ENGINECORE_CURVE_KEYS), copied by whoever starts them.
            path = write_rank_keys(self._curve, self.config.transport_config.curve_key_file
                                   or default_key_file(self.config))
            self._addresses.remove_at_cleanup(path)
            logger.warning("CURVE keys for the headless ranks of this launch: %s (0600)", path)
        handshake, hs_address = self._bind_handshake(
            self.config.parallel_config.data_parallel_rpc_port if headless else 0)
        try:
            local = self.ranks[: self.num_local_engines]
            self.procs.extend(self._spawn_ranks(local, hs_address, config))
            ready = self._handshake(handshake, timeout_s, self.ranks, dict(zip(local, self.procs)))
            first = ready[self.ranks[0]]
            self.num_gpu_blocks = first.num_gpu_blocks
            self.max_model_len = first.max_model_len
            self._await_input_sockets(self.num_engines, timeout_s)
        finally:
            handshake.close(linger=0)

    def _engine_config(self) -> EngineConfig:
        config = self.config
        if config.use_native is None:
            # The engines follow this process's hot-path choice (env or set_native).
            config = dataclasses.replace(config, use_native=_native._enabled and
                                         _native._ext is not None)
        if self._curve is not None:
            # The ranks' CURVE keys ride in their config (the spawn pipe, Ray's
            # arguments), never over a socket; the server secret stays here.
            config = dataclasses.replace(config, transport_config=dataclasses.replace(
                config.transport_config, curve_keys=self._curve.for_ranks()))
        return config

    def _bind_handshake(self, port: int = 0) -> tuple[zmq.Socket, str]:
        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.setsockopt(zmq.LINGER, 0)
        secure_server(handshake, self._curve)
        self._handshakes = getattr(self, "_handshakes", 0) + 1
        try:
            return handshake, self._addresses.bind(
                handshake, f"handshake{self._handshakes}.sock", port)
        except BaseException:
            handshake.close(linger=0)
            raise

    def _spawn_ranks(self, ranks: list[int], hs_address: str, config: EngineConfig,
                     ) -> list[multiprocessing.process.BaseProcess]:
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
                            ipc_dir=self._addresses.dir,
                            visible_devices=devices[rank % len(devices)] if devices else None,
                            **self._spawn_args),
                daemon=True)
            with children_ignore_sigint():
                proc.start()
            procs.append(proc)
        return procs

    def _await_input_sockets(self, count: int, timeout_s: float) -> None:
        """Each engine's input sockets say hello once connected; only then can we route."""
        for i, (inp, _, _, _) in enumerate(self._front_ends):
            if inp is None:
                continue  # bound in another process, which waits for its own hellos
            for _ in range(count):
                if not inp.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"an engine did not connect its input socket for "
                                       f"front-end {i} within {timeout_s:g} s")
                inp.recv_multipart()

    def _init_message(self) -> bytes:
        """INIT: where an engine connects, and the parallel settings."""
        pc = self.config.parallel_config
        coord = self._coord_addresses or {}
        return msgspec.msgpack.encode(HandshakeInit(
            [fe[2] for fe in self._front_ends], [fe[3] for fe in self._front_ends],
            pc.data_parallel_rank, pc.data_parallel_size,
            coordinator_input_address=coord.get("engine_input"),
            coordinator_output_address=coord.get("engine_output"),
            dp_store_address=self._dp_store_address, dp_group_generation=self._dp_generation))

    def _start_ray(self, executor_class, log_stats, timeout_s, engine_log_level) -> None:
        """Ranks as Ray actors: addresses known up front, no handshake socket."""
        from enginecore.client.ray_engines import RayEngines

        self._ray = RayEngines(executor_class, log_stats, _log_level(engine_log_level))
        self.num_gpu_blocks, self.max_model_len = self._ray.start(
            self._engine_config(), self.ranks, self._init_message(), timeout_s)
        self._await_input_sockets(self.num_engines, timeout_s)
        self._ray.watch(self._announce_dead)

    def _handshake(self, handshake: zmq.Socket, timeout_s: float, ranks: list[int],
                   local: dict[int, multiprocessing.process.BaseProcess],
                   on_all_hello: Any = None) -> dict[int, HandshakeReady]:
        """HELLO -> INIT -> READY with ``ranks``; ``on_all_hello()`` runs once every
        one of them has its INIT (an elastic scale-up triggers the rescale there)."""
        decoder = msgspec.msgpack.Decoder(HandshakeMessage)
        init = self._init_message()
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

    def _watch_remote_ranks(self) -> None:
        """Ranks we have no process handle for (headless, Ray): their input
        connection dropping means they died."""
        from zmq.utils.monitor import recv_monitor_message

        monitor = self.input_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self_ref = weakref.ref(self)

        def watch() -> None:
            while True:
                try:
                    if not monitor.poll(200):
                        client = self_ref()
                        if client is None or client._closed:
                            break
                        del client
                        continue
                    event = recv_monitor_message(monitor)
                except zmq.ZMQError:
                    break
                client = self_ref()
                if client is None or client._closed:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED and client._expected_disconnects:
                    client._expected_disconnects -= 1  # a rank that left in a rescale
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    client._announce_dead(f"an engine disconnected from {client.input_address} "
                                          "(a remote rank died or its node went away)")
                    break
                del client
            monitor.close(linger=0)

        self._remote_watch = threading.Thread(target=watch, daemon=True,
                                              name="enginecore-remote-watch")
        self._remote_watch.start()

    def _announce_dead(self, why: str) -> None:
        """An engine is gone: every front-end's output socket gets ENGINE_CORE_DEAD,
        so each waiter learns it at once."""
        if self._closed:
            return
        logger.error("%s", why)
        self._dead = True
        for address in [fe[3] for fe in self._front_ends]:
            try:
                push = self.ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 1000)
                secure_client(push, address, self._curve)
                push.connect(address)
                push.send(ENGINE_CORE_DEAD)
                push.close()
            except zmq.ZMQError:
                pass

    def _watched(self) -> list[multiprocessing.process.BaseProcess]:
        procs = [p for p in self.procs if p not in self._leaving]
        return procs + ([self.coordinator] if self.coordinator is not None else [])

    def _start_monitor(self) -> None:
        """Turn an engine (or the coordinator) dying into ENGINE_CORE_DEAD on our
        own output sockets. Ranks leaving in a rescale exit without alarm."""
        self._monitor_stop_r, self._monitor_stop_w = multiprocessing.Pipe(duplex=False)
        stop_r = self._monitor_stop_r
        self_ref = weakref.ref(self)

        def monitor() -> None:
            while True:
                client = self_ref()
                if client is None or client._closed:
                    return
                watched = {p.sentinel: p for p in client._watched()}
                del client
                # Re-read the set now and then: a rescale adds and removes ranks.
                ready = multiprocessing.connection.wait([*watched, stop_r], timeout=0.5)
                if stop_r in ready:
                    return
                client = self_ref()
                if client is None or client._closed:
                    return
                died = [watched[s] for s in ready if watched[s] not in client._leaving]
                if died:
                    break
            client._announce_dead(", ".join(
                f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}" for p in died))

        self._monitor = threading.Thread(target=monitor, daemon=True, name="enginecore-monitor")
        self._monitor.start()
