"""Admission: a two-lane waiting queue and a KV-token budget.

Interactive requests are admitted ahead of batch ones, FIFO within a lane. A request reserves
prompt + max_tokens cache tokens when admitted, so a running request can always finish: memory
never runs out mid-stream and nothing has to be preempted. A request whose reservation exceeds
the whole budget (or one slot) is refused up front; one that fits later waits. Admission is
strict: if the head of the highest non-empty lane does not fit yet, nothing behind it jumps
ahead, so large requests are not starved by a stream of small ones.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterator, TypeVar

LANES = ("interactive", "batch")

T = TypeVar("T")


class WaitingQueue(Generic[T]):
    def __init__(self):
        self._lanes: dict[str, deque[T]] = {lane: deque() for lane in LANES}

    def push(self, lane: str, item: T) -> None:
        self._lanes[lane].append(item)

    def head(self) -> T | None:
        for lane in LANES:
            if self._lanes[lane]:
                return self._lanes[lane][0]
        return None

    def pop(self) -> T:
        for lane in LANES:
            if self._lanes[lane]:
                return self._lanes[lane].popleft()
        raise IndexError("empty")

    def remove(self, item: T) -> bool:
        for lane in LANES:
            try:
                self._lanes[lane].remove(item)
                return True
            except ValueError:
                pass
        return False

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def __iter__(self) -> Iterator[T]:
        for lane in LANES:
            yield from self._lanes[lane]


class TokenBudget:
    """KV-cache tokens reserved by running requests."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def fits(self, tokens: int) -> bool:
        return self.used + tokens <= self.total

    def reserve(self, tokens: int) -> None:
        self.used += tokens

    def release(self, tokens: int) -> None:
        self.used -= tokens
