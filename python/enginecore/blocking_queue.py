"""FIFO queue whose blocking ``get`` releases the GIL (Python twin of
csrc/blocking_queue.cpp); ``make_blocking_queue`` picks the active path."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

from enginecore import _native

_WAKE_S = 0.1


class PyBlockingQueue:
    """Same interface as ``enginecore._C.BlockingQueue``: put / put_nowait /
    get(timeout) / get_nowait / peek / qsize / empty / len / bool / maxsize."""

    def __init__(self, maxsize: int = 0) -> None:
        self._maxsize = maxsize
        self._items: deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())

    def put(self, item: Any) -> None:
        with self._cond:
            if self._maxsize and len(self._items) >= self._maxsize:
                raise queue.Full
            self._items.append(item)
            self._cond.notify()

    put_nowait = put

    @property
    def maxsize(self) -> int:
        """The bound given at construction (0: unbounded); read-only, as natively."""
        return self._maxsize

    def get(self, timeout: float | None = None) -> Any:
        """Waits in 100 ms slices, as the native queue does: a signal that the
        kernel hands to another thread (SIGTERM to an idle engine) is only run by
        the main thread once it wakes; an endless wait slept through it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                wait = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.monotonic())
                if wait <= 0:
                    raise queue.Empty
                self._cond.wait(wait)
            return self._items.popleft()

    def get_nowait(self) -> Any:
        with self._cond:
            if not self._items:
                raise queue.Empty
            return self._items.popleft()

    def peek(self) -> Any:
        with self._cond:
            if not self._items:
                raise queue.Empty
            return self._items[0]

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def make_blocking_queue(maxsize: int = 0) -> Any:
    return _native.twin("BlockingQueue", PyBlockingQueue)(maxsize)
