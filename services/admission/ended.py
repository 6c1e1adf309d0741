"""Ended jobs that left admission's memory: a compact read model in a NATS KV bucket.

The job view (:class:`~services.admission.jobview.JobView`) keeps the open jobs and the newest
``retain_ended`` ended ones. An older ended job is handed to :class:`EndedJobs`, which writes
its whole record (spec, shards, attempts, latest decisions, reasons) as zlib-compressed JSON
under its job id in the bucket ``<prefix>_jobs_ended`` (one value per job, history 1). GetJob,
WatchJob and ExplainJob of a job not in the view read it from there, so a job that ended long
ago is still returned with its state and attempts. Only admission reads and writes the bucket
(``fedapp/natsauth.py``).

Why a KV read model rather than ClickHouse: the record is exactly what the view held (no second
fold of the audit log to keep in step), it survives restarts (a rebuild hands the same records
to the bucket again: the same bytes under the same key), and admission needs no store client.

The record codec (:func:`record_doc` / :func:`record_from_doc`) is also the job part of
admission's snapshot (:mod:`services.admission.snapshot`).

Writes are asynchronous: :meth:`EndedJobs.put` is called from the view's fold (synchronous),
keeps the encoded record in :attr:`EndedJobs.pending` (where :meth:`EndedJobs.get` finds it too)
and :meth:`EndedJobs.flush` writes what is pending; a failed write stays pending.

Idempotency asks the bucket about every new submission that carries a request id (was its job
archived?). A batch (SubmitJobs) asks about all of its ids in one request: JetStream's batch
direct get (``multi_last`` on ``$JS.API.DIRECT.GET.<stream>``, nats-server >= 2.11, on a bucket
created with ``allow_direct``), answered by the records found and an end-of-batch status -- so
the common case of all-new ids costs one round trip per call, not one per item. A bucket created
before it allowed direct gets (its stream config says ``allow_direct`` off) is asked key by key,
as before, through the stream leader.

Direct gets on a replicated bucket: with ``allow_direct`` every replica answers them -- also a
follower behind the leader -- and nats.py's ``kv.get`` uses direct gets on such a bucket too. A
lagging follower's "not found" for a retried request id whose job left the view would make a
second job (stop-12 review). So a direct answer is trusted as it is only on a bucket of one
replica; on a replicated one (read from the stream's config when the bucket is opened) a found
record stands (records are only ever written, with the same bytes) but every miss is confirmed
by the stream leader: a non-direct ``STREAM.MSG.GET`` by last subject (one request per miss, at
once). A batch answered by a status (503 during a leader election, 408) is retried after
:data:`BATCH_RETRY_S`; only the stream's config turns batches off for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import zlib
from dataclasses import MISSING, fields
from typing import Any, Iterable

import nats.js.errors

from fedsched.jobs import AttemptState, JobSpec, JobState
from fedsched.snapshots import ModelTable
from services.admission.jobview import AttemptRecord, Decision, JobRecord, ShardRecord

log = logging.getLogger(__name__)

BUCKET = "jobs_ended"  #: KV bucket suffix (``<prefix>_jobs_ended``)
#: keys per batch direct get (the server takes at most 1024 subjects per ``multi_last``)
BATCH_KEYS = 256
#: after a batch get went unanswered (or failed), ask key by key for this long (seconds)
BATCH_RETRY_S = 60.0
CODEC_VERSION = 2
_KEY = re.compile(r"^[-_=.a-zA-Z0-9]{1,64}$")  # a job id usable as a KV key (ours: j- and 20 hex characters)


def record_doc(rec: JobRecord, specs: ModelTable | None = None) -> dict[str, Any]:
    """A JSON-ready document of one job record (everything but the watchers' bookkeeping); with
    ``specs`` the spec is a reference into that table (a snapshot's shared specs)."""
    doc = {
        "job_id": rec.job_id,
        "spec": specs.ref(rec.spec) if specs is not None else rec.spec.model_dump(mode="json", exclude_defaults=True),
        "submitted_at": rec.submitted_at, "submitted_by": rec.submitted_by, "request_id": rec.request_id,
        "shards": [_lean(sh, attempts=[_lean(a) for a in sh.attempts],
                         decision=_lean(sh.decision) if sh.decision is not None else None) for sh in rec.shards],
        "version": rec.version,
    }
    doc.update(_lean(rec, _SKIP_JOB))
    return doc


_SKIP_JOB = frozenset({"job_id", "spec", "submitted_at", "submitted_by", "request_id", "shards", "version",
                       "counted_state", "listed"})


def _lean(obj: Any, skip: frozenset[str] = frozenset(), **extra: Any) -> dict[str, Any]:
    """The fields of dataclass ``obj`` that differ from their defaults (the rest are implied),
    plus ``extra``; fields in ``skip`` left out."""
    out: dict[str, Any] = {}
    for name, default, factory in _defaults(type(obj)):
        if name in skip or name in extra:
            continue
        value = getattr(obj, name)
        if default is not MISSING and value == default:
            continue
        if factory is not MISSING and value == factory():
            continue
        out[name] = value
    out.update((k, v) for k, v in extra.items() if v)
    return out


_DEFAULTS: dict[type, tuple[tuple[str, Any, Any], ...]] = {}


def _defaults(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, default, default_factory) of each field of dataclass ``cls``, in order
    (``MISSING`` where there is none), read once per class: :func:`dataclasses.fields` builds
    its tuple on every call, two thirds of a checkpoint walk's time (issue 15)."""
    known = _DEFAULTS.get(cls)
    if known is None:
        known = _DEFAULTS[cls] = tuple((f.name, f.default, f.default_factory) for f in fields(cls))
    return known


def record_from_doc(doc: dict[str, Any], specs: list[JobSpec] | None = None) -> JobRecord:
    """The job record of a :func:`record_doc` document (``specs``: the loaded table its spec
    refers to, if it was written with one).

    Raises:
        KeyError, ValueError, TypeError: not such a document (pydantic's ValidationError is a
            ValueError).
    """
    shards = []
    for sh in doc["shards"]:
        attempts = [AttemptRecord(**{**a, "outcome": AttemptState(a.get("outcome", AttemptState.PLACED))})
                    for a in sh.get("attempts", ())]
        d = sh.get("decision")
        decision = Decision(**{**d, "evaluations": tuple(d["evaluations"])}) if d else None
        shards.append(ShardRecord(sh["index"], JobState(sh.get("state", JobState.QUEUED)), sh.get("reason", ""),
                                  attempts, decision, sh.get("failures", 0), sh.get("unplaceable", False),
                                  sh.get("ended_at")))
    spec = specs[doc["spec"]] if specs is not None else JobSpec.model_validate(doc["spec"])
    return JobRecord(doc["job_id"], spec, doc["submitted_at"], doc["submitted_by"], doc["request_id"], shards,
                     doc.get("cancelled", False), doc.get("cancel_requested", False), doc.get("cancel_reason", ""),
                     doc.get("policy_version", ""), doc.get("approval_id", ""), doc["version"], doc.get("held", False),
                     doc.get("hold_reason", ""), doc.get("holds", 0), doc.get("priority_changes", 0))


def encode_record(rec: JobRecord) -> bytes:
    """zlib-compressed JSON of ``{"v": CODEC_VERSION, "job": record_doc(rec)}``."""
    return zlib.compress(json.dumps({"v": CODEC_VERSION, "job": record_doc(rec)}, separators=(",", ":")).encode())


def decode_record(data: bytes) -> JobRecord:
    """The record of :func:`encode_record`'s bytes.

    Raises:
        ValueError: corrupt, or written by an incompatible codec version.
    """
    try:
        doc = json.loads(zlib.decompress(data))
    except (zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not an ended-job record: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != CODEC_VERSION:
        raise ValueError(f"ended-job record of codec version {doc.get('v') if isinstance(doc, dict) else '?'}, "
                         f"this build reads {CODEC_VERSION}")
    try:
        return record_from_doc(doc["job"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed ended-job record: {e!r}") from e


class EndedJobs:
    """The ended-jobs read model (module docstring).

    Args:
        bus: the admission's bus (None: records stay in :attr:`pending`, for tests without NATS).
    """

    def __init__(self, bus: Any | None) -> None:
        self.bus = bus
        self.pending: dict[str, bytes] = {}  #: job id -> encoded record not yet written
        self.written = 0  #: records written to the bucket so far
        self._kv = None
        self._wake = asyncio.Event()
        #: requests sent to the bucket by :meth:`get` / :meth:`get_many` (one per batch, or
        #: per key where batches are not possible): the idempotency lookups' round trips
        self.lookups = 0
        #: batch direct gets work on this bucket (None: not answered yet; True: a batch was
        #: answered; False: the stream allows no direct gets, asked key by key for good)
        self.batch_gets: bool | None = None
        #: loop time before which batches are not tried after one went unanswered (a request
        #: the server never answers, e.g. one it does not permit, would hold every call)
        self._batch_retry_at = 0.0
        #: replicas of the bucket's stream (None: not known yet -- misses are confirmed)
        self.replicas: int | None = None
        #: misses of a direct get confirmed with the stream leader (replicated buckets only)
        self.leader_reads = 0
        self._direct: bool | None = None  #: the stream's ``allow_direct`` (None: not known yet)
        self._replies: _BatchReplies | None = None  #: where batch gets are answered (:meth:`_batch_get`)

    def put(self, rec: JobRecord) -> None:
        """Queue ``rec`` (a job leaving the view) for the bucket; O(size of the record)."""
        self.pending[rec.job_id] = encode_record(rec)
        self._wake.set()

    @property
    def _stream(self) -> str:
        return f"KV_{self.bus.prefix}_{BUCKET}"

    async def _bucket(self):
        """The bucket (created allowing direct gets if it is not there yet), its stream's replicas
        and ``allow_direct`` read once (:attr:`replicas`; no direct gets: :attr:`batch_gets` False).

        Raises:
            whatever the bus raises (the bucket is opened again on the next call).
        """
        if self._kv is None:
            kv = await self.bus.key_value(BUCKET, direct=True)
            config = (await self.bus.js.stream_info(self._stream)).config
            self.replicas = config.num_replicas or 1
            self._direct = bool(config.allow_direct)
            if not self._direct:
                self.batch_gets = False  # the stream's own config: never a batch here
            self._kv = kv
        return self._kv

    def _confirm_misses(self) -> bool:
        """A direct get's "not found" may come from a follower behind the leader: true unless the
        bucket is known to have one replica, or allows no direct gets (its gets go to the leader)."""
        return self._direct is not False and (self.replicas is None or self.replicas > 1)

    async def _leader_value(self, job_id: str) -> bytes | None:
        """The stored value of ``job_id`` as the stream leader has it (a non-direct
        ``STREAM.MSG.GET`` by last subject); None: not there, or deleted.

        Raises:
            whatever the bus raises but "not found".
        """
        self.lookups += 1
        self.leader_reads += 1
        try:
            msg = await self.bus.js.get_last_msg(self._stream, f"$KV.{self.bus.prefix}_{BUCKET}.{job_id}")
        except nats.js.errors.NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data or None

    async def flush(self) -> int:
        """Write every pending record; returns how many are still pending (failed writes).

        Raises:
            nothing: a bus error leaves the records pending (logged).
        """
        if self.bus is None or not self.pending:
            return len(self.pending)
        try:
            kv = await self._bucket()
        except Exception as e:  # noqa: BLE001 - the bus may be down; retried at the next flush
            log.warning("ended jobs: bucket unavailable, %d records pending: %s", len(self.pending), e)
            return len(self.pending)
        for job_id, data in list(self.pending.items()):
            try:
                await kv.put(job_id, data)
            except Exception as e:  # noqa: BLE001
                log.warning("ended jobs: cannot write %s (%d pending): %s", job_id, len(self.pending), e)
                break
            if self.pending.get(job_id) is data:
                del self.pending[job_id]
            self.written += 1
        return len(self.pending)

    async def run(self, stop: asyncio.Event, retry_s: float = 1.0) -> None:
        """Flush whenever records are queued (retrying failed writes every ``retry_s``) until
        ``stop`` is set; a last flush on the way out."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), retry_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.flush()
        await self.flush()

    async def get(self, job_id: str) -> JobRecord | None:
        """The record of an ended job that left the view (None: unknown or unreadable).

        Raises:
            nothing: a bus error or a corrupt value is logged and reads as None.
        """
        data = self.pending.get(job_id)
        if data is None:
            if self.bus is None or not _KEY.match(job_id):
                return None
            self.lookups += 1
            try:
                kv = await self._bucket()
                try:
                    data = (await kv.get(job_id)).value
                except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                    data = None
                if not data and self._confirm_misses():
                    data = await self._leader_value(job_id)
            except Exception as e:  # noqa: BLE001 - an outage reads as not found; logged
                log.warning("ended jobs: cannot read %s: %s", job_id, e)
                return None
            if not data:
                return None
        try:
            return decode_record(data)
        except ValueError as e:
            log.warning("ended jobs: %s: %s", job_id, e)
            return None

    async def get_many(self, job_ids: Iterable[str], timeout_s: float = 2.0) -> dict[str, JobRecord]:
        """The records of those of ``job_ids`` that ended and left the view (absent: unknown or
        unreadable), as :meth:`get` answers each, in one bucket request per :data:`BATCH_KEYS`
        ids (module docstring); pending records are answered from memory.

        Raises:
            nothing: a bus error or a corrupt value is logged and reads as not found (the
                caller tells an archived job from a new one by the view's tombstones).
        """
        found: dict[str, JobRecord] = {}
        ask: list[str] = []
        for job_id in dict.fromkeys(job_ids):
            data = self.pending.get(job_id)
            if data is not None:
                rec = self._decoded(job_id, data)
                if rec is not None:
                    found[job_id] = rec
            elif self.bus is not None and _KEY.match(job_id):
                ask.append(job_id)
        for i in range(0, len(ask), BATCH_KEYS):
            chunk = ask[i:i + BATCH_KEYS]
            batch = self.batch_gets is not False and asyncio.get_running_loop().time() >= self._batch_retry_at
            values = await self._batch_get(chunk, timeout_s) if batch else None
            if values is None:  # no batch gets here (or for now): key by key, at once
                records = await asyncio.gather(*(self.get(job_id) for job_id in chunk))
                found.update((job_id, rec) for job_id, rec in zip(chunk, records) if rec is not None)
                continue
            misses = [job_id for job_id in chunk if job_id not in values]
            if misses and self._confirm_misses():  # a follower may be behind: ask the leader
                confirmed = await asyncio.gather(*(self._leader_value(j) for j in misses), return_exceptions=True)
                for job_id, data in zip(misses, confirmed):
                    if isinstance(data, BaseException):
                        log.warning("ended jobs: cannot read %s: %r", job_id, data)
                    elif data:
                        values[job_id] = data
            for job_id, data in values.items():
                rec = self._decoded(job_id, data)
                if rec is not None:
                    found[job_id] = rec
        return found

    async def _batch_get(self, job_ids: list[str], timeout_s: float) -> dict[str, bytes] | None:
        """job id -> stored value of those of ``job_ids`` (valid keys) the bucket holds, by one
        batch direct get (a direct answer: on a replicated bucket the caller confirms misses);
        None when the bucket's stream allows no direct gets (:attr:`batch_gets` False, from its
        config), or the batch was answered by a status or failed (logged; no batch for
        :data:`BATCH_RETRY_S`: the caller asks key by key). The answer comes to the connection's
        reply subscription (:class:`_BatchReplies`), within ``timeout_s`` seconds."""
        try:
            await self._bucket()  # created (allowing direct gets) if it is not there yet
        except Exception as e:  # noqa: BLE001 - the bus may be down; the caller's gets log it too
            log.warning("ended jobs: bucket unavailable: %s", e)
            return None
        if self.batch_gets is False:
            return None
        nc = self.bus.nc
        stream = f"KV_{self.bus.prefix}_{BUCKET}"
        prefix = f"$KV.{self.bus.prefix}_{BUCKET}."
        body = json.dumps({"multi_last": [prefix + j for j in job_ids], "batch": len(job_ids)},
                          separators=(",", ":")).encode()
        self.lookups += 1
        loop = asyncio.get_running_loop()
        batch = _Batch(prefix, loop.create_future())
        replies = None
        try:
            replies = await self._replies_of(nc)
            inbox = replies.expect(batch)
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", body, reply=inbox)
            status = await asyncio.wait_for(batch.done, timeout_s)
            if status is None:  # end of batch / none of the keys
                self.batch_gets = True
                return batch.values
            # e.g. 503 during a leader election, 408: try batches again later
            log.info("ended jobs: batch get not answered (%s); key by key for %g s", status, BATCH_RETRY_S)
            self._batch_retry_at = loop.time() + BATCH_RETRY_S
            return None
        except Exception as e:  # noqa: BLE001 - an outage or a timeout: the caller asks key by key (and logs)
            log.warning("ended jobs: batch get of %d keys failed (%r); key by key for %g s", len(job_ids), e,
                        BATCH_RETRY_S)
            self._batch_retry_at = asyncio.get_running_loop().time() + BATCH_RETRY_S
            return None
        finally:
            if replies is not None:
                replies.forget(batch)

    async def _replies_of(self, nc: Any) -> "_BatchReplies":
        """The reply subscription of batch gets on connection ``nc`` (made on first use, and
        again for a new connection)."""
        replies = self._replies
        if replies is None or replies.nc is not nc:
            replies = _BatchReplies(nc)
            await replies.subscribe()
            self._replies = replies
        return replies

    @staticmethod
    def _decoded(job_id: str, data: bytes) -> JobRecord | None:
        try:
            return decode_record(data)
        except ValueError as e:
            log.warning("ended jobs: %s: %s", job_id, e)
            return None


class _Batch:
    """One batch direct get's answer as it arrives: the values found (job id -> stored bytes,
    keys under ``prefix``), and ``done`` -- set to None at the end-of-batch status (204, or 404:
    none of the keys), or to ``"<status> <description>"`` when the server answered with another
    status (the batch was not served)."""

    __slots__ = ("prefix", "done", "values", "token")

    def __init__(self, prefix: str, done: asyncio.Future) -> None:
        self.prefix = prefix
        self.done = done
        self.values: dict[str, bytes] = {}
        self.token = ""  #: its reply subject's last token (:meth:`_BatchReplies.expect`)

    def arrive(self, msg: Any) -> None:
        """Take one message of the answer."""
        if self.done.done():  # (a message after the end, or after the caller gave up)
            return
        headers = msg.headers or {}
        status = headers.get("Status")
        if status in ("204", "404"):
            self.done.set_result(None)
        elif status:
            self.done.set_result(f"{status} {headers.get('Description', '')}")
        else:
            subject = headers.get("Nats-Subject", "")
            if subject.startswith(self.prefix) and headers.get("KV-Operation") not in ("DEL", "PURGE") and msg.data:
                self.values[subject[len(self.prefix):]] = msg.data


class _BatchReplies:
    """One wildcard inbox subscription of a connection for the answers of every batch direct get
    (each request's reply subject is ``<inbox>.<n>``): a lookup per ``SubmitJobs`` call costs no
    subscribe and unsubscribe of an inbox of its own, nor a timer task per message read. An
    answer for a request no longer waiting (timed out) is dropped, as an unsubscribed inbox's was.

    Args:
        nc: the NATS connection.
    """

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox() + "."
        self._waiting: dict[str, _Batch] = {}
        self._next = 0

    async def subscribe(self) -> None:
        """Subscribe to the replies (raises what ``nc.subscribe`` raises)."""
        await self.nc.subscribe(self.prefix + "*", cb=self._arrive)

    def expect(self, batch: _Batch) -> str:
        """Register ``batch`` and give the reply subject its request must carry."""
        self._next += 1
        batch.token = str(self._next)
        self._waiting[batch.token] = batch
        return self.prefix + batch.token

    def forget(self, batch: _Batch) -> None:
        """``batch`` no longer waits (answered, failed or timed out)."""
        self._waiting.pop(batch.token, None)

    async def _arrive(self, msg: Any) -> None:
        batch = self._waiting.get(msg.subject[len(self.prefix):])
        if batch is not None:
            batch.arrive(msg)
