"""Builders shared by the tests (functions and constants only; fixtures are in conftest.py).

- names and data: :func:`unique`, :data:`DATA` (the bundled trace);
- the scheduling core: :func:`node`, :func:`cluster`, :func:`job`, :func:`view` (card models
  :data:`T4`, :data:`V100`, :data:`G2`);
- the tenancy policy: a test policy with known tokens (:func:`policy_text`, :func:`policy_doc`),
  storing it in NATS KV (:func:`store_policy`), channels and stubs that carry a principal's token
  (:func:`channel`, :class:`Stubs`), and :func:`until` (await a condition with a deadline).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from pathlib import Path

import grpc

from fedapp.client import aio_channel
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.auth import hash_token
from fedsched.bus import Bus
from fedsched.jobs import JobSpec, PriorityClass
from fedsched.policystore import StoredPolicy, read_policy, write_policy
from fedsched.tenancy import PolicyDoc, parse_policy
from services.scheduler.core import ClusterState, NodeState, QueuedJob, View

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


class Stubs:
    """All four stubs over one channel."""

    def __init__(self, ch: grpc.aio.Channel) -> None:
        self.jobs = pb_grpc.JobServiceStub(ch)
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
