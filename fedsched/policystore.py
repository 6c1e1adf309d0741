"""Distributing the governance policy over NATS KV (bucket ``<prefix>_policy``, key ``current``).

The value is JSON: ``{"version", "applied_by", "applied_at", "doc"}`` with ``doc`` in canonical
form (:func:`fedsched.tenancy.canonical`). Writers replace it with a compare-and-set on the
KV revision (:func:`write_policy`), so two concurrent changes never overwrite each other
silently; the bucket keeps the last 64 revisions.

Every service holds the newest version in a :class:`PolicyHolder`, kept current by a
:class:`PolicyFollower` (a KV watch that survives reconnects), so a ``policy apply`` reaches the
scheduler within milliseconds. A value that does not validate is logged and ignored (the
holder keeps the previous version).

First start: :func:`bootstrap` stores the default policy if the bucket has none, adding a
``bootstrap`` admin principal, and writes that admin's token to ``<data_dir>/admin.token``
(mode 0600). The token itself exists only in that file and in the caller's hands.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import nats.errors
import nats.js.errors

from fedsched.auth import hash_token, new_token, read_token_file, write_token_file
from fedsched.bus import Bus
from fedsched.errors import ConflictError, UnavailableError, ValidationError
from fedsched.events import EventType, PolicyApplied, business_event_id, make_event
from fedsched.tenancy import (Governance, GrantDoc, PolicyDoc, PrincipalDoc, canonical, diff, parse_policy,
                                 parse_policy_data, with_principal)

log = logging.getLogger(__name__)

BUCKET = "policy"
KEY = "current"
HISTORY = 64


@dataclass(frozen=True)
class StoredPolicy:
    """The policy in force: the index, its KV revision, who applied it and when (business s)."""

    gov: Governance
    revision: int
    applied_by: str = ""
    applied_at: float = 0.0

    @property
    def version(self) -> str:
        """The policy's content hash."""
        return self.gov.version


def _encode(doc: PolicyDoc, actor: str, now: float, version: str) -> bytes:
    return json.dumps({"version": version, "applied_by": actor, "applied_at": now, "doc": canonical(doc)},
                      sort_keys=True, separators=(",", ":")).encode()


def _decode(data: bytes, revision: int) -> StoredPolicy:
    """Parse a KV value. Raises ValidationError (or ValueError for non-JSON)."""
    body = json.loads(data)
    gov = Governance.of(parse_policy_data(body.get("doc")))
    return StoredPolicy(gov, revision, str(body.get("applied_by", "")), float(body.get("applied_at", 0.0)))


async def _kv(bus: Bus):
    return await bus.key_value(BUCKET, history=HISTORY)


async def read_policy(bus: Bus) -> StoredPolicy | None:
    """The stored policy, or None if none was ever applied.

    Raises:
        UnavailableError: NATS did not answer.
        ValidationError: the stored value does not validate.
    """
    kv = await _kv(bus)
    try:
        entry = await kv.get(KEY)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as e:
        raise UnavailableError(f"policy KV did not answer: {e!r}") from e
    if entry is None or not entry.value:
        return None
    return _decode(entry.value, entry.revision)


async def read_history(bus: Bus, limit: int = HISTORY) -> list[StoredPolicy]:
    """The stored policy versions, newest first: at most ``limit`` of the last :data:`HISTORY`
    KV revisions (the bucket keeps no more). Deleted or purged revisions and values that no
    longer validate (written by another version of fedsched) are left out.

    Raises:
        UnavailableError: NATS did not answer.
    """
    kv = await _kv(bus)
    try:
        entries = await kv.history(KEY)
    except nats.js.errors.NoKeysError:
        return []
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as e:
        raise UnavailableError(f"policy KV did not answer: {e!r}") from e
    out: list[StoredPolicy] = []
    for entry in reversed(entries):
        if len(out) >= limit:
            break
        if not entry.value or entry.operation is not None:  # DEL / PURGE markers
            continue
        try:
            out.append(_decode(entry.value, entry.revision))
        except (ValidationError, ValueError) as e:
            log.warning("policy revision %s does not validate; left out of the history: %s", entry.revision, e)
    return out


async def write_policy(bus: Bus, doc: PolicyDoc, *, actor: str, now: float, expected_revision: int) -> StoredPolicy:
    """Store ``doc`` as the policy in force if the stored revision is still ``expected_revision``
    (0 = no policy stored yet).

    Raises:
        ConflictError: someone else changed the policy meanwhile (re-read and retry).
        UnavailableError: NATS did not answer.
    """
    gov = Governance.of(doc)
    kv = await _kv(bus)
    data = _encode(doc, actor, now, gov.version)
    try:
        if expected_revision:
            revision = await kv.update(KEY, data, last=expected_revision)
        else:
            revision = await kv.create(KEY, data)
    except nats.js.errors.KeyWrongLastSequenceError as e:
        raise ConflictError("the policy changed meanwhile; read it again and retry") from e
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as e:
        raise UnavailableError(f"policy KV did not answer: {e!r}") from e
    return StoredPolicy(gov, revision, actor, now)


async def announce(bus: Bus, stored: StoredPolicy, *, previous_version: str, changes: list[str], source: str,
                   producer: str = "admission") -> None:
    """Publish ``policy.applied`` for a stored version (id from the KV revision: retries dedupe).

    Raises:
        UnavailableError: JetStream did not acknowledge.
    """
    payload = PolicyApplied(version=stored.version, previous_version=previous_version, changes=tuple(changes[:500]),
                            source=source)
    event = make_event(EventType.POLICY_APPLIED, payload, producer=producer, occurred_at=stored.applied_at,
                       event_id=business_event_id("policy", stored.revision, stored.version),
                       actor=stored.applied_by, policy_version=stored.version)
    await bus.publish(bus.subjects.governance_policy(), event)


class PolicyHolder:
    """The newest policy a service knows (set by its follower and by its own writes)."""

    def __init__(self) -> None:
        self.stored: StoredPolicy | None = None
        self.ready = asyncio.Event()
        self.listeners: list[Callable[[StoredPolicy], None]] = []

    @property
    def current(self) -> Governance | None:
        """The policy in force (None before the first one arrived)."""
        return self.stored.gov if self.stored else None

    def in_force(self) -> Governance:
        """The policy in force, for a request that needs one.

        Raises:
            UnavailableError: no policy applied yet (admission's interceptor refuses calls before).
        """
        gov = self.current
        if gov is None:
            raise UnavailableError("no governance policy applied yet")
        return gov

    @property
    def version(self) -> str:
        """Its version ("" before the first)."""
        return self.stored.version if self.stored else ""

    @property
    def revision(self) -> int:
        """Its KV revision (0 before the first)."""
        return self.stored.revision if self.stored else 0

    def set(self, stored: StoredPolicy) -> bool:
        """Adopt ``stored`` if it is newer than what is held; return whether it was adopted."""
        if self.stored is not None and stored.revision <= self.stored.revision:
            return False
        changed = self.stored is None or self.stored.version != stored.version
        self.stored = stored
        self.ready.set()
        if changed:
            log.info("policy %s in force (revision %d, applied by %s)", stored.version, stored.revision,
                     stored.applied_by or "?")
        for listener in self.listeners:
            listener(stored)
        return True

    @classmethod
    def fixed(cls, gov: Governance) -> "PolicyHolder":
        """A holder with a constant policy (pure tests, benchmarks)."""
        holder = cls()
        holder.set(StoredPolicy(gov, 1))
        return holder


class PolicyFollower:
    """Keeps a :class:`PolicyHolder` on the newest stored policy (a KV watch; re-watches after
    errors and server restarts).

    Setting up the watch (the bucket, its ordered consumer) is given ``setup_timeout_s`` wall
    seconds, then tried again: a JetStream API request left unanswered (seen when a service
    starts while another creates the bucket) otherwise holds it for the client's whole request
    timeout (10 s), and the scheduler waits for :attr:`initial` before its first cycle -- a
    500-job bench placed nothing for ~9.5 s (issue 15). A watch set up after its attempt timed
    out is stopped."""

    def __init__(self, bus: Bus, holder: PolicyHolder, name: str = "policy", *, setup_timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.holder = holder
        self.name = name
        self.setup_timeout_s = setup_timeout_s
        self.initial = asyncio.Event()  # set once the stored state (a policy or none) was read
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    async def run(self) -> None:
        """Watch until :meth:`stop`."""
        backoff = 0.1
        while not self._stop.is_set():
            watcher = None
            try:
                watcher = await self._watch()
                while not self._stop.is_set():
                    try:
                        entry = await watcher.updates(timeout=1.0)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        continue
                    backoff = 0.1
                    if entry is None or not entry.value:
                        self.initial.set()  # the end-of-initial-state marker: no policy stored
                        continue
                    try:
                        self.holder.set(_decode(entry.value, entry.revision))
                    except (ValidationError, ValueError, TypeError) as e:
                        log.error("%s: ignoring invalid policy at revision %d: %s", self.name, entry.revision, e)
                    self.initial.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reconnects: watch again
                if self._stop.is_set():
                    break
                log.info("%s: policy watch: %r; watching again in %.1fs", self.name, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:  # noqa: BLE001
                        pass


    async def _watch(self):
        """A KV watch of the policy key, set up within ``setup_timeout_s``.

        Raises:
            asyncio.TimeoutError: not set up in time.
            asyncio.CancelledError: the caller was cancelled.
            Whatever the set-up raised. A set-up whose watch is not returned (timed out,
            cancelled caller) is left to finish, then its watch is stopped (never leaked).
        """
        async def setup():
            return await (await _kv(self.bus)).watch(KEY)

        task = asyncio.ensure_future(setup())
        returned = False
        try:
            watcher = await asyncio.wait_for(asyncio.shield(task), self.setup_timeout_s)
            returned = True
            return watcher
        finally:
            if not returned:
                task.add_done_callback(_stop_late_watch)


#: stops of late watches in flight (the loop keeps only weak references to tasks)
_LATE_STOPS: set[asyncio.Future] = set()


def _stop_late_watch(task: "asyncio.Future") -> None:
    """Stop a watch whose set-up finished after its caller stopped waiting for it (timed out
    or cancelled); a set-up that failed or was cancelled made no watch."""
    if task.cancelled() or task.exception() is not None:
        return
    stopping = asyncio.ensure_future(task.result().stop())
    _LATE_STOPS.add(stopping)
    stopping.add_done_callback(_late_stop_done)


def _late_stop_done(stopping: "asyncio.Future") -> None:
    _LATE_STOPS.discard(stopping)
    if not stopping.cancelled() and stopping.exception() is not None:
        log.info("stopping a late policy watch failed: %r", stopping.exception())


async def bootstrap(bus: Bus, default_text: str, token_path: Path, *, now: float) -> str | None:
    """Store the default policy on first start, with a bootstrap admin.

    If the bucket already holds a policy, nothing changes and the token in ``token_path`` (if
    any) is returned. Otherwise ``default_text`` is validated, an admin principal
    (``admin``, or ``bootstrap-admin`` if the document already has an ``admin``) is added with
    the token ``token_path`` already holds (a deployment's pre-made secret, e.g. a Kubernetes
    Secret mounted read-only) or else a fresh one, which is written to ``token_path`` (mode
    0600); the policy is stored create-only (of several starting processes exactly one wins).

    Returns:
        The admin token this data dir holds, or None if it holds none.

    Raises:
        ValidationError: the default policy does not validate.
        UnavailableError: NATS did not answer.
    """
    if await read_policy(bus) is not None:
        return read_token_file(token_path)
    doc = parse_policy(default_text)
    given = read_token_file(token_path)
    if given is not None and (len(given) < 16 or not all(33 <= ord(ch) < 127 for ch in given)):
        raise ValidationError("admin_token_file", f"{token_path} must hold one token: at least 16 printable ASCII "
                                                  f"characters, no spaces (e.g. from `fedsched token new`)")
    token = given or new_token()
    name = "bootstrap-admin" if any(p.name == "admin" for p in doc.principals) else "admin"
    doc = with_principal(doc, PrincipalDoc(name=name, token_sha256=hash_token(token),
                                           roles=(GrantDoc(role="admin"),), bootstrap=True))
    try:
        stored = await write_policy(bus, doc, actor="bootstrap", now=now, expected_revision=0)
    except ConflictError:
        return read_token_file(token_path)  # another process bootstrapped first
    if given is None:
        write_token_file(token_path, token)
    await announce(bus, stored, previous_version="", changes=diff(None, doc), source="bootstrap", producer="bootstrap")
    log.info("bootstrap: stored the default policy; admin token written to %s", token_path)
    return token
