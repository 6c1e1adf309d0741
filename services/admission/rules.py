"""Admission's governance rules for one submission: quota and budget (pure functions).

* :func:`check_quota_can_fit` -- refuse a job that can never fit its tenant's quota: on every
  (card model, region) the job may use, the quota covering it caps the tenant below the job's
  demand even with nothing else running (ceilings: :meth:`QuotaBook.ceiling`). A job that
  fits some day is accepted; the scheduler holds it until usage frees.
* :func:`check_budget` -- refuse new jobs once the tenant's month-to-date spend has reached its
  monthly budget; and refuse a job whose worst-case cost, on top of the spend and of the worst
  case of the tenant's open (queued or running, not yet billed) jobs, would overrun it, where
  the worst case counts the retry budget::

      worst = (1 + retry_limit) x GPUs x estimated hours x unit price

  with the unit price the job's price ceiling, or else the highest list price of a card model
  it may use in a region it may use (CPU-only: cores x CPU core-hour price). A tenant with a
  budget must give a runtime estimate (INVALID_ARGUMENT otherwise: the cost has no bound).
  Failed attempts that did run are billed like any other and so count against the budget
  through the spend itself; a job that runs past its estimate is billed for what it ran.

Both raise :class:`~fedsched.errors.QuotaExceededError` (gRPC RESOURCE_EXHAUSTED) whose
``limit`` names the quota (``quota.<tenant>/<card>/<region>``) or the budget
(``budget.<tenant>``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Iterable

from fedsched.errors import QuotaExceededError, ValidationError
from fedsched.tenancy import Governance
from fedsched.jobs import JobSpec, Locality
from fedsched.pricing import PriceCatalog, money
from fedsched.quota import QuotaBook
from services.admission.budgets import SpendBook, month_of


def candidate_regions(spec: JobSpec, known_regions: Iterable[str]) -> list[str]:
    """Regions the job may run in, among ``known_regions`` (plus its home)."""
    if spec.locality == Locality.MUST_LOCAL:
        regions = {spec.home_region}
    elif spec.allowed_regions:
        regions = set(spec.allowed_regions)
    else:
        regions = set(known_regions) | {spec.home_region}
    return sorted(regions - set(spec.forbidden_regions))


def _gpus(milli: int) -> str:
    return f"{milli / 1000:g} GPU"


def check_quota_can_fit(gov: Governance, spec: JobSpec, known_models: Iterable[str],
                        known_regions: Iterable[str]) -> None:
    """Raise if no (card model, region) the job may use has a quota ceiling >= its demand.

    Raises:
        QuotaExceededError: ``limit`` = ``quota.<rule label>`` of the most generous refusing rule.
    """
    if not gov.quota_rules or spec.gpus_per_worker == 0:
        return
    book = QuotaBook(gov.quota_rules)
    if not book.limits(spec.tenant):
        return
    models = list(spec.card_models) or sorted(known_models)
    regions = candidate_regions(spec, known_regions)
    demand = spec.total_gpu_milli
    best = None
    for model in models:
        for region in regions:
            cap, rule = book.ceiling(spec.tenant, model, region)
            if cap is None or cap >= demand:
                return
            if best is None or cap > best[0]:
                best = (cap, rule)
    if best is None:
        return  # nothing known yet to judge by
    cap, rule = best
    raise QuotaExceededError(
        f"quota.{rule.label}",
        f"the job needs {_gpus(demand)} but quota {rule.label} allows tenant {spec.tenant} at most {_gpus(cap)} "
        f"({_gpus(rule.nominal_milli)} guaranteed"
        + (f" + borrowing in cohort {rule.cohort}" if rule.cohort else "")
        + f") on every card model and region the job may use, so it could never start (policy {gov.version})")


def worst_case_cost(spec: JobSpec, prices: PriceCatalog, known_models: Iterable[str],
                    known_regions: Iterable[str]) -> tuple[Decimal, str] | None:
    """The job's worst-case cost including its retries, and how it was computed; None without a
    duration estimate (formula in the module docstring)."""
    if not spec.estimated_duration_s:
        return None
    hours = Decimal(str(spec.estimated_duration_s)) / Decimal(3600)
    attempts = 1 + spec.retry_limit
    regions = candidate_regions(spec, known_regions)
    if spec.gpus_per_worker == 0:
        cores = Decimal(spec.cpu_milli * spec.workers) / Decimal(1000)
        unit = max((prices.cpu_core_hour_in(r) for r in regions), default=prices.cpu_core_hour)
        cost = money(attempts * cores * hours * unit)
        return cost, f"{attempts} attempt(s) x {cores} cores x {hours:.2f} h x {unit}/core-h"
    gpus = Decimal(spec.total_gpu_milli) / Decimal(1000)
    if spec.max_price_per_gpu_hour:
        unit = money(spec.max_price_per_gpu_hour)
    else:
        models = list(spec.card_models) or sorted(known_models)
        unit = max((prices.gpu_hour(r, m) for r in regions for m in models), default=prices.default_gpu_hour)
    cost = money(attempts * gpus * hours * unit)
    return cost, f"{attempts} attempt(s) x {gpus} GPU x {hours:.2f} h x {unit}/GPU-h"


def check_budget(gov: Governance, spend: SpendBook, spec: JobSpec, now: float, prices: PriceCatalog,
                 known_models: Iterable[str], known_regions: Iterable[str],
                 open_costs: Iterable[Decimal] = ()) -> None:
    """Raise if the tenant's budget is exhausted, or if its spend plus the worst case of the
    jobs it has open (queued or running, not billed yet) plus this job's would overrun it.

    Args:
        now: business time (seconds since the Unix epoch): picks the month.
        open_costs: the worst-case costs (:func:`worst_case_cost`) of the tenant's other jobs
            that have not ended; walked only when the tenant has a budget.

    Raises:
        QuotaExceededError: ``limit`` = ``budget.<tenant>``.
        ValidationError: the tenant has a budget and the job gives no runtime estimate (field
            ``spec.estimated_duration_seconds``): its cost could not be bounded.
    """
    budget = gov.budget(spec.tenant)
    if budget is None:
        return
    month = month_of(now)
    spent = spend.spend(spec.tenant, month)
    cur = budget.currency
    if spent >= budget.monthly:
        raise QuotaExceededError(
            f"budget.{spec.tenant}",
            f"month-to-date spend {spent} {cur} has reached tenant {spec.tenant}'s monthly budget {budget.monthly} "
            f"{cur} for {month}; new jobs are refused until next month or a larger budget (policy {gov.version})")
    worst = worst_case_cost(spec, prices, known_models, known_regions)
    if worst is None:
        raise ValidationError("spec.estimated_duration_seconds",
                              f"tenant {spec.tenant} has a monthly budget ({budget.monthly} {cur}): give the job's "
                              f"runtime estimate, so its worst-case cost can be checked against what is left")
    committed = sum(open_costs, Decimal(0))
    if spent + committed + worst[0] > budget.monthly:
        left = budget.monthly - spent - committed
        held = f", {committed} {cur} held by its open jobs" if committed else ""
        raise QuotaExceededError(
            f"budget.{spec.tenant}",
            f"the job may cost up to {worst[0]} {cur} ({worst[1]}, retries included) but only {left} {cur} of "
            f"tenant {spec.tenant}'s {month} budget {budget.monthly} {cur} is left (spent {spent} {cur}{held}; "
            f"policy {gov.version})")