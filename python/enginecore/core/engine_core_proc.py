"""EngineCoreProc: EngineCore in its own process behind ZMQ.

Threads: the input thread receives from every front-end (DEALER), decodes and
preprocesses requests; the main thread runs the busy loop; the output thread
encodes outputs into reused buffers and pushes them (PUSH) to the front-end
they belong to. docs/protocol.md describes the messages.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import msgspec
import zmq

from enginecore import _native
from enginecore.blocking_queue import make_blocking_queue
from enginecore.config import EngineConfig
from enginecore.core.engine_core import EngineCore
from enginecore.core.utility import convert_args, signature_of
from enginecore.executor.abstract import Executor
from enginecore.interrupts import ignore_sigint
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeMessage,
    HandshakeReady,
    UtilityOutput,
    UtilityRequest,
    StartDPWave,
    UtilityResult,
    engine_identity,
)
from enginecore.request import Request
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.serial import OutputEncoder

logger = logging.getLogger(__name__)

# Frames at least this large go out zero-copy (tracked); smaller ones are copied.
ZERO_COPY_THRESHOLD = 64 * 1024
_SHUTDOWN = object()
_ADD = EngineCoreRequestType.ADD
_ABORT = EngineCoreRequestType.ABORT
_UTILITY = EngineCoreRequestType.UTILITY
_EXECUTOR_FAILED = EngineCoreRequestType.EXECUTOR_FAILED
_START_DP_WAVE = EngineCoreRequestType.START_DP_WAVE


class EngineCoreProc(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        executor_class: type[Executor] | None = None,
        log_stats: bool = False,
        engine_index: int = 0,
        handshake_timeout_s: float = 60.0,
        init: HandshakeInit | None = None,
    ) -> None:
        """``handshake_address``: run the HELLO/INIT/READY handshake there; or, with
        ``init`` (Ray: addresses known up front), start from it with no handshake."""
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        _native.set_native(config.use_native)  # before the queues pick their path
        # The busy loop blocks on the input queue when idle and the output thread on
        # the output queue: natively with the GIL released. (An earlier measurement
        # had the native output queue ~20% slower; 500-round medians do not.)
        self.input_queue = make_blocking_queue()
        self.output_queue = make_blocking_queue()
        self.ctx = zmq.Context()
        try:
            if init is not None:
                self._start_from(init, config, executor_class, log_stats)
            else:
                self._start(config, handshake_address, executor_class, log_stats,
                            engine_index, handshake_timeout_s)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        # Long-lived start-up objects leave the GC's view: fewer, cheaper collections.
        gc.collect()
        gc.freeze()

    def _start(self, config, handshake_address, executor_class, log_stats, engine_index,
               handshake_timeout_s) -> None:
        self._handshake = self.ctx.socket(zmq.DEALER)
        self._handshake.setsockopt(zmq.IDENTITY, self.identity)
        self._handshake.setsockopt(zmq.LINGER, 5000)
        self._handshake.connect(handshake_address)
        self._hs_encoder = msgspec.msgpack.Encoder()
        self._hs_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
        self._send_handshake(HandshakeHello(engine_index, os.getpid()))
        if not self._handshake.poll(int(handshake_timeout_s * 1000)):
            raise TimeoutError(
                f"engine {engine_index}: the front-end at {handshake_address} did not send its "
                f"init message within {handshake_timeout_s:g} s of HELLO"
            )
        init = self._hs_decoder.decode(self._handshake.recv())
        if not isinstance(init, HandshakeInit):
            raise RuntimeError(f"engine {engine_index}: expected INIT, got {type(init).__name__}")
        try:
            self._build(init, config, executor_class, log_stats)
        except BaseException as e:
            self._send_handshake(HandshakeFailed(engine_index, f"{type(e).__name__}: {e}"))
            raise
        self._start_io_threads(init)
        self._send_handshake(HandshakeReady(
            engine_index, self.config.cache_config.num_gpu_blocks or 0,
            self.scheduler.max_model_len))
        self._handshake.close()

    def _start_from(self, init: HandshakeInit, config, executor_class, log_stats) -> None:
        self._build(init, config, executor_class, log_stats)
        self._start_io_threads(init)

    def _build(self, init: HandshakeInit, config, executor_class, log_stats) -> None:
        """The engine itself, once INIT is known (both start-up paths)."""
        self.client_count = len(init.output_addresses)
        super().__init__(config, executor_class, log_stats,
                         executor_fail_callback=self._on_executor_failure)
        self._init_data_parallel(init)

    def _init_data_parallel(self, init: HandshakeInit) -> None:
        """DPEngineCoreProc joins its DP group here (before READY)."""

    def _send_handshake(self, msg: HandshakeMessage) -> None:
        self._handshake.send(self._hs_encoder.encode(msg))

    def _on_executor_failure(self) -> None:
        self.input_queue.put_nowait((_EXECUTOR_FAILED, None))

    # -- IO threads ------------------------------------------------------------------------
    def _start_io_threads(self, init: HandshakeInit) -> None:
        # Native path: step outputs stay columns and the output thread writes
        # msgpack from them in C++ (serial.py); the Python path builds objects.
        self.scheduler.columnar_outputs = _native.native_available()
        self._stop = threading.Event()
        # The coordinator (data parallel) is one more peer on each side: it sends
        # START_DP_WAVE like a front-end, and takes outputs addressed to client -1.
        inputs, outputs = list(init.input_addresses), list(init.output_addresses)
        if init.coordinator_input_address and init.coordinator_output_address:
            inputs.append(init.coordinator_input_address)
            outputs.append(init.coordinator_output_address)
        self.input_thread = threading.Thread(
            target=self._input_loop, args=(inputs,), daemon=True, name="enginecore-input")
        self.output_thread = threading.Thread(
            target=self._output_loop, args=(outputs,), daemon=True, name="enginecore-output")
        ready = threading.Barrier(3, timeout=30)
        self._io_ready = ready
        self.input_thread.start()
        self.output_thread.start()
        ready.wait()

    def _input_loop(self, addresses: list[str]) -> None:
        sockets = []
        poller = zmq.Poller()
        for addr in addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            # ZMTP heartbeats: a front-end that vanishes (another node, kill -9) drops
            # the connection within seconds instead of never.
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.connect(addr)
            # An empty message registers this engine with the front-end's ROUTER.
            sock.send(b"")
            poller.register(sock, zmq.POLLIN)
            sockets.append(sock)
        # The owning front-end going away ends the engine (a headless node would
        # otherwise serve nobody forever).
        owner_events = sockets[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(owner_events, zmq.POLLIN)
        self._io_ready.wait()
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
        wave_decoder = msgspec.msgpack.Decoder(StartDPWave)
        put = self.input_queue.put_nowait
        while not self._stop.is_set():
            try:
                events = poller.poll(200)
            except zmq.ZMQError:
                break
            for sock, _ in events:
                if sock is owner_events:
                    self._owner_gone(owner_events, addresses[0])
                    continue
                try:
                    frames = sock.recv_multipart()
                except zmq.ZMQError:
                    continue
                try:
                    self._dispatch_input(frames, put, add_decoder, abort_decoder,
                                         utility_decoder, wave_decoder)
                except Exception as e:  # noqa: BLE001 - bad input never kills the engine
                    logger.warning("engine %d dropped a malformed message (%d frames, "
                                   "first bytes %r): %s", self.engine_index, len(frames),
                                   frames[0][:8] if frames else b"", e)
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
            self.input_queue.put_nowait((_EXECUTOR_FAILED, f"the front-end at {address} "
                                                           "went away"))

    def _dispatch_input(self, frames, put, add_dec, abort_dec, util_dec, wave_dec) -> None:
        if len(frames) != 2:
            raise ValueError(f"expected [type, payload], got {len(frames)} frames")
        try:
            kind = EngineCoreRequestType(frames[0])
        except ValueError:
            raise ValueError(f"unknown request type {frames[0][:4]!r}") from None
        payload = frames[1]
        if kind is _ADD:
            req = add_dec.decode(payload)
            request, wave = self.preprocess_add_request(req)
            put((_ADD, (request, wave)))
        elif kind is _ABORT:
            ids = abort_dec.decode(payload)
            self.aborts_queue.put_nowait(ids)  # applied before the running step's outputs
            put((_ABORT, ids))
        elif kind is _UTILITY:
            put((_UTILITY, util_dec.decode(payload)))
        elif kind is _START_DP_WAVE:
            put((_START_DP_WAVE, wave_dec.decode(payload)))
        else:
            raise ValueError(f"front-ends may not send {kind.name}")

    def _output_loop(self, addresses: list[str]) -> None:
        sockets = []
        for addr in addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 4000)
            sock.connect(addr)
            sockets.append(sock)
        self._io_ready.wait()
        encoder = OutputEncoder()
        in_flight: deque[tuple[zmq.MessageTracker, bytearray]] = deque()
        q = self.output_queue
        # Native path: a step's columns are encoded into a reused buffer and sent
        # on pyzmq's socket through the libzmq pyzmq loaded, without the GIL.
        ext = _native.extension()
        native_send = ext is not None and ext.libzmq_path() is not None
        handles = [sock.underlying for sock in sockets]
        logger.debug("output thread: step outputs sent by %s",
                     "the native sender" if native_send else "pyzmq")
        while True:
            item = q.get()
            if item is _SHUTDOWN:
                break
            client, outs = item
            if outs is ENGINE_CORE_DEAD:
                for sock in sockets:
                    sock.send(ENGINE_CORE_DEAD)
                continue
            if native_send and type(outs) is ColumnarOutputs:
                ext.send_columnar(handles[client], *encoder.columnar_args(outs))
                continue
            # Buffers zmq has finished sending go back to the encoder.
            while in_flight and in_flight[0][0].done:
                encoder.release(in_flight.popleft()[1])
            buf = encoder.encode(outs)
            sock = sockets[client]
            if len(buf) < ZERO_COPY_THRESHOLD:
                sock.send(buf, copy=True)
                encoder.release(buf)
            else:
                tracker = sock.send(buf, copy=False, track=True)
                in_flight.append((tracker, buf))
        for sock in sockets:
            sock.close()

    # -- busy loop -----------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _idle(self) -> bool:
        """Nothing to step: the busy loop blocks on the input queue."""
        return not self._has_work()

    def _has_work(self) -> bool:
        return bool(self.batch_queue) or (
            self.scheduler.has_schedulable_work() and not self.model_executor.is_sleeping)

    def _process_input_queue(self) -> None:
        q = self.input_queue
        while self._idle():
            # Idle: block (GIL released) until a front-end sends something.
            self._handle_client_request(*q.get())
        while not q.empty():
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            self._handle_client_request(*item)

    def _process_engine_step(self) -> bool:
        outputs, model_executed = self.step_fn()
        for client, outs in outputs.items():
            outs.engine_index = self.engine_index
            self.output_queue.put_nowait((client, outs))
        self.post_step(model_executed)
        return model_executed

    def _handle_client_request(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if kind is _ADD:
            request, wave = payload
            self._add_from_client(request, wave)
        elif kind is _ABORT:
            self.abort_requests(payload)
        elif kind is _UTILITY:
            self._run_utility(payload)
        elif kind is _EXECUTOR_FAILED:
            raise RuntimeError(payload or "the executor reported a failure")
        elif kind is _START_DP_WAVE:
            self._handle_start_wave(payload)

    def _add_from_client(self, request: Request, wave: int) -> None:
        try:
            self.add_request(request, wave)
        except (ValueError, TypeError) as e:
            # Duplicate live id or a bad request: the first request is untouched.
            logger.warning("engine %d rejected request %r: %s", self.engine_index,
                           request.request_id, e)

    def _handle_start_wave(self, msg: StartDPWave) -> None:
        logger.debug("engine %d ignores START_DP_WAVE %d (not data parallel)",
                     self.engine_index, msg.wave)

    def _run_utility(self, call: UtilityRequest) -> None:
        self._reply_utility(call, self._call_utility(call))

    def _call_utility(self, call: UtilityRequest) -> UtilityOutput:
        out = UtilityOutput(call.call_id)
        try:
            signature_of(call.method)  # refuses anything off the allow-list
            args = convert_args(call.method, call.args)
            out.result = UtilityResult(getattr(self, call.method)(*args))
        except Exception as e:  # noqa: BLE001 - the failure goes back to the caller
            logger.warning("utility %s failed: %s", call.method, e)
            out.failure_message = f"{call.method} failed: {type(e).__name__}: {e}"
        return out

    def _reply_utility(self, call: UtilityRequest, out: UtilityOutput) -> None:
        if not 0 <= call.client_index < self.client_count:
            logger.warning("utility call %d names unknown client %d; dropped", call.call_id,
                           call.client_index)
            return
        self.output_queue.put_nowait((call.client_index, EngineCoreOutputs(
            engine_index=self.engine_index, utility_output=out)))

    # -- shutdown ----------------------------------------------------------------------------------
    def send_engine_dead(self) -> None:
        self.output_queue.put_nowait((None, ENGINE_CORE_DEAD))

    def shutdown(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.output_queue.put_nowait(_SHUTDOWN)
            self.output_thread.join(timeout=5)
            self.input_thread.join(timeout=2)
            stuck = [t.name for t in (self.output_thread, self.input_thread) if t.is_alive()]
        else:
            stuck = []
        super().shutdown()
        if stuck:
            # Closing sockets under a live IO thread can hang in zmq_ctx_term; the
            # process is exiting anyway (run_engine_core ends with os._exit).
            logger.warning("engine %d: %s still running at shutdown; leaving the zmq context "
                           "to the process exit", self.engine_index, ", ".join(stuck))
            return
        self.ctx.destroy(linger=0)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the front-end process that started us is gone (no orphans)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            logger.warning("parent process %d is gone; engine shutting down", parent_pid)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(1)


class _Shutdown(BaseException):
    pass


class RankRemoved(BaseException):
    """This data-parallel rank left the group in a rescale; the process exits cleanly."""


def run_engine_core(
    config: EngineConfig,
    handshake_address: str,
    executor_class: type[Executor] | None = None,
    log_stats: bool = False,
    engine_index: int = 0,
    handshake_timeout_s: float = 60.0,
    parent_pid: int | None = None,
    log_level: int = logging.WARNING,
    visible_devices: str | None = None,
) -> None:
    """Entry point of the engine process."""
    if visible_devices is not None:
        # Before anything imports torch's CUDA runtime: this rank sees only its device.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s engine{engine_index} "
                        "%(name)s: %(message)s")

    def on_signal(signum: int, frame: Any) -> None:
        raise _Shutdown(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    if parent_pid is None:
        signal.signal(signal.SIGINT, on_signal)
    else:
        ignore_sigint()  # Ctrl-C is the front-end's; it stops us (interrupts.py)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="enginecore-parent-watch").start()
    engine: EngineCoreProc | None = None
    exit_code = 0
    try:
        cls = EngineCoreProc
        if config.parallel_config.data_parallel_size > 1:
            from enginecore.core.dp_engine_core_proc import DPEngineCoreProc

            cls = DPEngineCoreProc
        engine = cls(config, handshake_address, executor_class, log_stats, engine_index,
                     handshake_timeout_s)
        engine.run_busy_loop()
    except _Shutdown as e:
        logger.info("engine %d shutting down on %s", engine_index, e)
    except RankRemoved:
        logger.info("engine %d left the data-parallel group; exiting", engine_index)
    except BaseException:
        exit_code = 1
        logger.error("engine %d died:\n%s", engine_index, traceback.format_exc())
        if engine is not None and hasattr(engine, "_stop"):
            engine.send_engine_dead()
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except BaseException:  # noqa: BLE001
                logger.exception("engine %d shutdown failed", engine_index)
    # Everything is closed: leave without interpreter finalization, where library
    # finalizers (torch, zmq) have been seen to stall a dying engine for seconds.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
