"""Narrow interfaces (ports) the services take instead of concrete plumbing.

A service that publishes events takes a :class:`Publisher`; the real one is
:class:`fedsched.bus.Bus` (JetStream, message id = event id, so a repeated publish is never a
second message). Tests hand in a fake that records what was published and acknowledges (or
refuses) each item, so a service's rules run without NATS.

Time is the other seam: services take a :class:`fedsched.clock.Clock` for business time and,
where they judge liveness (heartbeat age, reclamation timers), a second ``Clock`` reading wall
time (:class:`fedsched.clock.SystemClock` live). Tests pass a fake clock they advance by hand.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence

from fedsched.events import Envelope

#: (subject, event, extra headers or None): one item of :meth:`Publisher.publish_many`.
PublishItem = tuple[str, Envelope, "dict[str, str] | None"]


class PublishResult(enum.Enum):
    """What became of one item of :meth:`Publisher.publish_many`. Only :attr:`ACKED` is true,
    so ``if ok:`` and ``all(results)`` read as before.

    * ``ACKED``: JetStream stored it (or had it already: same event id).
    * ``FAILED``: not acknowledged after retries (an outage); the caller keeps its local state
      unchanged and may try again on a later cycle.
    * ``REFUSED``: it can never be sent -- larger than the server's ``max_payload``, or refused
      by the server for itself -- and was dead-lettered on ``<prefix>.deadletter.<publisher>``
      with the reason; trying again would fail the same way, so the caller gives up on it.
    """

    ACKED = "acked"
    FAILED = "failed"
    REFUSED = "refused"

    def __bool__(self) -> bool:
        return self is PublishResult.ACKED


def retryable(result: "PublishResult | bool") -> bool:
    """True for a batch item that failed for now and may succeed later (not acked, not refused)."""
    return not result and result is not PublishResult.REFUSED


class Publisher(Protocol):
    """Publishes events durably (implemented by :class:`fedsched.bus.Bus`)."""

    async def publish(self, subject: str, event: Envelope, *, headers: dict[str, str] | None = None) -> Any:
        """Publish one event on ``subject``; returns the acknowledgement.

        Raises:
            UnavailableError: the event was not acknowledged (after retries).
            PayloadTooLargeError: it is larger than the bus carries (not sent).
        """
        ...

    async def publish_many(self, items: Sequence[PublishItem]) -> list[PublishResult]:
        """Publish several events in order; per item, a :class:`PublishResult` (fakes may
        answer plain bools: True = acked, False = failed).

        Never raises for one item's failure, and one item never fails another: a failed item's
        entry is ``FAILED`` and the caller keeps its local state unchanged for it (it is
        retried on a later cycle); an item that can never be sent is ``REFUSED`` (dead-lettered
        with the reason).
        """
        ...
