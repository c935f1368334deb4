"""Clients for an engine core in its own process: sync and asyncio.

The client binds the sockets (IPC in a private 0700 directory by default, or
TCP on loopback), spawns the engine, runs the handshake and watches the
process: if it dies for any reason (crash, kill -9, OOM) every waiter gets
``EngineDeadError`` at once, not after a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from enginecore import _native
from enginecore.client.core_client import EngineCoreClient
from enginecore.config import EngineConfig
from enginecore.core.utility import convert_result, signature_of
from enginecore.errors import EngineDeadError
from enginecore.executor.abstract import Executor
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeMessage,
    HandshakeReady,
    UtilityRequest,
    engine_identity,
)

logger = logging.getLogger(__name__)

_ADD = EngineCoreRequestType.ADD.value
_ABORT = EngineCoreRequestType.ABORT.value
_UTILITY = EngineCoreRequestType.UTILITY.value


class _Addresses:
    """Where the client binds; a private directory for IPC sockets."""

    def __init__(self, transport: str) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.transport = transport
        self.dir = tempfile.mkdtemp(prefix="enginecore-") if transport == "ipc" else None
        if self.dir:
            os.chmod(self.dir, 0o700)

    def bind(self, sock: zmq.Socket, name: str) -> str:
        if self.dir is not None:
            addr = f"ipc://{os.path.join(self.dir, name)}"
            sock.bind(addr)
            return addr
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def cleanup(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class MPClient(EngineCoreClient):
    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = False,
        *,
        transport: str = "ipc",
        handshake_timeout_s: float = 120.0,
        engine_log_level: int | None = None,
        client_count: int = 1,
    ) -> None:
        """Start the engine process; ``client_count`` front-ends may share it
        (this client is front-end 0; ``attach(i)`` gives front-end i)."""
        self._init_common(config, client_index=0)
        self._owner = True
        self._addresses = _Addresses(transport)
        self.ctx = zmq.Context()
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._front_ends: list[tuple[zmq.Socket, zmq.Socket, str, str]] = []
        try:
            for i in range(client_count):
                inp = self.ctx.socket(zmq.ROUTER)
                inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
                inp.setsockopt(zmq.LINGER, 0)
                in_addr = self._addresses.bind(inp, f"input{i}.sock")
                out = self.ctx.socket(zmq.PULL)
                out.setsockopt(zmq.LINGER, 0)
                out_addr = self._addresses.bind(out, f"output{i}.sock")
                self._front_ends.append((inp, out, in_addr, out_addr))
            (self.input_socket, self.output_socket, self.input_address,
             self.output_address) = self._front_ends[0]
            self._start_engine(executor_class, log_stats, handshake_timeout_s, engine_log_level)
            self._start_monitor()
        except BaseException:
            self.shutdown()
            raise

    def _init_common(self, config: EngineConfig, client_index: int) -> None:
        self.config = config
        self.engine_index = 0
        self.client_index = client_index
        self.identity = engine_identity(self.engine_index)
        self._dead = False
        self._closed = False
        self._call_ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._live: set[str] = set()
        self._live_lock = threading.Lock()

    def attach(self, client_index: int) -> MPClient:
        """Another front-end (same class) on this client's engine; it does not own
        the engine process, so its ``shutdown`` leaves the engine running."""
        if not self._owner:
            raise RuntimeError("attach from the client that started the engine")
        if not 0 < client_index < len(self._front_ends):
            raise ValueError(f"client_index must be in [1, {len(self._front_ends)})")
        other = type(self).__new__(type(self))
        other._init_common(self.config, client_index)
        other._owner = False
        other._primary = self
        other.ctx = self.ctx
        other.proc = self.proc
        other._front_ends = []
        (other.input_socket, other.output_socket, other.input_address,
         other.output_address) = self._front_ends[client_index]
        other._post_init()
        return other

    def _post_init(self) -> None:
        """Set-up of the subclasses (output reader); runs for attached clients too."""

    # -- start-up ----------------------------------------------------------------------------
    def _start_engine(self, executor_class, log_stats, timeout_s, engine_log_level) -> None:
        from enginecore.core.engine_core_proc import run_engine_core

        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.setsockopt(zmq.LINGER, 0)
        try:
            hs_address = self._addresses.bind(handshake, "handshake.sock")
            level = engine_log_level if engine_log_level is not None else (
                logging.getLogger().getEffectiveLevel())
            config = self.config
            if config.use_native is None:
                # The engine follows this process's hot-path choice (env or set_native).
                config = dataclasses.replace(config, use_native=_native._enabled and
                                             _native._ext is not None)
            ctx = multiprocessing.get_context("spawn")
            self.proc = ctx.Process(
                target=run_engine_core, name=f"EngineCore_{self.engine_index}",
                kwargs=dict(config=config, handshake_address=hs_address,
                            executor_class=executor_class, log_stats=log_stats,
                            engine_index=self.engine_index, handshake_timeout_s=timeout_s,
                            parent_pid=os.getpid(), log_level=level),
                daemon=True)
            self.proc.start()
            decoder = msgspec.msgpack.Decoder(HandshakeMessage)
            encoder = msgspec.msgpack.Encoder()
            hello = self._await_handshake(handshake, decoder, timeout_s, "HELLO")
            if not isinstance(hello, HandshakeHello):
                raise RuntimeError(f"engine {self.engine_index}: expected HELLO, got {hello!r}")
            handshake.send_multipart([self.identity, encoder.encode(HandshakeInit(
                [fe[2] for fe in self._front_ends], [fe[3] for fe in self._front_ends],
                self.config.parallel_config.data_parallel_rank,
                self.config.parallel_config.data_parallel_size))])
            ready = self._await_handshake(handshake, decoder, timeout_s, "READY")
            if isinstance(ready, HandshakeFailed):
                raise RuntimeError(f"engine {ready.engine_index} failed to start: {ready.error}")
            if not isinstance(ready, HandshakeReady):
                raise RuntimeError(f"engine {self.engine_index}: expected READY, got {ready!r}")
            self.num_gpu_blocks = ready.num_gpu_blocks
            self.max_model_len = ready.max_model_len
            # The engine's input sockets say hello once connected; only then can we route.
            for i, (inp, _, _, _) in enumerate(self._front_ends):
                if not inp.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"engine {self.engine_index} did not connect its input "
                                       f"socket for front-end {i}")
                inp.recv_multipart()
        finally:
            handshake.close(linger=0)

    def _await_handshake(self, sock, decoder, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(200):
                _, payload = sock.recv_multipart()
                return decoder.decode(payload)
            if self.proc is not None and not self.proc.is_alive():
                raise RuntimeError(
                    f"engine {self.engine_index} (pid {self.proc.pid}) exited with code "
                    f"{self.proc.exitcode} before sending {what}; see its log above")
        raise TimeoutError(
            f"engine {self.engine_index} (pid {self.proc.pid if self.proc else '?'}) did not send "
            f"{what} within {timeout_s:.0f} s (handshake_timeout_s)")

    def _start_monitor(self) -> None:
        """Turn the engine process dying into ENGINE_CORE_DEAD on our own output socket."""
        assert self.proc is not None
        sentinel = self.proc.sentinel
        self._monitor_stop_r, self._monitor_stop_w = multiprocessing.Pipe(duplex=False)
        stop_r = self._monitor_stop_r
        output_addresses = [fe[3] for fe in self._front_ends]
        ctx = self.ctx
        self_ref = weakref.ref(self)
        proc = self.proc

        def monitor() -> None:
            ready = multiprocessing.connection.wait([sentinel, stop_r])
            if stop_r in ready:
                return
            client = self_ref()
            if client is None or client._closed:
                return
            logger.error("engine %d (pid %s) died with exit code %s", client.engine_index,
                         proc.pid, proc.exitcode)
            client._dead = True
            for address in output_addresses:
                try:
                    push = ctx.socket(zmq.PUSH)
                    push.setsockopt(zmq.LINGER, 1000)
                    push.connect(address)
                    push.send(ENGINE_CORE_DEAD)
                    push.close()
                except zmq.ZMQError:
                    pass

        self._monitor = threading.Thread(target=monitor, daemon=True, name="enginecore-monitor")
        self._monitor.start()

    # -- sending -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError()
        if self._closed:
            raise RuntimeError("the client is shut down")

    def _register(self, request: EngineCoreRequest) -> None:
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        with self._live_lock:
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already live")
            self._live.add(request.request_id)
        request.client_index = self.client_index

    def _forget_finished(self, outs: EngineCoreOutputs) -> None:
        finished = [o.request_id for o in outs.outputs if o.finish_reason is not None]
        if finished:
            with self._live_lock:
                self._live.difference_update(finished)

    def _utility_frames(self, method: str, args: tuple) -> tuple[int, list[bytes]]:
        signature_of(method)  # refuse early, locally, what the engine would refuse
        call_id = next(self._call_ids)
        payload = self._encoder.encode(
            UtilityRequest(self.client_index, call_id, method, list(args)))
        return call_id, [self.identity, _UTILITY, payload]

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._owner:
            return
        if hasattr(self, "_monitor_stop_w"):
            self._monitor_stop_w.send(b"x")
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.terminate()  # SIGTERM: the engine shuts down cleanly
            proc.join(timeout=10)
            if proc.is_alive():
                logger.warning("engine %d ignored SIGTERM; killing it", self.engine_index)
                proc.kill()
                proc.join(timeout=5)
        self._close_sockets()
        self._addresses.cleanup()

    def _close_sockets(self) -> None:
        self.ctx.destroy(linger=0)


class SyncMPClient(MPClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._post_init()

    def _post_init(self) -> None:
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self._pending: dict[int, tuple[str, Future]] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, daemon=True,
                                        name="enginecore-client-output")
        self._reader.start()

    def _read_outputs(self) -> None:
        sock = self.output_socket
        decoder = self._decoder
        while not self._closed:
            try:
                if not sock.poll(200):
                    continue
                frame = sock.recv(copy=False)
            except zmq.ZMQError:
                break
            buf = frame.buffer
            if bytes(buf[: len(ENGINE_CORE_DEAD)]) == ENGINE_CORE_DEAD and len(buf) == len(
                    ENGINE_CORE_DEAD):
                self._fail_all()
                break
            outs = decoder.decode(buf)
            if outs.utility_output is not None:
                self._resolve_utility(outs)
                continue
            self._forget_finished(outs)
            self.outputs_queue.put_nowait(outs)

    def _fail_all(self) -> None:
        self._dead = True
        self.outputs_queue.put_nowait(EngineDeadError())
        for _, fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError())
        self._pending.clear()

    def _resolve_utility(self, outs: EngineCoreOutputs) -> None:
        u = outs.utility_output
        assert u is not None
        entry = self._pending.pop(u.call_id, None)
        if entry is None:
            return
        method, fut = entry
        if u.failure_message is not None:
            fut.set_exception(RuntimeError(u.failure_message))
        else:
            try:
                fut.set_result(convert_result(method, u.result.value if u.result else None))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

    def _send(self, frames: list[bytes]) -> None:
        self._check_alive()
        with self._send_lock:
            try:
                self.input_socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:
                raise EngineDeadError(f"could not send to the engine: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._register(request)
        try:
            self._send([self.identity, _ADD, self._encoder.encode(request)])
        except BaseException:
            with self._live_lock:
                self._live.discard(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send([self.identity, _ABORT, self._encoder.encode(list(request_ids))])

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        item = self.outputs_queue.get(timeout=timeout)
        if isinstance(item, Exception):
            self.outputs_queue.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id, frames = self._utility_frames(method, args)
        fut: Future = Future()
        self._pending[call_id] = (method, fut)
        try:
            self._send(frames)
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        if self._dead and not fut.done():
            fut.set_exception(EngineDeadError())
        return fut.result(timeout=timeout)

    def shutdown(self) -> None:
        super().shutdown()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2)


class AsyncMPClient(MPClient):
    """asyncio client: call it from one event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._post_init()

    def _post_init(self) -> None:
        self._ainput = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._aoutput = zmq.asyncio.Socket.from_socket(self.output_socket)
        self._queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._reader_task: asyncio.Task | None = None

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self._queue = asyncio.Queue()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        assert self._queue is not None
        decoder = self._decoder
        while not self._closed:
            try:
                frame = await self._aoutput.recv(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                break
            buf = frame.buffer
            if len(buf) == len(ENGINE_CORE_DEAD) and bytes(buf) == ENGINE_CORE_DEAD:
                self._dead = True
                self._queue.put_nowait(EngineDeadError())
                for _, fut in list(self._pending.values()):
                    if not fut.done():
                        fut.set_exception(EngineDeadError())
                self._pending.clear()
                break
            outs = decoder.decode(buf)
            u = outs.utility_output
            if u is not None:
                entry = self._pending.pop(u.call_id, None)
                if entry is not None and not entry[1].done():
                    method, fut = entry
                    if u.failure_message is not None:
                        fut.set_exception(RuntimeError(u.failure_message))
                    else:
                        try:
                            fut.set_result(convert_result(method, u.result.value if u.result
                                                          else None))
                        except Exception as e:  # noqa: BLE001
                            fut.set_exception(e)
                continue
            self._forget_finished(outs)
            self._queue.put_nowait(outs)

    async def _send(self, frames: list[bytes]) -> None:
        self._check_alive()
        self._ensure_reader()
        try:
            await self._ainput.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"could not send to the engine: {e}") from e

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._register(request)
        try:
            await self._send([self.identity, _ADD, self._encoder.encode(request)])
        except BaseException:
            with self._live_lock:
                self._live.discard(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send([self.identity, _ABORT, self._encoder.encode(list(request_ids))])

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self._queue is not None
        item = await self._queue.get()
        if isinstance(item, Exception):
            self._queue.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id, frames = self._utility_frames(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (method, fut)
        try:
            await self._send(frames)
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return await fut

    def shutdown(self) -> None:
        task = getattr(self, "_reader_task", None)
        if task is not None and not task.done():
            task.cancel()
        super().shutdown()
