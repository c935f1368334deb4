"""EngineCoreProc: EngineCore in its own process behind ZMQ.

Threads: the input thread receives from every front-end (DEALER), decodes and
preprocesses requests; the main thread runs the busy loop; the output thread
encodes outputs into reused buffers and pushes them (PUSH) to the front-end
they belong to (core/engine_io.py). docs/protocol.md describes the messages.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
from typing import Any

import msgspec
import zmq

from enginecore import _native
from enginecore.blocking_queue import make_blocking_queue
from enginecore.config import EngineConfig
from enginecore.core.engine_core import EngineCore
from enginecore.core.engine_io import FAIL_SILENTLY, FATAL, SHUTDOWN, EngineIO
from enginecore.core.utility import convert_args, signature_of
from enginecore.executor.abstract import Executor
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequestType,
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeMessage,
    HandshakeReady,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
    engine_identity,
)
from enginecore.request import Request, RequestStatus
from enginecore.transport import new_context, secure_client

logger = logging.getLogger(__name__)

_ADD = EngineCoreRequestType.ADD
_ABORT = EngineCoreRequestType.ABORT
_UTILITY = EngineCoreRequestType.UTILITY
_START_DP_WAVE = EngineCoreRequestType.START_DP_WAVE


class EngineCoreProc(EngineIO, EngineCore):
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
        # Set when the owning front-end is gone (its connection closed, its process
        # exited): the engine then also removes the front-end's private IPC directory.
        self.owner_gone = False
        self._utility_encoder = msgspec.msgpack.Encoder()
        self.ctx = new_context(config)
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
        secure_client(self._handshake, handshake_address, config.transport_config.curve_keys)
        self._handshake.connect(handshake_address)
        self._hs_encoder = msgspec.msgpack.Encoder()
        self._hs_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
        self._send_handshake(HandshakeHello(engine_index, os.getpid()))
        if not self._handshake.poll(int(handshake_timeout_s * 1000)):
            raise TimeoutError(
                f"engine {engine_index}: the front-end at {handshake_address} did not send its "
                f"init message within {handshake_timeout_s:g} s of HELLO"
                + (" (over TCP with CURVE: are these the keys of the front-end's current "
                   "launch?)" if config.transport_config.curve_keys is not None
                   and handshake_address.startswith("tcp://") else "")
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
        self.input_queue.put_nowait((FATAL, None))

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

    def _handle_client_request(self, kind: Any, payload: Any) -> None:
        if kind is _ADD:
            request, wave = payload
            self._add_from_client(request, wave)
        elif kind is _ABORT:
            self.abort_requests(payload)
        elif kind is _UTILITY:
            self._run_utility(payload)
        elif kind is FATAL:
            raise RuntimeError(payload or "the executor reported a failure")
        elif kind is _START_DP_WAVE:
            self._handle_start_wave(payload)
        elif kind is FAIL_SILENTLY:
            self.scheduler.finish_requests(payload, RequestStatus.FINISHED_ERROR, silent=True)

    def _add_from_client(self, request: Request, wave: int) -> None:
        try:
            self.add_request(request, wave)
        except (ValueError, TypeError) as e:
            # A live id sent again by the same front-end (ids are scoped per front-end,
            # so front-ends never collide; the client refuses this with ValueError
            # before sending): the first request is untouched, and an ERROR answer
            # under the same id would end it for its caller, so the copy is dropped.
            logger.warning("engine %d dropped request %r: %s", self.engine_index,
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
            # Typed (and bounded) arguments: a bad one is refused before the call,
            # so no utility does half its work and then fails.
            args = convert_args(call.method, call.args)
            result = UtilityResult(getattr(self, call.method)(*args))
            self._utility_encoder.encode(result)  # an unencodable result fails here, not later
            out.result = result
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

    def shutdown(self, process_exit: bool = False, front_end_gone: bool = False) -> None:
        """Stop the IO threads, the executor, then the sockets. ``process_exit``: the
        process leaves by ``os._exit`` next, which frees the zmq context: terminating it
        here was seen to block (until the parent watch's hard exit, ~4 s after a kill -9
        of the front-end). ``front_end_gone``: nobody reads the last outputs, so the
        output thread (perhaps blocked sending to a peerless socket) is not waited for."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.output_queue.put_nowait(SHUTDOWN)
            self.output_thread.join(timeout=0.1 if front_end_gone else 5)
            self.input_thread.join(timeout=0.1 if front_end_gone else 2)
            stuck = [t.name for t in (self.output_thread, self.input_thread) if t.is_alive()]
        else:
            stuck = []
        super().shutdown()
        if process_exit:
            return
        if stuck:
            # Closing sockets under a live IO thread can hang in zmq_ctx_term; the
            # process is exiting anyway (run_engine_core ends with os._exit).
            logger.warning("engine %d: %s still running at shutdown; leaving the zmq context "
                           "to the process exit", self.engine_index, ", ".join(stuck))
            return
        self.ctx.destroy(linger=0)


class RankRemoved(BaseException):
    """This data-parallel rank left the group in a rescale; the process exits cleanly."""
