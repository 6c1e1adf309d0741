"""The billing service: job events -> priced usage lines in ClickHouse, and budget spend.

Two durable consumers feed one writer:

* ``billing`` on ``<p>.status.>``: ended attempts -> ``compute`` lines;
* ``billing-transfer`` on ``<p>.placements.>``: every placement goes into the placement book
  (NATS KV bucket ``<p>_placements``, key ``<job>.<attempt>.<shard>``, the
  :class:`~services.billing.usage.PlacementRecord` as JSON; a put of the same record is
  idempotent); placements that move data -> ``transfer`` lines.

Agents speak only for themselves (issue 14, :mod:`fedsched.trust`): a status is priced only
when its envelope matches the subject it came on and the book holds a placement of exactly
that attempt on exactly that region and cluster, and the line's tenant, project, card model,
GPUs and prices come from that placement, only the times from the agent. A status whose
placement the book lacks waits (the batch is handed back, like an outage) while the placement
consumer has not yet read up to it -- both consumers read one stream, in which the placement
always precedes its statuses -- and is refused once it has: refused messages bill nothing,
and are dead-lettered with the reason and recorded as ``security.rejected_message``.

A placement whose scheduler-lease ``fencing_token`` is stale (a former active scheduler's late
order, refused by its agent too: :func:`~fedsched.lease.stale_order`) is neither booked nor
billed: a higher token precedes it in the stream (:class:`~fedsched.lease.StreamFencing`, kept in
memory: judged in stream order, because the consumer handles messages out of stream order after
a batch is handed back), or it is below the lease's current tenure, read from the KV bucket
before each batch of placements (:func:`~fedsched.lease.read_tenure`), and stored in the stream
after that tenure began -- so a restarted billing, which has seen no token yet, refuses it too,
and agrees with the agent however late either reads it.

What a line is and costs is the pure core's business (:mod:`services.billing.usage`). The cycle
of one batch (:meth:`BillingService.write`):

0. put the batch's placements into the placement book, and screen its statuses against the
   book (refusals dead-lettered and recorded; :meth:`BillingService.screen`);
1. price the batch's events into lines (pure; a status with its placement);
2. insert the lines not yet in ``usage`` (:meth:`~fedsched.store.Store.insert_new`, keyed on
   ``usage_id`` = the event id), so redelivery, restarts and replays never bill twice;
3. for every (tenant, month) the batch touches, recompute the month-to-date spend from
   ``usage`` and put it in the NATS KV bucket ``<p>_spend`` under ``<tenant>.<YYYY-MM>`` (a
   decimal string): recomputed, never incremented, so a redelivered batch cannot double it;
4. publish ``usage.recorded`` per line (event id derived from the line's, so JetStream drops a
   repeat) in the trace of the event it prices (its ``traceparent`` handed on);
5. return -- the consumer acknowledges only now.

A ClickHouse or NATS outage raises :class:`~fedsched.errors.UnavailableError`: the consumer
backs off and redelivers, the backlog waits in JetStream (:meth:`BillingService.lag`). The two
consumers share one lock, so spend is always computed after the insert it must include.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
import json
import logging
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Awaitable, Callable

import nats.errors
import nats.js.errors
import orjson

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, DurableConsumer, publish_pipelined
from fedsched.dispatch import SkippedTypes
from fedsched.errors import DecodeError, UnavailableError
from fedsched.gctune import YOUNG_THRESHOLD, tune_for_service
from fedsched.events import (MONEY_LIMIT, Envelope, EventType, JobPlaced, JobStatus, UsageRecorded, business_event_id,
                             make_event)
from fedsched.metrics import WriterMetrics
from fedsched.lease import StreamFencing, Tenure, read_tenure
from fedsched.ports import retryable
from fedsched.pricing import PriceCatalog, money
from fedsched.store import AsyncStore
from fedsched.trust import PlacedAttempt, Rejection, check_placement, check_subject, rejection_events
from services.billing.usage import (BILLING_EVENTS, ENDINGS, USAGE_COLUMNS, PlacementRecord, UsageLine,
                                    compute_line, placement_key, placement_record, spend_key)

log = logging.getLogger(__name__)

#: KV bucket (``<prefix>_spend``) holding month-to-date spend per tenant.
SPEND_BUCKET = "spend"

#: KV bucket (``<prefix>_placements``): billing's placement book (see the module docstring).
PLACEMENT_BUCKET = "placements"

#: What a NATS KV key may be (nats.py's ``_is_key_valid``; no leading or trailing dot).
_KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")

_SPEND_SQL = """
    SELECT sum(cost) FROM {db}.usage
    WHERE tenant = {tenant:String}
      AND ended_at >= {start:DateTime64(3, 'UTC')} AND ended_at < {end:DateTime64(3, 'UTC')}"""


#: the compute line of an attempt (shard) already billed: its ending event and end
_ENDED_SQL = """
    SELECT usage_id, ended_at FROM {db}.usage
    WHERE line = 'compute' AND job_id = {job:String} AND attempt = {attempt:UInt32} AND shard = {shard:UInt32}
    ORDER BY ended_at LIMIT 1"""

#: attempts whose end billing remembers without asking the store (oldest forgotten first)
ENDED_MEMORY = 100_000


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of ``YYYY-MM`` (aware UTC)."""
    year, mon = (int(x) for x in month.split("-"))
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=UTC)
    return start, end


def unpriceable(env: Envelope, why: str) -> str:
    """The dead-letter reason of an event billing cannot price: ``<type> <event id> cannot be
    billed: <why>`` (typed words, never an exception's raw text)."""
    return f"{env.type} {env.event_id} cannot be billed: {why}"


class BillingService:
    """Prices ended attempts and data transfers; publishes budget spend.

    Args:
        bus: NATS connection.
        store: the ClickHouse store (async wrapper).
        prices: the price catalog.
        batch / max_wait_s / linger_s / ack_wait_s: consumer batching (size and time bounds:
            usage lines reach ClickHouse within about ``linger_s``)
            and redelivery: a batch is redelivered ``ack_wait_s`` after the writer's last progress
            report (a writer that died: its successor or another replica bills it within that;
            see :class:`~fedsched.bus.DurableConsumer`). Lines are keyed on ``usage_id`` and spend
            is recomputed, so a redelivered batch bills nothing twice.
        metrics: where insert latency is timed (default: a registry of its own).
        tenure: reads the scheduler lease's current tenure (default
            :func:`~fedsched.lease.read_tenure` on ``bus``).
        gc_young_threshold: :meth:`run` freezes the start-up heap and raises the collector's
            young threshold to this (:func:`~fedsched.gctune.tune_for_service`, process-wide;
            0 = leave the collector alone).
    """

    def __init__(self, bus: Bus, store: AsyncStore, prices: PriceCatalog, *, batch: int = 1000,
                 max_wait_s: float = 0.5, linger_s: float = 0.5, ack_wait_s: float = 5.0,
                 metrics: WriterMetrics | None = None,
                 tenure: Callable[[], Awaitable[Tenure | None]] | None = None,
                 gc_young_threshold: int = YOUNG_THRESHOLD) -> None:
        self.bus = bus
        self.metrics = metrics if metrics is not None else WriterMetrics("billing")
        self.store = store
        self.prices = prices
        kw = dict(batch=batch, max_wait_s=max_wait_s, linger_s=linger_s, ack_wait_s=ack_wait_s)
        self.consumer = DurableConsumer(bus, "EVENTS", "billing", [bus.subjects.all("status")], self.write, **kw)
        self.transfer_consumer = DurableConsumer(bus, "EVENTS", "billing-transfer", [bus.subjects.all("placements")],
                                                 self.write, **kw)
        self.consumers = [self.consumer, self.transfer_consumer]
        self.rows = 0
        self.skipped = SkippedTypes("billing")  #: events of unknown types (newer producers) skipped
        self._lock = asyncio.Lock()
        self._kv = None
        self._book = None
        self.rejected = 0  #: statuses refused by the trust checks
        #: attempt (shard) key -> (ending event id, end time) of recent billed ends (:meth:`_already_ended`)
        self._ended: OrderedDict[str, tuple[str, datetime]] = OrderedDict()
        self.fencing = StreamFencing()  #: scheduler-lease fencing of placements (see the module docstring)
        self.stale_orders = 0
        self._read_tenure = tenure if tenure is not None else (lambda: read_tenure(bus))
        self.tenure: Tenure | None = None  #: the scheduler lease's tenure, as last read
        self.gc_young_threshold = gc_young_threshold

    @property
    def highest_token(self) -> int:
        """The highest scheduler-lease fencing token seen on a placement."""
        return self.fencing.highest

    def _stale(self, d: Delivery) -> bool:
        token = d.envelope.payload_as(JobPlaced).fencing_token
        return self.fencing.judge(token, d, self.tenure) is not None

    def stale_token(self, d: Delivery) -> bool:
        """Whether the placement ``d`` carries a stale scheduler-lease fencing token
        (:func:`~fedsched.lease.stale_order` in stream order and against :attr:`tenure`: a former
        active scheduler's late order, neither booked nor billed)."""
        if self._stale(d):
            self.stale_orders += 1
            return True
        return False

    def lines(self, deliveries: list[Delivery], placements: dict[str, PlacementRecord]) -> list[UsageLine]:
        """The priced lines of a batch (step 1; pure), given the placements of its statuses
        (key :func:`~services.billing.usage.placement_key`; statuses without one are skipped).

        Raises:
            DecodeError: an event that cannot be priced or whose line the store cannot hold
                (:func:`unpriceable`): the consumer dead-letters that event with this reason
                (the rest of its batch is billed), never with a raw exception's text.
        """
        out = []
        for d in deliveries:
            env = d.envelope
            if env.type == EventType.JOB_PLACED and self.stale_token(d):
                continue
            price = BILLING_EVENTS.route(env.type, self.skipped)
            if price is None:
                continue
            try:
                if price is compute_line:
                    placed = placements.get(placement_key(env.job_id, env.attempt, env.payload_as(JobStatus).shard))
                    line = compute_line(env, placed, self.prices) if placed is not None else None
                else:
                    line = price(env, self.prices)
            except (ArithmeticError, ValueError, OverflowError) as e:  # a time or amount past what we compute
                raise DecodeError(unpriceable(env, "its times or amounts are outside what billing computes with "
                                                   f"({type(e).__name__})")) from e
            if line is not None:
                if not 0 <= line.cost < MONEY_LIMIT:
                    raise DecodeError(unpriceable(env, f"its cost {line.cost} is outside [0, 10^12) "
                                                       f"(usage.cost is Decimal(18, 6))"))
                out.append(line)
        return out

    async def _placement_book(self):
        if self._book is None:
            self._book = await self.bus.key_value(PLACEMENT_BUCKET, ttl_s=self.bus.max_age_s)
        return self._book

    async def record_placements(self, deliveries: list[Delivery]) -> None:
        """Put the batch's placements into the placement book (idempotent), all puts of the
        batch in flight at once; returns once every one is confirmed.

        Raises:
            UnavailableError: NATS unreachable.
        """
        records = []
        for d in deliveries:
            if d.envelope.type == EventType.JOB_PLACED and self._stale(d):
                continue  # a former active scheduler's late order: not booked (counted by lines())
            if (r := placement_record(d.envelope)) is not None:
                records.append(r)
        if not records:
            return
        try:
            await self._placement_book()  # the bucket exists (made on first use)
            await self._put_all([(r.key, orjson.dumps(r.to_json())) for r in records])
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            self._book = None
            raise UnavailableError(f"cannot record placements: {e!r}") from e

    async def _put_all(self, entries: list[tuple[str, bytes]], timeout_s: float = 10.0) -> None:
        """Put every (key, value) into the placement book, pipelined: all are published
        (JetStream ``publish_async`` on the bucket's ``$KV.<bucket>.<key>`` subjects, what a KV
        put publishes) before any acknowledgement is awaited -- one flush and one wait per batch,
        not a request and its reply timer per placement (issue 15) -- and return once JetStream
        acknowledged every one.

        Raises:
            asyncio.CancelledError: cancelled (also while waiting for a slot of the client's
                pending-ack limit); the puts not yet acknowledged are given up.
            nats.js.errors.InvalidKeyError: a key a KV bucket cannot hold.
            nats.js.errors.TooManyStalledMsgsError: the client's pending-ack limit held a put
                back longer than ``timeout_s``.
            asyncio.TimeoutError: some put was not acknowledged within ``timeout_s``.
            nats.errors.Error / OSError: a put failed (the first failure is raised).
        """
        bucket = f"{self.bus.prefix}_{PLACEMENT_BUCKET}"
        futures = []
        try:
            for key, value in entries:
                if not _KV_KEY.fullmatch(key) or key.startswith(".") or key.endswith("."):
                    raise nats.js.errors.InvalidKeyError(key)
                # a cancellation while the client's pending-ack limit holds the put back is one
                # (nats.py would raise TooManyStalledMsgsError: a nak, and the consumer kept running)
                futures.append(await publish_pipelined(self.bus.js, f"$KV.{bucket}.{key}", value, headers=None,
                                                       wait_stall=timeout_s))
            if not futures:
                return
            done, pending = await asyncio.wait(futures, timeout=timeout_s)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        for f in pending:
            f.cancel()
        if pending:
            raise asyncio.TimeoutError(f"{len(pending)} of {len(futures)} placement puts not acknowledged "
                                       f"within {timeout_s:g} s")
        for f in futures:
            if (e := f.exception()) is not None:
                raise e

    async def _lookup(self, key: str, *, leader: bool = False) -> PlacementRecord | None:
        """The placement book's record of ``key`` (None: none). ``leader``: read it from the
        bucket's stream leader (``STREAM.MSG.GET``) instead of the KV get, which on a replicated
        bucket may be answered by a replica that has not yet received the newest put -- a
        placement recorded a moment ago would then look "never placed"."""
        try:
            if leader:
                bucket = f"{self.bus.prefix}_{PLACEMENT_BUCKET}"
                raw = await self.bus.js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
                value = raw.data
            else:
                book = await self._placement_book()
                value = (await book.get(key)).value
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError):
            return None
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            self._book = None
            raise UnavailableError(f"cannot read the placement book: {e!r}") from e
        try:
            return PlacementRecord.from_json(json.loads(value))
        except (KeyError, ValueError, TypeError):
            return None

    async def _placements_read_past(self, sequence: int) -> bool:
        """Whether the placement consumer has recorded every placement up to stream ``sequence``."""
        try:
            info = await self.bus.js.consumer_info(self.transfer_consumer.stream, self.transfer_consumer.durable)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            raise UnavailableError(f"cannot read the placement consumer's progress: {e!r}") from e
        if int(info.num_pending or 0) == 0 and int(info.num_ack_pending or 0) == 0:
            return True
        return bool(info.ack_floor and (info.ack_floor.stream_seq or 0) >= sequence)

    async def _wait_for_placements(self, sequence: int, timeout_s: float = 2.0) -> bool:
        """Wait (up to ``timeout_s``, polling every 50 ms) until the placement consumer has
        recorded every placement up to stream ``sequence``; True when it has."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self._placements_read_past(sequence):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def screen(self, deliveries: list[Delivery]) -> tuple[list[Delivery], dict[str, PlacementRecord]]:
        """The statuses of a batch that may be billed, with their placements; the others are
        refused (:meth:`reject`). See the module docstring.

        Raises:
            UnavailableError: a status's placement may still be on its way, or NATS is unreachable.
        """
        keep: list[Delivery] = []
        placements: dict[str, PlacementRecord] = {}
        refused: list[Rejection] = []
        batch_ends: dict[str, tuple[str, datetime]] = {}  # key -> (ending event id, its time) of this batch
        for d in deliveries:
            env = d.envelope
            reason = check_subject(self.bus.prefix, d.subject, env) if d.subject else None
            if reason is None and env.type in ENDINGS:
                shard = env.payload_as(JobStatus).shard
                key = placement_key(env.job_id, env.attempt, shard)
                placed = placements.get(key) or await self._lookup(key)
                if placed is None and await self._wait_for_placements(d.stream_sequence):
                    placed = await self._lookup(key, leader=True)  # recorded meanwhile (or never placed)
                if placed is None:
                    if not await self._placements_read_past(d.stream_sequence):
                        raise UnavailableError(f"waiting for the placement of {key} (placement consumer behind)")
                    reason = f"attempt {env.attempt} (shard {shard}) of {env.job_id} was never placed"
                else:
                    reason = check_placement(env, True, PlacedAttempt(placed.attempt, placed.region, placed.cluster),
                                             placed.attempt)
                    if reason is None:
                        reason = await self._already_ended(key, env, batch_ends)
                    if reason is None:
                        placements[key] = placed
                        batch_ends[key] = (env.event_id, env.occurred_at)
            if reason is not None:
                refused.append(Rejection(self.consumer.durable, d.subject, env, reason, d.stream_sequence,
                                         headers=tuple(sorted(d.headers.items()))))
                continue
            keep.append(d)
        if refused:
            await self.reject(refused)
        return keep, placements

    async def _already_ended(self, key: str, env: Envelope, batch_ends: dict) -> str | None:
        """Why the ending status ``env`` of the attempt (shard) ``key`` may not be billed: that
        attempt already ended under another event (a second ``job.finished`` with another time, a
        ``job.failed`` after it: one attempt interval gets at most one compute line, README's
        exactly-once rows); None when it did not (or ``env`` is that very end, redelivered).
        Looked up in this batch, then a bounded memory of recent ends, then the ``usage`` table
        (across restarts). An end that produced no line (an attempt never started) is known only
        to the memory.

        Raises:
            UnavailableError: ClickHouse unreachable.
        """
        ended = batch_ends.get(key) or self._ended.get(key)
        if ended is None:
            job_id, attempt, shard = env.job_id, env.attempt, env.payload_as(JobStatus).shard
            row = (await self.store.query(_ENDED_SQL.replace("{db}", self.store.store.database),
                                          {"job": job_id, "attempt": attempt, "shard": shard})).rows
            if row:
                ended = (str(row[0][0]), row[0][1])
                self._remember_end(key, *ended)
        if ended is None or ended[0] == env.event_id:
            return None
        return f"attempt already ended at {ended[1].isoformat()} ({ended[0]})"

    def _remember_ends(self, ends: list[Envelope]) -> None:
        """Remember the ends of a written batch (after its lines were committed)."""
        for env in ends:
            self._remember_end(placement_key(env.job_id, env.attempt, env.payload_as(JobStatus).shard),
                               env.event_id, env.occurred_at)

    def _remember_end(self, key: str, event_id: str, at: datetime) -> None:
        """Keep the end of attempt ``key`` in the bounded memory (:data:`ENDED_MEMORY`)."""
        self._ended[key] = (event_id, at)
        self._ended.move_to_end(key)
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    async def reject(self, refused: list[Rejection]) -> None:
        """Dead-letter the refused statuses and record them as security events.

        Raises:
            UnavailableError: NATS did not acknowledge.
        """
        now = refused[0].envelope.occurred_at.timestamp()
        items = [(subject, event, None) for r in refused for subject, event in rejection_events(self.bus.subjects, r, now)]
        for r in refused:
            log.warning("billing: refused %s on %s: %s", r.envelope.type, r.subject, r.reason)
        if not all(await self.bus.publish_many(items)):
            raise UnavailableError("could not record refused statuses; will retry")
        self.rejected += len(refused)

    async def write(self, deliveries: list[Delivery]) -> None:
        """Bill one batch (steps 1-4 of the module docstring); return only once all is committed.

        Placements of the batch are recorded in the placement book first, then its statuses are
        screened against the book (:meth:`screen`).

        Raises:
            UnavailableError: ClickHouse or NATS unreachable (retried by the consumer).
            DecodeError: a payload does not validate (dead-lettered by the consumer).
        """
        placements = [d for d in deliveries if d.envelope.type == EventType.JOB_PLACED]
        if placements:
            self.tenure = await self._read_tenure()  # UnavailableError: the batch is retried
        await self.record_placements(placements)
        statuses = [d for d in deliveries if d.envelope.type != EventType.JOB_PLACED]
        statuses, placed = await self.screen(statuses)
        lines = self.lines(placements + statuses, placed)
        ends = [d.envelope for d in statuses if d.envelope.type in ENDINGS]
        if not lines:
            self._remember_ends(ends)
            return
        async with self._lock:
            with self.metrics.time_insert("usage"):
                self.rows += await self.store.insert_new("usage", [ln.row() for ln in lines], USAGE_COLUMNS,
                                                         "usage_id")
            await self.publish_spend({(ln.tenant, ln.month) for ln in lines})
        self._remember_ends(ends)
        # a line's usage_id is the id of the event it prices: that event's trace is the line's
        causes = {d.envelope.event_id: telemetry.trace_headers(d.headers) for d in deliveries}
        await self._publish_recorded(lines, causes)

    async def spend(self, tenant: str, month: str) -> Decimal:
        """Month-to-date spend of ``tenant`` in ``month`` (``YYYY-MM``), from ``usage``.

        Raises:
            UnavailableError: ClickHouse unreachable.
        """
        start, end = month_bounds(month)
        total = (await self.store.query(_SPEND_SQL.replace("{db}", self.store.store.database),
                                        {"tenant": tenant, "start": start, "end": end})).scalar()
        return money(total or 0)

    async def publish_spend(self, keys: set[tuple[str, str]]) -> None:
        """Recompute and put the spend of each (tenant, month) in the KV bucket (step 3).

        Raises:
            UnavailableError: ClickHouse or NATS unreachable.
        """
        for tenant, month in sorted(keys):
            amount = await self.spend(tenant, month)
            try:
                if self._kv is None:
                    self._kv = await self.bus.key_value(SPEND_BUCKET)
                await self._kv.put(spend_key(tenant, month), format(amount, "f").encode())
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
                self._kv = None
                raise UnavailableError(f"cannot publish spend of {tenant} {month}: {e!r}") from e

    async def _publish_recorded(self, lines: list[UsageLine], causes: dict[str, dict[str, str]]) -> None:
        items = []
        for ln in lines:
            usage = UsageRecorded(gpu_seconds=ln.gpu_seconds, cost=str(ln.cost), currency=ln.currency)
            event = make_event(EventType.USAGE_RECORDED, usage, producer="billing",
                               occurred_at=ln.ended_at.timestamp(),
                               event_id=business_event_id(ln.usage_id, "usage"), region=ln.region, zone=ln.zone,
                               cluster=ln.cluster, tenant=ln.tenant, project=ln.project, job_id=ln.job_id,
                               attempt=ln.attempt, actor="billing")
            items.append((self.bus.subjects.usage(ln.tenant), event, causes.get(ln.usage_id)))
        ok = await self.bus.publish_many(items)
        if any(retryable(r) for r in ok):  # a refused one (too large) is dead-lettered: retrying cannot help
            raise UnavailableError("could not publish usage.recorded; will retry (rows are already idempotent)")

    async def lag(self) -> int:
        """Events not yet billed (both consumers), from the server's consumer info."""
        return sum([await c.lag() for c in self.consumers])

    async def run(self) -> None:
        """Consume until stopped; first, unless ``gc_young_threshold`` is 0, tune the
        process's garbage collector (:func:`~fedsched.gctune.tune_for_service`)."""
        if self.gc_young_threshold:
            tune_for_service(self.gc_young_threshold)
        await asyncio.gather(*(c.run() for c in self.consumers))

    def stop(self) -> None:
        """Stop after the current batches."""
        for c in self.consumers:
            c.stop()
