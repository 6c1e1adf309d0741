"""Builders shared by the tests (functions and constants only; fixtures are in conftest.py).

- names and data: :func:`unique`, :data:`DATA` (the bundled trace);
- the scheduling core: :func:`node`, :func:`cluster`, :func:`job`, :func:`view` (card models
  :data:`T4`, :data:`V100`, :data:`G2`);
- the tenancy policy: a test policy with known tokens (:func:`policy_text`, :func:`policy_doc`),
  storing it in NATS KV (:func:`store_policy`), channels and stubs that carry a principal's token
  (:func:`channel`, :class:`Stubs`), and :func:`until` (await a condition with a deadline).
- fakes of our own interfaces (no NATS, no sleeps), below:

  * :class:`FakeClock` -- a :class:`~fedsched.clock.Clock` moved by hand.
  * :class:`FakePublisher` -- a :class:`~fedsched.ports.Publisher` that records what was published
    and acknowledges it (or refuses the items a predicate picks, like an unavailable JetStream).
  * Event builders: :func:`spec`, :func:`submitted`, :func:`cancel_requested`, :func:`job_action`
    (hold, release, priority change), :func:`status_event`,
    :func:`snapshot`, :func:`heartbeat`, :func:`delivery`.
  * Agent: :class:`StaticBackend` (a :class:`~services.inventory.agent.Backend` with fixed nodes
    and runtimes), :func:`placement`, :func:`stop_order`.
  * :class:`SchedulerHarness` -- a :class:`~services.scheduler.service.SchedulerService` driven by
    hand the way its run loop drives it: deliveries in stream order (its own publishes read back
    too), live clusters heartbeating as the clock advances, cycles when asked, and a restart that
    rebuilds a new service from the recorded streams (events from the start, the newest
    inventory and heartbeat per cluster).

  Times are seconds since the Unix epoch; one fake clock serves as both the business clock and the
  liveness (wall) clock, and every delivery's JetStream time is the clock's time when it was made.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from fedapp.client import aio_channel
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.auth import hash_token
from fedsched.bus import Bus, Delivery
from fedsched.clock import to_datetime
from fedsched.errors import PayloadTooLargeError, UnavailableError
from fedsched.events import (Envelope, Heartbeat, InventorySnapshot, JobCancelRequested, JobPlaced, JobStatus, JobStop,
                             JobSubmitted, NodeInventory, Subjects, WorkerBinding, business_event_id, make_event)
from fedsched.jobs import AttemptState, Dataset, JobSpec, PriorityClass
from fedsched.policystore import PolicyHolder, StoredPolicy, read_policy, write_policy
from fedsched.ports import PublishResult
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance, PolicyDoc, parse_policy
from services.inventory.agent import TraceBackend
from services.scheduler.core import ClusterState, NodeState, QueuedJob, View, build_policy
from services.scheduler.approvals import TenancyGate
from services.scheduler.service import JobEntry, SchedulerService, ShardEntry


#: principal -> (token, roles as written in the policy)
PRINCIPALS: dict[str, tuple[str, str]] = {
    "root": ("tok-root-0123456789", "[{role: admin}]"),
    "alice": ("tok-alice-0123456789", "[{role: submitter, tenants: [search]}]"),
    "dave": ("tok-dave-0123456789", "[{role: submitter, tenants: [search], projects: [train]}]"),
    "carol": ("tok-carol-0123456789", "[{role: submitter, tenants: [ads, vision, nlp, recsys]}]"),
    "bob": ("tok-bob-0123456789", "[{role: approver, tenants: [search, ads]}]"),
    "agent1": ("tok-agent1-0123456789", "[{role: agent, region: cn-north-1, cluster: cn-north-1-c1}]"),
}
TOKENS = {name: token for name, (token, _) in PRINCIPALS.items()}

TENANTS = """
tenants:
  - {name: search, home_region: cn-north-1, projects: [train, serve, batch]}
  - {name: ads, home_region: cn-north-1, projects: [train, serve, batch], cross_region: approval,
     job_classes: [{name: finance, residency_tags: [finance], cross_region: forbidden}]}
  - {name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}
  - {name: vision, home_region: cn-south-1, projects: [train, serve, batch]}
  - {name: recsys, home_region: cn-east-1, projects: [train, serve, batch], cross_region: forbidden,
     regions: [cn-east-1]}
"""


def principals_yaml(names=None) -> str:
    """The ``principals:`` section for ``names`` (default all of :data:`PRINCIPALS`)."""
    lines = ["principals:"]
    for name in names or PRINCIPALS:
        token, roles = PRINCIPALS[name]
        lines.append(f"  - {{name: {name}, token_sha256: {hash_token(token)}, roles: {roles}}}")
    return "\n".join(lines) + "\n"


def policy_text(extra: str = "", tenants: str = TENANTS) -> str:
    """A test policy: ``tenants`` + every test principal + ``extra`` YAML sections."""
    return tenants + principals_yaml() + extra


def policy_doc(extra: str = "", tenants: str = TENANTS) -> PolicyDoc:
    """:func:`policy_text` parsed."""
    return parse_policy(policy_text(extra, tenants))


async def store_policy(bus: Bus, doc: PolicyDoc, actor: str = "test") -> StoredPolicy:
    """Make ``doc`` the stored policy (replacing any)."""
    current = await read_policy(bus)
    return await write_policy(bus, doc, actor=actor, now=time.time(),
                              expected_revision=current.revision if current else 0)


def channel(port_or_target, who: str | None) -> grpc.aio.Channel:
    """An aio channel to admission carrying ``who``'s token (None = no token)."""
    target = port_or_target if isinstance(port_or_target, str) else f"127.0.0.1:{port_or_target}"
    return aio_channel(target, TOKENS[who] if who else None)


async def submit_at_once(ports: Sequence[int], who: str, request: pb.SubmitJobRequest,
                         count: int) -> tuple[list[pb.SubmitJobResponse], list[grpc.aio.AioRpcError]]:
    """``count`` copies of ``request`` submitted at once as ``who``, round-robin over one channel
    per entry of ``ports`` (admission ports; repeat a port for several channels to it).

    Returns:
        The accepted responses and the refusals (RPC errors), each in call order.
    """
    channels = [channel(port, who) for port in ports]
    stubs = [pb_grpc.JobServiceStub(ch) for ch in channels]

    async def submit(i: int):
        try:
            return await stubs[i % len(stubs)].SubmitJob(request, timeout=60)
        except grpc.aio.AioRpcError as e:
            return e

    try:
        results = await asyncio.gather(*(submit(i) for i in range(count)))
    finally:
        for ch in channels:
            await ch.close()
    return ([r for r in results if isinstance(r, pb.SubmitJobResponse)],
            [r for r in results if not isinstance(r, pb.SubmitJobResponse)])


class Stubs:
    """Every service's stub over one channel."""

    def __init__(self, ch: grpc.aio.Channel) -> None:
        self.jobs = pb_grpc.JobServiceStub(ch)
        self.clusters = pb_grpc.ClusterServiceStub(ch)
        self.system = pb_grpc.SystemServiceStub(ch)
        self.tenants = gpb_grpc.TenantServiceStub(ch)
        self.approvals = gpb_grpc.ApprovalServiceStub(ch)
        self.policy = gpb_grpc.PolicyServiceStub(ch)


async def until(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``pred()`` (a plain or an async predicate) every ``interval`` seconds until it is true
    (True) or ``timeout`` seconds pass (False); it is always tried at least once."""
    deadline = time.monotonic() + timeout
    while True:
        ok = pred()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def until_sync(pred, timeout: float = 10.0, interval: float = 0.1) -> bool:
    """:func:`until` for synchronous tests (e.g. ones driving the CLI in subprocesses)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --------------------------------------------------------------------------- names and data

DATA = Path(__file__).resolve().parent.parent / "fedsched" / "data" / "alibaba-gpu-2023"


def unique(prefix: str = "t") -> str:
    """A fresh lower-case token, e.g. for subject prefixes and database names."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- the scheduling core

T4, V100, G2 = "nvidia-t4-16gb", "nvidia-v100-32gb", "alibaba-g2"
MEM = {T4: 16, V100: 32, G2: None}  #: card model -> memory per card, GiB (None = unknown)


def node(name: str, model: str = T4, gpus: int = 2, free: tuple[int, ...] | None = None, cpu: int = 64000,
         mem: int = 262144, healthy: bool = True) -> NodeState:
    """A node of ``gpus`` idle cards of ``model`` (``free``: milli-GPUs free per card instead);
    ``cpu`` in milli-CPUs, ``mem`` in MiB, all free."""
    return NodeState(name, model, MEM.get(model), free if free is not None else (1000,) * gpus, cpu, mem, cpu, mem,
                     healthy)


def cluster(name: str, region: str = "cn-north-1", nodes: tuple[NodeState, ...] = (), *, age: float = 0.0,
            tags: frozenset[str] = frozenset(), fabric: str = "ethernet", prices: dict | None = None,
            maintenance: bool = False) -> ClusterState:
    """A cluster in ``region`` (zone ``<region>a``) whose inventory is ``age`` seconds old; ``prices``:
    card model -> price per GPU-hour (default T4 6, V100 20, G2 14)."""
    return ClusterState(name, region, region + "a", nodes, heartbeat_age_s=age, residency_tags=tags,
                        interconnect=fabric, prices=prices or {T4: 6.0, V100: 20.0, G2: 14.0}, maintenance=maintenance)


def job(job_id: str = "j1", *, gpus: int = 1, milli: int = 1000, workers: int = 1, models: tuple[str, ...] = (),
        home: str = "cn-north-1", priority: PriorityClass = PriorityClass.NORMAL, at: float = 0.0, **kw) -> QueuedJob:
    """Attempt 1 of a job of tenant search / project train, queued at ``at`` (seconds):
    ``workers`` x ``gpus`` cards of ``milli`` milli-GPUs each; ``cpu`` (milli-CPUs) and any other
    :class:`~fedsched.jobs.JobSpec` field as keywords."""
    spec = JobSpec(tenant="search", project="train", home_region=home, gpus_per_worker=gpus,
                   gpu_milli=milli if gpus else 0, workers=workers, card_models=models, priority=priority,
                   cpu_milli=kw.pop("cpu", 1000), **kw)
    return QueuedJob(job_id, 1, spec, at)


def view(*clusters: ClusterState, stale: float = 10.0) -> View:
    """The clusters at time 1000 s; inventories older than ``stale`` seconds are stale."""
    return View(tuple(clusters), now=1000.0, stale_after_s=stale)


class _NoBound:
    """A scorer with an infinite bound (its scores are the wrapped scorer's): nothing can be pruned."""

    bound_scope = "cluster"

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name

    def score(self, *args):
        return self.inner.score(*args)

    def bound(self, *args):
        return 1e9


def without_bounds(policy):
    """``policy`` with every scorer's bound infinite: the branch and bound then fits and scores
    every candidate (the exhaustive search a pruned one must agree with, when
    ``policy.max_scored_fits`` is 0)."""
    return replace(policy, weights=tuple((_NoBound(scorer), w) for scorer, w in policy.weights))


T4 = "nvidia-t4-16gb"
EPOCH = 1_700_000_000.0


class FakeClock:
    """A clock that only moves when told (seconds since the Unix epoch)."""

    def __init__(self, start: float = EPOCH) -> None:
        self.now = start

    def time(self) -> float:
        """The current time."""
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
        assert seconds >= 0, "a clock never goes back"
        self.now += seconds
        return self.now


@dataclass
class Published:
    """One item a fake publisher acknowledged."""

    subject: str
    event: Envelope
    headers: dict[str, str] | None


class FakePublisher:
    """Records publishes; acknowledges every item unless ``refuse(subject, event)`` is true
    (not acknowledged: an outage) or ``too_large(subject, event)`` is (refused for good, as the
    bus refuses a message above its server's max_payload: ``PublishResult.REFUSED`` in a batch,
    :class:`~fedsched.errors.PayloadTooLargeError` alone).

    Attributes:
        published: acknowledged items, in order.
        refused: items refused (not acknowledged), in order.
        dead_lettered: items refused for good (too large), in order.
        seen_ids: event ids already acknowledged (a repeated id is acknowledged but not
            recorded again, like JetStream's duplicate window).
    """

    def __init__(self, refuse: Callable[[str, Envelope], bool] | None = None,
                 too_large: Callable[[str, Envelope], bool] | None = None) -> None:
        self.published: list[Published] = []
        self.refused: list[Published] = []
        self.dead_lettered: list[Published] = []
        self.refuse = refuse
        self.too_large = too_large
        self.seen_ids: set[str] = set()

    async def publish(self, subject: str, event: Envelope, *, headers: dict[str, str] | None = None) -> Any:
        """Acknowledge ``event`` (or raise like the real bus after its retries)."""
        result = self._accept(subject, event, headers)
        if result is PublishResult.REFUSED:
            raise PayloadTooLargeError(subject, event.event_id, str(event.type), 0, 0)
        if not result:
            raise UnavailableError(f"fake: publish to {subject} refused")
        return True

    async def publish_many(self, items: Sequence[tuple[str, Envelope, dict[str, str] | None]]
                           ) -> list[bool | PublishResult]:
        """Per item, whether it was acknowledged (``PublishResult.REFUSED`` when too large)."""
        return [self._accept(s, e, h) for s, e, h in items]

    def _accept(self, subject: str, event: Envelope, headers: dict[str, str] | None) -> bool | PublishResult:
        item = Published(subject, event, headers)
        if self.too_large is not None and self.too_large(subject, event):
            self.dead_lettered.append(item)
            return PublishResult.REFUSED
        if self.refuse is not None and self.refuse(subject, event):
            self.refused.append(item)
            return False
        if event.event_id not in self.seen_ids:
            self.seen_ids.add(event.event_id)
            self.published.append(item)
        return True


# ---------------------------------------------------------------------------- event builders

def spec(*, tenant: str = "search", project: str = "train", home: str = "cn-north-1", gpus: int = 1,
         **kw: Any) -> JobSpec:
    """A job spec with small defaults (one 1-GPU worker, 1 core, home cn-north-1)."""
    kw.setdefault("cpu_milli", 1000)
    return JobSpec(tenant=tenant, project=project, home_region=home, gpus_per_worker=gpus, **kw)


def submitted(job_id: str, job: JobSpec, at: float) -> Envelope:
    """``job.submitted`` as admission publishes it."""
    return make_event("job.submitted", JobSubmitted(spec=job), producer="admission", occurred_at=at,
                      event_id=business_event_id(job_id, "submitted"), tenant=job.tenant, project=job.project,
                      job_id=job_id, actor="test")


def cancel_requested(job_id: str, job: JobSpec, at: float) -> Envelope:
    """``job.cancel_requested`` as admission publishes it."""
    return make_event("job.cancel_requested", JobCancelRequested(reason="test"), producer="admission",
                      occurred_at=at, event_id=business_event_id(job_id, "cancel"), tenant=job.tenant,
                      project=job.project, job_id=job_id, actor="test")


def job_action(type_: str, job_id: str, job: JobSpec, at: float, *, number: int = 1, reason: str = "test",
               priority: PriorityClass | None = None) -> Envelope:
    """``job.held`` / ``job.released`` / ``job.priority_changed`` (to ``priority``) as admission
    publishes them (``number``: the n-th such action on the job, for its event id)."""
    from fedsched.events import JobHeld, JobPriorityChanged

    payload = (JobPriorityChanged(previous=job.priority, priority=priority, reason=reason)
               if type_ == "job.priority_changed" else JobHeld(reason=reason))
    return make_event(type_, payload, producer="admission", occurred_at=at,
                      event_id=business_event_id(job_id, type_, number), tenant=job.tenant, project=job.project,
                      job_id=job_id, actor="test")


def status_event(type_: str, placed: Envelope, at: float, *, reason: str = "", started_at: float | None = None,
                 progress_s: float = 0.0) -> Envelope:
    """An agent's status event (``job.started``, ``job.finished``, ...) for the attempt ``placed``
    (a ``job.placed`` envelope), with the agent's deterministic id."""
    p = placed.payload_as(JobPlaced)
    step = {"job.started": "started", "job.rejected": "rejected"}.get(type_, "ended")
    payload = JobStatus(card_model=p.card_model, gpu_milli=p.spec.total_gpu_milli, reason=reason, shard=p.shard,
                        started_at=to_datetime(started_at) if started_at is not None else None,
                        kind=p.spec.kind.value, progress_s=progress_s)
    return make_event(type_, payload, producer=f"agent/{placed.cluster}", occurred_at=at,
                      event_id=business_event_id(placed.job_id, placed.attempt, p.shard, step),
                      region=placed.region, zone=placed.zone, cluster=placed.cluster, tenant=placed.tenant,
                      project=placed.project, job_id=placed.job_id, attempt=placed.attempt)


def placement_of(status: Envelope, *, at: float | None = None, transfer_bytes: int = 0) -> Envelope:
    """The scheduler's ``job.placed`` of the attempt an agent's ``status`` reports about: same
    job, attempt, shard, tenant, project, region, zone, cluster, card model, kind and demand
    (the payload's ``gpu_milli`` as whole GPUs of one worker, or a share of one; its
    ``cpu_milli``), placed at ``at`` (default: the status's ``started_at``, else its time).
    Billing prices an attempt from this record only (issue 14)."""
    s = status.payload_as(JobStatus)
    gpus, milli = (s.gpu_milli // 1000, 1000) if s.gpu_milli >= 1000 else (1 if s.gpu_milli else 0, s.gpu_milli or 1000)
    job_spec = JobSpec(tenant=status.tenant, project=status.project, home_region=status.region,
                       kind=s.kind or "batch", gpus_per_worker=gpus, gpu_milli=milli, cpu_milli=s.cpu_milli)
    when = at if at is not None else (s.started_at or status.occurred_at).timestamp()
    payload = JobPlaced(spec=job_spec, card_model=s.card_model, bindings=(WorkerBinding(worker=0, node="n1"),),
                        shard=s.shard, cross_region=s.cross_region, transfer_bytes=transfer_bytes)
    return make_event("job.placed", payload, producer="scheduler", occurred_at=when,
                      event_id=business_event_id(status.job_id, status.attempt, s.shard, "placed"),
                      region=status.region, zone=status.zone, cluster=status.cluster, tenant=status.tenant,
                      project=status.project, job_id=status.job_id, attempt=status.attempt, actor="scheduler")


def nodes(prefix: str, count: int = 1, gpus: int = 8, model: str = T4) -> tuple[NodeInventory, ...]:
    """``count`` healthy nodes of ``gpus`` cards each."""
    return tuple(NodeInventory(name=f"{prefix}{i}", card_model=model, gpus=gpus, gpu_memory_gib=16,
                               gpu_free_milli=(1000,) * gpus, cpu_milli=64000, cpu_free_milli=64000,
                               memory_mib=262144, memory_free_mib=262144) for i in range(count))


def snapshot(cluster: str, region: str, node_list: tuple[NodeInventory, ...], at: float, sequence: int = 1) -> Envelope:
    """``inventory.snapshot`` of a cluster."""
    return make_event("inventory.snapshot", InventorySnapshot(nodes=node_list, sequence=sequence),
                      producer=f"agent/{cluster}", occurred_at=at, region=region, zone=region + "a", cluster=cluster)


def heartbeat(cluster: str, region: str, at: float, sequence: int = 1, orders_backlog: int = 0) -> Envelope:
    """``inventory.heartbeat`` of a cluster (``orders_backlog``: orders its agent has yet to read)."""
    return make_event("inventory.heartbeat", Heartbeat(sequence=sequence, orders_backlog=orders_backlog),
                      producer=f"agent/{cluster}",
                      occurred_at=at, region=region, zone=region + "a", cluster=cluster)


def delivery(event: Envelope, subject: str, sequence: int, published_at: float,
             headers: dict[str, str] | None = None) -> Delivery:
    """A delivery as a stream follower hands it over (JetStream time ``published_at``)."""
    return Delivery(event, subject, dict(headers or {}), sequence, 1, None, published_at)


# ---------------------------------------------------------------------------- the scheduler, by hand

@dataclass
class ClusterSpec:
    """A cluster of the harness: name, region, nodes."""

    name: str
    region: str = "cn-north-1"
    node_list: tuple[NodeInventory, ...] = field(default_factory=lambda: nodes("n"))


@dataclass
class Decision:
    """A published decision, reduced to what cycle tables compare."""

    type: str
    job_id: str
    attempt: int
    cluster: str = ""
    reason: str = ""


class SchedulerHarness:
    """A scheduler service on fakes, driven like its run loop (see the module docstring).

    Args:
        clusters: the federation.
        heartbeat_s: seconds between heartbeats of a live cluster.
        **settings: :class:`~services.scheduler.service.SchedulerService` keyword arguments
            (``stale_after_s``, ``reclaim_after_s``, ...).
    """

    def __init__(self, clusters: Sequence[ClusterSpec], *, policy: str = "federated", heartbeat_s: float = 0.5,
                 **settings: Any) -> None:
        self.clock = FakeClock()
        self.subjects = Subjects("t")
        self.prices = load_price_catalog()
        self.policy = build_policy(policy)
        self.settings = {"interval_s": 0.0, **settings}
        self.heartbeat_s = heartbeat_s
        self.clusters = {c.name: c for c in clusters}
        self.silent: set[str] = set()
        self.backlog: dict[str, int] = {}  # cluster -> orders its agent says it has yet to read
        self.events: list[Delivery] = []                   # the EVENTS stream, in order
        self.inventory: dict[tuple[str, str], Delivery] = {}  # newest per (subject family, cluster)
        self.specs: dict[str, JobSpec] = {}
        self.placed: dict[tuple[str, int], Envelope] = {}  # (job, shard) -> its latest job.placed
        self.started: dict[tuple[str, int], float] = {}  # (job, attempt) -> its job.started time
        self._seq = 0
        self.pending_folds: list = []  # awaitables handle_event returned (see settle)
        self._next_beat = self.clock.time()
        self.publisher = FakePublisher()
        self._read = 0  # publisher items already read back into the stream
        self._actions = 0  # holds, releases, priority changes so far (their event ids)
        self.svc = self._service()
        for c in clusters:
            self._inventory(snapshot(c.name, c.region, c.node_list, self.clock.time()), self.subjects.inventory(c.region, c.name))
        self._beat()

    def _service(self):
        return SchedulerService(None, self.clock, self.policy, self.prices, publisher=self.publisher,
                                subjects=self.subjects, liveness=self.clock, **self.settings)

    # -- streams

    def _event(self, event: Envelope, subject: str) -> None:
        self._seq += 1
        d = delivery(event, subject, self._seq, self.clock.time())
        self.events.append(d)
        if event.type == "job.placed":
            self.placed[(event.job_id, event.payload_as(JobPlaced).shard)] = event
        elif event.type == "job.started":
            self.started[(event.job_id, event.attempt)] = event.occurred_at.timestamp()
        pending = self.svc.handle_event(d)
        if pending is not None:  # the fold waits for a read (the lease's tenure): ``await settle()``
            self.pending_folds.append(pending)

    async def settle(self) -> None:
        """Await the folds :meth:`_event` left waiting (in order, as the follower does)."""
        while self.pending_folds:
            await self.pending_folds.pop(0)

    def _inventory(self, event: Envelope, subject: str) -> None:
        self._seq += 1
        d = delivery(event, subject, self._seq, self.clock.time())
        self.inventory[(event.type, event.cluster)] = d
        self.svc.handle_inventory(d)

    def _read_back(self) -> list[Envelope]:
        """Read the service's own new publishes back from the stream (as its follower does)."""
        new = self.publisher.published[self._read:]
        self._read = len(self.publisher.published)
        for item in new:
            self._event(item.event, item.subject)
        return [item.event for item in new]

    def _beat(self) -> None:
        while self._next_beat <= self.clock.time():
            for c in self.clusters.values():
                if c.name not in self.silent:
                    self._inventory(heartbeat(c.name, c.region, self._next_beat,
                                              orders_backlog=self.backlog.get(c.name, 0)),
                                    self.subjects.heartbeat(c.region, c.name))
            self._next_beat += self.heartbeat_s

    # -- inputs

    def submit(self, job_id: str, **kw: Any) -> None:
        """Admission accepted a job (see :func:`spec` for the keywords)."""
        job = spec(**kw)
        self.specs[job_id] = job
        self._event(submitted(job_id, job, self.clock.time()), self.subjects.job("submitted", job.tenant, job.project))

    def cancel(self, job_id: str) -> None:
        """A caller asked to cancel ``job_id``."""
        job = self.specs[job_id]
        self._event(cancel_requested(job_id, job, self.clock.time()), self.subjects.job("cancel", job.tenant, job.project))

    def hold(self, job_id: str) -> None:
        """A caller held ``job_id`` (``job.held``)."""
        job = self.specs[job_id]
        self._actions += 1
        self._event(job_action("job.held", job_id, job, self.clock.time(), number=self._actions),
                    self.subjects.job("hold", job.tenant, job.project))

    def release(self, job_id: str) -> None:
        """A caller released ``job_id`` (``job.released``)."""
        job = self.specs[job_id]
        self._actions += 1
        self._event(job_action("job.released", job_id, job, self.clock.time(), number=self._actions),
                    self.subjects.job("release", job.tenant, job.project))

    def set_priority(self, job_id: str, priority: PriorityClass) -> None:
        """A caller changed ``job_id``'s priority class (``job.priority_changed``)."""
        job = self.specs[job_id]
        self._actions += 1
        self._event(job_action("job.priority_changed", job_id, job, self.clock.time(), number=self._actions,
                               priority=priority), self.subjects.job("priority", job.tenant, job.project))
        self.specs[job_id] = job.model_copy(update={"priority": priority})

    def report(self, job_id: str, type_: str, *, shard: int = 0, reason: str = "", progress_s: float = 0.0) -> None:
        """The agent of the shard's latest placement reports ``type_`` for that attempt."""
        placed = self.placed[(job_id, shard)]
        started = self.started.get((job_id, placed.attempt))
        if type_ == "job.started":
            started = self.clock.time()
        event = status_event(type_, placed, self.clock.time(), reason=reason, started_at=started, progress_s=progress_s)
        self._event(event, self.subjects.status(placed.region, placed.cluster))

    def silence(self, cluster: str) -> None:
        """The cluster's agent stops heartbeating (dead or cut off)."""
        self.silent.add(cluster)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass; live clusters heartbeat meanwhile (no cycle runs)."""
        end = self.clock.time() + seconds
        while self._next_beat <= end:
            self.clock.now = max(self.clock.now, self._next_beat)
            self._beat()
        self.clock.now = end

    def restart(self, prepare: Callable[[SchedulerService], None] | None = None) -> None:
        """A new scheduler rebuilds from the streams (events from the start, then the newest
        inventory and heartbeat of every cluster -- deliveries keep their JetStream times), then
        begins its start-up grace as :meth:`SchedulerService.run` does; ``prepare(service)`` runs first (e.g. the governance policy it already holds)."""
        self.svc = self._service()
        if prepare is not None:
            prepare(self.svc)
        for d in self.events:
            self.svc.handle_event(d)
        for d in sorted(self.inventory.values(), key=lambda d: d.stream_sequence):
            self.svc.handle_inventory(d)
        self.svc.start_grace()  # as run() does once rebuilt

    # -- cycles

    async def cycle(self) -> list[Decision]:
        """One scheduling cycle; its published decisions (``job.pending`` left out), read back
        into the stream afterwards."""
        await self.svc.cycle()
        return [decision(e) for e in self._read_back() if e.type != "job.pending"]

    async def run_for(self, seconds: float) -> list[tuple[float, Decision]]:
        """Run the service's loop for ``seconds``: sleep :meth:`next_wake_s` (the periodic
        wake-up without events), cycle, repeat. Returns (time, decision) pairs."""
        end = self.clock.time() + seconds
        out: list[tuple[float, Decision]] = []
        while True:
            wake = min(self.svc.next_wake_s(), end - self.clock.time())
            if wake <= 0:
                break
            self.advance(wake)
            out += [(self.clock.time(), d) for d in await self.cycle()]
        return out

    # -- reading the book

    def shard(self, job_id: str, index: int = 0):
        """The service's entry of one shard."""
        return self.svc.jobs[job_id].shards[index]


def decision(e: Envelope) -> Decision:
    """The comparable part of a published decision event."""
    reason = ""
    if e.type in ("job.stop", "job.stopped", "job.cancelled"):
        reason = e.payload.get("reason", "")
    return Decision(e.type, e.job_id, e.attempt, e.cluster, reason)


# ---------------------------------------------------------------------------- the agent, by hand

class StaticBackend(TraceBackend):
    """A :class:`~services.inventory.backend.Backend` (the trace backend's machinery) with fixed
    nodes; every attempt runs ``runtime_s`` (None = until stopped) minus the work it resumes from,
    ending ``outcome`` (exit code 1 when ``failed``)."""

    def __init__(self, node_list: tuple[NodeInventory, ...], *, clock, runtime_s: float | None = 600.0,
                 outcome: str = "succeeded") -> None:
        super().__init__(node_list, clock=clock)
        self.runtime_s = runtime_s
        self.outcome = outcome

    def plan(self, spec: JobSpec, started_at: float, *, attempt: int = 1, resume_from_s: float = 0.0):
        if self.runtime_s is None:
            return None, AttemptState(self.outcome)
        return started_at + max(0.0, self.runtime_s - resume_from_s), AttemptState(self.outcome)


def placement(job_id: str, job: JobSpec, cluster: str, region: str, bindings: Sequence[tuple[str, tuple[int, ...]]], *,
              attempt: int = 1, at: float = EPOCH, card_model: str = T4, resume_from_s: float = 0.0,
              fencing_token: int = 0) -> Envelope:
    """``job.placed`` binding worker i to ``bindings[i]`` = (node, GPU indices), whole GPUs."""
    payload = JobPlaced(spec=job, card_model=card_model, resume_from_s=resume_from_s, fencing_token=fencing_token,
                        bindings=tuple(WorkerBinding(worker=i, node=node, gpu_indices=devices,
                                                     gpu_milli=job.gpu_milli, cpu_milli=job.cpu_milli,
                                                     memory_mib=job.memory_mib)
                                       for i, (node, devices) in enumerate(bindings)))
    return make_event("job.placed", payload, producer="scheduler", occurred_at=at,
                      event_id=business_event_id(job_id, attempt, 0, "placed"), region=region, zone=region + "a",
                      cluster=cluster, tenant=job.tenant, project=job.project, job_id=job_id, attempt=attempt)


def stop_order(placed: Envelope, reason: str, at: float, *, checkpoint_interval_s: float = 0.0,
               fencing_token: int = 0) -> Envelope:
    """The scheduler's ``job.stop`` for the attempt ``placed``."""
    return make_event("job.stop", JobStop(reason=reason, checkpoint_interval_s=checkpoint_interval_s,
                                          fencing_token=fencing_token),
                      producer="scheduler", occurred_at=at,
                      event_id=business_event_id(placed.job_id, placed.attempt, 0, "stop"), region=placed.region,
                      zone=placed.zone, cluster=placed.cluster, tenant=placed.tenant, project=placed.project,
                      job_id=placed.job_id, attempt=placed.attempt)


# --------------------------------------------------------------------------- the tenancy gate

GATE_NOW = 1.7e9  #: business time of :func:`gate_entry` submissions (s)


def gate_entry(job_id: str, tenant: str = "ads", *, gpus: int = 1, hours: float = 2.0, data_gb: float = 0,
           placed_on: str = "", **kw) -> JobEntry:
    """A scheduler job entry of one shard (T4, home cn-north-1, submitted at :data:`GATE_NOW`);
    ``placed_on`` = a region: running there on cn-north-1-c1 node h1 (attempt 1)."""
    datasets = (Dataset(name="d1", home_region="cn-north-1", size_bytes=int(data_gb * 1e9)),) if data_gb else ()
    spec = JobSpec(tenant=tenant, project="train", home_region="cn-north-1", gpus_per_worker=gpus, cpu_milli=1000,
                   card_models=(T4,), estimated_duration_s=hours * 3600, datasets=datasets, **kw)
    entry = JobEntry(job_id, tenant, "train", spec, GATE_NOW, shards=[ShardEntry(0)])
    if placed_on:
        shard = entry.shards[0]
        shard.placed = JobPlaced(spec=spec, card_model=T4, bindings=(WorkerBinding(
            worker=0, node="h1", gpu_indices=tuple(range(gpus)), gpu_milli=1000),))
        shard.region, shard.cluster, shard.state, shard.attempt = placed_on, "cn-north-1-c1", "running", 1
    return entry


def tenancy_gate(extra: str = "") -> TenancyGate:
    """The scheduler's tenancy gate over the test policy plus ``extra`` YAML."""
    return TenancyGate(PolicyHolder.fixed(Governance.parse(policy_text(extra))), Subjects("fed"), load_price_catalog())


def queued_of(entry: JobEntry) -> QueuedJob:
    """The queue entry of ``entry``'s next attempt."""
    return QueuedJob(entry.job_id, entry.attempt + 1, entry.spec, entry.submitted_at)


# --------------------------------------------------------------------------- a running admission


@contextlib.asynccontextmanager
async def running_admission(bus: Bus, doc: PolicyDoc | str | None = None, *, models: tuple[str, ...] = (T4,),
                            **options):
    """Admission serving on a free loopback port over ``bus``, with ``doc`` stored as the policy
    first (default: the test policy) and ``models`` known as if agents had reported them;
    ``options`` go to :class:`~services.admission.service.AdmissionService`. Stops it on exit."""
    from fedsched.clock import SystemClock
    from services.admission.service import AdmissionService

    await store_policy(bus, doc if doc is not None else policy_doc())
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", **options)
    svc.known_models.update(models)
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(svc.ready.wait(), 20)
        yield svc
    finally:
        svc.stop()
        await task


@contextlib.asynccontextmanager
async def embedded_federation(nats_url: str, chdb_path: Path, data_dir: Path, split: dict, **settings):
    """The whole embedded system (fedapp.runtime) over an existing nats-server and chDB path, with
    trace clusters given as ``split`` (cluster name -> TraceNode list) and a business clock 600x
    wall time; yields ``(system, JobService stub)`` once the scheduler has every cluster's
    inventory. ``settings`` override the fast test defaults (heartbeats 0.2 s, cycles 5 ms)."""
    from fedapp.runtime import System, SystemOptions
    from fedsched.clock import ClockState, ReplayClock
    from fedsched.settings import Settings

    options = dict(data_dir=data_dir, nats_url=nats_url, subject_prefix=unique("f"), clickhouse_path=chdb_path,
                   clickhouse_database=unique("db"), grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2,
                   schedule_interval_s=0.005)
    options.update(settings)
    clock = ReplayClock(ClockState(time.time(), 1.7e9, 600.0, 1))
    system = System(SystemOptions(settings=Settings(**options), clock=clock, split=split, agent_tick_s=0.005))
    await system.start()
    channel = aio_channel(system.grpc_target, system.admin_token)
    try:
        assert await until(lambda: len(system.scheduler.clusters) == len(split), timeout=30), "no inventory"
        yield system, pb_grpc.JobServiceStub(channel)
    finally:
        await channel.close()
        await system.stop()


# --------------------------------------------------------------------------- the scheduler lease

class FakeLeaseStore:
    """A :class:`~fedsched.lease.LeaseStore` in memory with NATS KV's compare-and-set rules:
    revisions come from one counter for the whole store (a KV bucket's stream sequence), ``create``
    fails when the key exists, ``update(last=N)`` when its revision is not N. ``down`` holds the
    names of clients (see :meth:`client`) whose calls fail as an outage would. With a ``clock``
    every write is stamped with its time, as JetStream stamps a KV write, and clients answer
    ``written_at`` (else 0.0: unknown)."""

    def __init__(self, clock: "FakeClock | None" = None) -> None:
        self.records: dict[str, Any] = {}
        self.sequence = 0
        self.down: set[str] = set()
        self.clock = clock
        self.times: dict[int, float] = {}  # revision -> server time of the write (with a clock)

    def client(self, name: str) -> "FakeLeaseStore._Client":
        """The store as one replica sees it (so an outage can hit one replica only)."""
        return FakeLeaseStore._Client(self, name)

    class _Client:
        def __init__(self, store: "FakeLeaseStore", name: str) -> None:
            self.store, self.name = store, name

        def _check(self) -> None:
            if self.name in self.store.down:
                raise UnavailableError(f"fake lease store: {self.name} cannot reach it")

        async def get(self, key: str):
            self._check()
            return self.store.records.get(key)

        async def create(self, key: str, record):
            from fedsched.lease import LeaseConflict

            self._check()
            if key in self.store.records:
                raise LeaseConflict(key, "exists")
            return self._put(key, record)

        async def update(self, key: str, record, last: int):
            from fedsched.lease import LeaseConflict

            self._check()
            current = self.store.records.get(key)
            if (current.revision if current else 0) != last:
                raise LeaseConflict(key, f"revision is not {last}")
            return self._put(key, record)

        async def written_at(self, revision: int) -> float:
            # as NatsLeaseStore.written_at: 0.0 (unknown) when it cannot be read
            return 0.0 if self.name in self.store.down else self.store.times.get(revision, 0.0)

        def _put(self, key: str, record) -> int:
            from dataclasses import replace as _replace

            self.store.sequence += 1
            if self.store.clock is not None:
                self.store.times[self.store.sequence] = self.store.clock.time()
            self.store.records[key] = _replace(record, revision=self.store.sequence)
            return self.store.sequence


def comparable_verdicts(evaluations, placed: bool) -> list[tuple]:
    """A job's per-cluster verdicts as a sorted list of ``(cluster, passed, code, detail, total)``
    for comparing decisions made with and without the cycle's caches: the free-capacity details
    of an "insufficient" verdict are left out (they describe the cluster when the cycle first
    found it too small), and for a placed job a cluster that lost is "not chosen" whether its
    score bound ruled it out ("outscored") or the cycle already knew the request does not fit
    there ("insufficient") -- which one depends on what the cycle knew."""
    from fedsched.reasons import Reason

    out = []
    for e in evaluations:
        code = str(e.verdict.reason)
        if placed and e.verdict.reason in (Reason.OUTSCORED, Reason.INSUFFICIENT):
            code, detail = "not chosen", ""
        else:
            detail = "" if e.verdict.reason == Reason.INSUFFICIENT else e.verdict.detail
        out.append((e.cluster, e.verdict.passed, code, detail, e.total))
    return sorted(out)
