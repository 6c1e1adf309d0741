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
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import zlib
from dataclasses import MISSING, fields
from typing import Any

import nats.js.errors

from fedsched.jobs import AttemptState, JobSpec, JobState
from fedsched.snapshots import ModelTable
from services.admission.jobview import AttemptRecord, Decision, JobRecord, ShardRecord

log = logging.getLogger(__name__)

BUCKET = "jobs_ended"  #: KV bucket suffix (``<prefix>_jobs_ended``)
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
    for f in fields(obj):
        if f.name in skip or f.name in extra:
            continue
        value = getattr(obj, f.name)
        if f.default is not MISSING and value == f.default:
            continue
        if f.default_factory is not MISSING and value == f.default_factory():
            continue
        out[f.name] = value
    out.update((k, v) for k, v in extra.items() if v)
    return out


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

    def put(self, rec: JobRecord) -> None:
        """Queue ``rec`` (a job leaving the view) for the bucket; O(size of the record)."""
        self.pending[rec.job_id] = encode_record(rec)
        self._wake.set()

    async def _bucket(self):
        if self._kv is None:
            self._kv = await self.bus.key_value(BUCKET)
        return self._kv

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
            try:
                entry = await (await self._bucket()).get(job_id)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return None
            except Exception as e:  # noqa: BLE001 - an outage reads as not found; logged
                log.warning("ended jobs: cannot read %s: %s", job_id, e)
                return None
            data = entry.value
            if not data:
                return None
        try:
            return decode_record(data)
        except ValueError as e:
            log.warning("ended jobs: %s: %s", job_id, e)
            return None
