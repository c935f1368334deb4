"""The engine process's IO threads (mixed into EngineCoreProc).

* Input thread: one DEALER per front-end (and the DP coordinator). A message is
  tied to the connection it came in on: that front-end's index is the request's
  ``client_index`` (whatever the payload says), its request ids are scoped to it
  (``scoped_id``), its aborts can only name its own requests, and its utility
  replies go back to it. An ADD that does not decode is answered with an ERROR
  output when its request id can be read; other malformed messages are logged
  and dropped.
* Output thread: encodes into reused buffers and pushes to each front-end. An
  output that cannot be encoded fails only its request.
* Either thread dying (an exception, or leaving its loop while the engine runs)
  is the engine's death: the busy loop is told at once and the process exits, so
  every front-end gets ENGINE_CORE_DEAD / EngineDeadError.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from typing import Any

import msgspec
import zmq

from enginecore import _native
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    FinishReason,
    HandshakeInit,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
    decode_request,
    readable_request_id,
)
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.serial import OutputEncoder
from enginecore.transport import secure_client, set_heartbeats

logger = logging.getLogger(__name__)

# Frames at least this large go out zero-copy (tracked); smaller ones are copied.
ZERO_COPY_THRESHOLD = 64 * 1024
SHUTDOWN = object()
_ADD = EngineCoreRequestType.ADD
_ABORT = EngineCoreRequestType.ABORT
_UTILITY = EngineCoreRequestType.UTILITY
_START_DP_WAVE = EngineCoreRequestType.START_DP_WAVE
# Internal to the engine (never accepted from a socket): something the engine
# cannot live without failed; the busy loop raises with the payload's reason.
FATAL = EngineCoreRequestType.EXECUTOR_FAILED
# Internal: end these requests with ERROR, their answer was already sent.
FAIL_SILENTLY = object()
# Request ids of front-end i > 0 live in the engine as "\0<i>\0<id>"; front-end 0's
# ids are kept as they are (so they may not start with NUL).
_SCOPE = "\x00"


def scoped_id(client_index: int, request_id: str) -> str:
    """The engine-internal id of a front-end's request id (unique across front-ends)."""
    return request_id if client_index == 0 else f"{_SCOPE}{client_index}{_SCOPE}{request_id}"


def _scope_prefix_len(client_index: int) -> int:
    return len(str(client_index)) + 2


class EngineIO:
    """IO threads of EngineCoreProc; ``self`` is the engine."""

    def _start_io_threads(self, init: HandshakeInit) -> None:
        self._stop = threading.Event()
        # The coordinator (data parallel) is one more peer on each side: it sends
        # START_DP_WAVE like a front-end, and takes outputs addressed to client -1.
        inputs, outputs = list(init.input_addresses), list(init.output_addresses)
        self._coordinator_input = None
        if init.coordinator_input_address and init.coordinator_output_address:
            self._coordinator_input = len(inputs)
            inputs.append(init.coordinator_input_address)
            outputs.append(init.coordinator_output_address)
        self._io_ready = threading.Barrier(3, timeout=30)
        self.input_thread = self._io_thread("enginecore-input", self._input_loop, inputs)
        self.output_thread = self._io_thread("enginecore-output", self._output_loop, outputs)
        self._io_ready.wait()

    def _io_thread(self, name: str, target: Any, addresses: list[str]) -> threading.Thread:
        def run() -> None:
            try:
                target(addresses)
            except BaseException as e:  # noqa: BLE001 - reported as the engine's death
                self._io_thread_died(name, e)
                return
            if not self._stop.is_set():
                self._io_thread_died(name, RuntimeError("left its loop while the engine runs"))

        thread = threading.Thread(target=run, daemon=True, name=name)
        thread.start()
        return thread

    def _io_thread_died(self, name: str, error: BaseException) -> None:
        if self._stop.is_set():
            return
        why = f"engine {self.engine_index}: its {name} thread died: {type(error).__name__}: {error}"
        logger.error("%s\n%s", why, "".join(traceback.format_exception(error)))
        self._io_ready.abort()  # a start-up still waiting on the thread fails now
        self.input_queue.put_nowait((FATAL, why))

    # -- input -------------------------------------------------------------------------------
    def _input_loop(self, addresses: list[str]) -> None:
        tc = self.config.transport_config
        keys = tc.curve_keys
        sockets = []
        poller = zmq.Poller()
        for addr in addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            set_heartbeats(sock, addr, tc)
            secure_client(sock, addr, keys)
            sock.connect(addr)
            # An empty message registers this engine with the front-end's ROUTER.
            sock.send(b"")
            poller.register(sock, zmq.POLLIN)
            sockets.append(sock)
        index_of = {sock: i for i, sock in enumerate(sockets)}
        # The owning front-end going away (its connection closes: process death; on
        # TCP also a heartbeat timeout) ends the engine: it would serve nobody.
        owner_events = sockets[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(owner_events, zmq.POLLIN)
        self._io_ready.wait()
        decoders = (msgspec.msgpack.Decoder(list[str]), msgspec.msgpack.Decoder(UtilityRequest),
                    msgspec.msgpack.Decoder(StartDPWave))
        try:
            while not self._stop.is_set():
                try:
                    events = poller.poll(200)
                except zmq.ZMQError:
                    if self._stop.is_set():
                        break
                    raise
                for sock, _ in events:
                    if sock is owner_events:
                        self._owner_gone(owner_events, addresses[0])
                        continue
                    try:
                        frames = sock.recv_multipart(copy=True)
                    except zmq.Again:
                        continue
                    try:
                        self._dispatch_input(index_of[sock], frames, *decoders)
                    except Exception as e:  # noqa: BLE001 - bad input never kills the engine
                        logger.warning("engine %d dropped a malformed message (%d frames, first "
                                       "bytes %r): %s", self.engine_index, len(frames),
                                       frames[0][:8] if frames else b"", e)
        finally:
            sockets[0].disable_monitor()
            owner_events.close(linger=0)
            for sock in sockets:
                sock.close(linger=0)

    def _owner_gone(self, monitor: zmq.Socket, address: str) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED and not self._stop.is_set():
            logger.error("engine %d: the front-end at %s went away; shutting down",
                         self.engine_index, address)
            self.owner_gone = True
            self.input_queue.put_nowait((FATAL, f"the front-end at {address} went away"))

    def _dispatch_input(self, client: int, frames: list[bytes], abort_dec, util_dec,
                        wave_dec) -> None:
        if len(frames) != 2:
            raise ValueError(f"expected [type, payload], got {len(frames)} frames")
        try:
            kind = EngineCoreRequestType(frames[0])
        except ValueError:
            raise ValueError(f"unknown request type {frames[0][:4]!r}") from None
        payload = frames[1]
        if kind is _START_DP_WAVE:
            self.input_queue.put_nowait((_START_DP_WAVE, wave_dec.decode(payload)))
        elif client == self._coordinator_input:
            raise ValueError(f"the DP coordinator may not send {kind.name}")
        elif kind is _ADD:
            self._receive_add(client, payload)
        elif kind is _ABORT:
            ids = [scoped_id(client, rid) for rid in abort_dec.decode(payload)]
            self.aborts_queue.put_nowait(ids)  # applied before the running step's outputs
            self.input_queue.put_nowait((_ABORT, ids))
        elif kind is _UTILITY:
            call = util_dec.decode(payload)
            call.client_index = client  # the reply goes back where the call came from
            self.input_queue.put_nowait((_UTILITY, call))
        else:
            raise ValueError(f"front-ends may not send {kind.name}")

    def _receive_add(self, client: int, payload: bytes) -> None:
        """Decode and preprocess an ADD; a request that fails either is answered
        with ERROR (when its id can be read), so its caller never waits in vain."""
        try:
            req = decode_request(payload)
        except ValueError as e:
            rid = readable_request_id(payload)
            if rid is None:
                raise
            self._answer_error(client, scoped_id(client, rid), str(e))
            return
        rid = req.request_id
        if client == 0 and rid.startswith(_SCOPE):
            self._answer_error(0, rid, "request ids may not begin with a NUL character")
            return
        req.request_id = scoped_id(client, rid)
        req.client_index = client
        try:
            request, wave = self.preprocess_add_request(req, validated=True)
        except Exception as e:  # noqa: BLE001 - this request's failure only
            self._answer_error(client, req.request_id, f"{type(e).__name__}: {e}")
            return
        self.input_queue.put_nowait((_ADD, (request, wave)))

    def _answer_error(self, client: int, request_id: str, reason: str) -> None:
        logger.warning("engine %d answers request %r with ERROR: %s", self.engine_index,
                       request_id, reason)
        self.output_queue.put_nowait((client, EngineCoreOutputs(
            engine_index=self.engine_index, outputs=[EngineCoreOutput(
                request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)])))

    # -- output ------------------------------------------------------------------------------
    def _output_loop(self, addresses: list[str]) -> None:
        keys = self.config.transport_config.curve_keys
        sockets = []
        for addr in addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 4000)
            secure_client(sock, addr, keys)
            sock.connect(addr)
            sockets.append(sock)
        self._io_ready.wait()
        try:
            self._send_outputs(sockets)
        except BaseException:
            # Tell the front-ends before the thread goes (nobody else can send here).
            for sock in sockets:
                try:
                    sock.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            raise
        finally:
            for sock in sockets:
                sock.close()

    def _send_outputs(self, sockets: list[zmq.Socket]) -> None:
        encoder = OutputEncoder()
        in_flight: deque[tuple[zmq.MessageTracker, bytearray]] = deque()
        q = self.output_queue
        num_front_ends = self.client_count
        # A front-end drops the connection on a message over its cap: larger steps
        # go out one output per message (_split).
        cap = self.config.transport_config.max_message_bytes
        # Native path: a step's columns are encoded into a reused buffer and sent
        # on pyzmq's socket through the libzmq pyzmq loaded, without the GIL.
        ext = _native.extension()
        native_send = ext is not None and ext.libzmq_path() is not None
        handles = [sock.underlying for sock in sockets]
        logger.debug("output thread: step outputs sent by %s",
                     "the native sender" if native_send else "pyzmq")
        while True:
            item = q.get()
            if item is SHUTDOWN:
                return
            client, outs = item
            if outs is ENGINE_CORE_DEAD:
                for sock in sockets:
                    sock.send(ENGINE_CORE_DEAD)
                continue
            if not (0 <= client < len(sockets)
                    or (client == -1 and self._coordinator_input is not None)):
                logger.error("engine %d: outputs for unknown front-end %r dropped",
                             self.engine_index, client)
                continue
            if 0 < client < num_front_ends:
                _unscope(outs, _scope_prefix_len(client))
            sock = sockets[client]
            try:
                if native_send and type(outs) is ColumnarOutputs and ext.send_columnar(
                        handles[client], *encoder.columnar_args(outs), cap):
                    continue
                # Buffers zmq has finished sending go back to the encoder.
                while in_flight and in_flight[0][0].done:
                    encoder.release(in_flight.popleft()[1])
                buf = encoder.encode(outs)
            except (TypeError, ValueError, OverflowError) as e:
                logger.error("engine %d: outputs for front-end %d did not encode (%s); "
                             "isolating", self.engine_index, client, e)
                buf = None
            if buf is None or len(buf) > cap:
                for frame in self._split(client, outs, cap):
                    sock.send(frame, copy=True)
                continue
            if len(buf) < ZERO_COPY_THRESHOLD:
                sock.send(buf, copy=True)
                encoder.release(buf)
            else:
                tracker = sock.send(buf, copy=False, track=True)
                in_flight.append((tracker, buf))

    def _split(self, client: int, outs: Any, cap: int) -> list[bytes]:
        """A step's outputs that did not encode, or encode too large: one message
        per output. An output that does not encode, or alone passes the cap, becomes
        an ERROR answer for its request (which the busy loop then ends), and a
        utility result likewise a failure: nothing is lost, nothing killed."""
        encode = msgspec.msgpack.Encoder().encode
        engine = outs.engine_index
        if outs.utility_output is not None:
            u = outs.utility_output
            try:
                frame = encode(outs)
            except (TypeError, ValueError, OverflowError) as e:
                frame, why = None, f"{type(e).__name__}: {e}"
            else:
                why = f"{len(frame)} bytes, over the {cap}-byte message cap"
            if frame is None or len(frame) > cap:
                frame = encode(EngineCoreOutputs(engine_index=engine, utility_output=UtilityOutput(
                    u.call_id, f"the result could not be sent: {why}")))
            return [frame]
        frames, failed = [], []
        stats = outs.scheduler_stats
        for out in outs.outputs:
            try:
                frame = encode(EngineCoreOutputs(engine_index=engine, outputs=[out]))
                why = None if len(frame) <= cap else f"{len(frame)} bytes, over the {cap}-byte " \
                                                     "message cap (zmq_max_message_bytes)"
            except (TypeError, ValueError, OverflowError) as e:
                why = f"{type(e).__name__}: {e}"
            if why is not None:
                frame = encode(EngineCoreOutputs(engine_index=engine, outputs=[EngineCoreOutput(
                    out.request_id, [], finish_reason=FinishReason.ERROR,
                    stop_reason=f"its output could not be sent: {why}")]))
                if out.finish_reason is None:
                    failed.append(scoped_id(client, out.request_id) if client > 0
                                  else out.request_id)
            frames.append(frame)
        if stats is not None:
            frames.append(encode(EngineCoreOutputs(engine_index=engine, scheduler_stats=stats)))
        if failed:
            self.input_queue.put_nowait((FAIL_SILENTLY, failed))
        return frames


def _unscope(outs: Any, k: int) -> None:
    """Outputs for front-end i > 0 carry its own request ids again."""
    if type(outs) is ColumnarOutputs:
        outs.request_ids = [None if r is None else r[k:] for r in outs.request_ids]
        for o in outs.specials:
            o.request_id = o.request_id[k:]
        return
    for o in outs.outputs:
        o.request_id = o.request_id[k:]


__all__ = ["FAIL_SILENTLY", "FATAL", "SHUTDOWN", "EngineIO", "scoped_id"]
