"""Restart checkpoints: a service's state with the stream sequence it reflects, in a NATS
object store (issue 15 item 3, issue 14 item 8).

A service that rebuilds itself from the events stream (the scheduler, admission) periodically
writes a *snapshot*: its state as a JSON document (live jobs and what later events need of the
ended ones), zlib-compressed, with ``applied_seq`` -- the last stream sequence folded into it.
On start it loads the newest snapshot, restores the state and reads the stream only after
``applied_seq``; because every fold is idempotent, an event already reflected in the snapshot
and read again changes nothing.

Storage: the object store bucket ``<prefix>_snapshot_<service>`` (stream ``OBJ_...``; objects
are chunked, so a snapshot may exceed the server's max payload), one object ``latest``,
replaced by each write (nats.py purges the previous chunks). Only the service itself may read or
write its bucket (``fedapp/natsauth.py``).

Wire format (:func:`encode` / :func:`decode`)::

    zlib(JSON {"format": FORMAT, "service": str, "version": int, "applied_seq": int,
               "written_at": ISO-8601 UTC, "state": {...}})

``version`` is the service's own state schema version. A snapshot that cannot be read (corrupt,
another format or version, another service) raises :class:`SnapshotError`; the service then
logs a warning and falls back to the full read from sequence 1.

Writing without stopping the service (:class:`ForkedCapture`): walking a million jobs to build
the state document takes seconds, and the service's event loop must not stop for that. The
capture is a ``fork()``: the child process holds a copy-on-write image of the service's memory
as it was at that instant (the Redis ``BGSAVE`` technique), builds the state and encodes it
there, and writes the bytes to a pipe; the parent's loop does one ``fork`` and reads the pipe
in a worker thread, then uploads the bytes (the object store put yields between chunks). The
work on the loop does not depend on how many jobs are held (the kernel copies the page tables
during ``fork``: ~26 ms at 1.5 GiB RSS on the project's machine, against seconds of walking).
The child runs at a lower CPU priority (:data:`CHILD_NICE`): a checkpoint is background work,
and on a machine the services share (``fedsched up`` on two cores) it takes the CPU they leave
rather than a share of the placements' (Redis, for the same reason, lets an operator pin its
``BGSAVE`` child to other CPUs: ``bgsave_cpulist``).
Where ``fork`` is missing the state is built on the loop and encoded in a thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import warnings
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
import orjson

log = logging.getLogger(__name__)

FORMAT = "fedsched-snapshot/1"
OBJECT = "latest"
#: how much nicer (``os.nice`` increment, 0-19) than its service a checkpoint's forked child
#: runs: at +10 the kernel's fair scheduler gives it about a tenth of the CPU a service at +0
#: gets while both want it (CFS weights 110 vs 1024), and all of it when the services idle
CHILD_NICE = 10


class SnapshotError(ValueError):
    """A snapshot that cannot be used (corrupt, incompatible format or version, other service)."""


@dataclass(frozen=True)
class Snapshot:
    """A decoded snapshot: ``applied_seq`` is the last events-stream sequence its state reflects."""

    service: str
    version: int
    applied_seq: int
    written_at: str
    state: dict[str, Any]


def encode(service: str, version: int, applied_seq: int, state: dict[str, Any], *, at: datetime | None = None) -> bytes:
    """The bytes of a snapshot (module docstring); ``state`` must be JSON-ready: dicts, lists,
    strings, finite numbers, booleans and None (dict keys strings or integers, which become
    strings, as the ``json`` module writes them), and ``orjson.Fragment`` -- JSON text written
    as is (a pydantic model's ``model_dump_json``: no dict built for it).

    Encoded with orjson (issue 15): a 50,000-job admission state (116 MB of JSON) in 0.24 s
    against 1.49 s with the ``json`` module, the same bytes (both compact; orjson writes
    non-ASCII as UTF-8 where ``json`` escapes it, which reads back the same). A non-finite
    float -- none in the services' states: every number there comes from a validated event,
    whose types refuse them, or from the clock -- would be written as ``null``.

    Raises:
        TypeError: a value that is not JSON-ready (orjson.JSONEncodeError), or an integer
            beyond 64 bits.
    """
    doc = {"format": FORMAT, "service": service, "version": version, "applied_seq": applied_seq,
           "written_at": (at or datetime.now(UTC)).isoformat(), "state": state}
    return zlib.compress(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS), 1)


def decode(data: bytes, service: str, version: int) -> Snapshot:
    """The snapshot in ``data``.

    Raises:
        SnapshotError: not a snapshot, or one of another format, service or state version.
    """
    try:
        with collector_paused():
            doc = orjson.loads(zlib.decompress(data))
    except (zlib.error, orjson.JSONDecodeError) as e:  # (orjson's: also for bytes that are not UTF-8)
        raise SnapshotError(f"corrupt snapshot: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError(f"not a {FORMAT} snapshot")
    if doc.get("service") != service:
        raise SnapshotError(f"a snapshot of {doc.get('service')!r}, not of {service!r}")
    if doc.get("version") != version:
        raise SnapshotError(f"{service} snapshot of state version {doc.get('version')}, this build reads {version}")
    seq, state = doc.get("applied_seq"), doc.get("state")
    if not isinstance(seq, int) or seq < 0 or not isinstance(state, dict):
        raise SnapshotError("snapshot without a sequence or state")
    return Snapshot(service, version, seq, str(doc.get("written_at", "")), state)


def checkpoint_due(*, applied_seq: int, written_seq: int, now: float, written_at: float, every_s: float,
                   every_events: int, retry_at: float = 0.0, force: bool = False) -> bool:
    """Whether a service should write its next restart checkpoint (the rule the scheduler and
    admission share).

    Due when something was folded since the last one (``applied_seq > written_seq``, stream
    sequences) and either ``every_events`` events or ``every_s`` seconds (``now`` and
    ``written_at`` on one clock) have passed since it -- or at once with ``force``. After a
    failed attempt the caller sets ``retry_at`` (``now`` plus a period): nothing is due before
    it unless forced, so a capture that keeps failing costs one fork per period, not one per
    chance (admission forked its 1 GB image every second while its children crashed).
    """
    if applied_seq <= written_seq:
        return False
    if force:
        return True
    if now < retry_at:
        return False
    return applied_seq - written_seq >= every_events or now - written_at >= every_s


@contextmanager
def collector_paused():
    """Pause Python's cyclic garbage collector for a bulk load (restoring a checkpoint).

    A restore allocates millions of long-lived containers; each 700 allocations start a young
    collection and every so many a full one over everything already loaded, which makes the
    load superlinear (measured: a third of a restore's time at 50,000 jobs). Reference counting
    still frees everything that is not a cycle; the collector resumes (if it was on) at the
    end, error or not.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class ForkedCapture:
    """A snapshot captured at one instant and encoded in a forked child (module docstring).

    ``ForkedCapture(build)`` forks at once (the capture instant: the child sees the service's
    memory exactly as it was then, whatever the parent's loop does afterwards); the child
    calls ``build()`` -- a function returning the snapshot's bytes, e.g. ``lambda:
    encode(...)`` over the service's state -- writes them to a pipe and exits with
    ``os._exit`` (no atexit handlers, no buffered output, no event loop run in the child).
    :meth:`result` awaits the bytes without blocking the loop. Without ``os.fork`` (or with
    ``in_child=False``) ``build`` runs at construction, on the caller's thread.

    Args:
        build: the snapshot's bytes; must not await nor touch sockets (it runs in the child).
        timeout_s: the child is killed when it has not delivered within this many seconds.
        in_child: False to build in this process (tests of the fallback).
        nice: the child's niceness increment (:data:`CHILD_NICE`; 0 = as the service).
    """

    def __init__(self, build: Callable[[], bytes], *, timeout_s: float = 900.0, in_child: bool = True,
                 nice: int = CHILD_NICE) -> None:
        self.timeout_s = timeout_s
        self.pid = 0
        self._fd = -1
        self._data: bytes | None = None
        if not in_child or not hasattr(os, "fork"):
            self._data = build()
            return
        r, w = os.pipe()
        with warnings.catch_warnings():
            # (3.12+ warns that forking a threaded process may deadlock the child: this child
            # takes no lock another thread may hold -- it walks its own copy of Python objects,
            # encodes, writes to a pipe and leaves with os._exit; a stuck one is killed)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: a frozen image of the service
            code = 1
            try:
                os.close(r)
                if nice:
                    os.nice(nice)  # (the increment saturates at 19; unprivileged, it only ever lowers)
                gc.disable()  # (a collection would touch, hence copy, every page of the image)
                data = memoryview(build())
                while data:
                    data = data[os.write(w, data):]
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the parent as a failed capture
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self._fd = pid, r

    @staticmethod
    def _collect(fd: int, pid: int) -> tuple[bytes, int]:
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        return b"".join(chunks), status

    async def result(self) -> bytes:
        """The snapshot's bytes.

        Raises:
            SnapshotError: the child failed, was killed or timed out (nothing to write).
        """
        if self._data is not None or self.pid == 0:
            return self._data or b""
        pid, fd = self.pid, self._fd
        self.pid, self._fd = 0, -1
        work = asyncio.ensure_future(asyncio.to_thread(self._collect, fd, pid))
        try:
            data, status = await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except asyncio.CancelledError:
            _kill(pid)  # its pipe closes: the reading thread ends and reaps it
            raise
        except asyncio.TimeoutError:
            _kill(pid)
            await asyncio.gather(work, return_exceptions=True)
            raise SnapshotError(f"snapshot child did not deliver within {self.timeout_s} s") from None
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            raise SnapshotError(f"snapshot child failed (wait status {status})")
        self._data = data
        return data

    async def discard(self) -> None:
        """Abandon the capture (kill the child, reap it)."""
        if self.pid:
            pid, fd = self.pid, self._fd
            self.pid, self._fd = 0, -1
            _kill(pid)
            await asyncio.to_thread(self._collect, fd, pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SnapshotStore:
    """A service's snapshot bucket (module docstring).

    Args:
        bus: the service's :class:`~fedsched.bus.Bus` (``js`` and ``prefix`` are used).
        service: ``scheduler`` or ``admission`` (the bucket's suffix).
    """

    def __init__(self, bus: Any, service: str) -> None:
        self.bus = bus
        self.service = service
        self.bucket = f"{bus.prefix}_snapshot_{service}"
        self._store = None

    async def _objects(self, create: bool):
        if self._store is None:
            try:
                self._store = await self.bus.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    return None
                self._store = await self.bus.js.create_object_store(self.bucket)
        return self._store

    async def write(self, data: bytes) -> None:
        """Replace the snapshot with ``data`` (:func:`encode`'s bytes).

        Raises:
            nats.errors.Error: the bus refused (the caller logs it and tries again later).
        """
        store = await self._objects(create=True)
        await store.put(OBJECT, data)

    async def read(self) -> bytes | None:
        """The newest snapshot's bytes, None when there is none (or the bucket is unreadable:
        logged; the caller reads the whole stream)."""
        try:
            store = await self._objects(create=False)
            if store is None:
                return None
            return (await store.get(OBJECT)).data
        except nats.js.errors.ObjectNotFoundError:
            return None
        except (nats.js.errors.Error, nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("%s: snapshot bucket %s unreadable (%s); reading the whole stream", self.service,
                        self.bucket, e)
            return None

    async def load(self, version: int) -> Snapshot | None:
        """The newest usable snapshot, or None (none, unreadable, corrupt or incompatible: warned)."""
        data = await self.read()
        if data is None:
            return None
        try:
            return decode(data, self.service, version)
        except SnapshotError as e:
            log.warning("%s: snapshot not used (%s); reading the whole stream", self.service, e)
            return None


class ModelTable:
    """Identical pydantic models written once in a snapshot (jobs often share a spec: parsing
    and validating one per job is most of a restore's cost).

    :meth:`ref` gives a model's index in :attr:`docs` (keyed by its JSON, so equal models share
    one entry); :func:`load_models` validates each entry once, and equal models come back as one
    shared (immutable) instance.
    """

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self.docs: list[str] = []  #: the models' JSON texts, in index order

    def ref(self, model: Any) -> int:
        """The index of ``model`` (a frozen pydantic model), adding it if new."""
        text = model.model_dump_json(exclude_defaults=True)
        i = self._index.get(text)
        if i is None:
            i = self._index[text] = len(self.docs)
            self.docs.append(text)
        return i


def load_models(docs: list[str], cls: Any) -> list[Any]:
    """The models of a :class:`ModelTable`'s ``docs``, each validated once.

    Raises:
        ValueError: an entry is not a valid ``cls`` (pydantic's ValidationError).
    """
    return [cls.model_validate_json(text) for text in docs]
