"""Quotas: guaranteed GPU shares per tenant x card model (or class) x region, with borrowing.

The terms are Kueue's. A :class:`QuotaRule` gives one tenant a *nominal* (guaranteed) amount of
milli-GPUs on a set of card models (one model, a class of models, or any) in a set of regions
(one region or any), a *borrowing limit* above it, and a *cohort*: rules in one cohort lend each
other their unused nominal quota.

A placement (tenant ``t``, card model ``m``, region ``g``, ``d`` milli-GPUs) is *covered* by
every rule of ``t`` that matches ``(m, g)``. It is admitted when every covering rule ``r``
admits it::

    used_r + d <= nominal_r                                        (within the guarantee)
 or used_r + d - nominal_r <= borrowing_limit_r                    (None = no limit)
    and cohort_r != "" and used_C + d <= nominal_C                 (the cohort can lend it)

where ``used_C`` / ``nominal_C`` sum over the rules of the cohort ``C`` that match ``(m, g)``.
A placement no rule covers is not limited by quota. Guaranteed quota lent to others is taken
back by preemption, by the rules in :mod:`.preempt` (reclaim within the cohort).

Everything here is pure: a :class:`QuotaBook` is built from the rules and the allocations in
force; :meth:`QuotaBook.check` returns a :class:`~.reasons.Verdict` (``Reason.QUOTA`` with a
detail naming the rule); :meth:`QuotaBook.add` is used only on a private :meth:`copy` (the
scheduler admits one cycle's placements in order against such a copy).

Units: milli-GPUs (1000 = one card).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from fedsched.reasons import PASS, Reason, Verdict, fail


@dataclass(frozen=True, slots=True)
class QuotaRule:
    """One quota.

    Attributes:
        tenant: the tenant it limits.
        models: canonical card models it covers (None = any model).
        regions: regions it covers (None = any region).
        nominal_milli: guaranteed milli-GPUs.
        borrowing_limit_milli: most milli-GPUs it may use above nominal (None = no limit; only
            meaningful with a cohort).
        cohort: cohort name ("" = none: no borrowing, no lending).
        label: how people name it, e.g. ``search/nvidia-a100-80gb/cn-north-1``.
    """

    tenant: str
    models: frozenset[str] | None
    regions: frozenset[str] | None
    nominal_milli: int
    borrowing_limit_milli: int | None = 0
    cohort: str = ""
    label: str = ""

    def matches(self, model: str, region: str) -> bool:
        """Covers card model ``model`` in ``region`` (for any tenant)."""
        return (self.models is None or model in self.models) and (self.regions is None or region in self.regions)

    @property
    def ceiling_milli(self) -> int | None:
        """Most it could ever hold alone: nominal + borrowing limit (None = unbounded)."""
        if not self.cohort:
            return self.nominal_milli
        if self.borrowing_limit_milli is None:
            return None
        return self.nominal_milli + self.borrowing_limit_milli


def _milli(m: int) -> str:
    return f"{m / 1000:g} GPU" if m % 1000 == 0 else f"{m}m GPU"


class QuotaBook:
    """Quota rules with the usage in force.

    Args:
        rules: every rule of every tenant.
        used: usage per rule index (milli-GPUs); see :meth:`build`.
    """

    __slots__ = ("rules", "used", "_covering", "_by_tenant")

    def __init__(self, rules: Iterable[QuotaRule], used: dict[int, int] | None = None) -> None:
        self.rules: tuple[QuotaRule, ...] = tuple(rules)
        self.used: dict[int, int] = dict(used or {})
        self._covering: dict[tuple[str, str, str], tuple[int, ...]] = {}
        self._by_tenant: dict[str, tuple[int, ...]] = {}
        for i, r in enumerate(self.rules):
            self._by_tenant[r.tenant] = self._by_tenant.get(r.tenant, ()) + (i,)

    @classmethod
    def build(cls, rules: Iterable[QuotaRule], allocations: Iterable[tuple[str, str, str, int]]) -> "QuotaBook":
        """A book with ``allocations`` (tenant, card model, region, milli-GPUs) counted."""
        book = cls(rules)
        for tenant, model, region, milli in allocations:
            book.add(tenant, model, region, milli)
        return book

    def copy(self) -> "QuotaBook":
        """An independent copy (same rules, usage copied)."""
        twin = QuotaBook.__new__(QuotaBook)
        twin.rules, twin.used = self.rules, dict(self.used)
        twin._covering, twin._by_tenant = self._covering, self._by_tenant
        return twin

    def limits(self, tenant: str) -> bool:
        """The tenant has any quota rule."""
        return tenant in self._by_tenant

    def covering(self, tenant: str, model: str, region: str) -> tuple[int, ...]:
        """Indices of the rules covering (tenant, model, region)."""
        key = (tenant, model, region)
        hit = self._covering.get(key)
        if hit is None:
            hit = self._covering[key] = tuple(i for i in self._by_tenant.get(tenant, ())
                                              if self.rules[i].matches(model, region))
        return hit

    def add(self, tenant: str, model: str, region: str, milli: int) -> None:
        """Count an allocation (use on a :meth:`copy`; negative ``milli`` releases)."""
        if milli == 0 or not model:
            return
        for i in self.covering(tenant, model, region):
            self.used[i] = self.used.get(i, 0) + milli

    def _cohort(self, rule: QuotaRule, model: str, region: str) -> tuple[int, int]:
        nominal = used = 0
        for i, r in enumerate(self.rules):
            if r.cohort == rule.cohort and r.matches(model, region):
                nominal += r.nominal_milli
                used += self.used.get(i, 0)
        return used, nominal

    def check(self, tenant: str, model: str, region: str, milli: int) -> Verdict:
        """Whether ``milli`` more milli-GPUs of ``model`` in ``region`` fit ``tenant``'s quota now.

        Returns:
            PASS, or ``Reason.QUOTA`` with a detail naming the first rule that refuses.
        """
        if milli <= 0 or not model:
            return PASS
        for i in self.covering(tenant, model, region):
            r = self.rules[i]
            used = self.used.get(i, 0)
            if used + milli <= r.nominal_milli:
                continue
            head = f"quota {r.label}: {_milli(used)} in use + {_milli(milli)} > {_milli(r.nominal_milli)} guaranteed"
            if not r.cohort:
                return fail(Reason.QUOTA, head + " (no cohort to borrow from)")
            over = used + milli - r.nominal_milli
            if r.borrowing_limit_milli is not None and over > r.borrowing_limit_milli:
                return fail(Reason.QUOTA, head + f" + {_milli(r.borrowing_limit_milli)} borrowing limit")
            c_used, c_nominal = self._cohort(r, model, region)
            if c_used + milli > c_nominal:
                lendable = max(0, (c_nominal - r.nominal_milli) - (c_used - used))
                return fail(Reason.QUOTA, head + f"; cohort {r.cohort} has {_milli(lendable)} unused to lend")
        return PASS

    def room(self, tenant: str, model: str, region: str, milli: int) -> bool:
        """Shorthand: :meth:`check` passes."""
        return self.check(tenant, model, region, milli).passed

    def ceiling(self, tenant: str, model: str, region: str) -> tuple[int | None, QuotaRule | None]:
        """The most ``tenant`` could ever hold of ``model`` in ``region`` with nothing else
        running, and the rule that sets it (``(None, None)`` = unlimited).

        A rule's ceiling is its nominal without a cohort, else nominal + borrowing limit, capped
        by the cohort's total nominal for (model, region).
        """
        best: tuple[int | None, QuotaRule | None] = (None, None)
        for i in self.covering(tenant, model, region):
            r = self.rules[i]
            cap = r.ceiling_milli
            if r.cohort:
                _, c_nominal = self._cohort(r, model, region)
                cap = c_nominal if cap is None else min(cap, c_nominal)
            if best[0] is None or cap < best[0]:
                best = (cap, r)
        return best
