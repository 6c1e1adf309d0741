"""Dispatch tables: how a consumer maps an event type to its handler.

Every consumer of bus events declares one :class:`EventTable`: the :class:`~fedsched.events.EventType`
members it handles (type -> handler) and those it receives but ignores on purpose. Together they
are the types the consumer *knows*; ``tests/unit/fedsched/test_event_dispatch.py`` checks per consumer that
the types it must know (e.g. every terminal job status, :data:`~fedsched.events.TERMINAL_STATUSES`)
are covered, so a new event type cannot be forgotten silently.

Routing a type (:meth:`EventTable.route`) gives its handler, or None when the consumer does not
handle it. A type this build does not know at all (a newer producer during a rolling upgrade) is
also None, and is counted in the consumer's :class:`SkippedTypes` (exposed on the service's
status) instead of being dead-lettered; the audit log still stores such events.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, Iterable, Mapping, TypeVar

from fedsched.events import EventType, known_type

log = logging.getLogger(__name__)

H = TypeVar("H")


class SkippedTypes:
    """Count of the unknown event types one consumer skipped (per type name).

    Counts skip decisions: a batch redelivered after a failure counts its unknown events again.

    Args:
        consumer: the consumer's name (for logs), e.g. ``scheduler-events``.
    """

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer
        self.counts: Counter[str] = Counter()

    def skip(self, type_: str) -> None:
        """Count one skipped event of unknown type ``type_`` (logged on its first occurrence)."""
        if type_ not in self.counts:
            log.warning("%s: skipping events of unknown type %r (from a newer producer?)", self.consumer, type_)
        self.counts[type_] += 1

    @property
    def total(self) -> int:
        """Events skipped, all types."""
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """Type -> events skipped (for status endpoints)."""
        return dict(sorted(self.counts.items()))


@dataclass(frozen=True)
class EventTable(Generic[H]):
    """One consumer's dispatch table.

    Attributes:
        handlers: event type -> handler (any callable shape; the consumer calls it).
        ignores: known types this consumer receives (or may receive) and does nothing with.

    Raises:
        ValueError: a type both handled and ignored.
    """

    handlers: Mapping[EventType, H]
    ignores: frozenset[EventType] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        both = set(self.handlers) & set(self.ignores)
        if both:
            raise ValueError(f"event types both handled and ignored: {sorted(both)}")

    @property
    def known(self) -> frozenset[EventType]:
        """Every type this consumer handles or ignores on purpose."""
        return frozenset(self.handlers) | self.ignores

    def uncovered(self, required: Iterable[EventType]) -> frozenset[EventType]:
        """The types of ``required`` this table neither handles nor ignores (empty = covered)."""
        return frozenset(required) - self.known

    def route(self, type_: str, skipped: SkippedTypes | None = None) -> H | None:
        """The handler of ``type_`` (an envelope's ``type``), or None.

        Args:
            type_: the event type as decoded (a known :class:`EventType` value or an unknown name).
            skipped: where to count a type this build does not know (None = do not count, for
                tables a consumer consults after its own routing already counted).
        """
        handler = self.handlers.get(type_)  # type: ignore[call-overload] - EventType hashes as its str
        if handler is None and skipped is not None and known_type(type_) is None:
            skipped.skip(type_)
        return handler
