"""A leader lease in NATS JetStream KV, and its fencing token.

Several replicas of a singleton service (the scheduler) run; one is *active*: the one holding
the lease, a record under one key of a KV bucket (``<prefix>_leases``, key e.g. ``scheduler``).
The rules (:class:`Lease`) are those of Kubernetes' client-go leader election
(``tools/leaderelection``), on a compare-and-set store instead of a Lease object:

* **acquire** -- the key is absent: ``create`` (JetStream: expected last subject sequence 0);
  the key holds a record released by its holder (``holder == ""``), or a record whose revision
  has not changed for ``ttl_s`` seconds *as observed by this replica* on its own clock:
  ``update(last=<that revision>)``. Observed time, never the writer's timestamp, decides expiry,
  so clocks of different hosts need not agree (client-go's ``observedTime``).
* **renew** -- the holder writes its record again every ``renew_every_s`` with
  ``update(last=<its last revision>)``; any other writer in between makes it fail: the lease is
  lost at once.
* **validity** -- the holder considers itself active until ``renew started + ttl_s -
  margin_s`` of its last successful write (a renewal that cannot reach NATS does not extend it);
  a standby can take over only ``ttl_s`` after it *saw* that write, which happened after it was
  started: the two never overlap (clocks may drift by less than ``margin_s`` per ``ttl_s``).
* **fencing token** -- the KV revision of the write that acquired the lease (a KV revision is
  the bucket stream's sequence: strictly increasing across holders). Renewals keep the token.
  Whatever the active replica orders carries it; receivers refuse a token lower than the
  highest they have seen (Kleppmann, "How to do distributed locking", 2016), which stops a
  paused former holder whose orders arrive late. The bucket must never be deleted: a new one
  would count revisions from 1 again, below the tokens already on the bus.
* **what receivers read** (:func:`read_tenure`, :func:`stale_order`) -- a receiver that has
  not yet seen an order of the new holder would still take the old one's; so it also reads the
  lease key itself: the current *tenure* is its fencing token and the server time it began
  (the acquiring write's JetStream timestamp). Renewals carry both in the record (``token``,
  ``since``: copied from the server, never the holder's clock); the acquiring write carries
  neither (it is its own revision and time). An order is stale when its token is below the
  highest seen on the stream, or below the current tenure's token *and stored in the stream
  after that tenure began*: an order the former holder published while it held the lease is
  not refused just because it is read late, so every receiver (agent, billing, admission,
  audit), whenever it reads the order, agrees on it.
* **tenure history** -- the current tenure alone misses an order of tenure t1 stored after t2
  began and judged after t3 began by a receiver that saw nothing of t2 (t1 < t3, but it was
  stored before t3 began). So every record also carries the recent earlier tenures
  (``tenures``: ``(token, since)``, oldest first, at most :data:`TENURE_HISTORY`): an acquiring
  write carries its predecessor's list plus the tenure of the record it replaces (its
  ``token``/``since``, or -- a record that began a tenure itself, an acquisition or a release --
  its own revision and stream time); renewals and releases carry their tenure's list on. An
  order with token ``t`` is stale iff some tenure with a token above ``t`` -- the current one or
  a remembered one -- began at or before the order was stored (:func:`stale_order`). Orders
  older than the remembered tenures are judged by the oldest remembered one (and by the
  stream-order rule of :class:`StreamFencing`).
* **forged tokens** (:func:`unissued`) -- a holder writes its tenure to the bucket before it
  publishes, so a legit order's token is never above the current tenure's token as read after
  the order was fetched. A token above it was issued by no tenure (a forged order, e.g. 2^62 with
  the scheduler's credentials): it is refused and never taken as the highest token seen, which
  would otherwise make every later real order stale, for good once re-read from the stream.
* **release** -- a holder that stops writes ``holder = ""`` (CAS on its revision), so a
  standby takes over without waiting ``ttl_s``; to receivers the release begins a tenure of
  nobody (token = its revision): an order the releaser stores after it is stale.
* **resume** -- a replica that lost the lease only because its renewals could not reach the
  store (e.g. the KV stream electing a leader) and finds its own last write still the newest
  starts a new tenure at once (CAS on that revision, a new token), instead of waiting ``ttl_s``.

nats.py semantics used (``nats/js/kv.py``): ``create`` = ``update(last=0)`` (re-creating over a
delete marker), ``update(last=N)`` raises ``KeyWrongLastSequenceError`` when the key's last
revision is not N; both return the new revision.

Seam: :class:`LeaseStore` (three methods); :class:`NatsLeaseStore` is the real one, tests use a
fake with the same compare-and-set rules. Time comes from a :class:`~fedsched.clock.Clock`
(wall or monotonic seconds; a fake in tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import nats.errors
import nats.js.errors

from fedsched.clock import Clock
from fedsched.errors import UnavailableError

log = logging.getLogger(__name__)


#: earlier tenures a lease record carries (``LeaseRecord.tenures``): orders of a holder this
#: many takeovers back are judged by the oldest one remembered
TENURE_HISTORY = 16


def _tenure_history(previous: "LeaseRecord | None", previous_at: float) -> tuple[tuple[int, float], ...]:
    """The ``tenures`` an acquiring write carries: ``previous``'s list plus ``previous``'s own
    tenure (its ``token``/``since``, or for a record that began one -- acquisition, release --
    its revision and ``previous_at``, the server time of that write; 0 = unknown), the newest
    :data:`TENURE_HISTORY`. Empty when there was no record."""
    if previous is None:
        return ()
    own = (previous.token, previous.since) if previous.token else (previous.revision, previous_at)
    return (*previous.tenures, own)[-TENURE_HISTORY:]


class LeaseConflict(Exception):
    """A compare-and-set write lost: the key exists (create) or has another revision (update).

    Attributes:
        key: the key written.
    """

    def __init__(self, key: str, detail: str = "") -> None:
        super().__init__(f"lease {key}: compare-and-set failed{': ' + detail if detail else ''}")
        self.key = key


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What the lease key holds, with its KV revision.

    Attributes:
        holder: id of the replica holding it ("" = released).
        ttl_s: the holder's lease duration (seconds).
        revision: KV revision of this record (set by the store; 0 before writing).
        token: fencing token of the tenure this record renews (0 = this write acquires: its
            revision is the token).
        since: server time (seconds since the epoch, UTC) the tenure began, copied from the
            acquiring write's stream timestamp (0 = unknown).
        tenures: the tenures before this record's, ``(token, server seconds it began; 0 =
            unknown)``, oldest first, at most :data:`TENURE_HISTORY` (the module docstring's
            "tenure history").
    """

    holder: str
    ttl_s: float
    revision: int = 0
    token: int = 0
    since: float = 0.0
    tenures: tuple[tuple[int, float], ...] = ()

    def to_bytes(self) -> bytes:
        """JSON body (``holder``, ``ttl_s``, ``token``/``since`` once known, ``tenures`` when
        any; the revision is the KV's)."""
        body: dict = {"holder": self.holder, "ttl_s": self.ttl_s}
        if self.token:
            body.update(token=self.token, since=self.since)
        if self.tenures:
            body["tenures"] = [[t, s] for t, s in self.tenures[-TENURE_HISTORY:]]
        return json.dumps(body).encode()

    @classmethod
    def from_bytes(cls, data: bytes, revision: int) -> "LeaseRecord":
        """Parse a stored record; an unreadable one counts as released (it can be taken over),
        an unreadable ``tenures`` list as empty (the newest :data:`TENURE_HISTORY` are kept)."""
        try:
            body = json.loads(data or b"{}")
            record = cls(str(body.get("holder", "")), float(body.get("ttl_s", 0.0)), revision,
                         int(body.get("token", 0)), float(body.get("since", 0.0)))
        except (ValueError, TypeError, AttributeError):
            return cls("", 0.0, revision)
        try:
            tenures = tuple((int(t), float(at)) for t, at in body.get("tenures", ())[-TENURE_HISTORY:])
        except (ValueError, TypeError):
            tenures = ()
        return replace(record, tenures=tenures)


class LeaseStore(Protocol):
    """A compare-and-set record store (NATS KV live)."""

    async def get(self, key: str) -> LeaseRecord | None:
        """The record under ``key`` (None if absent or deleted).

        Raises:
            UnavailableError: the store cannot be reached.
        """
        ...

    async def create(self, key: str, record: LeaseRecord) -> int:
        """Write ``record`` iff ``key`` is absent; returns the new revision.

        Raises:
            LeaseConflict: the key exists.
            UnavailableError: the store cannot be reached.
        """
        ...

    async def update(self, key: str, record: LeaseRecord, last: int) -> int:
        """Write ``record`` iff the key's last revision is ``last``; returns the new revision.

        Raises:
            LeaseConflict: the revision differs.
            UnavailableError: the store cannot be reached.
        """
        ...


# anything else NATS raises (timeouts, no responders, a stream electing its leader, a closed or
# reconnecting connection) is an outage of the store: the lease rules treat it as "cannot write"
_NATS_DOWN = (nats.errors.Error, asyncio.TimeoutError, OSError)


class NatsLeaseStore:
    """:class:`LeaseStore` on a NATS KV bucket (``nats.js.kv.KeyValue``).

    Args:
        kv: the bucket.
        js: the JetStream context and ``stream`` (``KV_<bucket>``) for :meth:`written_at`
            (None: the time of a write is not read, renewals carry no ``since``).
    """

    def __init__(self, kv, *, js=None, stream: str = "") -> None:
        self.kv = kv
        self.js = js
        self.stream = stream

    async def written_at(self, revision: int) -> float:
        """Server time (epoch seconds) of the write ``revision`` (0.0 when it cannot be read)."""
        if self.js is None or not self.stream:
            return 0.0
        try:
            raw = await self.js.get_msg(self.stream, seq=revision)
        except (nats.js.errors.NotFoundError, *_NATS_DOWN) as e:
            log.info("lease: time of revision %d not read (%r)", revision, e)
            return 0.0
        return raw.time.timestamp() if raw.time else 0.0

    async def get(self, key: str) -> LeaseRecord | None:
        try:
            entry = await self.kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        except _NATS_DOWN as e:
            raise UnavailableError(f"lease {key}: {e!r}") from e
        return LeaseRecord.from_bytes(entry.value or b"", int(entry.revision or 0))

    async def create(self, key: str, record: LeaseRecord) -> int:
        try:
            return int(await self.kv.create(key, record.to_bytes()))
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise LeaseConflict(key, "exists") from e
        except _NATS_DOWN as e:
            raise UnavailableError(f"lease {key}: {e!r}") from e

    async def update(self, key: str, record: LeaseRecord, last: int) -> int:
        try:
            return int(await self.kv.update(key, record.to_bytes(), last=last))
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise LeaseConflict(key, f"revision is not {last}") from e
        except _NATS_DOWN as e:
            raise UnavailableError(f"lease {key}: {e!r}") from e


class Lease:
    """One replica's side of a lease (see the module docstring for the rules).

    Args:
        store: the compare-and-set store.
        key: the lease's key (e.g. ``scheduler``).
        holder: this replica's id (unique per process instance).
        clock: seconds (wall or monotonic; only differences on this replica are used).
        ttl_s: lease duration (seconds): how long a standby waits after the last write it saw.
        renew_every_s: seconds between renewals (default ``ttl_s / 3``).
        margin_s: the holder stops this long before ``ttl_s`` after its last renewal started
            (default ``ttl_s / 5``).

    Attributes:
        token: fencing token of the current tenure (KV revision at acquisition; 0 = never held).
        since: server time (epoch seconds) the current tenure began, written into renewals.
        history: the earlier tenures ``(token, since)`` our writes carry (``LeaseRecord.tenures``).
        active: whether this replica holds the lease (see :meth:`is_active` for the time check).
        resumed: the current tenure was begun over our own previous record, unchanged since we
            wrote it (we lost the lease only because a renewal came too late, and no other replica
            wrote in between): no other holder can have given orders since our last tenure.

    Raises:
        ValueError: ``ttl_s`` not positive, or the renewal period not below ``ttl_s - margin_s``.
    """

    def __init__(self, store: LeaseStore, key: str, holder: str, clock: Clock, *, ttl_s: float,
                 renew_every_s: float | None = None, margin_s: float | None = None) -> None:
        self.store = store
        self.key = key
        self.holder = holder
        self.clock = clock
        self.ttl_s = ttl_s
        self.renew_every_s = ttl_s / 3 if renew_every_s is None else renew_every_s
        self.margin_s = ttl_s / 5 if margin_s is None else margin_s
        if ttl_s <= 0 or not 0 < self.renew_every_s < ttl_s - self.margin_s:
            raise ValueError(f"lease {key}: need 0 < renew_every_s ({self.renew_every_s}) < ttl_s - margin_s "
                             f"({ttl_s - self.margin_s})")
        self.token = 0
        self.since = 0.0         # server time the current tenure began (its acquiring write's; 0 = unknown)
        self.history: tuple[tuple[int, float], ...] = ()  # earlier tenures, carried by every write of ours
        self.active = False
        self.resumed = False
        self.revision = 0        # our last successful write (while active)
        self.valid_until = 0.0   # clock seconds; active only before this
        self.renewed_at = 0.0    # when our last successful write was started
        self._seen: tuple[int, float] | None = None  # (revision of the other holder's record, when first seen)
        self.on_change: list[Callable[[bool], None]] = []  # called with the new state on gain/loss
        self._abandoned = False

    # ------------------------------------------------------------------ the rules

    def is_active(self) -> bool:
        """Held and not past its validity (``renewed_at + ttl_s - margin_s``) on this clock."""
        if self.active and self.clock.time() >= self.valid_until:
            self._lose("validity ran out without a renewal")
        return self.active

    async def step(self) -> bool:
        """One tick: renew when holding and due, else try to acquire. Returns :meth:`is_active`.

        Never raises for a lost race or an unreachable store (logged; the validity check takes
        the lease away when renewals keep failing).
        """
        if self._abandoned:
            return False
        if self.is_active():
            if self.clock.time() - self.renewed_at >= self.renew_every_s:
                await self._renew()
        else:
            await self._acquire()
        return self.is_active()

    async def _write(self, create: bool, last: int, *, renew: bool = False,
                     history: tuple[tuple[int, float], ...] = ()) -> int:
        # a renewal names its tenure for receivers (read_tenure); an acquiring write is its own;
        # both carry the earlier tenures (``history``; a renewal: ours)
        record = LeaseRecord(self.holder, self.ttl_s, token=self.token if renew else 0,
                             since=self.since if renew else 0.0, tenures=self.history if renew else history)
        return await (self.store.create(self.key, record) if create else self.store.update(self.key, record, last))

    async def _written_at(self, revision: int) -> float:
        """Server time of the write ``revision`` (0.0 when the store cannot say)."""
        stamp = getattr(self.store, "written_at", None)
        return await stamp(revision) if stamp is not None else 0.0

    async def _renew(self) -> None:
        started = self.clock.time()
        try:
            self.revision = await self._write(False, self.revision, renew=True)
        except LeaseConflict:
            self._lose("another replica wrote the lease")
            return
        except UnavailableError as e:
            log.warning("lease %s: renewal failed (%s); active until %.1f", self.key, e, self.valid_until)
            return
        self.renewed_at = started
        self.valid_until = started + self.ttl_s - self.margin_s

    async def _acquire(self) -> None:
        started = self.clock.time()
        try:
            current = await self.store.get(self.key)
            previous = current.holder if current is not None and current.holder != self.holder else ""
            resumed = current is not None and self._still_ours(current)
            if current is None:
                history: tuple[tuple[int, float], ...] = ()
                revision = await self._write(True, 0)
            elif current.holder == "" or self._expired(current, started) or resumed:
                at = 0.0 if current.token else await self._written_at(current.revision)
                history = _tenure_history(current, at)
                revision = await self._write(False, current.revision, history=history)
            else:
                return
        except LeaseConflict:
            self._seen = None  # someone else won: watch their record from now on
            return
        except UnavailableError as e:
            log.info("lease %s: cannot acquire (%s)", self.key, e)
            return
        self.revision = self.token = revision
        self.resumed = resumed  # (the compare-and-set on our own revision succeeded: nobody wrote between)
        self.since = await self._written_at(revision)  # the server's time of the acquiring write
        self.history = history
        self.renewed_at = started
        self.valid_until = started + self.ttl_s - self.margin_s
        self._seen = None
        self.active = True
        # routine (a first start, our own restart, a released lease): INFO; taking over from
        # another holder that stopped renewing is a failover worth a WARNING
        log.log(logging.WARNING if previous else logging.INFO, "lease %s: acquired by %s (fencing token %d)%s",
                self.key, self.holder, self.token, f", taking over from {previous}" if previous else "")
        for cb in self.on_change:
            cb(True)

    def _still_ours(self, current: LeaseRecord) -> bool:
        """Our own last write is still the newest (we lost the lease only because renewals
        could not reach the store): nobody took over, so we may start a new tenure at once --
        the compare-and-set on that revision fails if a standby writes first."""
        return current.holder == self.holder and current.revision == self.revision != 0

    def _expired(self, current: LeaseRecord, now: float) -> bool:
        """The other holder's record has not changed for its ``ttl_s`` (at least ours) since we
        first saw this revision (observed time on our clock)."""
        if self._seen is None or self._seen[0] != current.revision:
            self._seen = (current.revision, now)
            return False
        return now - self._seen[1] >= max(self.ttl_s, current.ttl_s)

    def _lose(self, why: str) -> None:
        if not self.active:
            return
        self.active = False
        self._seen = None
        log.warning("lease %s: %s lost it (%s; fencing token was %d)", self.key, self.holder, why, self.token)
        for cb in self.on_change:
            cb(False)

    def lose(self, why: str) -> None:
        """Give up at once without writing (e.g. a newer token was seen on the bus)."""
        self._lose(why)

    def abandon(self) -> None:
        """Drills: behave like a killed process -- inactive at once, and nothing is written
        any more (no release): standbys take over only after ``ttl_s``."""
        self._abandoned = True
        self.active = False

    async def release(self) -> None:
        """Write ``holder = ""`` over our record (CAS) so a standby takes over at once; no-op
        when not holding. Never raises."""
        if not self.active or self._abandoned:
            return
        self.active = False
        try:
            # a tenure of nobody begins: it carries ours on (its own is its revision and time)
            history = (*self.history, (self.token, self.since))[-TENURE_HISTORY:]
            await self.store.update(self.key, LeaseRecord("", self.ttl_s, tenures=history), self.revision)
        except (LeaseConflict, UnavailableError) as e:
            log.info("lease %s: release not written (%s)", self.key, e)
        for cb in self.on_change:
            cb(False)

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``renew_every_s / 2`` seconds until ``stop`` is set, then release."""
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except Exception:  # noqa: BLE001 - the lease loop must outlive any surprise
                    log.exception("lease %s: step failed", self.key)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.renew_every_s / 2)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.release()


@dataclass(frozen=True, slots=True)
class Tenure:
    """The lease's current tenure, as a receiver of orders reads it (:func:`read_tenure`).

    Attributes:
        token: its fencing token (for a released lease: the release's revision).
        since: server time (epoch seconds, UTC) it began -- or, when the holder could not read
            that time, the time of its newest write (later: fewer orders judged stale).
        holder: who holds it ("" = released).
        history: the earlier tenures the lease record remembers, ``(token, since)`` oldest first
            (at most :data:`TENURE_HISTORY`; an unknown start is read as the next known one:
            later, so fewer orders are judged stale).
    """

    token: int
    since: float
    holder: str = ""
    history: tuple[tuple[int, float], ...] = ()


def stale_order(token: int, stored_at: float | None, highest_seen: int, tenure: Tenure | None) -> str | None:
    """Why an order (placement or stop) with fencing ``token`` is stale, or None when it may be
    carried out (the rule in the module docstring; Kleppmann 2016, with the lease read from the
    store as well as the highest token seen): stale iff ``token`` is below ``highest_seen``, or
    some tenure with a higher token -- the current one or one in ``tenure.history`` -- began at
    or before the order was stored. (A token above ``tenure``'s is judged by :func:`unissued`
    when ``tenure`` was read after the order was fetched.)

    Args:
        token: the order's fencing token.
        stored_at: when JetStream stored the order (epoch seconds; None = unknown: judged as
            stored now, after any tenure began).
        highest_seen: highest token on the orders this receiver read before, in stream order.
        tenure: the lease's current tenure with its history (None: no lease, a single scheduler).
    """
    if token < highest_seen:
        return f"stale fencing token: {token} is below {highest_seen}, the highest seen on the stream"
    if tenure is None:
        return None
    if token < tenure.token and (stored_at is None or stored_at >= tenure.since):
        who = f"held by {tenure.holder}" if tenure.holder else "released"
        return (f"stale fencing token: {token} is below {tenure.token}, the scheduler lease's current tenure "
                f"({who}), which began before the order was stored")
    for later, since in tenure.history:
        if token < later and (stored_at is None or stored_at >= since):
            return (f"stale fencing token: {token} is below {later}, an earlier tenure of the scheduler lease "
                    f"(since {since:.3f}), which began before the order was stored")
    return None


def unissued(token: int, tenure: Tenure | None) -> str | None:
    """Why ``token`` cannot have been issued by any tenure of the lease, or None: a holder writes
    its tenure to the lease bucket before it publishes an order, so a legit order's token is never
    above the current tenure's token as read after the order was fetched; one above it was forged
    (e.g. 2^62 published with the scheduler's credentials) and must neither be carried out nor
    taken as the highest token seen -- it would make every later real order look stale.

    Args:
        token: the order's fencing token.
        tenure: the lease's current tenure, read after the order was fetched (None: no lease was
            read -- nothing can be judged; a scheduler without a lease stamps token 0).
    """
    if tenure is None or token <= tenure.token:
        return None
    return f"fencing token {token} was issued by no tenure (the lease's current token is {tenure.token})"


async def read_tenure(bus, key: str = "scheduler") -> Tenure | None:
    """The current tenure of the lease ``key`` in ``<prefix>_leases``, read from the bucket's
    stream (``STREAM.MSG.GET`` of the key's last message: the record and its server time), or
    None when there is no lease (no bucket, no key, or it was deleted). ``bus`` is a
    :class:`fedsched.bus.Bus`.

    Raises:
        UnavailableError: NATS unreachable.
    """
    bucket = f"{bus.prefix}_leases"
    try:
        raw = await bus.js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except nats.js.errors.NotFoundError:
        return None
    except _NATS_DOWN as e:
        raise UnavailableError(f"cannot read the lease {key}: {e!r}") from e
    if (raw.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
        return None
    record = LeaseRecord.from_bytes(raw.data or b"", int(raw.seq or 0))
    at = raw.time.timestamp() if raw.time else 0.0
    return tenure_of(record, at)


def tenure_of(record: LeaseRecord, written_at: float) -> Tenure:
    """The tenure a receiver reads from ``record``, the lease key's newest record, written at
    server time ``written_at`` (epoch seconds): its ``token``/``since`` (a renewal), else its own
    revision and ``written_at`` (an acquisition or a release), with ``record.tenures`` as the
    history -- an unknown start (0) taken as the next known later one (the current tenure's at
    the latest): later, so fewer orders are judged stale."""
    if record.token:
        current = Tenure(record.token, record.since or written_at, record.holder)
    else:
        current = Tenure(record.revision, written_at, record.holder)
    history: list[tuple[int, float]] = []
    later = current.since
    for token, since in reversed(record.tenures):
        later = since if since else later
        history.append((token, later))
    return replace(current, history=tuple(reversed(history)))


class MonotonicClock:
    """``time.monotonic`` as a :class:`~fedsched.clock.Clock` (lease timing on one host)."""

    def time(self) -> float:
        """Seconds of the monotonic clock."""
        return time.monotonic()


async def nats_lease(bus, key: str, holder: str, *, ttl_s: float, clock: Clock | None = None) -> Lease:
    """A :class:`Lease` on ``bus``'s KV bucket ``<prefix>_leases`` (created with the bus's stream
    replicas if missing, history 1). ``bus`` is a :class:`fedsched.bus.Bus`."""
    await bus.key_value("leases")  # created if missing
    # lease calls time out fast (a third of the TTL, at most 2 s): a request stuck on a NATS node
    # that died must not outlast the lease it is trying to keep or take
    js = bus.nc.jetstream(timeout=min(2.0, ttl_s / 3), domain=getattr(bus, "js_domain", "") or None)
    kv = await js.key_value(f"{bus.prefix}_leases")
    store = NatsLeaseStore(kv, js=js, stream=f"KV_{bus.prefix}_leases")
    return Lease(store, key, holder, clock or MonotonicClock(), ttl_s=ttl_s)


class StreamFencing:
    """Fencing tokens judged in *stream order*, whatever order a consumer handles messages in.

    A durable consumer does not handle its messages in stream order: a batch handed back during
    an outage (nak) is redelivered after later messages were handled. Judging "token below the
    highest seen so far" in handling order then refuses a former holder's order that was valid
    when it was published (it precedes every order of the next holder in the stream) as soon as
    one of the next holder's orders happens to be handled first -- billing refused a real job's
    end as "never placed" that way after a NATS node kill.

    The rule, the same for every reader of the stream (so every consumer agrees with the
    scheduler, which reads in order): an order with token ``t`` at stream sequence ``s`` is
    stale iff some order with a higher token ``t' > t`` precedes it in the stream
    (``first(t') < s``), where ``first(t')`` is the lowest stream sequence handled with token
    ``t'``. Handled in stream order this is exactly "below the highest seen".

    Memory: one entry per fencing token (one per lease tenure), at most ``keep`` (the lowest
    tokens are forgotten first: an order carrying a token below every remembered one is stale
    iff any remembered token precedes it, which it does after the first tenure change).

    Args:
        keep: tenures remembered.
    """

    __slots__ = ("_first", "keep")

    def __init__(self, keep: int = 256) -> None:
        self._first: dict[int, int] = {}
        self.keep = keep

    @property
    def highest(self) -> int:
        """The highest token handled so far (0 before any)."""
        return max(self._first, default=0)

    def stale(self, token: int, stream_sequence: int, tenure: "Tenure | None" = None) -> bool:
        """Whether the order carrying ``token`` at ``stream_sequence`` is a former holder's late
        order (see the class docstring); records the token either way -- except a token above
        ``tenure``'s (:func:`unissued`), which is neither stale by this rule nor recorded."""
        if unissued(token, tenure) is not None:
            return False
        return self.above(token, stream_sequence) > 0

    def judge(self, token: int, delivery, tenure: "Tenure | None") -> str | None:
        """Why the order carrying ``token``, delivered as ``delivery`` (a
        :class:`fedsched.bus.Delivery`: its stream sequence and stored time), is stale, or None
        (:func:`stale_order` with the highest token preceding it in the stream); records the token
        -- unless it is above ``tenure``'s token (:func:`unissued`: issued by no tenure, refused
        and not recorded, so a forged token never raises the highest seen)."""
        forged = unissued(token, tenure)
        if forged is not None:
            return forged  # not recorded: a forged token must not fence real orders
        return stale_order(token, delivery.published_at, self.above(token, delivery.stream_sequence), tenure)

    def above(self, token: int, stream_sequence: int) -> int:
        """The highest token above ``token`` that precedes ``stream_sequence`` in the stream (0:
        none -- the order is not stale by this rule); records the token. What
        :func:`stale_order` takes as ``highest_seen`` from a consumer that handles messages out of
        stream order."""
        first = self._first.get(token)
        if first is None or stream_sequence < first:
            self._first[token] = stream_sequence
            if len(self._first) > self.keep:
                del self._first[min(self._first)]
        return max((t for t, s in self._first.items() if t > token and s < stream_sequence), default=0)
