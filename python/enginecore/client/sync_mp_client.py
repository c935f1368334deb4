"""SyncMPClient: the multiprocess client for blocking callers (LLM, tests): an output
thread and a queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from enginecore.client.elastic import ElasticScaler
from enginecore.client.mp_client_base import (
    MPClient,
    _drop_rest,
    _shut_down,
)
from enginecore.errors import EngineDeadError
from enginecore.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
)

logger = logging.getLogger(__name__)


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
