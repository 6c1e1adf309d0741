"""Typed, countable reasons a cluster is excluded (filter verdicts) -- Kueue/Armada style.

A reason is a code (countable: dashboards group by it) plus a human detail. Filters never raise;
they return a :class:`Verdict`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """Why a cluster cannot take a job. The value is the stable code stored in ClickHouse."""

    UNHEALTHY = "cluster_unhealthy"
    STALE = "inventory_stale"
    MAINTENANCE = "cluster_maintenance"
    REGION_NOT_ALLOWED = "region_not_allowed"
    REGION_FORBIDDEN = "region_forbidden"
    NOT_HOME = "outside_home_region"
    RESIDENCY = "residency_mismatch"
    CARD_MODEL = "card_model_not_offered"
    GPU_MEMORY = "gpu_memory_too_small"
    INTERCONNECT = "interconnect_missing"
    PRICE = "price_above_ceiling"
    GANG_TOO_BIG = "gang_never_fits"
    INSUFFICIENT = "insufficient_free_resources"
    QUOTA = "quota_exceeded"
    AVOIDED = "failed_here_before"
    RESERVED = "reserved_for_higher_priority"
    WAIT_FOR_HOME = "waiting_for_home_region"
    OUTSCORED = "outscored"


#: Reasons that hold whatever the load: if every cluster fails on one of these, the job is
#: unplaceable on today's federation.
STATIC_REASONS = frozenset(Reason) - {Reason.INSUFFICIENT, Reason.QUOTA, Reason.STALE, Reason.UNHEALTHY,
                                      Reason.MAINTENANCE, Reason.AVOIDED, Reason.RESERVED, Reason.WAIT_FOR_HOME,
                                      Reason.OUTSCORED}


@dataclass(frozen=True, slots=True)
class Verdict:
    """A filter's answer for one (job, cluster): passed, or the reason and a detail."""

    passed: bool
    reason: Reason | None = None
    detail: str = ""

    def __str__(self) -> str:
        if self.passed:
            return "ok"
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


PASS = Verdict(True)


def fail(reason: Reason, detail: str = "") -> Verdict:
    """A failed verdict."""
    return Verdict(False, reason, detail)


def summarise_counts(counts: "Counter[Reason]") -> str:
    """:func:`summarise` from reason counts already made (the scheduler keeps them as it goes)."""
    counts = +counts  # drop zero and negative entries
    counts.pop(None, None)
    if not counts:
        return "no cluster reported inventory yet"
    parts = [f"{reason.value} ({n} cluster{'s' if n != 1 else ''})" for reason, n in counts.most_common()]
    return "no cluster fits: " + ", ".join(parts)


def summarise(verdicts: dict[str, Verdict]) -> str:
    """One line for a pending job: reason codes with their cluster counts, most common first.

    >>> summarise({"a": fail(Reason.CARD_MODEL), "b": fail(Reason.CARD_MODEL), "c": fail(Reason.STALE)})
    'no cluster fits: card_model_not_offered (2 clusters), inventory_stale (1 cluster)'
    """
    if not verdicts:
        return "no cluster reported inventory yet"
    counts = Counter(v.reason for v in verdicts.values() if not v.passed)
    counts.pop(None, None)
    parts = [f"{reason.value} ({n} cluster{'s' if n != 1 else ''})" for reason, n in counts.most_common()]
    return "no cluster fits: " + ", ".join(parts)
