"""Scheduling policies: filters, weighted scorers, queueing and preemption parameters, a version.

A policy is data (frozen), built by name. ``federated`` is the product's policy; the others
are the baselines the benchmark compares it with. All share the queue order (priority, aging,
fair share); only ``federated`` waits for the home region when that is worth it, preempts, and
reserves capacity for blocked head jobs (backfilling around the reservation).

=============  ==============================================================================
name           placement
=============  ==============================================================================
federated      all hard filters; scores: home region, start time vs deadline (incl. data
               transfer), estimated cost (compute + egress), fragmentation, packing
local-only     every job stays in its home region (each region schedules for itself)
least-loaded   spread to the cluster with the most free capacity (a multi-cluster spreader)
cheapest       the lowest estimated cost that fits
random         any cluster that fits, chosen pseudo-randomly (deterministic per job)
=============  ==============================================================================

The version is a content hash of :meth:`Policy.describe`, so every decision records the exact
rules it used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from fedsched.errors import ValidationError
from fedsched.policynames import POLICY_NAMES
from services.scheduler.core import filters as f
from services.scheduler.core import scorers as s


@dataclass(frozen=True)
class Policy:
    """A scheduling policy.

    Attributes:
        name: policy name (see the module table).
        filters: hard filters, applied in order (first failure is the reason).
        weights: (scorer, weight) pairs; ``total = sum(weight * score)``.
        inter_region_bandwidth_bps: bytes/s between regions (transfer time = bytes / this) for
            pairs not in ``region_bandwidth_bps``.
        region_bandwidth_bps: ``(region a, region b, bytes/s)`` per ordered region pair (from the
            topology's ``bandwidth``; empty = ``inter_region_bandwidth_bps`` everywhere).
        egress_price_per_gb: currency units per GB moved across regions.
        fast_lane_s: jobs estimated to run at most this long (s) use the fast lane.
        fast_lane_bonus: priority points the fast lane adds.
        aging_period_s / aging_step / aging_max_steps: waiting adds ``aging_step`` priority
            points per ``aging_period_s`` seconds, at most ``aging_max_steps`` times.
        prefer_local_max_wait_s: a ``prefer_local`` job whose home region is full waits for it
            when the estimated home start comes no later than the data transfer abroad would
            (plus ``prefer_local_slack_s``), and never longer than this (s); 0 = never waits.
        prefer_local_slack_s: seconds of extra wait a ``prefer_local`` job accepts to stay home.
        preemption: may evict preemptible work for a blocked job, by the rules of
            :mod:`.preempt` (Kueue's: within the tenant's quota by priority, reclaim within the
            cohort, borrow within the cohort).
        preempt_min_priority: only jobs with at least this class value may preempt by priority
            (reclaiming a tenant's guarantee needs no minimum).
        reclaim_within_cohort: Kueue's ``reclaimWithinCohort``: a job that fits within its
            tenant's guarantee may evict work of tenants of its cohort that borrow -- ``any``
            (whatever the borrower's priority), ``lower_priority`` or ``never``.
        borrow_within_cohort: Kueue's ``borrowWithinCohort`` (LowerPriority): a job that must
            borrow may evict lower-priority work of borrowing tenants of its cohort; off, it
            evicts only its own tenant's work (never preempts to borrow).
        checkpoint_interval_s: how much work a checkpointable victim loses at most (s).
        backfill: reserve capacity for blocked head jobs and backfill only work that ends (by
            its estimate) before the reservation starts.
        reservations: at most this many head jobs hold reservations per cycle.
        reserve_after_s: only a job that has waited this long (s) reserves capacity (holding
            cards back for a job that would start soon anyway costs more than it saves).
        max_scored_fits: per job, stop after this many clusters fit and were scored (in order
            of their score bound); 0 = score every cluster that can still win (exact). Like
            kube-scheduler's percentageOfNodesToScore: with many clusters the best of the most
            promising few is nearly always the best of all, at a fraction of the cost.
    """

    name: str
    filters: tuple[f.Filter, ...]
    weights: tuple[tuple[s.Scorer, float], ...]
    inter_region_bandwidth_bps: float = 1.25e9
    region_bandwidth_bps: tuple[tuple[str, str, float], ...] = ()
    egress_price_per_gb: float = 0.5
    fast_lane_s: float = 600.0
    fast_lane_bonus: int = 5
    aging_period_s: float = 1800.0
    aging_step: int = 10
    aging_max_steps: int = 6
    prefer_local_max_wait_s: float = 0.0
    prefer_local_slack_s: float = 120.0
    preemption: bool = False
    preempt_min_priority: int = 50
    reclaim_within_cohort: str = "any"
    borrow_within_cohort: bool = False
    checkpoint_interval_s: float = 1800.0
    backfill: bool = False
    reservations: int = 8
    reserve_after_s: float = 900.0
    max_scored_fits: int = 4
    version: str = field(default="", compare=False)

    def describe(self) -> dict[str, Any]:
        """The policy as plain data (what the version hashes)."""
        data = {x.name: getattr(self, x.name) for x in fields(self) if x.name not in ("filters", "weights", "version")}
        if not self.region_bandwidth_bps:  # unset: the version stays what it was before the field existed
            del data["region_bandwidth_bps"]
        data["filters"] = [x.name for x in self.filters]
        data["weights"] = {sc.name: w for sc, w in self.weights}
        return data


def _versioned(policy: Policy) -> Policy:
    digest = hashlib.sha256(json.dumps(policy.describe(), sort_keys=True).encode()).hexdigest()[:12]
    return replace(policy, version=f"{policy.name}@{digest}")


RECLAIM_MODES = ("any", "lower_priority", "never")  #: values of ``Policy.reclaim_within_cohort``

SCORERS = {"home": s.HomeRegion, "start": s.StartTime, "cost": s.Cost, "fragmentation": s.Fragmentation,
           "packing": s.Packing, "headroom": s.Headroom, "random": s.Random}

_TABLE: dict[str, dict[str, Any]] = {
    "federated": dict(weights={"home": 0.1, "start": 0.2, "cost": 0.45, "fragmentation": 0.15, "packing": 0.1},
                      prefer_local_max_wait_s=1800.0, preemption=True, backfill=True),
    "local-only": dict(weights={"fragmentation": 0.5, "packing": 0.5}, extra_filters=(f.HomeOnly(),)),
    "least-loaded": dict(weights={"headroom": 1.0}),
    "cheapest": dict(weights={"cost": 1.0, "packing": 0.01}),
    "random": dict(weights={"random": 1.0}),
}


def build_policy(name: str = "federated", *, weights: Mapping[str, float] | None = None, **params: Any) -> Policy:
    """The named policy, optionally with other weights or parameters (from the versioned
    policy file).

    Args:
        name: one of :data:`POLICY_NAMES`.
        weights: scorer name -> weight (replaces the named policy's weights).
        **params: any other :class:`Policy` field (e.g. ``aging_period_s``).

    Raises:
        ValidationError: unknown policy, scorer or parameter (field ``policy...``).
    """
    if name not in _TABLE:
        raise ValidationError("policy", f"unknown policy {name!r}; one of {', '.join(POLICY_NAMES)}")
    spec = dict(_TABLE[name])
    extra = spec.pop("extra_filters", ())
    chosen = dict(weights) if weights is not None else spec.pop("weights")
    spec.pop("weights", None)
    for key in chosen:
        if key not in SCORERS:
            raise ValidationError(f"policy.weights.{key}", f"unknown scorer; one of {', '.join(SCORERS)}")
        if not chosen[key] >= 0:
            raise ValidationError(f"policy.weights.{key}", "weights must be >= 0")
    known = {x.name for x in fields(Policy)} - {"name", "filters", "weights", "version"}
    for key in params:
        if key not in known:
            raise ValidationError(f"policy.{key}", f"unknown policy parameter; one of {', '.join(sorted(known))}")
    spec.update(params)
    if spec.get("reclaim_within_cohort", "any") not in RECLAIM_MODES:
        raise ValidationError("policy.reclaim_within_cohort", f"one of {', '.join(RECLAIM_MODES)}")
    pairs = tuple((SCORERS[k](), float(w)) for k, w in chosen.items())
    return _versioned(Policy(name, f.STANDARD_FILTERS + tuple(extra), pairs, **spec))
