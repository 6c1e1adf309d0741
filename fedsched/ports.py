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

from typing import Any, Protocol, Sequence

from fedsched.events import Envelope

#: (subject, event, extra headers or None): one item of :meth:`Publisher.publish_many`.
PublishItem = tuple[str, Envelope, "dict[str, str] | None"]


class Publisher(Protocol):
    """Publishes events durably (implemented by :class:`fedsched.bus.Bus`)."""

    async def publish(self, subject: str, event: Envelope, *, headers: dict[str, str] | None = None) -> Any:
        """Publish one event on ``subject``; returns the acknowledgement.

        Raises:
            UnavailableError: the event was not acknowledged (after retries).
        """
        ...

    async def publish_many(self, items: Sequence[PublishItem]) -> list[bool]:
        """Publish several events in order; per item, whether it was acknowledged.

        Never raises for one item's failure: that item's entry is False and the caller keeps
        its local state unchanged for it (it is retried on a later cycle).
        """
        ...
