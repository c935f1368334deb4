"""Server-sent events: the streaming response, and merging several generations.

``SSEResponse`` sends each bytes item of an async iterator as it comes and
watches the connection meanwhile: when the client disconnects, the task
streaming the body is cancelled where it waits (usually on the engine's next
output), the generation is closed, and the front-end aborts the request in the
engine, within one step. It is a bare ASGI app (no task group per request): the
server's per-token cost is one ``send`` per engine step and stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

_DONE = b"data: [DONE]\n\n"
_START_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                  (b"cache-control", b"no-cache")]


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class SSEResponse:
    def __init__(self, body: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]] = (),
                 end_with_done: bool = True) -> None:
        self.body = body
        self.headers = [*_START_HEADERS, *headers]
        # False: the body brings its own ``[DONE]`` (a relayed stream: enginecore proxy).
        self.final = _DONE if end_with_done else b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": self.final, "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            # The client went away; its generation is closed below (engine abort).
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
        except OSError:
            pass  # the connection broke while sending
        finally:
            watcher.cancel()
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(index of the stream, item) as items arrive from several async iterators;
    closing the merge cancels (and so aborts) the streams still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    running -= 1
                    continue
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
