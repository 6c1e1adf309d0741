"""Scheduling policies: which filters, which scorers with which weights, and a version.

A policy is data (frozen), built by name. ``federated`` is the product's policy; the others
are the baselines the benchmark compares it with:

=============  ==============================================================================
name           behaviour
=============  ==============================================================================
federated      all hard filters; scores: home region, data transfer, price, bin-packing
local-only     every job stays in its home region (each region schedules for itself)
least-loaded   spread to the cluster with the most free capacity (a multi-cluster spreader)
cheapest       the lowest price that fits
random         any cluster that fits, chosen pseudo-randomly (deterministic per job)
=============  ==============================================================================

The version is a content hash of the policy's definition, so every decision can record the
exact rules it used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from fedsched.errors import ValidationError
from services.scheduler.core import filters as f
from services.scheduler.core import scorers as s


@dataclass(frozen=True)
class Policy:
    """A scheduling policy.

    Attributes:
        name: policy name (see the module table).
        filters: hard filters, applied in order (first failure is the reason).
        weights: scorer -> weight; ``total = sum(weight * score)``.
        inter_region_bandwidth_bps: bytes/s between regions (transfer time = bytes / this).
        egress_price_per_gb: currency units per GB moved across regions.
    """

    name: str
    filters: tuple[f.Filter, ...]
    weights: tuple[tuple[s.Scorer, float], ...]
    inter_region_bandwidth_bps: float = 1.25e9
    egress_price_per_gb: float = 0.5
    version: str = field(default="", compare=False)

    def describe(self) -> dict:
        """The policy as plain data (what the version hashes)."""
        return {
            "name": self.name,
            "filters": [x.name for x in self.filters],
            "weights": {sc.name: w for sc, w in self.weights},
            "inter_region_bandwidth_bps": self.inter_region_bandwidth_bps,
            "egress_price_per_gb": self.egress_price_per_gb,
        }


def _versioned(policy: Policy) -> Policy:
    digest = hashlib.sha256(json.dumps(policy.describe(), sort_keys=True).encode()).hexdigest()[:12]
    return Policy(policy.name, policy.filters, policy.weights, policy.inter_region_bandwidth_bps,
                  policy.egress_price_per_gb, version=f"{policy.name}@{digest}")


POLICY_NAMES = ("federated", "local-only", "least-loaded", "cheapest", "random")


def build_policy(name: str = "federated", *, inter_region_bandwidth_bps: float = 1.25e9,
                 egress_price_per_gb: float = 0.5) -> Policy:
    """The named policy.

    Raises:
        ValidationError: unknown name (field ``policy``).
    """
    std = f.STANDARD_FILTERS
    table: dict[str, tuple[tuple[f.Filter, ...], tuple[tuple[s.Scorer, float], ...]]] = {
        "federated": (std, ((s.HomeRegion(), 0.35), (s.DataTransfer(), 0.25), (s.Price(), 0.15), (s.Packing(), 0.25))),
        "local-only": (std + (f.HomeOnly(),), ((s.Packing(), 1.0),)),
        "least-loaded": (std, ((s.Headroom(), 1.0),)),
        "cheapest": (std, ((s.Price(), 1.0), (s.Packing(), 0.01))),
        "random": (std, ((s.Random(), 1.0),)),
    }
    if name not in table:
        raise ValidationError("policy", f"unknown policy {name!r}; one of {', '.join(POLICY_NAMES)}")
    filters, weights = table[name]
    return _versioned(Policy(name, filters, weights, inter_region_bandwidth_bps, egress_price_per_gb))
