"""Month-to-date spend per tenant, as admission needs it for budgets.

Two sources, per the contract with billing:

1. the NATS KV bucket ``<prefix>_spend`` (billing's figure), key ``<tenant>.<YYYY-MM>``, value
   the decimal amount spent that month, updated by billing after each usage insert. Where a key
   exists it is the truth for that tenant and month. Admission only reads it: it waits for
   billing to create the bucket and watches it from then on (:class:`SpendWatcher`);
2. ``usage.recorded`` events on ``<p>.billing.usage.<tenant>``, summed per tenant and calendar
   month (UTC) of the event's business time -- the fallback while billing keeps no KV figure
   for that month (:meth:`SpendBook.apply_event`, fed by admission's stream follower).

Money is :class:`~decimal.Decimal`; one currency per federation (the price catalog's).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from decimal import Decimal

import nats.errors
import nats.js.errors

from fedsched.bus import Bus
from fedsched.events import Envelope, EventType, UsageRecorded
from fedsched.tenancy import decimal_or_none

log = logging.getLogger(__name__)

BUCKET = "spend"


def month_of(epoch_s: float) -> str:
    """``YYYY-MM`` of a business time (UTC)."""
    return datetime.fromtimestamp(epoch_s, tz=UTC).strftime("%Y-%m")


class SpendBook:
    """Spend per (tenant, month) from the KV (preferred) and from usage events (fallback)."""

    def __init__(self) -> None:
        self.from_kv: dict[tuple[str, str], Decimal] = {}
        self.from_events: dict[tuple[str, str], Decimal] = {}

    def apply_event(self, env: Envelope) -> None:
        """Add a ``usage.recorded`` event's cost to its tenant's month."""
        if env.type != EventType.USAGE_RECORDED or not env.tenant:
            return
        cost = decimal_or_none(env.payload_as(UsageRecorded).cost)
        if cost is None:
            return
        key = (env.tenant, env.occurred_at.astimezone(UTC).strftime("%Y-%m"))
        self.from_events[key] = self.from_events.get(key, Decimal(0)) + cost

    def apply_kv(self, key: str, value: bytes | None) -> None:
        """Take billing's figure for ``<tenant>.<YYYY-MM>`` (None/empty/invalid = forget it)."""
        tenant, _, month = key.partition(".")
        if not tenant or len(month) != 7:
            return
        amount = decimal_or_none(value.decode("utf-8", "replace").strip()) if value else None
        if amount is None:
            self.from_kv.pop((tenant, month), None)
        else:
            self.from_kv[(tenant, month)] = amount

    def spend(self, tenant: str, month: str) -> Decimal:
        """Month-to-date spend of ``tenant`` in ``month`` (``YYYY-MM``)."""
        key = (tenant, month)
        if key in self.from_kv:
            return self.from_kv[key]
        return self.from_events.get(key, Decimal(0))

    def source(self, tenant: str, month: str) -> str:
        """Where :meth:`spend` comes from: ``kv`` or ``events``."""
        return "kv" if (tenant, month) in self.from_kv else "events"


class SpendWatcher:
    """Watches billing's spend bucket once it exists (polling for it every ``poll_s``)."""

    def __init__(self, bus: Bus, book: SpendBook, *, poll_s: float = 5.0) -> None:
        self.bus = bus
        self.book = book
        self.poll_s = poll_s
        self.watching = asyncio.Event()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    async def _wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def run(self) -> None:
        """Find the bucket, watch every key, re-watch after errors."""
        name = f"{self.bus.prefix}_{BUCKET}"
        while not self._stop.is_set():
            watcher = None
            try:
                try:
                    kv = await self.bus.js.key_value(name)
                except nats.js.errors.BucketNotFoundError:
                    await self._wait(self.poll_s)  # billing has not created it yet: events only
                    continue
                watcher = await kv.watchall()
                self.watching.set()
                while not self._stop.is_set():
                    try:
                        entry = await watcher.updates(timeout=1.0)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        continue
                    if entry is not None:
                        deleted = entry.operation in ("DEL", "PURGE")
                        self.book.apply_kv(entry.key, None if deleted else entry.value)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reconnects: watch again
                if self._stop.is_set():
                    break
                log.info("spend watch: %r; retrying", e)
                await self._wait(1.0)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:  # noqa: BLE001
                        pass
