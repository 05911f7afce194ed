"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival, order))."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from minivllm.core.request import Request


class RequestQueue(Protocol):
    def push(self, req: Request) -> None: ...
    def push_front(self, req: Request) -> None: ...  # a preempted request goes back first
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def __len__(self) -> int: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)


class PriorityQueue:
    """Lower priority value first, then earlier arrival. Removal is lazy (tombstones)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()
        self._entry: dict[str, int] = {}  # request id -> order number of its live heap entry
        self._removed: set[int] = set()  # order numbers of removed entries still in the heap
        self._size = 0

    def push(self, req: Request) -> None:
        order = next(self._order)
        self._entry[req.request_id] = order
        heapq.heappush(self._heap, (req.priority, req.arrival_time, order, req))
        self._size += 1

    push_front = push  # a preempted request keeps its place by priority and arrival

    def _skip_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def peek(self) -> Request:
        self._skip_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._skip_removed()
        self._size -= 1
        req = heapq.heappop(self._heap)[3]
        self._entry.pop(req.request_id, None)
        return req

    def remove(self, req: Request) -> None:
        self._removed.add(self._entry.pop(req.request_id))
        self._size -= 1

    def __len__(self) -> int:
        return self._size


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
