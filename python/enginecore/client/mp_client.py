"""Clients for an engine core in its own process: sync and asyncio.

The client binds the sockets (IPC in a private 0700 directory by default, or
TCP on loopback), spawns the engine, runs the handshake and watches the
process: if it dies for any reason (crash, kill -9, OOM) every waiter gets
``EngineDeadError`` at once, not after a timeout.

Its parts are owned objects: ``router``, ``pending_calls``, ``elastic``, and for
the client that starts the engines its ``launcher`` (client/engine_launcher.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from enginecore.client.core_client import EngineCoreClient
from enginecore.client.dp_link import CoordinatorLink
from enginecore.client.elastic import AsyncElasticScaler, ElasticScaler
from enginecore.client.engine_launcher import EngineLauncher, Process
from enginecore.client.engine_watch import EngineWatch
from enginecore.client.remote_front_end import FrontEndHandoff, FrontEnds, FrontEndSockets
from enginecore.client.request_router import RequestRouter
from enginecore.client.utility_calls import PendingCall, PendingCalls
from enginecore.config import EngineConfig
from enginecore.core.utility import signature_of
from enginecore.errors import EngineDeadError
from enginecore.executor.abstract import Executor
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
    encode_request,
    engine_identity,
)
from enginecore.transport import new_context, start_authenticator

logger = logging.getLogger(__name__)

_Client = TypeVar("_Client", bound="MPClient")


def _shut_down() -> EngineDeadError:
    return EngineDeadError("the client was shut down")


_ADD = EngineCoreRequestType.ADD.value
_ABORT = EngineCoreRequestType.ABORT.value
_UTILITY = EngineCoreRequestType.UTILITY.value


class MPClient(EngineCoreClient):
    # The engines' launcher: this client's own, or (attached in process) its
    # primary's; None for a front-end attached from another process.
    launcher: EngineLauncher | None = None
    # Death notices for this client's front-ends: the launcher's, or (attached
    # from another process) this client's own; None when attached in process.
    watch: EngineWatch | None = None
    _auth: Any = None
    _own_context = False  # attached from another process: the context is ours to close

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
        local_client_count: int | None = None,
    ) -> None:
        """Start the engine process; ``client_count`` front-ends may share it
        (this client is front-end 0; ``attach(i)`` gives front-end i). Front-ends
        from ``local_client_count`` on are bound by other processes: ``handoff(i)``
        gives what such a process passes to ``connect`` (client/remote_front_end.py)."""
        self._init_common(config, client_index=0)
        self._owner = True
        local_clients = client_count if local_client_count is None else local_client_count
        if not 1 <= local_clients <= client_count:
            raise ValueError(f"local_client_count must be in [1, {client_count}]")
        self.ctx = new_context(config)
        try:
            self.launcher = EngineLauncher(self, self.ctx, transport)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.watch = self.launcher.watch
        self._curve = self.launcher.curve
        self._auth = start_authenticator(self.ctx, self._curve)
        try:
            self.num_gpu_blocks, self.max_model_len = self.launcher.start(
                client_count, local_clients, executor_class, log_stats, handshake_timeout_s,
                engine_log_level)
            self._use_front_end(self.launcher.front_ends[0])
            self._connect_coordinator(self.launcher.coord_addresses)
        except BaseException:
            self.shutdown()
            raise

    def _init_common(self, config: EngineConfig, client_index: int) -> None:
        self.config = config
        self.engine_index = 0
        pc = config.parallel_config
        # The engine indexes (DP ranks) this client talks to: all of them, or with
        # external load balancing only its own rank.
        self.ranks = ([pc.data_parallel_rank] if pc.data_parallel_external_lb
                      else list(range(pc.data_parallel_size)))
        self.num_engines = len(self.ranks)
        self.identities = [engine_identity(r) for r in self.ranks]
        self.identity = self.identities[0]
        self.router = RequestRouter(self.num_engines, client_index)
        self.client_index = client_index
        self._dead = False
        self._closed = False
        self._call_ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._max_message_bytes = config.transport_config.max_message_bytes
        # Utility calls waiting for their replies (settled by the output reader).
        self.pending_calls = PendingCalls()

    def _use_front_end(self, front_end: FrontEndSockets) -> None:
        """This client's own request and output sockets (bound in this process)."""
        assert front_end.input_socket is not None and front_end.output_socket is not None
        self.input_socket: zmq.Socket = front_end.input_socket
        self.output_socket: zmq.Socket = front_end.output_socket
        self.input_address = front_end.input_address
        self.output_address = front_end.output_address

    def _connect_coordinator(self, addresses: dict[str, str] | None) -> None:
        """With a DP coordinator: balance by its counts, follow its waves."""
        if addresses is not None:
            self.router.link = CoordinatorLink(
                self.ctx, addresses, self.config.parallel_config.data_parallel_lockstep,
                self._curve)

    def _owned_launcher(self) -> EngineLauncher:
        if not self._owner or self.launcher is None:
            raise RuntimeError("only the client that started the engines attaches or hands "
                               "over front-ends")
        return self.launcher

    def attach(self: _Client, client_index: int) -> _Client:
        """Another front-end (same class) on this client's engine; it does not own
        the engine process, so its ``shutdown`` leaves the engine running."""
        launcher = self._owned_launcher()
        front_end = launcher.front_ends.local(client_index)
        other = type(self).__new__(type(self))
        other._init_common(self.config, client_index)
        other._owner = False
        other._primary = self
        other.launcher = launcher
        other.ctx = self.ctx
        other._curve = self._curve
        other.num_gpu_blocks, other.max_model_len = self.num_gpu_blocks, self.max_model_len
        other._connect_coordinator(launcher.coord_addresses)
        other._use_front_end(front_end)
        other._post_init()
        return other

    def handoff(self, client_index: int) -> FrontEndHandoff:
        """What another process passes to ``connect`` to be front-end ``client_index``
        (one reserved with ``local_client_count``; client/remote_front_end.py)."""
        launcher = self._owned_launcher()
        front_end = launcher.front_ends.reserved(client_index)
        return FrontEndHandoff(self.config, client_index, len(launcher.front_ends),
                               front_end.input_address, front_end.output_address,
                               launcher.coord_addresses, self.num_gpu_blocks,
                               self.max_model_len, os.getpid(), self._curve)

    @classmethod
    def connect(cls: type[_Client], handoff: FrontEndHandoff,
                timeout_s: float = 60.0) -> _Client:
        """Attach to the engines as ``handoff.client_index``, in this process. The
        client does not own the engines: its ``shutdown`` leaves them running."""
        client = cls.__new__(cls)
        client._init_common(handoff.config, handoff.client_index)
        client._owner = False
        client._own_context = True
        client.ctx = new_context(handoff.config)
        client._curve = handoff.curve
        client._auth = start_authenticator(client.ctx, handoff.curve)
        client.num_gpu_blocks = handoff.num_gpu_blocks
        client.max_model_len = handoff.max_model_len
        try:
            front_ends = FrontEnds.for_handoff(client.ctx, handoff)
            client.watch = EngineWatch(client, client.ctx, front_ends, handoff.curve)
            client._use_front_end(front_ends[0])
            front_ends.await_hellos(client.num_engines, timeout_s)
            client.watch.watch_disconnects()
            client._connect_coordinator(handoff.coordinator_addresses)
            client._post_init()
        except BaseException:
            client.shutdown()
            raise
        return client

    def _post_init(self) -> None:
        """Set-up of the subclasses (output reader); runs for attached clients too."""

    @property
    def procs(self) -> list[Process]:
        """The engine processes (none with Ray, or attached from another process)."""
        return self.launcher.procs if self.launcher is not None else []

    @property
    def proc(self) -> Process | None:
        """The (first) engine process."""
        procs = self.procs
        return procs[0] if procs else None

    @property
    def coordinator(self) -> Process | None:
        """The DP coordinator process, when this process started one."""
        return self.launcher.coordinator if self.launcher is not None else None

    # -- sending -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError()
        if self._closed:
            raise RuntimeError("the client is shut down")

    def _add_frames(self, engine: int, request: EngineCoreRequest) -> list[bytes]:
        """The ADD to send, checked as the engine will decode it (types, bounds): a
        request the engine would refuse raises ``ValueError`` here, unsent."""
        return [self.identities[engine], _ADD, encode_request(self._encoder, request)]

    def _check_size(self, frames: list[bytes]) -> None:
        """The engine drops the connection on a message over its cap (a dead link):
        refuse it here instead."""
        size = len(frames[-1])
        if size > self._max_message_bytes:
            raise ValueError(f"a {size}-byte message is over the {self._max_message_bytes}-byte "
                             "message cap (zmq_max_message_bytes)")

    def _abort_frames(self, request_ids: list[str]) -> list[list[bytes]]:
        """One ABORT per engine that owns some of the ids (unknown ids go to all)."""
        return [[self.identities[e], _ABORT, self._encoder.encode(ids)]
                for e, ids in self.router.owners(request_ids).items()]

    def _utility_frames(self, method: str, args: tuple, fut: Any,
                        engine: int | None = None) -> tuple[int, list[list[bytes]]]:
        """The same call to every engine (data parallel: pause, sleep, ... apply to
        all), or to ``engine`` only; registers the pending reply."""
        signature_of(method)  # refuse early, locally, what the engine would refuse
        if engine is not None and not 0 <= engine < self.num_engines:
            raise ValueError(f"engine index {engine} is not in [0, {self.num_engines})")
        call_id = next(self._call_ids)
        payload = self._encoder.encode(
            UtilityRequest(self.client_index, call_id, method, list(args)))
        targets = range(self.num_engines) if engine is None else [engine]
        self.pending_calls.add(call_id, PendingCall(method, fut, replies_due=len(targets),
                                                    answering_rank=self.ranks[targets[0]]))
        return call_id, [[self.identities[e], _UTILITY, payload] for e in targets]

    def _fail_pending(self, queue_put) -> None:
        """The engine is dead: every waiter (outputs, utility calls) learns it now."""
        self._dead = True
        self._fail_waiters(queue_put, EngineDeadError())

    def _fail_waiters(self, put: Any, error: EngineDeadError) -> None:
        put(error)
        self.pending_calls.fail_all(error)

    def _on_frame(self, buf: memoryview, put: Any) -> bool:
        """One frame from the output socket: outputs go to ``put``, utility replies
        to their futures. False once the engine is dead. A frame that does not
        decode (or whose handling fails) is logged and dropped: one bad frame never
        stops the reader."""
        if len(buf) == len(ENGINE_CORE_DEAD) and bytes(buf) == ENGINE_CORE_DEAD:
            self._fail_pending(put)
            return False
        try:
            outs = self._decoder.decode(buf)
            if outs.utility_output is not None:
                self.pending_calls.settle(outs, single_engine=self.num_engines == 1)
                return True
            self.router.forget_finished(outs)
        except Exception as e:  # noqa: BLE001 - drop the frame, keep reading
            logger.warning("client %d dropped an output frame it could not read (%d bytes, "
                           "first bytes %r): %s", self.client_index, len(buf),
                           bytes(buf[:8]), e)
            return True
        put(outs)
        return True

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.router.link is not None:
            self.router.link.close()
        self._wake_on_shutdown()
        if not self._owner:
            if self._own_context:  # attached from another process
                self._release_context()
            return
        assert self.launcher is not None
        self.launcher.stop_engines()
        self._release_context()
        self.launcher.addresses.cleanup()

    def _release_context(self) -> None:
        self._join_socket_threads()
        if self._auth is not None:
            self._auth.stop()
        self._close_sockets()

    def _wake_on_shutdown(self) -> None:
        """Subclasses: whoever waits for outputs or a utility reply gets
        EngineDeadError (``_fail_waiters`` on their queue)."""

    def _join_socket_threads(self) -> None:
        """The threads that poll this context's sockets (output reader, remote-rank
        watch) see ``_closed`` within 200 ms; the context may only close their
        sockets after they are gone: zmq sockets are not thread-safe, and closing
        one another thread is polling crashed the process (a segfault in CI, on
        the Ray path, where shutdown has no processes to wait for first)."""
        reader = getattr(self, "_reader", None)
        if isinstance(reader, threading.Thread) and reader is not threading.current_thread():
            reader.join(timeout=2)
            if reader.is_alive():
                logger.warning("%s did not stop; closing its sockets anyway", reader.name)
        if self.watch is not None:
            self.watch.join()

    def _close_sockets(self) -> None:
        self.ctx.destroy(linger=0)


class SyncMPClient(MPClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._post_init()

    def _post_init(self) -> None:
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self._send_lock = threading.Lock()
        self.elastic = ElasticScaler(self)
        self._reader = threading.Thread(target=self._read_outputs, daemon=True,
                                        name="enginecore-client-output")
        self._reader.start()

    def _read_outputs(self) -> None:
        sock = self.output_socket
        while not self._closed:
            try:
                if not sock.poll(200):
                    continue
                frame = sock.recv(copy=False)
                if frame.more:  # our peers send single frames: drop the rest of this one
                    _drop_rest(sock, self.client_index)
                    continue
            except zmq.ZMQError:
                if self._closed:
                    break
                logger.exception("client %d: output socket error", self.client_index)
                time.sleep(0.01)  # not a hot loop if the error persists
                continue
            if not self._on_frame(frame.buffer, self.outputs_queue.put_nowait):
                break

    def _wake_on_shutdown(self) -> None:
        if hasattr(self, "outputs_queue"):  # not when start-up failed
            self._fail_waiters(self.outputs_queue.put_nowait, _shut_down())

    def _send(self, frames: list[bytes]) -> None:
        self._check_alive()
        self._check_size(frames)
        with self._send_lock:
            try:
                self.input_socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:
                raise EngineDeadError(f"could not send to the engine: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        engine = self.router.register(request)
        try:
            self._send(self._add_frames(engine, request))
        except BaseException:
            self.router.forget(request.request_id)
            raise
        self.router.sent(engine, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for frames in self._abort_frames(list(request_ids)):
            self._send(frames)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        if self._closed and self.outputs_queue.empty():
            raise _shut_down()
        item = self.outputs_queue.get(timeout=timeout)
        if isinstance(item, Exception):
            self.outputs_queue.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run an allow-listed method on every engine; engine 0's result."""
        return self._call(None, method, args, timeout)

    def call_utility_on(self, engine: int, method: str, *args: Any,
                        timeout: float | None = None) -> Any:
        """Run an allow-listed method on one engine (index into ``ranks``)."""
        return self._call(engine, method, args, timeout)

    def _call(self, engine: int | None, method: str, args: tuple,
              timeout: float | None) -> Any:
        return self._call_nowait(engine, method, args).result(timeout=timeout)

    def _call_nowait(self, engine: int | None, method: str, args: tuple) -> Future:
        fut: Future = Future()
        call_id, per_engine = self._utility_frames(method, args, fut, engine)
        try:
            for frames in per_engine:
                self._send(frames)
        except BaseException:
            self.pending_calls.discard(call_id)
            raise
        if self._dead and not fut.done():
            fut.set_exception(EngineDeadError())
        return fut

    def scale_elastic_ep(self, new_size: int, drain_timeout_s: float = 300.0,
                         timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving
        (client/elastic.py)."""
        self.elastic.scale(new_size, drain_timeout_s, timeout_s)

    def shutdown(self) -> None:
        super().shutdown()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2)


class AsyncMPClient(MPClient):
    """asyncio client: call it from one event loop."""

    # Until _post_init: a start that fails shuts down, and shutdown reads these.
    _queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._post_init()

    def _post_init(self) -> None:
        self._ainput = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._aoutput = zmq.asyncio.Socket.from_socket(self.output_socket)
        self._queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_task: asyncio.Task | None = None
        self.elastic = AsyncElasticScaler(self)

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self._queue = asyncio.Queue()
            self._loop = asyncio.get_running_loop()
            self._reader_task = self._loop.create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        assert self._queue is not None
        while not self._closed:
            try:
                frame = await self._aoutput.recv(copy=False)
                if frame.more:  # our peers send single frames: drop the rest of this one
                    _drop_rest(self.output_socket, self.client_index)
                    continue
            except asyncio.CancelledError:
                break
            except zmq.ZMQError:
                if self._closed:
                    break
                logger.exception("client %d: output socket error", self.client_index)
                await asyncio.sleep(0.01)
                continue
            if not self._on_frame(frame.buffer, self._queue.put_nowait):
                break

    def _wake_on_shutdown(self) -> None:
        queue, loop = self._queue, self._loop
        if queue is None or loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fail_waiters(queue.put_nowait, _shut_down())
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_waiters, queue.put_nowait, _shut_down())

    async def _send(self, frames: list[bytes]) -> None:
        self._check_alive()
        self._check_size(frames)
        self._ensure_reader()
        try:
            await self._ainput.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"could not send to the engine: {e}") from e

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        engine = self.router.register(request)
        try:
            await self._send(self._add_frames(engine, request))
        except BaseException:
            self.router.forget(request.request_id)
            raise
        self.router.sent(engine, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for frames in self._abort_frames(list(request_ids)):
            await self._send(frames)

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._closed and (self._queue is None or self._queue.empty()):
            raise _shut_down()
        self._ensure_reader()
        assert self._queue is not None
        item = await self._queue.get()
        if isinstance(item, Exception):
            self._queue.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run an allow-listed method on every engine; engine 0's result."""
        return await self._call_async(None, method, args)

    async def call_utility_on_async(self, engine: int, method: str, *args: Any) -> Any:
        """Run an allow-listed method on one engine (index into ``ranks``)."""
        return await self._call_async(engine, method, args)

    async def _call_async(self, engine: int | None, method: str, args: tuple) -> Any:
        fut = asyncio.get_running_loop().create_future()
        call_id, per_engine = self._utility_frames(method, args, fut, engine)
        try:
            for frames in per_engine:
                await self._send(frames)
        except BaseException:
            self.pending_calls.discard(call_id)
            raise
        return await fut

    async def scale_elastic_ep_async(self, new_size: int, drain_timeout_s: float = 300.0,
                                     timeout_s: float = 120.0) -> None:
        """Change the number of data-parallel ranks to ``new_size`` while serving
        (client/elastic.py)."""
        await self.elastic.scale_async(new_size, drain_timeout_s, timeout_s)

    def shutdown(self) -> None:
        task = getattr(self, "_reader_task", None)
        super().shutdown()  # wakes the waiters first
        if task is not None and not task.done():
            task.cancel()
        self._close_async_sockets()  # a front-end attached in process never gets there

    def _close_sockets(self) -> None:
        self._close_async_sockets()
        super()._close_sockets()

    def _close_async_sockets(self) -> None:
        """Close the asyncio wrappers before their context: closing takes their fds
        off the event loop's selector. Destroying the context alone left them
        registered, and the next client on the same loop, given the same fd
        numbers, never heard its engine."""
        for sock in (getattr(self, "_ainput", None), getattr(self, "_aoutput", None)):
            if sock is not None and not sock.closed:
                sock.close(linger=0)


def _drop_rest(sock: zmq.Socket, client_index: int) -> None:
    """A multi-frame message on an output socket is not ours: drop all of it."""
    while sock.get(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)
    logger.warning("client %d dropped a multi-frame message on its output socket",
                   client_index)
