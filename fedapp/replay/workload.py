"""Turning trace pods into job submissions: the documented overlay rule.

A trace has resources and times but no owners, data or policy. The overlay adds them
deterministically from hashes of the pod name (``u(x) = sha256(pod/x)`` scaled to [0, 1)), so
every replay of the same trace submits the same jobs:

=================  ===========================================================================
field              rule
=================  ===========================================================================
tenant             ``u(tenant)`` against weights search .30, ads .25, nlp .20, vision .15,
                   recsys .10 (tenants of ``fedsched/catalog/policy.yaml``)
home_region        the tenant's home region when ``u(home) < .85``, else one of the other
                   regions in force, by ``u(home)``. Under a custom topology the tenant's
                   home is its default home moved by :func:`fedapp.topology.map_region` (the
                   i-th default region -> the topology's region ``i mod n``, file order), and
                   "the other regions" are the topology's
kind               ``num_gpu >= 2`` -> training; qos ``LS`` -> inference; ``Guaranteed`` /
                   ``Burstable`` -> training; ``BE`` -> batch
project            training -> ``train``, inference -> ``serve``, others -> ``batch``
priority           ``LS`` -> high; ``Guaranteed``/``Burstable`` -> normal; ``BE`` -> low
                   (the openb QoS order LS > Guaranteed/Burstable > BE)
locality           ``u(locality) < .10`` -> must_local; ``< .40`` -> prefer_local; else global
residency_tags     ads jobs with ``u(residency) < .03`` -> [finance]; nlp ones -> [pii]
datasets           one input in the home region: training 10 GB..2 TB, batch 1..200 GB,
                   inference 1..50 GB (log-uniform in ``u(size)``)
preemptible        qos ``BE``
checkpointable     training with ``u(ckpt) < .5``
estimated duration the true runtime x ``2 ** (3 u(estimate) - 1)`` (x0.5 .. x4: users guess
                   roughly and mostly high); the scheduler only ever sees this estimate
card_models        the pod's ``gpu_spec`` (canonical names), empty = any
gpus               ``num_gpu`` whole cards, or one card's ``gpu_milli`` share when
                   ``num_gpu == 1``; a pod with ``num_gpu > 1`` and ``gpu_milli < 1000`` asks
                   for whole cards (shares span one card here)
cpu                the pod's ``cpu_milli``; a pod with neither GPUs nor CPU asks one core
name               the pod name as a job label (lower case, other characters as ``-``; changed
                   names get 6 hex of their hash); the dataset is ``<tenant>/<label>-input``
annotations        ``trace.pod``, ``trace.runtime_s``, ``trace.outcome`` -- read only by the
                   trace agent, which runs the job that long and ends it that way
=================  ===========================================================================
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import pydantic

from fedsched.jobs import Dataset, JobKind, JobSpec, Locality, PriorityClass
from fedapp.topology import DEFAULT_REGIONS, map_region
from services.inventory.trace import TracePod, pick, unit_hash

TENANT_WEIGHTS: tuple[tuple[str, str, float], ...] = (
    ("search", "cn-north-1", 0.30),
    ("ads", "cn-north-1", 0.25),
    ("nlp", "cn-east-1", 0.20),
    ("vision", "cn-south-1", 0.15),
    ("recsys", "cn-east-1", 0.10),
)

REGIONS: tuple[str, ...] = DEFAULT_REGIONS

_PRIORITY = {"LS": PriorityClass.HIGH, "Guaranteed": PriorityClass.NORMAL, "Burstable": PriorityClass.NORMAL,
             "BE": PriorityClass.LOW}
_SIZES = {JobKind.TRAINING: (10e9, 2e12), JobKind.BATCH: (1e9, 200e9), JobKind.INFERENCE: (1e9, 50e9)}


@dataclass(frozen=True, slots=True)
class TraceJob:
    """A pod as a job: when to submit it (trace seconds), its spec, its request id."""

    pod: TracePod
    submit_at_s: int
    spec: JobSpec
    request_id: str


def _log_uniform(u: float, lo: float, hi: float) -> int:
    return int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))


def _label(name: str) -> str:
    """``name`` as a canonical job/dataset label: lower case, runs of other characters as one
    ``-``, starting with a letter, at most 63 characters; a name that had to change gets 6 hex
    of its SHA-256 appended, so two pods never share a label."""
    label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if label != name or not label[:1].isalpha() or len(label) > 63:
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        label = f"{label if label[:1].isalpha() else 'pod-' + label}"[:56].rstrip("-") + "-" + digest
    return label


def overlay(pod: TracePod, regions: tuple[str, ...] = REGIONS) -> JobSpec:
    """The job spec of ``pod`` by the module's rule, with home regions among ``regions`` (the
    topology's, file order; default: the default split's)."""
    name = pod.name
    label = _label(name)
    tenant_i = pick(unit_hash(name, "tenant"), [w for _, _, w in TENANT_WEIGHTS])
    tenant, tenant_home, _ = TENANT_WEIGHTS[tenant_i]
    tenant_home = map_region(tenant_home, regions)
    u_home = unit_hash(name, "home")
    others = [r for r in regions if r != tenant_home]
    if u_home < 0.85 or not others:
        home = tenant_home
    else:
        home = others[min(len(others) - 1, int((u_home - 0.85) / 0.15 * len(others)))]
    if pod.num_gpu >= 2 or pod.qos in ("Guaranteed", "Burstable"):
        kind = JobKind.TRAINING
    elif pod.qos == "LS":
        kind = JobKind.INFERENCE
    else:
        kind = JobKind.BATCH
    project = {JobKind.TRAINING: "train", JobKind.INFERENCE: "serve"}.get(kind, "batch")
    u_loc = unit_hash(name, "locality")
    locality = Locality.MUST_LOCAL if u_loc < 0.10 else Locality.PREFER_LOCAL if u_loc < 0.40 else Locality.GLOBAL
    tags: tuple[str, ...] = ()
    if unit_hash(name, "residency") < 0.03:
        tags = {"ads": ("finance",), "nlp": ("pii",)}.get(tenant, ())
    lo, hi = _SIZES[kind]
    dataset = Dataset(name=f"{tenant}/{label}-input", home_region=home,
                      size_bytes=_log_uniform(unit_hash(name, "size"), lo, hi))
    estimate = pod.runtime_s * 2 ** (3 * unit_hash(name, "estimate") - 1)
    cpu_milli = pod.cpu_milli
    if pod.num_gpu == 0:
        gpus, milli = 0, 0
        cpu_milli = cpu_milli or 1000  # a pod list without resource columns: one core, not nothing
    elif pod.num_gpu == 1:
        gpus, milli = 1, pod.gpu_milli
    else:
        gpus, milli = pod.num_gpu, 1000
    fields = dict(
        tenant=tenant, project=project, name=label, kind=kind,
        priority=_PRIORITY.get(pod.qos, PriorityClass.NORMAL),
        workers=1, gpus_per_worker=gpus, gpu_milli=milli, cpu_milli=cpu_milli, memory_mib=pod.memory_mib,
        card_models=pod.gpu_spec, home_region=home, locality=locality, residency_tags=tags, datasets=(dataset,),
        preemptible=pod.qos == "BE", checkpointable=kind == JobKind.TRAINING and unit_hash(name, "ckpt") < 0.5,
        estimated_duration_s=round(estimate, 3),
        annotations={"trace.pod": name, "trace.runtime_s": str(pod.runtime_s), "trace.outcome": pod.outcome},
    )
    try:
        return JobSpec(**fields)
    except pydantic.ValidationError:
        # a pod no valid job can express (e.g. 100 GPUs, a 20-year runtime): submit it as the
        # trace says and let admission reject it, so it is counted and audited like any bad job
        return JobSpec.model_construct(**fields)


def trace_jobs(pods: list[TracePod], limit: int | None = None, load: float = 1.0,
               regions: tuple[str, ...] = REGIONS) -> list[TraceJob]:
    """The first ``limit`` pods (by creation time) as jobs.

    Args:
        pods: the trace's pods.
        limit: keep only the first N.
        load: arrival compression: submit times are ``(creation - first creation) / load``,
            runtimes unchanged, so ``load = 20`` offers about 20x the concurrent demand (the
            openb timeline alone peaks near 66 busy GPUs of 6212). 1 = the trace as recorded.
        regions: the regions in force (see :func:`overlay`).
    """
    if not load > 0:
        raise ValueError("load must be > 0")
    chosen = pods[:limit] if limit else pods
    t0 = chosen[0].creation_time if chosen else 0
    return [TraceJob(p, int((p.creation_time - t0) / load), overlay(p, regions), f"replay-{p.name}") for p in chosen]
