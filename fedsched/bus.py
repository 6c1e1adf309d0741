"""NATS JetStream plumbing shared by every service.

* :class:`Bus` -- one connection: idempotent stream setup, publishing with a message id
  (``Nats-Msg-Id`` = event id, or for agents a keyed hash of it (:meth:`Bus.msg_id`), so a
  retried publish is dropped by JetStream's duplicate window)
  and the trace context in the headers.
  Every message's encoded size (headers + body) is
  checked against the server's ``max_payload`` (from its INFO) before it is sent: NATS closes
  the connection on a larger one, and nats.py's own check counts the body only. In a batch
  (:meth:`Bus.publish_many`) one message never fails the others: an oversized one is
  dead-lettered on ``<prefix>.deadletter.<publisher>`` (issue 14 item 6).
* :class:`DurableConsumer` -- a durable pull consumer that hands batches to a handler and
  acknowledges only after the handler returned (its effect is committed). Undecodable messages
  and messages that keep failing go to the dead-letter subject with the reason; a dependency
  outage (:class:`~fedsched.errors.UnavailableError`) naks with back-off and keeps the backlog.
  An event of a type this build does not know but well formed (a newer producer) is not
  undecodable: it is handed to the handler, whose dispatch table skips and counts it
  (:mod:`fedsched.dispatch`).
* :class:`StreamFollower` -- reads a stream from the start (or a sequence) and follows it; how
  services rebuild their state after a restart. It tracks the stream sequence itself and
  recreates its ephemeral consumer after errors or a server restart (nats.py pull consumers can
  stall after restarts: nats.py issues #504, #986), so it resumes exactly where it was.

Streams (``P`` = upper-cased subject prefix):

=================  ==========================================================  ==============
stream             subjects                                                    retention
=================  ==========================================================  ==============
``P_EVENTS``       jobs, admission, placements, decisions, status, billing,    max age
                   governance
``P_INVENTORY``    inventory, heartbeat                                        max age 1 day
``P_DLQ``          deadletter                                                  max age
=================  ==========================================================  ==============
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from fedsched import telemetry
from fedsched.errors import DecodeError, PayloadTooLargeError, SequenceConflictError, UnavailableError
from fedsched.metrics import dead_letter_code
from fedsched.events import DeadLetter, Envelope, EventType, Subjects, business_event_id, make_event
from fedsched.ports import PublishResult

log = logging.getLogger(__name__)

# NoStreamResponseError / ServiceUnavailableError: a clustered stream is electing a new leader (its
# old leader's node died) -- seconds on a three-node cluster; retried like a timeout
_TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
              nats.errors.OutboundBufferLimitError, asyncio.TimeoutError, ConnectionError,
              nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


#: compare-and-set headers of a publish (see :meth:`Bus.publish`)
EXPECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
EXPECT_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


_HDR_LINE = len(b"NATS/1.0\r\n")


def encoded_size(headers: dict[str, str] | None, data: bytes) -> int:
    """Bytes a message counts against the server's ``max_payload``: its headers as nats.py
    encodes them (``NATS/1.0\\r\\n``, ``key: value\\r\\n`` each, a closing ``\\r\\n``) plus its body."""
    if not headers:
        return len(data)
    return _HDR_LINE + sum(len(k.strip().encode()) + len(str(v).strip().encode()) + 4
                           for k, v in headers.items() if k.strip()) + 2 + len(data)


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream: its name suffix, subject families and retention (seconds)."""

    suffix: str
    families: tuple[str, ...]
    max_age_s: float


def stream_specs(max_age_s: float) -> tuple[StreamSpec, ...]:
    """The streams of a federation (see the module docstring)."""
    return (
        StreamSpec("EVENTS", ("jobs", "admission", "placements", "decisions", "status", "billing", "governance"),
                   max_age_s),
        StreamSpec("INVENTORY", ("inventory", "heartbeat"), min(max_age_s, 86400.0)),
        StreamSpec("DLQ", ("deadletter",), max_age_s),
    )


@dataclass(slots=True)
class Delivery:
    """A decoded bus message handed to a handler.

    Attributes:
        envelope: the decoded event.
        subject: the subject it arrived on.
        headers: its NATS headers (``traceparent``, ``Nats-Msg-Id``).
        stream_sequence: sequence in its stream.
        deliveries: how many times it has been delivered (1 = first time).
        published_at: wall time (s since the Unix epoch) JetStream stored it, from the message
            metadata; None when unknown. Liveness is judged from it (when a heartbeat was
            produced), never from when a restarted service happened to read it.
    """

    envelope: Envelope
    subject: str
    headers: dict[str, str]
    stream_sequence: int
    deliveries: int
    msg: Msg | None = field(default=None, repr=False)
    published_at: float | None = None
    pending: int = 0  #: messages stored after this one that its reader has not read yet (JetStream num_pending)

    @property
    def trace_id(self) -> str:
        """Trace id from the ``traceparent`` header ("" if none)."""
        return telemetry.trace_id_of(self.headers)


class Bus:
    """A NATS connection with the federation's JetStream conventions.

    Create with :meth:`connect`; close with :meth:`close` (or ``async with``).

    Args:
        nc: connected nats client.
        prefix: subject prefix (validated by Settings).
        duplicate_window_s / max_age_s: stream settings used by :meth:`ensure_streams`.
        name: the publisher's name (the connection name): messages it can never send are
            dead-lettered on ``<prefix>.deadletter.<name>``.
    """

    def __init__(self, nc: nats.NATS, prefix: str = "fed", *, duplicate_window_s: float = 120.0,
                 max_age_s: float = 30 * 86400.0, js_domain: str = "", replicas: int = 1,
                 name: str = "fedsched") -> None:
        self.nc = nc
        self.name = name
        self.refused = 0  #: messages refused (too large / refused by the server) and dead-lettered
        self.js = nc.jetstream(timeout=10, domain=js_domain or None)
        self.js_domain = js_domain
        self.subjects = Subjects(prefix)
        self.prefix = prefix
        self.duplicate_window_s = duplicate_window_s
        self.max_age_s = max_age_s
        self.replicas = replicas
        #: ``(consumer, reason code)`` called for every dead letter this connection records
        #: (a service's :meth:`fedsched.metrics.ServiceMetrics.dead_letter`); None = not counted
        self.on_dead_letter: Callable[[str, str], None] | None = None
        #: key of this connection's message ids (b"" = the event id itself); see :meth:`msg_id`
        self.msg_id_key = b""
        #: :meth:`publish_many` waits this long for a batch's pipelined acks, then sends the
        #: unacknowledged ones again one by one (same message ids)
        self.ack_timeout_s = 30.0
        self._stream_by_family: dict[str, str] | None = None  # (:meth:`stream_of`)

    def msg_id(self, subject: str, event: Envelope) -> str:
        """The ``Nats-Msg-Id`` of ``event`` on ``subject``: its event id, or -- with a
        :attr:`msg_id_key` -- ``HMAC-SHA256(key, subject + " " + event id)`` (32 hex chars).

        Both are deterministic (a retried publish is dropped by JetStream's duplicate window).
        The keyed form is for region agents (issue 14): JetStream deduplicates by message id
        across a whole stream, so an agent that knew another cluster's next message id could
        publish first, on its own subject, and have the real event dropped; with a per-agent
        key no other publisher can compute it. Consumers deduplicate by event id themselves.
        """
        if not self.msg_id_key:
            return event.event_id
        return hmac.new(self.msg_id_key, f"{subject} {event.event_id}".encode(), hashlib.sha256).hexdigest()[:32]

    @classmethod
    async def connect(cls, url: str, prefix: str = "fed", *, name: str = "fedsched",
                      duplicate_window_s: float = 120.0, max_age_s: float = 30 * 86400.0,
                      connect_timeout_s: float = 10.0, js_domain: str = "", inbox_prefix: str = "",
                      replicas: int = 1) -> "Bus":
        """Connect (retrying reconnects forever once connected).

        Args:
            url: server URL(s), comma separated; credentials may be in the URL.
            prefix: subject prefix.
            js_domain: JetStream domain (needed through leaf nodes; "" = none).
            inbox_prefix: reply-subject prefix for this connection (per-user inboxes let NATS
                permissions keep users from reading each other's replies; "" = ``_INBOX``).
            replicas: stream replicas when this connection creates the streams.

        Raises:
            UnavailableError: no server answered within ``3 * connect_timeout_s`` seconds.
        """

        async def _error_cb(e: Exception) -> None:
            log.debug("nats %s: %s", name, e)

        extra = {"inbox_prefix": inbox_prefix.encode()} if inbox_prefix else {}
        nc = nats.NATS()
        try:
            # reconnects retry forever once connected; the first connection gets a bounded wait
            # (nats.py would otherwise keep retrying an unreachable server without end)
            await asyncio.wait_for(nc.connect(
                url.split(","), name=name, connect_timeout=connect_timeout_s, max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, allow_reconnect=True, error_cb=_error_cb,
                pending_size=64 * 1024 * 1024, **extra,
            ), timeout=3 * connect_timeout_s)
        except (nats.errors.NoServersError, OSError, asyncio.TimeoutError, nats.errors.Error) as e:
            with contextlib.suppress(Exception):
                await nc.close()
            raise UnavailableError(f"cannot connect to NATS at {redact(url)} within {3 * connect_timeout_s:g} s: "
                                   f"{str(e) or 'no server answered'}") from e
        return cls(nc, prefix, duplicate_window_s=duplicate_window_s, max_age_s=max_age_s, js_domain=js_domain,
                   replicas=replicas, name=name)

    @property
    def max_payload(self) -> int:
        """The connected server's largest message in bytes (headers + body), from its INFO
        (updated on reconnect; NATS's default is 1 MB)."""
        return int(self.nc.max_payload)

    def check_size(self, subject: str, event: Envelope, headers: dict[str, str] | None, data: bytes) -> None:
        """Raise if the message would exceed the server's ``max_payload``.

        Raises:
            PayloadTooLargeError: with the sizes.
        """
        size = encoded_size(headers, data)
        limit = self.max_payload
        if size > limit:
            raise PayloadTooLargeError(subject, event.event_id, str(event.type), size, limit)

    async def close(self) -> None:
        """Flush pending publishes and close the connection (idempotent)."""
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.flush(), timeout=2)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            await self.nc.close()

    async def __aenter__(self) -> "Bus":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ streams

    def stream_name(self, suffix: str) -> str:
        """Full stream name, e.g. ``FED_EVENTS``."""
        return f"{self.prefix.upper()}_{suffix}"

    @property
    def js_api_prefix(self) -> str:
        """The JetStream API subject prefix: ``$JS.API``, with a domain ``$JS.<domain>.API``."""
        return f"$JS.{self.js_domain}.API" if self.js_domain else "$JS.API"

    def stream_of(self, subject: str) -> str:
        """The full name of the stream that stores ``subject`` (by its family, the token after
        the prefix: :func:`stream_specs`); "" for a subject of no stream."""
        streams = self._stream_by_family
        if streams is None:
            streams = self._stream_by_family = {family: self.stream_name(spec.suffix)
                                                for spec in stream_specs(self.max_age_s) for family in spec.families}
        head, _, rest = subject.partition(".")
        return streams.get(rest.partition(".")[0], "") if head == self.prefix else ""

    async def ensure_streams(self) -> None:
        """Create the federation's streams if missing (with ``replicas``), or bring the settings
        fedsched owns (subjects, retention, duplicate window) up to date. Settings an operator
        owns -- replicas, placement, limits not listed here -- are kept as they are."""
        for spec in stream_specs(self.max_age_s):
            name = self.stream_name(spec.suffix)
            subjects = [f"{self.prefix}.{family}.>" for family in spec.families]
            window = min(self.duplicate_window_s, spec.max_age_s)
            try:
                info = await self.js.stream_info(name)
            except nats.js.errors.NotFoundError:
                await self.js.add_stream(api.StreamConfig(
                    name=name, subjects=subjects, retention=api.RetentionPolicy.LIMITS, storage=api.StorageType.FILE,
                    max_age=spec.max_age_s, duplicate_window=window, discard=api.DiscardPolicy.OLD,
                    num_replicas=self.replicas))
                continue
            current = info.config
            if (sorted(current.subjects or []) != sorted(subjects) or current.max_age != spec.max_age_s
                    or current.duplicate_window != window):
                await self.js.update_stream(current.evolve(subjects=subjects, max_age=spec.max_age_s,
                                                           duplicate_window=window))

    async def key_value(self, bucket: str, history: int = 1, ttl_s: float | None = None, *, direct: bool = False):
        """Get or create the KV bucket ``<prefix>_<bucket>`` (created with ``replicas``, like the
        streams; ``direct``: its stream allows direct gets, e.g. a batch get of many keys in one
        request, :meth:`services.admission.ended.EndedJobs.get_many`)."""
        name = f"{self.prefix}_{bucket}"
        try:
            return await self.js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            return await self.js.create_key_value(api.KeyValueConfig(bucket=name, history=history, ttl=ttl_s,
                                                                     replicas=self.replicas, direct=direct or None))

    # ------------------------------------------------------------------ publishing

    async def publish(self, subject: str, event: Envelope, *, headers: dict[str, str] | None = None,
                      attempts: int = 8) -> api.PubAck:
        """Publish ``event`` on ``subject`` with ``Nats-Msg-Id`` = :meth:`msg_id` and the trace context.

        Trace context (:func:`fedsched.telemetry.event_headers`): the ``traceparent`` in
        ``headers`` (the event's cause), else the active span's, else a new root trace -- every
        event carries one. Retries (same message id, so never a duplicate) on timeouts with
        exponential back-off.

        Compare-and-set: ``headers`` may carry ``Nats-Expected-Last-Subject-Sequence`` (with
        ``Nats-Expected-Last-Subject-Sequence-Subject``, a subject filter that may hold wildcards,
        nats-server >= 2.11): JetStream stores the event only if the last message on that filter
        still has that sequence.

        Raises:
            UnavailableError: JetStream did not acknowledge after ``attempts`` tries.
            PayloadTooLargeError: headers + body exceed the server's ``max_payload`` (not sent).
            SequenceConflictError: the compare-and-set condition failed.
        """
        hdrs = telemetry.event_headers(headers, f"publish {event.type}")
        hdrs["Nats-Msg-Id"] = self.msg_id(subject, event)
        data = event.to_bytes()
        self.check_size(subject, event, hdrs, data)
        delay = 0.05
        last: Exception | None = None
        _share(data, event, self.stream_of(subject), subject)
        try:
            for _ in range(attempts):
                try:
                    ack = await self.js.publish(subject, data, headers=hdrs, timeout=5)
                    _settle(ack, data)
                    return ack
                except _TRANSIENT as e:
                    last = e
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                except nats.js.errors.APIError as e:
                    if e.err_code in (10071, 10164):  # JSStreamWrongLastSequence(Constant)Err
                        raise SequenceConflictError(hdrs.get(EXPECT_SUBJECT, subject),
                                                    int(hdrs.get(EXPECT_SEQUENCE, "0") or 0)) from e
                    raise
        except BaseException:
            _unshare(data)
            raise
        _unshare(data)
        raise UnavailableError(f"publish to {subject} failed after {attempts} attempts: {last!r}")

    async def publish_many(self, items: Sequence[tuple[str, Envelope, dict[str, str] | None]]
                           ) -> list[PublishResult]:
        """Publish several events pipelined (``publish_async``) and wait for every ack.

        1. Each message's encoded size (headers + body) is checked against the server's
           ``max_payload``; an oversized one is not sent but dead-lettered
           (:meth:`_refuse`: ``<prefix>.deadletter.<publisher>``, the reason and a summary:
           event id, type, subject, size).
        2. The others are sent pipelined; one that cannot even be handed to the client (any
           error) fails alone.
        3. Those whose ack does not arrive (within :attr:`ack_timeout_s` for the whole batch)
           are retried one by one with :meth:`publish`; one the
           server refuses for itself (a JetStream API error other than 503, e.g. a stream's
           ``max_msg_size``) is dead-lettered like an oversized one.

        Args:
            items: (subject, event, extra headers or None).

        Returns:
            Per item, a :class:`~fedsched.ports.PublishResult`: ``ACKED``; ``FAILED`` only after
            retries failed (an outage: try again later); ``REFUSED`` (dead-lettered: never
            retry). Never raises for one item.
        """
        if not items:
            return []
        futures: list[Any] = []
        sent: list[dict[str, str]] = []
        datas: list[bytes] = []
        refused: dict[int, str] = {}
        stalled = False  # the client's pending-ack limit held one back ack_timeout_s: send the rest alone
        try:
            for i, (subject, event, extra) in enumerate(items):
                hdrs = telemetry.event_headers(extra, f"publish {event.type}")
                sent.append(telemetry.trace_headers(hdrs))  # a retry keeps the same trace
                hdrs["Nats-Msg-Id"] = self.msg_id(subject, event)
                data = event.to_bytes()
                datas.append(data)
                try:
                    self.check_size(subject, event, hdrs, data)
                    _share(data, event, self.stream_of(subject), subject)
                except PayloadTooLargeError as e:
                    refused[i] = e.message
                    futures.append(_failed(e))
                    continue
                if stalled:
                    futures.append(_failed(nats.js.errors.TooManyStalledMsgsError()))
                    continue
                try:
                    futures.append(await publish_pipelined(self.js, subject, data, headers=hdrs,
                                                           wait_stall=self.ack_timeout_s))
                except asyncio.CancelledError:
                    raise
                except nats.js.errors.TooManyStalledMsgsError as e:
                    stalled = True
                    futures.append(_failed(e))
                except Exception as e:  # noqa: BLE001 - one message's failure is that message's only
                    futures.append(_failed(e))
        except BaseException:
            _abandon(futures)
            _unshare(*datas)
            raise
        results = await _batch_acks(futures, datas, self.ack_timeout_s)
        out: list[PublishResult] = []
        for i, ((subject, event, extra), trace_ctx, result) in enumerate(zip(items, sent, results)):
            if i in refused:
                out.append(await self._refuse(subject, event, refused[i], trace_ctx))
                continue
            if not isinstance(result, BaseException):
                _settle(result, datas[i])
                out.append(PublishResult.ACKED)
                continue
            try:
                await self.publish(subject, event, headers={**(extra or {}), **trace_ctx})
                out.append(PublishResult.ACKED)
            except asyncio.CancelledError:
                raise
            except PayloadTooLargeError as e:  # the server's limit shrank since the first try
                out.append(await self._refuse(subject, event, e.message, trace_ctx))
            except nats.js.errors.APIError as e:
                if e.code is not None and e.code < 500:  # the server refuses this message for itself
                    out.append(await self._refuse(subject, event, f"refused by JetStream: {e}", trace_ctx))
                else:
                    out.append(PublishResult.FAILED)
            except UnavailableError:
                out.append(PublishResult.FAILED)
            except Exception as e:  # noqa: BLE001 - never let one message fail the batch
                log.warning("publish of %s %s to %s failed: %s", event.type, event.event_id, subject, described(e))
                out.append(PublishResult.FAILED)
        return out

    async def publish_acks(self, items: Sequence[tuple[str, Envelope, dict[str, str] | None]]
                           ) -> list[Any]:
        """Publish several events pipelined, as :meth:`publish` publishes one, and give each
        its acknowledgement: all are sent (``publish_async``: the client writes them out
        together), then the acks are awaited together (within :attr:`ack_timeout_s`); one not
        acknowledged by then, or not handed to the client, is published again alone with
        :meth:`publish` (same ``Nats-Msg-Id``: never a second message). For a caller that needs
        each ack's sequence and ``duplicate`` flag (admission's batch submit); otherwise see
        :meth:`publish_many` (which dead-letters what can never be sent).

        Returns:
            Per item, in order, its :class:`~nats.js.api.PubAck` or the exception
            :meth:`publish` would have raised for it (``PayloadTooLargeError``,
            ``SequenceConflictError``, ``UnavailableError``, a JetStream ``APIError``). Never
            raises for one item.
        """
        futures: list[Any] = []
        datas: list[bytes] = []
        sent: list[dict[str, str]] = []
        stalled = False  # the client's pending-ack limit held one back ack_timeout_s: send the rest alone
        try:
            for subject, event, extra in items:
                hdrs = telemetry.event_headers(extra, f"publish {event.type}")
                sent.append({**(extra or {}), **telemetry.trace_headers(hdrs)})  # a retry keeps the same trace
                hdrs["Nats-Msg-Id"] = self.msg_id(subject, event)
                data = event.to_bytes()
                datas.append(data)
                try:
                    self.check_size(subject, event, hdrs, data)
                    _share(data, event, self.stream_of(subject), subject)
                    if stalled:
                        raise nats.js.errors.TooManyStalledMsgsError()
                    futures.append(await publish_pipelined(self.js, subject, data, headers=hdrs,
                                                           wait_stall=self.ack_timeout_s))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - that item's only (retried alone below unless too large)
                    stalled = stalled or isinstance(e, nats.js.errors.TooManyStalledMsgsError)
                    futures.append(_failed(e))
        except BaseException:
            _abandon(futures)
            _unshare(*datas)
            raise
        results = await _batch_acks(futures, datas, self.ack_timeout_s)
        out: list[Any] = []
        for (subject, event, _), headers, data, result in zip(items, sent, datas, results):
            if isinstance(result, api.PubAck):
                _settle(result, data)
                out.append(result)
                continue
            if isinstance(result, PayloadTooLargeError):
                out.append(result)
                continue
            if isinstance(result, nats.js.errors.APIError) and result.err_code in (10071, 10164):
                out.append(SequenceConflictError(headers.get(EXPECT_SUBJECT, subject),
                                                 int(headers.get(EXPECT_SEQUENCE, "0") or 0)))
                continue
            try:
                out.append(await self.publish(subject, event, headers=headers))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - that item's outcome
                out.append(e)
        return out

    async def _refuse(self, subject: str, event: Envelope, reason: str, trace_ctx: dict[str, str]) -> PublishResult:
        """Dead-letter a message that can never be sent, on ``<prefix>.deadletter.<publisher>``,
        with ``reason`` and a small summary (event id, type, subject, job, size of its body) in
        place of the body; its id is derived from the event's, so refusing the same event again
        stores no second dead letter. A dead letter that cannot be published is logged only.

        Returns:
            ``REFUSED``.
        """
        self.refused += 1
        summary = {"event_id": event.event_id, "type": str(event.type), "subject": subject, "job_id": event.job_id,
                   "attempt": event.attempt, "body_bytes": len(event.to_bytes())}
        payload = DeadLetter(consumer=self.name, subject=subject, reason=reason[:2000],
                             data=json.dumps(summary, separators=(",", ":")), headers=dict(trace_ctx))
        dead = make_event(EventType.BUS_DEAD_LETTER, payload, producer=self.name, occurred_at=time.time(),
                          event_id=business_event_id("dead_letter", self.name, "refused", event.event_id),
                          tenant=event.tenant, project=event.project, job_id=event.job_id)
        log.warning("%s: not sent, dead-lettered: %s", self.name, reason)
        try:
            await self.publish(self.subjects.deadletter(self.name), dead, headers=trace_ctx)
        except (UnavailableError, PayloadTooLargeError) as e:
            log.error("%s: could not dead-letter %s %s: %s", self.name, event.type, event.event_id, e)
        return PublishResult.REFUSED

    async def dead_letter(self, consumer: str, msg: Msg | None, reason: str, *, subject: str = "",
                          data: bytes = b"", headers: dict[str, str] | None = None) -> None:
        """Record an undecodable or unhandleable message on ``<prefix>.deadletter.<consumer>``
        (and count it through :attr:`on_dead_letter` with its reason code,
        :func:`fedsched.metrics.dead_letter_code`)."""
        if self.on_dead_letter is not None:
            self.on_dead_letter(consumer, dead_letter_code(reason))
        seq = deliveries = 0
        if msg is not None:
            subject = msg.subject
            data = msg.data
            headers = dict(msg.headers or {})
            try:
                seq = msg.metadata.sequence.stream
                deliveries = msg.metadata.num_delivered
            except Exception:  # noqa: BLE001 - not a JetStream message
                pass
        room = min(65536, self.max_payload // 8)  # the dead letter itself must fit (JSON may escape the body)
        payload = DeadLetter(consumer=consumer, subject=subject, stream_sequence=seq, deliveries=deliveries,
                             reason=reason[:2000], data=data[:room].decode("utf-8", errors="replace"),
                             headers={k: str(v) for k, v in (headers or {}).items()})
        # a stream message has one dead letter per consumer, however often it is re-read (a
        # follower rebuilding from the start after a restart): a deterministic id, so the
        # publish dedups and audit stores it once; anything else gets a fresh id
        event_id = business_event_id("dead_letter", consumer, subject, seq) if seq else None
        event = make_event(EventType.BUS_DEAD_LETTER, payload, producer=consumer, occurred_at=time.time(),
                           event_id=event_id)
        log.warning("dead-lettered message on %s for %s: %s", subject, consumer, reason)
        # in the trace of the message it gives up on (a new one if that had none)
        await self.publish(self.subjects.deadletter(consumer), event, headers=telemetry.trace_headers(headers))


def redact(url: str) -> str:
    """``url`` (possibly several, comma separated) with any password replaced by ``***``."""
    import re

    return re.sub(r"(://[^:/@,]+:)[^@/,]+@", r"\1***@", url)


#: wall seconds of work after which a reader of a fetched batch (a follower folding messages, a
#: consumer decoding them) hands the event loop back for a turn before going on: a batch of 500
#: submissions folded in one go held the scheduler's loop for ~0.1-1 s under load, long enough,
#: with collections and forks on top, for lease renewals to come too late (issue 15)
TURN_S = 0.005


class Turns:
    """Cooperative turns for a long synchronous stretch on the event loop: ``await
    turns.take()`` after each unit of work yields to the loop (``asyncio.sleep(0)``: every ready
    callback -- a lease renewal, a cycle, a gRPC call -- runs) once :data:`TURN_S` seconds have
    passed since the last yield, and costs one clock read otherwise."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until = time.perf_counter() + TURN_S

    async def take(self) -> None:
        """Yield to the loop if this stretch has run :data:`TURN_S` seconds since the last yield."""
        if time.perf_counter() >= self._until:
            await asyncio.sleep(0)
            self._until = time.perf_counter() + TURN_S


#: how long a request for what is already waiting behind a delivery lingers for more (seconds)
DRAIN_S = 0.002

#: a reader's wait before it makes its consumer again doubles after each failure up to this (s)
BACKOFF_CAP_S = 5.0


class _PullInbox:
    """What both pull readers share (private): the consumer's ``MSG.NEXT`` subject, an inbox
    subscription whose callback (:meth:`_arrive`) takes the deliveries into a buffer, and a
    count of the pull requests sent.

    Args:
        nc: the NATS connection.
        api_prefix: the JetStream API prefix (:attr:`Bus.js_api_prefix`).
        stream: the stream's name.
        consumer: the pull consumer's name; it must exist.
    """

    def __init__(self, nc: Any, api_prefix: str, stream: str, consumer: str) -> None:
        self.nc = nc
        self._subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = ""
        self._sub = None
        self._buf: list[Msg] = []
        self.requests = 0  #: pull requests sent (a count)

    async def start(self) -> None:
        """Subscribe the inbox."""
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._arrive)

    async def close(self) -> None:
        """Unsubscribe (what is still due is dropped by the server: nobody listens on the inbox)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _arrive(self, msg: Msg) -> None:
        raise NotImplementedError

    @staticmethod
    def _status(msg: Msg) -> str | None:
        """The status code of a status message from the server (``"100"``, ``"408"``, ...);
        None for a delivery."""
        headers = msg.headers
        return headers.get("Status") if headers else None


class PullFetcher(_PullInbox):
    """Fetches from one JetStream pull consumer (:meth:`fetch_fast`: a lingering request for the
    first message, then a no-wait request for what is already there) on an inbox subscription
    whose callback collects the deliveries, without nats.py's ``fetch`` and its task, timeout
    task and uuid per message (``next_msg``; issue 15). Each fetch waits for its
    requests' end (the message, the count, or the server's 404/408 status), so no delivery of
    an old request arrives later, except after a fetch the guard deadline cut short (the
    server never answered): such a stray is handed over by the next fetch, first. Arguments as
    :class:`_PullInbox` (``consumer``: the durable's name).
    """

    #: how long past a request's expiry a fetch waits for the server's answer before giving up
    #: (seconds): a request lost with the connection (reconnect) holds the consumer no longer
    GRACE_S = 1.0

    def __init__(self, nc: Any, api_prefix: str, stream: str, consumer: str) -> None:
        super().__init__(nc, api_prefix, stream, consumer)
        self._want = 0  #: deliveries the current request may still bring
        self._ended: asyncio.Future | None = None  #: resolved when the current request ends
        self._error: Exception | None = None

    def _end(self) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_result(None)

    async def _arrive(self, msg: Msg) -> None:
        status = self._status(msg)
        if status is None:
            self._buf.append(msg)
            self._want -= 1
            if self._want <= 0:
                self._end()
            return
        if status == "100":
            return
        if status not in ("404", "408"):  # 409 consumer deleted, leadership change, ...
            self._error = nats.js.errors.APIError(code=int(status) if status.isdigit() else None,
                                                  description=msg.headers.get("Description", ""))
        self._end()

    async def _request(self, batch: int, wait_s: float, no_wait: bool = False) -> None:
        """Send one pull request expiring after ``wait_s`` seconds and wait until it ends (or
        the guard deadline passes). ``no_wait`` with an expiry is what nats.py's ``fetch(n)``
        sends for what is already there: the server lingers until the expiry for the rest."""
        body: dict[str, Any] = {"batch": batch, "expires": max(1, int(wait_s * 1e9) - 100_000)}
        if no_wait:
            body["no_wait"] = True
        self._want = batch
        self._ended = asyncio.get_running_loop().create_future()
        self.requests += 1
        await self.nc.publish(self._subject, json.dumps(body).encode(), reply=self._inbox)
        try:
            async with asyncio.timeout(wait_s + self.GRACE_S):
                await self._ended
        except TimeoutError:
            pass  # no answer from the server: what came is kept, a late delivery waits in the buffer
        finally:
            self._ended = None

    async def fetch_fast(self, batch: int, max_wait_s: float) -> list[Msg]:
        """Up to ``batch`` messages, returning as soon as one has arrived, with what was already
        waiting behind it. nats.py's ``fetch(n)`` on an idle consumer lingers until ``n``
        messages or the timeout, so a lone message would wait the whole timeout; here the
        lingering request asks for one message (it returns on arrival) and, if the server said
        more were pending, a no-wait request takes what is already there, lingering
        :data:`DRAIN_S` for the rest (the request nats.py's ``fetch`` makes). The pull request is
        written in the caller's task before it yields -- in the same socket write as the acks
        the caller just sent (:class:`DurableConsumer`).

        Raises:
            nats.errors.TimeoutError: nothing arrived within ``max_wait_s``.
            nats.js.errors.APIError: the server ended a request with an error status (409:
                consumer deleted, ...).
        """
        if not self._buf:
            await self._request(1, max_wait_s)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if not self._buf:
                raise nats.errors.TimeoutError
        if len(self._buf) < batch and _pending_after(self._buf) > 0:
            await self._request(batch - len(self._buf), DRAIN_S, no_wait=True)
            self._error = None  # (the messages in hand are handed over; the next fetch meets it again)
        msgs, self._buf = self._buf[:batch], self._buf[batch:]
        return msgs


def _reconnects(nc: Any) -> int:
    """How many times the connection has reconnected (nats.py's ``stats``; 0 if not kept)."""
    stats = getattr(nc, "stats", None)
    return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0


class FeedLost(Exception):
    """A :class:`PullFeed` lost its consumer or stopped hearing from the server (the reason is
    the message); the reader makes a new consumer from the next sequence it needs."""


class PullFeed(_PullInbox):
    """A continuous pull on one JetStream pull consumer (what nats.go's ``Consume`` does;
    nats.py 2.x has only ``fetch``): the consumer's deliveries arrive on an inbox subscription
    whose callback appends them to a buffer (:meth:`take` hands it over), asked for by pull
    requests of ``batch`` messages, each topped up with another whenever at most half of what
    was asked is still due. A steady flow thus costs one pull request per ``batch / 2``
    messages and no task per message -- nats.py's ``fetch`` sends a request per call (a
    follower made two per batch) and waits for each message with ``next_msg``, which makes a task, a
    timeout task and a uuid per message (issue 15: ~0.1 ms of client and ~0.04 ms of server CPU
    per message, measured on the project's machine).

    A request expires after ``expires_s``: the server then answers status 408 with the count
    it did not deliver (``Nats-Pending-Messages``), which is no longer due. While a request
    waits the server sends an idle heartbeat (status 100) every ``heartbeat_s``; a feed that
    hears nothing for two heartbeats sends a fresh request (a consumer whose node died with the
    request answers it 503, no responders, at once; a loop that was held hears its queued
    heartbeats), and one that still hears nothing for ``lost_after_s`` after it raises
    :class:`FeedLost` from :meth:`take`, as it does on a 409 that ends the consumer, on any
    other error status and once the connection has reconnected (the server may have lost the
    request, or the consumer: a restarted server keeps no in-memory consumer). The 503 is what
    finds a dead node fast; ``lost_after_s`` is only for a request nothing answers at all, and is
    long enough that a healthy consumer whose heartbeats are late (a server busy with hundreds
    of readers made at once) is not given up: at two heartbeats (1 s) 200 followers started
    together on a 3-node cluster made ~160-240 consumers again (review of issue 15's change).

    Args:
        nc, api_prefix, stream, consumer: as :class:`_PullInbox`.
        batch: messages per pull request (at most 1.5 x ``batch`` are due at once, so the
            buffer holds at most that many unread messages).
        expires_s: seconds a pull request waits on the server.
        heartbeat_s: the idle heartbeat interval asked for (seconds).
        lost_after_s: seconds of silence after a fresh request before the feed is lost (at
            least two heartbeats).
    """

    def __init__(self, nc: Any, api_prefix: str, stream: str, consumer: str, *, batch: int = 500,
                 expires_s: float = 30.0, heartbeat_s: float = 0.5, lost_after_s: float = 5.0) -> None:
        if batch < 2:
            raise ValueError("a pull feed asks for at least 2 messages at a time")
        super().__init__(nc, api_prefix, stream, consumer)
        self.batch = batch
        self.heartbeat_s = heartbeat_s
        self.lost_after_s = max(lost_after_s, 2 * heartbeat_s)
        self._request = json.dumps({"batch": batch, "expires": int(expires_s * 1e9),
                                    "idle_heartbeat": int(heartbeat_s * 1e9)}).encode()
        self._ready = asyncio.Event()
        self._due = 0  #: messages asked for and not yet delivered nor expired
        self._heard = 0.0  #: monotonic time the server was last heard from, or a request last sent
        self._probed = False  #: a request was sent because the server fell silent (:meth:`take`)
        self._lost: str | None = None
        self._reconnects = 0  #: the connection's reconnect count when the feed started

    async def start(self) -> None:
        """Subscribe the inbox and send the first pull request."""
        self._reconnects = _reconnects(self.nc)
        await super().start()
        await self._top_up()

    async def _arrive(self, msg: Msg) -> None:
        status = self._status(msg)
        if status is None:  # a delivery
            self._buf.append(msg)
            self._due -= 1
            self._ready.set()
            return
        headers = msg.headers
        self._heard = time.monotonic()
        self._probed = False
        if status == "100":  # idle heartbeat (or flow control, not used by pull consumers)
            return
        if status == "408" or (status == "409" and "Leadership Change" in headers.get("Description", "")):
            # a request expired (or was dropped by a new leader): what it had not delivered is not due
            pending = headers.get("Nats-Pending-Messages")
            self._due = max(0, self._due - int(pending)) if pending and pending.isdigit() else 0
        elif status != "404":  # 409 consumer deleted, max waiting, ... : this consumer is done
            self._lost = f"{status} {headers.get('Description', '')}".strip()
        self._ready.set()

    async def _top_up(self) -> None:
        if self._due <= self.batch // 2:
            await self._send()

    async def _send(self) -> None:
        self._due += self.batch
        self.requests += 1
        self._heard = time.monotonic()  # (silence is counted from here too: a reader away from take())
        await self.nc.publish(self._subject, self._request, reply=self._inbox)

    async def take(self, wait_s: float) -> list[Msg]:
        """The messages delivered since the last call, in delivery order; if none, waits up to
        ``wait_s`` seconds for some (an empty list: nothing came).

        Raises:
            FeedLost: the consumer is gone (an error status), the connection reconnected, or
                the server was not heard from for ``lost_after_s`` after a fresh request.
        """
        if not self._buf and self._lost is None:
            self._ready.clear()
            await self._top_up()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._ready.wait()
        if self._lost is None and _reconnects(self.nc) != self._reconnects:
            self._lost = "the connection was re-established (the server may have lost the pull request)"
        if self._lost is not None:
            raise FeedLost(self._lost)
        if self._buf and len(self._buf) < self.batch and (behind := _pending_after(self._buf)) > 0:
            # more were stored behind the newest (the server said so) and are on their way: give
            # them DRAIN_S to join this batch, as PullFetcher's request for what is there does
            target = min(self.batch, len(self._buf) + behind)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_S):
                    while len(self._buf) < target and self._lost is None:
                        self._ready.clear()
                        await self._ready.wait()
        msgs = self._buf
        now = time.monotonic()
        if msgs:
            self._buf = []
            self._heard = now
            self._probed = False
        elif self._probed:
            if now - self._heard > self.lost_after_s:  # a fresh request went unanswered too
                raise FeedLost(f"nothing heard for {now - self._heard:.1f}s after a fresh pull request "
                               f"(heartbeat every {self.heartbeat_s:g}s)")
        elif now - self._heard > 2 * self.heartbeat_s:
            # silent for two heartbeats (the consumer's node died with the request, or this loop
            # was held): ask again -- a live consumer answers, a lost one gets 503 no responders
            self._probed = True
            await self._send()
        await self._top_up()
        return msgs


def described(e: BaseException) -> str:
    """``e`` for a log line: its type and its text (nats.py's ``APIError`` has an empty repr,
    so ``%r`` hid the status code and the server's description), or the repr when it has no
    text (``TimeoutError()``)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else repr(e)


async def _failed(e: Exception):
    raise e


async def publish_pipelined(js: Any, subject: str, data: bytes, *, headers: dict[str, str] | None,
                            wait_stall: float) -> "asyncio.Future[api.PubAck]":
    """``js.publish_async``: send one message and return the future of its JetStream ack.

    The client holds at most its pending-ack limit (nats.py: 4,000) of unacknowledged messages;
    past it this waits for a slot at most ``wait_stall`` seconds. nats.py turns both that
    timeout and a cancellation during the wait into ``TooManyStalledMsgsError``
    (nats/js/client.py ``publish_async``); a cancellation is given back as what it is.

    Raises:
        asyncio.CancelledError: the calling task was cancelled (also while waiting for a slot).
        nats.js.errors.TooManyStalledMsgsError: no slot within ``wait_stall`` seconds.
        nats.errors.Error: the client could not send it (closed connection, ...).
    """
    # nats.py waits for a slot with asyncio.wait_for(..., timeout=wait_stall): with a timeout that
    # is a task and a timer per message -- a 20,000-job bench fell from ~740 to ~200 jobs/s and
    # agents fell so far behind that a third of the placements were reclaimed -- so the deadline
    # is given only when the client is at its limit and the wait would really block
    sem = getattr(js, "_publish_async_pending_semaphore", None)
    stall = wait_stall if sem is None or sem.locked() else None
    try:
        return await js.publish_async(subject, data, headers=headers, wait_stall=stall)
    except nats.js.errors.TooManyStalledMsgsError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError() from None
        raise


def _abandon(futures: list[Any]) -> None:
    """Give up pipelined acks no one will await (the publisher was cancelled): a pending ack's
    future is cancelled, which frees its slot of the client's pending-ack limit (an ack the
    server never sends would hold it for good); a not-awaited ``_failed`` is closed."""
    for f in futures:
        if isinstance(f, asyncio.Future):
            f.cancel()
        elif asyncio.iscoroutine(f):
            f.close()


async def _acks(futures: list[Any], timeout_s: float) -> list[Any]:
    """Each future's result or exception, waiting at most ``timeout_s`` for them all; one not
    done by then is cancelled and given as a ``TimeoutError`` (its message is then sent again,
    under the same ``Nats-Msg-Id``: never a duplicate). A pipelined publish's ack has no
    deadline of its own: an ack the server never sends (overloaded, a connection blip) would
    otherwise hold the publisher -- a scheduler cycle -- for good."""
    if not futures:
        return []
    tasks = [asyncio.ensure_future(f) for f in futures]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    except BaseException:  # cancelled: no one will await them
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    out: list[Any] = []
    for t in tasks:
        if t in pending:
            out.append(asyncio.TimeoutError(f"no JetStream ack within {timeout_s:g} s"))
        elif t.cancelled():
            out.append(asyncio.CancelledError())
        else:
            out.append(t.exception() or t.result())
    return out


async def _batch_acks(futures: list[Any], datas: list[bytes], timeout_s: float) -> list[Any]:
    """:func:`_acks` of a batch whose events were shared (``datas``); if the wait is cancelled
    they are withdrawn."""
    try:
        return await _acks(futures, timeout_s)
    except BaseException:
        _unshare(*datas)
        raise


def _stored_at(md) -> float | None:
    """Wall seconds at which JetStream stored a message (its metadata timestamp), or None."""
    ts = getattr(md, "timestamp", None)
    return ts.timestamp() if ts is not None else None


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS subject filter ``pattern`` (``*`` = one token, a final ``>`` = one or more)
    matches the literal ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for k, token in enumerate(want):
        if token == ">":
            return len(have) > k
        if k >= len(have) or (token != "*" and token != have[k]):
            return False
    return len(want) == len(have)


class _Readers:
    """This process's readers of each stream (followers and consumers while they run, with their
    subject filters), to tell how many of them will read a message on a given subject -- how
    long the shared decode (:data:`_DECODED`) must keep its envelope. The count per (stream,
    subject) is memoised until the readers change."""

    def __init__(self) -> None:
        self._filters: dict[str, list[tuple[str, ...]]] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, stream: str, filters: Sequence[str]) -> tuple[str, tuple[str, ...]]:
        """Register a reader of ``stream`` with its subject ``filters``; returns its handle."""
        handle = (stream, tuple(filters))
        self._filters.setdefault(stream, []).append(handle[1])
        self._counts.clear()
        return handle

    def remove(self, handle: tuple[str, tuple[str, ...]]) -> None:
        """Forget a reader registered by :meth:`add` (no-op when already forgotten)."""
        readers = self._filters.get(handle[0], [])
        if handle[1] in readers:
            readers.remove(handle[1])
            self._counts.clear()

    def of(self, stream: str, subject: str) -> int:
        """How many registered readers of ``stream`` receive a message on ``subject``."""
        key = (stream, subject)
        n = self._counts.get(key)
        if n is None:
            if len(self._counts) > 4096:  # subjects are per tenant/project/cluster: few, but bounded
                self._counts.clear()
            n = sum(1 for filters in self._filters.get(stream, ())
                    if any(subject_matches(f, subject) for f in filters))
            self._counts[key] = n
        return n


#: the readers of this process (see :class:`_Readers`)
READERS = _Readers()

#: stream messages decoded (or published) here and still to be read by another reader of this
#: process, message bytes -> [envelope, reads left]: the consumers and followers of one process
#: (audit and billing in the store; every service when embedded) read the same messages, and an
#: envelope is a pure function of its bytes (and immutable), so each is decoded once, not once
#: per reader -- and one this process publishes not at all. Keyed by the bytes, not by stream
#: sequence, so a publisher can share its event before it is sent: a reader with a pull
#: request waiting (:class:`PullFeed`) often gets the delivery before the publisher gets its
#: ack. An entry lives until the last reader whose filter matches its subject has taken it (no
#: reader left: none is made -- an agent's placements have one reader, the agents' own statuses
#: none), so envelopes are not held for readers that will never come (the agents' process kept
#: ~8,000 envelopes alive, and the collector walking them was ~10% of its CPU); at most
#: :data:`_DECODED_MAX`, oldest dropped first (a reader far behind decodes for itself).
_DECODED: "OrderedDict[bytes, list]" = OrderedDict()
_DECODED_MAX = 8192


def _keep(data: bytes, event: Envelope, reads: int) -> None:
    if reads <= 0:
        return
    _DECODED[data] = [event, reads]
    if len(_DECODED) > _DECODED_MAX:
        _DECODED.popitem(last=False)


def _share(data: bytes, event: Envelope, stream: str, subject: str) -> None:
    """Share an event this process is about to publish on ``subject`` (``data`` =
    ``event.to_bytes()``) with its readers here: a follower or consumer of this process reading
    it back (the scheduler its placements, admission its submissions, every service when
    embedded) takes ``event`` itself -- with its parsed payloads -- instead of decoding the
    bytes again. Kept for as many reads as this process has readers of ``subject`` in
    ``stream`` (the one that stores it)."""
    _keep(data, event, READERS.of(stream, subject))


def _unshare(*datas: bytes) -> None:
    """Withdraw shared events that will not be read back: their publish failed for good, was a
    duplicate, or its publisher was cancelled (what was sent may still be stored: its readers
    decode it)."""
    for data in datas:
        _DECODED.pop(data, None)


def _settle(ack: Any, data: bytes) -> None:
    """After a publish's ack: a duplicate (the stream had the message already: no delivery
    follows) is withdrawn."""
    if getattr(ack, "duplicate", False):
        _unshare(data)


def _decode(msg: Msg) -> Envelope:
    """The envelope of a stream message (:meth:`Envelope.from_bytes`), shared with the other
    readers of this process through :data:`_DECODED` (a hit has the very same bytes).

    Raises:
        DecodeError: see :meth:`Envelope.from_bytes` (never cached).
    """
    data = msg.data
    hit = _DECODED.get(data)
    if hit is not None:
        hit[1] -= 1
        if hit[1] <= 0:
            del _DECODED[data]
        return hit[0]
    env = Envelope.from_bytes(data)
    try:
        stream = msg.metadata.stream
    except Exception:  # noqa: BLE001 - not a JetStream message: no other reader to share it with
        return env
    _keep(data, env, READERS.of(stream, msg.subject) - 1)
    return env


Handler = Callable[[list[Delivery]], Awaitable[None]]


class DurableConsumer:
    """A durable pull consumer with ack-after-commit, back-off and dead-lettering.

    Args:
        bus: the connection.
        stream_suffix: which stream (``EVENTS``, ``INVENTORY``, ``DLQ``).
        durable: durable consumer name (restarts resume where it acknowledged).
        filter_subjects: subjects to receive (wildcards allowed).
        handler: ``async handler(deliveries)``; returning means every delivery's effect is
            committed (they are then acknowledged). Raise
            :class:`~fedsched.errors.UnavailableError` for an outage (whole batch naked with
            back-off, retried forever), :class:`~fedsched.errors.DecodeError` for a bad message
            (dead-lettered), anything else for a failure (the batch is retried message by message;
            a message failing ``max_failures`` times is dead-lettered).
        batch: maximum messages per handler call.
        max_wait_s: how long a fetch waits for the first message.
        linger_s: after the first message, keep collecting up to ``batch`` for this long (0 =
            hand over what is there at once; > 0 makes fewer, bigger inserts), looking for more
            a few times per window (:meth:`_linger`), not once per message.
        ack_wait_s: JetStream redelivers a message after this long without an ack or a progress
            report. While a batch is in hand (from its fetch until it is acknowledged or handed
            back) the consumer reports progress (``+WPI``, :meth:`nats.aio.msg.Msg.in_progress`)
            on each of its messages every ``ack_wait_s / 4``, so a slow handler (a long insert)
            keeps its batch, and a consumer that died (``kill -9``: its heartbeats stop) loses its
            unacknowledged messages to its successor -- or to another replica sharing the durable
            -- within ``ack_wait_s``. A short ``ack_wait_s`` (the writers: 5 s) thus makes recovery
            prompt without a live replica's batch ever being redelivered while it is handled (short
            of an event-loop stall of about ``ack_wait_s``). An existing durable with another
            ack wait is updated to this one when the consumer subscribes.

    Attributes:
        progress_reports: progress reports (``+WPI``) sent, one per message and heartbeat.
        batches: fetches that brought messages (each batch handed to the handler, lingering
            included, counts once; a count, for per-batch costs).
        backlog: messages of the consumer not yet handled, as last known: the newest delivery's
            ``num_pending`` plus the fetched batch while it is handled; 0 after a fetch that
            found nothing (read up to now). A count, not a sequence.
    """

    def __init__(self, bus: Bus, stream_suffix: str, durable: str, filter_subjects: Sequence[str], handler: Handler,
                 *, batch: int = 256, max_wait_s: float = 0.5, ack_wait_s: float = 60.0, max_failures: int = 5,
                 deliver_new_only: bool = False, linger_s: float = 0.0) -> None:
        self.bus = bus
        self.stream = bus.stream_name(stream_suffix)
        self.durable = durable
        self.filter_subjects = list(filter_subjects)
        self.handler = handler
        self.batch = batch
        self.max_wait_s = max_wait_s
        self.ack_wait_s = ack_wait_s
        self.max_failures = max_failures
        self.deliver_new_only = deliver_new_only
        self.linger_s = linger_s
        self._stop = asyncio.Event()
        self._sub = None
        self._in_hand: list[Msg] = []  # the batch fetched and not yet handled (drained_through)
        self.processed = 0
        self.dead_lettered = 0
        self.progress_reports = 0
        self.batches = 0
        self.backlog = 0
        self._backoff = 0.1

    def _config(self) -> api.ConsumerConfig:
        config = api.ConsumerConfig(
            name=self.durable,  # named: nats.py then creates through the filtered create subject,
            durable_name=self.durable,  # which NATS permissions can pin to this consumer and filter
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=max(self.batch * 4, 1000),
            deliver_policy=api.DeliverPolicy.NEW if self.deliver_new_only else api.DeliverPolicy.ALL,
        )
        if len(self.filter_subjects) == 1:
            config.filter_subject = self.filter_subjects[0]
        else:
            config.filter_subjects = self.filter_subjects
        return config

    async def _subscribe(self) -> None:
        info = await self._info()
        if info is None:
            await create_consumer(self.bus, self.stream, self._config())
        else:
            configured = getattr(info.config, "ack_wait", None)
            if configured is not None and abs(float(configured) - self.ack_wait_s) > 1e-3:
                # a durable made with another ack wait (an older build: 60 s) keeps it until updated
                log.info("consumer %s: ack wait %.1fs -> %.1fs", self.durable, float(configured), self.ack_wait_s)
                await create_consumer(self.bus, self.stream, self._config())
        await self._drop_fetcher()
        fetcher = PullFetcher(self.bus.nc, self.bus.js_api_prefix, self.stream, self.durable)
        await fetcher.start()
        self._sub = fetcher

    async def _drop_fetcher(self) -> None:
        fetcher, self._sub = self._sub, None
        if fetcher is not None:
            await fetcher.close()

    async def _info(self):
        """The durable's consumer info, None if it does not exist."""
        try:
            return await asked_again(f"info of consumer {self.durable} on {self.stream}",
                                     lambda: self.bus.js.consumer_info(self.stream, self.durable))
        except nats.js.errors.NotFoundError:
            return None

    async def _heartbeat(self, msgs: list[Msg], *, now: bool = False) -> None:
        """Report progress on every message of ``msgs`` (the list grows while a batch lingers)
        every ``ack_wait_s / 4`` (the first time at once with ``now``) until cancelled; a report
        that cannot be sent is skipped (the next one, or the redelivery, follows). A message
        already acknowledged, handed back (nak, with or without a delay) or terminated gets no
        more reports: a progress report after a nak would restart the server's full ack wait
        instead of the nak's delay. :meth:`run` starts it (:class:`_Progress`) only for a batch
        still in hand ``ack_wait_s / 4`` after its fetch."""
        every = self.ack_wait_s / 4
        while True:
            if not now:
                await asyncio.sleep(every)
            now = False
            for msg in list(msgs):
                if msg.is_acked:  # nats.py: set by ack, nak and term alike
                    continue
                try:
                    await msg.in_progress()
                    self.progress_reports += 1
                except Exception as e:  # noqa: BLE001 - a dropped connection: redelivery takes over
                    log.debug("consumer %s: progress report failed: %r", self.durable, e)
                    break

    async def lag(self) -> int:
        """Messages not yet acknowledged (pending + in flight), from the server's consumer info.

        Before :meth:`run` created the durable consumer, every message its filter matches is lag.
        """
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            total = 0
            for subject in self.filter_subjects:
                state = (await self.bus.js.stream_info(self.stream, subjects_filter=subject)).state
                total += sum((state.subjects or {}).values())
            return total
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def drained_through(self, mark: int) -> bool:
        """Whether every message of the filter stored at stream sequence <= ``mark`` has been
        handled and acknowledged -- what was published before a drain began, whatever keeps
        arriving since (a writer lingering over a steady trickle of heartbeats is never idle, so
        :meth:`lag` may never read 0 while it keeps up). Conservative: True only when the server
        says nothing is pending and nothing unacknowledged, or when it has delivered past ``mark``
        and every unacknowledged message is one of the batch in hand here, all stored after
        ``mark`` (a message the server delivered that this consumer has not taken yet, or one
        handed back for redelivery, makes it False until a later call)."""
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            return await self.lag() == 0
        pending, unacked = int(info.num_pending or 0), int(info.num_ack_pending or 0)
        if pending == 0 and unacked == 0:
            return True
        delivered = int(info.delivered.stream_seq or 0) if info.delivered else 0
        if delivered < mark:
            return False
        held = [m.metadata.sequence.stream for m in list(self._in_hand) if not m.is_acked]
        return unacked == len(held) and all(seq > mark for seq in held)

    def stop(self) -> None:
        """Ask :meth:`run` to return; a batch being handled is finished first, a batch just
        fetched is handed back (nak) for redelivery."""
        self._stop.set()

    async def run(self) -> None:
        """Fetch and handle until :meth:`stop`; survives server restarts and outages."""
        reader = READERS.add(self.stream, self.filter_subjects)  # (how long the shared decode keeps a message)
        try:
            await self._run()
        finally:
            READERS.remove(reader)
            await self._drop_fetcher()

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sub is None:
                    await self._subscribe()
                try:
                    msgs = await self._sub.fetch_fast(self.batch, self.max_wait_s)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    self.backlog = 0  # nothing came within max_wait_s: read up to now
                    continue
                progress = _Progress(self, msgs)
                self._in_hand = msgs
                self.batches += 1
                try:
                    await self._linger(msgs)
                    if self._stop.is_set():  # stopped while fetching: hand the messages back, untouched
                        for msg in msgs:
                            await msg.nak()
                        break
                    self.backlog = _pending_after(msgs) + len(msgs)
                    await self._handle(msgs)
                    self.backlog = _pending_after(msgs)
                finally:
                    self._in_hand = []
                    beating = progress.cancel()
                    if beating is not None:
                        with contextlib.suppress(asyncio.CancelledError):
                            await beating
                self._backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - connection trouble: rebuild the subscription
                if self._stop.is_set():
                    break
                # once the back-off is at its cap the trouble has lasted seconds: say so above INFO
                log.log(logging.WARNING if self._backoff >= BACKOFF_CAP_S else logging.INFO,
                        "consumer %s: %s; resubscribing in %.1fs", self.durable, described(e), self._backoff)
                await self._drop_fetcher()
                await asyncio.sleep(self._backoff)
                self._backoff = min(self._backoff * 2, BACKOFF_CAP_S)

    #: slices of :attr:`linger_s` the consumer waits between looks for more messages
    LINGER_LOOKS = 4

    async def _linger(self, msgs: list[Msg]) -> None:
        """Add to ``msgs`` (the batch just fetched) what arrives within :attr:`linger_s`, up to
        :attr:`batch`, in at most ``LINGER_LOOKS`` + 1 looks: each look waits for the next message
        (:meth:`PullFetcher.fetch_fast`: one pull request lingering until the first arrives, one more taking
        what is already there), then -- unless the batch is full or waiting on the server -- the
        rest of its slice of the window (``linger_s / LINGER_LOOKS``), so messages trickling in
        meanwhile are taken together by the next look. Before, a look per message: a pull request
        and its status reply per message trickling in (issue 15)."""
        deadline = time.monotonic() + self.linger_s
        step = self.linger_s / self.LINGER_LOOKS
        while len(msgs) < self.batch and (left := deadline - time.monotonic()) > 0:
            look_ends = min(time.monotonic() + step, deadline)
            try:
                msgs += await self._sub.fetch_fast(self.batch - len(msgs), left)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                break  # nothing more within the window
            if len(msgs) < self.batch and _pending_after(msgs) < self.batch - len(msgs):
                rest = look_ends - time.monotonic()
                if rest > 0:
                    await asyncio.sleep(rest)
                if self._stop.is_set():
                    return

    async def _handle(self, msgs: list[Msg]) -> None:
        good: list[Delivery] = []
        turns = Turns()
        for msg in msgs:
            await turns.take()
            try:
                env = _decode(msg)
            except DecodeError as e:
                await self.bus.dead_letter(self.durable, msg, e.reason)
                await msg.ack()
                self.dead_lettered += 1
                continue
            md = msg.metadata
            good.append(Delivery(env, msg.subject, dict(msg.headers or {}), md.sequence.stream, md.num_delivered, msg,
                                 _stored_at(md)))
        if not good:
            return
        try:
            await self._call(good)
        except UnavailableError as e:
            log.warning("consumer %s: dependency unavailable (%s); backing off", self.durable, e)
            for d in good:
                await d.msg.nak(delay=self._backoff)
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, BACKOFF_CAP_S)
            return
        except Exception:  # noqa: BLE001 - isolate the failing message(s)
            if len(good) == 1:
                await self._single_failed(good[0])
                return
            for d in good:
                try:
                    await self._call([d])
                except UnavailableError:
                    await d.msg.nak(delay=self._backoff)
                except Exception:  # noqa: BLE001
                    await self._single_failed(d)
            return
        await self._ack(good)

    async def _call(self, deliveries: list[Delivery]) -> None:
        try:
            await self.handler(deliveries)
        except DecodeError:
            raise
        self.processed += len(deliveries)

    async def _ack(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            await d.msg.ack()

    async def _single_failed(self, d: Delivery) -> None:
        try:
            await self._call([d])
            await d.msg.ack()
            return
        except DecodeError as e:
            reason = e.reason
        except UnavailableError:
            await d.msg.nak(delay=self._backoff)
            return
        except Exception as e:  # noqa: BLE001
            reason = f"handler failed: {e!r}"
            if d.deliveries < self.max_failures:
                log.warning("consumer %s: %s (delivery %d)", self.durable, reason, d.deliveries)
                await d.msg.nak(delay=min(0.1 * 2 ** d.deliveries, 5.0))
                return
        await self.bus.dead_letter(self.durable, d.msg, reason)
        await d.msg.ack()
        self.dead_lettered += 1


class _Progress:
    """The progress reports of one batch in hand (:meth:`DurableConsumer._heartbeat`), started by
    a timer ``ack_wait_s / 4`` after the fetch: a batch handled sooner -- nearly every one -- costs
    a timer set and cancelled, no task, and its cancellation does not yield (so the batch's acks
    and the next pull request leave in one socket write)."""

    def __init__(self, consumer: "DurableConsumer", msgs: list[Msg]) -> None:
        self._consumer = consumer
        self._msgs = msgs
        self._task: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(consumer.ack_wait_s / 4, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._consumer._heartbeat(self._msgs, now=True),
                                                            name=f"progress-{self._consumer.durable}")

    def cancel(self) -> asyncio.Task | None:
        """Stop reporting; returns the reporting task to await when one was started, else None."""
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
        return self._task


def _pending_after(msgs: list[Msg]) -> int:
    """Messages the consumer had pending after the newest of ``msgs`` was delivered (its
    metadata's ``num_pending``; 0 when a message carries no JetStream metadata)."""
    try:
        return int(msgs[-1].metadata.num_pending or 0)
    except Exception:  # noqa: BLE001 - not a JetStream delivery
        return 0


MessageHandler = Callable[[Delivery], Any]


def ephemeral_name() -> str:
    """A fresh random consumer name (22 hex digits, as nats.py's ``pull_subscribe`` makes)."""
    return uuid.uuid4().hex[:22]


#: seconds a JetStream API request of a consumer's (re)creation is given before it is sent
#: again (:func:`asked_again`; one that makes a new consumer each time: up to twice as long)
CREATE_ATTEMPT_S = 1.0


async def asked_again(what: str, call: Callable[[], Awaitable[Any]], *, total_s: float = 10.0,
                      before_retry: Callable[[], None] | None = None) -> Any:
    """``await call()`` (one JetStream API request), given :data:`CREATE_ATTEMPT_S` seconds and
    sent again while unanswered, until one is answered or ``total_s`` seconds have passed.
    ``before_retry()`` runs before each retry (a fresh consumer name, :func:`create_consumer`);
    such retries, each of which may leave a consumer behind, wait twice as long from the second
    on (1, 2, 2, ... s).

    Why: on a JetStream cluster a request sent while the meta leader is being elected (its node
    was killed) is never answered, and each of a reader's calls to make its consumer again --
    the durable's info, a fixed-name follower's delete of its leftover, the create -- waited the
    whole API timeout (10 s): readers resumed 10-22 s after the kill, against the ~5 s of the
    election. Growing every wait (1, 2, 4 s) made them resume at 7-15 s; renaming retries are
    spaced out because at 1 s, 300 followers made at once on a healthy cluster were answered
    slowly enough to ask ~2,800 times over (review of issue 15's change).

    Raises:
        asyncio.TimeoutError (``nats.errors.TimeoutError`` is one): no answer within ``total_s``.
        Whatever ``call`` raises otherwise (not retried: an answer that refuses).
    """
    per = CREATE_ATTEMPT_S
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_s
    while True:
        left = deadline - loop.time()
        try:
            return await asyncio.wait_for(call(), timeout=max(0.05, min(per, left)))
        except asyncio.TimeoutError:
            if loop.time() >= deadline:
                raise
            log.info("%s: not answered within %.1f s; asking again", what, per)
            if before_retry is not None:
                per = 2 * CREATE_ATTEMPT_S
                before_retry()


async def create_consumer(bus: "Bus", stream: str, config: api.ConsumerConfig, *, rename: bool = False,
                          total_s: float = 10.0) -> api.ConsumerInfo:
    """``add_consumer`` of a named consumer (``config.name`` or ``durable_name``), asked again
    while unanswered (:func:`asked_again`): under the same name, or with ``rename`` (an
    ephemeral consumer whose name nothing else knows) under a fresh random name, written into
    ``config.name`` -- the caller reads the consumer's name from there.

    Measured on a 3-node cluster (kill -9 of the consumer's node, the client on another): asked
    again under the same name, a create was answered after 3 to 6 s in some runs and never
    within 10 s in others, while a create under a new name, sent after those 10 s, was answered
    at once -- so ephemeral consumers take a new name each time. Creating a named consumer is
    idempotent: when a request under that name did create it and only its answer was lost,
    asking again gets that same consumer. A renamed attempt can leave the earlier one behind,
    if it was made after all; an ephemeral consumer nobody reads is removed by the server after
    its ``inactive_threshold``.

    Raises:
        asyncio.TimeoutError: no answer within ``total_s``.
        nats.js.errors.APIError: the server refused the config, or nothing serves the JetStream
            API (``ServiceUnavailableError``, 503: e.g. a JetStream domain no server has).
    """
    def fresh_name() -> None:
        config.name = ephemeral_name()

    return await asked_again(f"create of consumer {config.name or config.durable_name} on {stream}",
                             lambda: bus.js.add_consumer(stream, config), total_s=total_s,
                             before_retry=fresh_name if rename else None)


class StreamFollower:
    """Read a stream (optionally filtered) from a sequence and keep following it.

    Used to rebuild a service's state from the bus and then stay current. No acks: the follower
    remembers the last stream sequence it handled and, after any error (server restart,
    consumer gone, :class:`FeedLost`), recreates its ephemeral consumer from the next sequence.
    Messages arrive through a continuous pull (:class:`PullFeed`: pull requests of ``batch``
    topped up as they are delivered, not a fetch per batch). Without acks a message the client
    received but never handed over is gone for the server (with nats.py's ``fetch``, one
    cancelled by its timeout after it had taken messages off the subscription's queue, when a
    long cycle held the loop): the follower checks that the consumer's own delivery sequence has
    no gap, and on one recreates the consumer from the next stream sequence it has not handled
    (:attr:`gaps` counts them) -- a scheduler fed 1M submissions missed 225 before this check.

    Args:
        bus: the connection.
        stream_suffix: which stream.
        filter_subjects: subject filters (wildcards allowed); empty = whole stream.
        handler: ``handler(delivery)`` (sync or async), called in stream order. A
            :class:`~fedsched.errors.DecodeError` (or undecodable message) is dead-lettered
            and skipped, never stops the follower.
        name: for logs and dead letters.
        start_sequence: first stream sequence to read (1 = from the start).
        last_per_subject: start with the newest message of each subject instead (e.g. the latest
            inventory of every cluster), then follow.
        batch: messages per pull request (at most 1.5 x ``batch`` delivered and not yet
            handled at once).
        max_wait_s: with nothing delivered for this long (seconds) the follower counts itself
            caught up.
        fixed_name: use ``name`` as the consumer's name (deleting a leftover of the same name
            first) and create it through the filtered create subject, so NATS permissions can
            allow exactly this consumer; needs at most one filter subject. Default: a random
            name.
    """

    def __init__(self, bus: Bus, stream_suffix: str, handler: MessageHandler, *, name: str,
                 filter_subjects: Sequence[str] = (), start_sequence: int = 1, last_per_subject: bool = False,
                 batch: int = 500, max_wait_s: float = 0.2, fixed_name: bool = False) -> None:
        if fixed_name and len(filter_subjects) > 1:
            raise ValueError("a fixed-name follower takes one filter subject")
        self.fixed_name = fixed_name
        self.bus = bus
        self.stream = bus.stream_name(stream_suffix)
        self.handler = handler
        self.name = name
        self.filter_subjects = list(filter_subjects)
        self.last_per_subject = last_per_subject
        self.next_sequence = max(1, start_sequence)
        self.batch = batch
        self.max_wait_s = max_wait_s
        self.caught_up = asyncio.Event()
        self._stop = asyncio.Event()
        self._feed: PullFeed | None = None
        self._consumer = ""  #: the current consumer's name
        self._requests_before = 0  #: pull requests of the feeds closed so far (:attr:`pull_requests`)
        self.handled = 0
        self.gaps = 0  #: deliveries found missing (each re-read from the stream)
        self.pending = 0  #: messages after the last one handled (its JetStream num_pending)
        self._expect_delivery = 1  #: the consumer sequence the next delivery must carry
        #: deliveries of the first consumer that make up the backlog stored when it was created
        #: (None = unknown): :attr:`caught_up` is set once they are handled, even if new
        #: messages keep arriving behind them
        self._backlog: int | None = None

    async def _subscribe(self) -> None:
        self._expect_delivery = 1
        first = self.last_per_subject and self.next_sequence == 1
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT if first else api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=None if first else self.next_sequence,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        subjects = self.filter_subjects or [f"{self.bus.prefix}.>"]
        if len(subjects) > 1:
            config.filter_subjects = subjects
        if self.fixed_name:
            try:
                await asked_again(f"delete of consumer {self.name} on {self.stream}",
                                  lambda: self.bus.js.delete_consumer(self.stream, self.name))
            except nats.js.errors.NotFoundError:
                pass
            config.name = self.name
            config.filter_subject = subjects[0]
        else:  # what nats.py's pull_subscribe does, keeping the created consumer's info
            config.name = ephemeral_name()
            if len(subjects) == 1:
                config.filter_subject = subjects[0]
        info = await create_consumer(self.bus, self.stream, config, rename=not self.fixed_name)
        await self._close_feed()
        feed = PullFeed(self.bus.nc, self.bus.js_api_prefix, self.stream, config.name, batch=max(2, self.batch))
        await feed.start()
        self._feed, self._consumer = feed, config.name
        if not self.caught_up.is_set():  # the backlog: what was stored when the consumer was made
            self._backlog = int(getattr(info, "num_pending", 0) or 0)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    async def _close_feed(self) -> None:
        feed, self._feed = self._feed, None
        if feed is not None:
            self._requests_before += feed.requests
            await feed.close()

    @property
    def pull_requests(self) -> int:
        """Pull requests sent so far, over every consumer this follower made (a count)."""
        return self._requests_before + (self._feed.requests if self._feed is not None else 0)

    async def consumer_info(self) -> api.ConsumerInfo | None:
        """The current consumer's info from the server (None before the first consumer exists).

        Raises:
            nats.js.errors.NotFoundError: the consumer is being recreated.
        """
        if not self._consumer:
            return None
        return await self.bus.js.consumer_info(self.stream, self._consumer)

    async def lag(self) -> int:
        """Messages of the stream (within the filter) not yet handled, as JetStream counted them
        when the last one was delivered (0 once caught up); the ``consumer_lag_messages`` sample."""
        return self.pending

    async def delete(self) -> None:
        """Delete a fixed-name follower's consumer now (random-name ones expire by themselves)."""
        if self.fixed_name:
            try:
                await self.bus.js.delete_consumer(self.stream, self.name)
            except Exception:  # noqa: BLE001 - already gone or the connection is closing
                pass

    async def run(self) -> None:
        """Follow until :meth:`stop`; sets :attr:`caught_up` once the backlog is read."""
        reader = READERS.add(self.stream, self.filter_subjects or [f"{self.bus.prefix}.>"])
        try:
            await self._run()
        finally:
            READERS.remove(reader)
            await self._close_feed()

    async def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self._feed is None:
                    await self._subscribe()
                msgs = await self._feed.take(self.max_wait_s)
                if not msgs:  # nothing within max_wait_s: read up to now
                    self.caught_up.set()
                    continue
                turns = Turns()
                for msg in msgs:
                    await turns.take()
                    delivered = msg.metadata.sequence.consumer
                    if delivered != self._expect_delivery:  # a delivery was lost: re-read from the stream
                        self.gaps += 1
                        log.warning("follower %s: delivery %d arrived, %d expected; re-reading from stream "
                                    "sequence %d", self.name, delivered, self._expect_delivery, self.next_sequence)
                        await self._close_feed()
                        break
                    self._expect_delivery = delivered + 1
                    await self._one(msg)
                if self._feed is None:
                    continue
                if msgs and (msgs[-1].metadata.num_pending == 0 or
                             (self._backlog is not None and msgs[-1].metadata.sequence.consumer >= self._backlog)):
                    self.caught_up.set()  # (under a steady flow num_pending may never be 0: the backlog counts)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - rebuild from the next sequence
                if self._stop.is_set():
                    break
                log.log(logging.WARNING if backoff >= BACKOFF_CAP_S else logging.INFO,
                        "follower %s: %s; resuming from sequence %d in %.1fs", self.name, described(e),
                        self.next_sequence, backoff)
                await self._close_feed()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_CAP_S)

    async def _one(self, msg: Msg) -> None:
        md = msg.metadata
        seq = md.sequence.stream
        if seq < self.next_sequence:  # a redelivery from a consumer we already replaced
            return
        self.next_sequence = seq + 1
        self.pending = int(md.num_pending or 0)
        try:
            env = _decode(msg)
            delivery = Delivery(env, msg.subject, dict(msg.headers or {}), seq, 1, None, _stored_at(md),
                                pending=int(md.num_pending or 0))
            result = self.handler(delivery)
            if asyncio.iscoroutine(result):
                await result
            self.handled += 1
        except DecodeError as e:
            await self.bus.dead_letter(self.name, msg, e.reason)
        except Exception as e:  # noqa: BLE001 - never stop following; never lose the message
            log.exception("follower %s: handler failed on sequence %d", self.name, seq)
            await self.bus.dead_letter(self.name, msg, f"handler failed: {e!r}")
