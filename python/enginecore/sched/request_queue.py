"""Waiting queues: FCFS and priority (lower ``priority`` value first, then arrival)."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from enginecore.request import Request


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def prepend_request(self, request: Request) -> None:
        """Put a preempted request back at the front."""
        self._q.appendleft(request)

    def peek_request(self) -> Request:
        return self._q[0]

    def pop_request(self) -> Request:
        return self._q.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """Heap ordered by (priority, arrival_time, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    # A preempted request goes back by its own priority: the heap order decides.
    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy | str) -> FCFSRequestQueue | PriorityRequestQueue:
    policy = SchedulingPolicy(policy)
    return PriorityRequestQueue() if policy is SchedulingPolicy.PRIORITY else FCFSRequestQueue()
