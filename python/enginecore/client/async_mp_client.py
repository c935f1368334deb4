"""AsyncMPClient: the multiprocess client for asyncio callers (AsyncLLM, the server)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio

from enginecore.client.elastic import AsyncElasticScaler
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
