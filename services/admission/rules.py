"""Admission's governance rules for one submission: quota and budget (pure functions).

* :func:`check_quota_can_fit` -- refuse a job that can never fit its tenant's quota: on every
  (card model, region) the job may use, the quota covering it caps the tenant below the job's
  demand even with nothing else running (ceilings: :meth:`QuotaBook.ceiling`). A job that
  fits some day is accepted; the scheduler holds it until usage frees. The demand compared is
  one shard's gang (workers x GPUs per worker): the shards of a split job are placed and
  admitted against the quota one by one, so a job fits when one shard does.
* :func:`check_budget` -- refuse new jobs once the tenant's month-to-date spend has reached its
  monthly budget; and refuse a job whose worst-case cost, on top of the spend and of the worst
  case of the tenant's open (queued or running, not yet billed) jobs, would overrun it, where
  the worst case counts the retry budget and every shard::

      worst = (1 + retry_limit) x shards x workers x GPUs per worker x estimated hours x unit price

  (each shard of a split job is a gang of its own, placed, run and billed separately);

  with the unit price the job's price ceiling, or else the highest list price of a card model
  it may use in a region it may use (CPU-only: cores x CPU core-hour price). A tenant with a
  budget must give a runtime estimate (INVALID_ARGUMENT otherwise: the cost has no bound).
  Failed attempts that did run are billed like any other and so count against the budget
  through the spend itself; a job that runs past its estimate is billed for what it ran.

Both raise :class:`~fedsched.errors.QuotaExceededError` (gRPC RESOURCE_EXHAUSTED) whose
``limit`` names the quota (``quota.<tenant>/<card>/<region>``) or the budget
(``budget.<tenant>``).

* :func:`check_can_ever_run` -- refuse a GPU job that no cluster admission knows of (from the
  agents' latest inventory, :class:`ClusterCapacity`) could ever hold as asked, even empty:
  no cluster in a region the job may use has a card model it allows (with its minimum GPU
  memory, RDMA, residency tags), or the gang (workers x GPUs per worker, per shard) is larger
  than any such cluster. Raises :class:`~fedsched.errors.ConflictError` (gRPC
  FAILED_PRECONDITION) with the reason. Node health and maintenance are ignored (they pass);
  with no inventory at all nothing is refused. The scheduler's ``fits_empty`` is the same
  judgement made later, on the inventory of the moment.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from typing import Iterable, Mapping

from fedsched.errors import ConflictError, QuotaExceededError, ValidationError
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
    shards = f"{spec.shards} shards x " if spec.shards > 1 else ""
    if spec.gpus_per_worker == 0:
        cores = Decimal(spec.cpu_milli * spec.workers) / Decimal(1000)
        unit = max((prices.cpu_core_hour_in(r) for r in regions), default=prices.cpu_core_hour)
        cost = money(attempts * spec.shards * cores * hours * unit)
        return cost, f"{attempts} attempt(s) x {shards}{cores} cores x {hours:.2f} h x {unit}/core-h"
    gpus = Decimal(spec.total_gpu_milli) / Decimal(1000)  # one shard's gang
    if spec.max_price_per_gpu_hour:
        unit = money(spec.max_price_per_gpu_hour)
    else:
        models = list(spec.card_models) or sorted(known_models)
        unit = max((prices.gpu_hour(r, m) for r in regions for m in models), default=prices.default_gpu_hour)
    cost = money(attempts * spec.shards * gpus * hours * unit)
    return cost, f"{attempts} attempt(s) x {shards}{gpus} GPU x {hours:.2f} h x {unit}/GPU-h"


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

@dataclass(frozen=True)
class ClusterCapacity:
    """What a cluster could ever hold, from its agent's latest inventory snapshot.

    Attributes:
        region: the cluster's region.
        rdma: its fabric is RDMA / InfiniBand.
        residency_tags: compliance tags it satisfies.
        nodes: ``(card model, GPU memory GiB or None, node RDMA) -> Counter(GPUs per node ->
            number of such nodes)``, GPU nodes only, healthy or not.
    """

    region: str
    rdma: bool
    residency_tags: frozenset[str]
    nodes: Mapping[tuple[str, int | None, bool], Counter]

    @classmethod
    def from_snapshot(cls, region: str, snapshot) -> "ClusterCapacity":
        """From an :class:`~fedsched.events.InventorySnapshot` (size: distinct node shapes)."""
        nodes: dict[tuple[str, int | None, bool], Counter] = {}
        for n in snapshot.nodes:
            if n.gpus and n.card_model:
                nodes.setdefault((n.card_model, n.gpu_memory_gib, n.rdma), Counter())[n.gpus] += 1
        return cls(region, snapshot.interconnect in ("rdma", "infiniband"), frozenset(snapshot.residency_tags), nodes)

    def workers_that_fit(self, spec: JobSpec) -> dict[str, int]:
        """Card model -> most workers of ``spec`` this cluster could hold on it when empty
        (whole GPUs: ``sum over nodes of floor(node GPUs / GPUs per worker)``; a fractional
        share: ``sum over nodes of node GPUs x floor(1000 / share)``)."""
        out: dict[str, int] = {}
        for (model, memory, _), counts in self.nodes.items():
            if spec.card_models and model not in spec.card_models:
                continue
            if spec.min_gpu_memory_gib and (memory is None or memory < spec.min_gpu_memory_gib):
                continue
            if spec.gpus_per_worker > 1 or spec.gpu_milli >= 1000:
                slots = sum(k * (gpus // spec.gpus_per_worker) for gpus, k in counts.items())
            else:
                slots = sum(k * gpus * (1000 // spec.gpu_milli) for gpus, k in counts.items())
            out[model] = out.get(model, 0) + slots
        return out


def check_can_ever_run(spec: JobSpec, clusters: Mapping[str, ClusterCapacity], known_regions: Iterable[str]) -> None:
    """Raise if no known cluster in a region the job may use could ever hold one shard of it.

    Args:
        spec: the admitted spec (after the tenant's policy narrowed it).
        clusters: cluster name -> its capacity (admission's inventory follower).
        known_regions: regions known to admission (for a job without region limits).

    Raises:
        ConflictError: the reason, naming the regions and what their clusters offer.
    """
    if spec.gpus_per_worker == 0 or not clusters:
        return
    regions = set(candidate_regions(spec, known_regions))
    tags = set(spec.residency_tags)
    for c in clusters.values():  # a cluster that could hold it: nothing to say (every submit)
        if c.region in regions and tags <= c.residency_tags and (c.rdma or not spec.requires_rdma) and any(
                workers >= spec.workers for workers in c.workers_that_fit(spec).values()):
            return
    # none could: the reason, from the clusters in name order (what is said of the best one)
    where = ", ".join(sorted(regions))
    local = {name: c for name, c in clusters.items() if c.region in regions}
    if not local:
        raise ConflictError(f"no cluster in the regions the job may use ({where}); it could never run as asked")
    local = {name: c for name, c in local.items() if tags <= c.residency_tags}
    if not local:
        raise ConflictError(f"no cluster in {where} carries the residency tags {', '.join(sorted(tags))}; "
                            f"the job could never run as asked")
    if spec.requires_rdma:
        local = {name: c for name, c in local.items() if c.rdma}
        if not local:
            raise ConflictError(f"no cluster in {where} has an RDMA fabric; the job could never run as asked")
    best: tuple[int, str, str] | None = None
    for name, c in sorted(local.items()):
        for model, workers in c.workers_that_fit(spec).items():
            if workers >= spec.workers:
                return
            if best is None or workers > best[0]:
                best = (workers, model, name)
    if best is None:
        offered = sorted({m for c in local.values() for (m, _, _) in c.nodes})
        wanted = ", ".join(spec.card_models) if spec.card_models else "any card model"
        memory = f" with >= {spec.min_gpu_memory_gib} GiB" if spec.min_gpu_memory_gib else ""
        raise ConflictError(f"no cluster in {where} has {wanted}{memory} (they have: "
                            f"{', '.join(offered) or 'no GPUs'}); the job could never run as asked")
    share = f"{spec.gpus_per_worker} GPU" if spec.gpu_milli >= 1000 or spec.gpus_per_worker > 1 else \
        f"{spec.gpu_milli}m GPU"
    if best[0] == 0:
        raise ConflictError(f"one worker needs {share} on one node, and no node of a card model the job allows in "
                            f"{where} has that many; the job could never run as asked")
    raise ConflictError(f"the gang of {spec.workers} workers x {share} is larger than any cluster in {where} "
                        f"could hold (at most {best[0]} workers, on {best[1]} in {best[2]}); the job could never "
                        f"run as asked")
