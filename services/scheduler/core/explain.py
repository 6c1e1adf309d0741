"""Counterfactual explanations: what would have changed a decision.

Pure functions over the same snapshot the decision used:

* :func:`pending_counterfactual` -- for a job that waits, try one relaxation at a time (regions
  and locality, card models, on-card memory, price ceiling), in that order, and report the first
  that would start it now: "allowing region cn-east-1 would start it now (est. cost +8%)";
  "relaxing card model to nvidia-t4-16gb would start it now".
* :func:`placement_counterfactual` -- for a job placed outside its home region, when the home
  region would have started it (estimated from running work's estimated ends) and at what cost
  difference: "staying in cn-north-1 would start it ~40 min later (est.) at -12% cost".

Each relaxation runs the real :func:`~.decide.decide` on a one-job queue, so explanations and
decisions can never disagree.
"""

from __future__ import annotations

from dataclasses import replace

from fedsched.jobs import Locality
from services.scheduler.core.decide import Placement, decide
from services.scheduler.core.filters import Context, candidate_models
from services.scheduler.core.fit import WorkingCluster
from services.scheduler.core.policy import Policy
from services.scheduler.core.preempt import estimated_start
from services.scheduler.core.scorers import estimated_cost
from services.scheduler.core.snapshot import QueuedJob, View


def _solo(view: View, job: QueuedJob, policy: Policy) -> Placement | None:
    quiet = replace(policy, preemption=False, backfill=False, prefer_local_max_wait_s=0.0)
    d = decide(view, [job], quiet)
    return d.placements[0] if d.placements else None


def pending_counterfactual(view: View, job: QueuedJob, policy: Policy) -> str:
    """The first single relaxation that would start a waiting job now, or "" if none does."""
    spec = job.spec
    relaxations = []
    if spec.allowed_regions or spec.forbidden_regions or spec.locality != Locality.GLOBAL or job.cross_region != "allowed":
        relaxations.append(("regions", replace(job, cross_region="allowed", spec=spec.model_copy(update={
            "allowed_regions": (), "forbidden_regions": (), "locality": Locality.GLOBAL}))))
    if spec.card_models:
        relaxations.append(("card_models", replace(job, spec=spec.model_copy(update={"card_models": ()}))))
    if spec.min_gpu_memory_gib:
        relaxations.append(("memory", replace(job, spec=spec.model_copy(update={"min_gpu_memory_gib": 0}))))
    if spec.max_price_per_gpu_hour:
        relaxations.append(("price", replace(job, spec=spec.model_copy(update={"max_price_per_gpu_hour": 0.0}))))
    for what, relaxed in relaxations:
        p = _solo(view, relaxed, policy)
        if p is None:
            continue
        if what == "regions":
            return f"allowing region {p.region} would start it now (est. cost {p.est_cost:.2f})"
        if what == "card_models":
            return f"relaxing card model to {p.card_model} would start it now on {p.cluster}"
        if what == "memory":
            return f"accepting {p.card_model} (less than {spec.min_gpu_memory_gib} GiB) would start it now"
        return f"a price ceiling of {p.price_per_gpu_hour:.2f}/GPU-h would start it now on {p.cluster}"
    return ""


def placement_counterfactual(view: View, placement: Placement, policy: Policy, starts: dict | None = None) -> str:
    """For a cross-region placement: the estimated home start and cost difference ("" otherwise).

    ``starts``: a memo of home-cluster start estimates shared by the calls made on one ``view``
    (a scheduling cycle): keyed by cluster and the request shape a fit reads (card models,
    workers, GPUs and milli-GPU per worker, CPU, memory), it saves walking the home clusters'
    running work again for every job of the same shape. Same results with or without it.
    """
    if not placement.cross_region:
        return ""
    job = placement.job
    home = job.spec.home_region
    ctx = Context(view, policy.inter_region_bandwidth_bps, policy.egress_price_per_gb,
                  region_bandwidth_bps={(a, b): bps for a, b, bps in policy.region_bandwidth_bps})
    best: tuple[float, float] | None = None
    for cluster in view.clusters:
        if cluster.region != home or cluster.name in job.avoid_clusters:
            continue
        models = candidate_models(job, cluster)
        if job.spec.gpus_per_worker and not models:
            continue
        s = job.spec
        key = (cluster.name, tuple(models), s.workers, s.gpus_per_worker, s.gpu_milli, s.cpu_milli, s.memory_mib)
        if starts is not None and key in starts:
            start = starts[key]
        else:
            start = estimated_start(s, models, cluster, WorkingCluster(cluster), view.now)
            if starts is not None:
                starts[key] = start
        if start is None:
            continue
        cost = estimated_cost(job, cluster, models[0] if models else "", ctx)
        if best is None or start < best[0]:
            best = (start, cost)
    if best is None:
        return f"{home} has no cluster that could run it"
    start, cost = best
    minutes = (start - view.now) / 60
    delta = (cost - placement.est_cost) / placement.est_cost * 100 if placement.est_cost else 0.0
    return f"staying in {home} would start it ~{minutes:.0f} min later (est.) at {delta:+.0f}% cost"
