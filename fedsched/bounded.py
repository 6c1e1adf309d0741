"""Containers that remember the newest entries only: what a service keeps of finished work.

A consumer that must recognise work it has finished (a redelivered placement, a late status)
keeps its keys, but not forever: :class:`RecentSet` and :class:`RecentDict` hold at most
``limit`` entries and forget the oldest inserted first. Memory is then bounded by the limit,
not by the history (issue 15 item 2). A key forgotten is treated as never seen by the caller,
so the limit is a retention that must exceed what can still arrive late (redeliveries come
within the stream's ack wait; an agent's rebuild reads its own subjects only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentSet(Generic[K]):
    """A set of at most ``limit`` keys (the newest added; re-adding a key makes it newest).

    Args:
        limit: entries kept (>= 1).

    Raises:
        ValueError: ``limit`` below 1.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._keys: OrderedDict[K, None] = OrderedDict()

    def add(self, key: K) -> None:
        """Add ``key`` (O(1)); the oldest key goes when the set is full."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def discard(self, key: K) -> None:
        """Remove ``key`` if present."""
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)


class RecentDict(OrderedDict, Generic[K, V]):
    """A dict of at most ``limit`` entries: setting a key makes it newest; the oldest go first.

    Args:
        limit: entries kept (>= 1).

    Raises:
        ValueError: ``limit`` below 1.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)
