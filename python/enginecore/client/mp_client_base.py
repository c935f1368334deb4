"""The multiprocess client's common part (``MPClient``): sockets, frames, sends, the
output reader's decoding, attach / handoff / connect. The sync and asyncio clients
(``sync_mp_client.py``, ``async_mp_client.py``) add their output readers and calls;
``mp_client.py`` gathers the three under the name every caller imports.

The client binds the sockets (IPC in a private 0700 directory by default, or
TCP on loopback), spawns the engine, runs the handshake and watches the
process: if it dies for any reason (crash, kill -9, OOM) every waiter gets
``EngineDeadError`` at once, not after a timeout.

Its parts are owned objects: ``router``, ``pending_calls``, ``elastic``, and for
the client that starts the engines its ``launcher`` (client/engine_launcher.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from enginecore.client.core_client import EngineCoreClient
from enginecore.client.dp_link import CoordinatorLink
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



def _drop_rest(sock: zmq.Socket, client_index: int) -> None:
    """A multi-frame message on an output socket is not ours: drop all of it."""
    while sock.get(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)
    logger.warning("client %d dropped a multi-frame message on its output socket",
                   client_index)
