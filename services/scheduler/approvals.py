"""The tenancy gate of the scheduler: quotas, cross-region modes and the approval workflow.

The scheduler service consults one :class:`TenancyGate` around the pure ``decide`` call; the
gate reads the tenancy policy in force (:class:`~fedsched.policystore.PolicyHolder`) and
the approval events on the bus, and never does I/O itself (it returns events for the service to
publish). Its parts of the cycle:

1. :meth:`TenancyGate.effective_policy` -- the running policy with the policy's scorer weights and,
   when quotas exist, the :class:`~services.scheduler.core.filters.Quota` filter; its version is
   ``<name>@<digest of filters and weights>/<governance version>``, so every decision event
   records both the scheduling rules and the governance policy it used;
2. :meth:`TenancyGate.narrow` -- the queue as the policy allows it: jobs awaiting approval are
   held back; jobs whose cross-region mode is ``forbidden`` (by the policy in force) or whose
   request was rejected or timed out are narrowed to ``must_local``; jobs whose tenant has
   quotas are narrowed to the card models that still have quota room somewhere;
3. :meth:`TenancyGate.quota_book` -- quota rules plus the usage of every placed or running job,
   the view's ``quota`` (the Quota filter reads it);
4. :meth:`TenancyGate.gate` -- the cycle's placements admitted in decision order against a copy of
   the quota book (several jobs placed in one cycle never exceed a quota together; a
   preemption's victims give their usage back first); a
   cross-region placement whose mode is ``approval`` (and whose region is not yet approved)
   becomes an ``approval.requested`` event instead, and the job waits;
5. :meth:`TenancyGate.expiries` -- ``approval.expired`` for requests past their deadline: the job
   falls back to its home queue. Deadlines are kept in a heap, so a cycle looks only at the
   requests that are due (not at every approval ever asked for).

The quota usage of placed and running work is kept as running totals per (tenant, card model,
region) by the scheduler service as shards are bound and released
(:meth:`TenancyGate.quota_book_of_totals`), so a cycle does not walk the active shards.

Approval outcomes (approved / rejected / expired) share one event id per approval
(:func:`~fedsched.events.approval_outcome_id`), so whichever is published first is the only
one; the gate folds outcomes from the stream, first one wins.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, Iterable, Mapping

from fedsched.bus import Delivery
from fedsched.dispatch import EventTable
from fedsched.events import (APPROVAL_OUTCOMES, ApprovalDecided, ApprovalRequested, Envelope, Subjects,
                             WorkerBinding, approval_outcome_id, business_event_id, make_event)
from fedsched.events import TERMINAL_STATUSES, EventType
from fedsched.tenancy import Governance
from fedsched.jobs import Locality
from fedsched.policystore import PolicyHolder
from fedsched.pricing import PriceCatalog, money
from fedsched.clock import to_datetime
from fedsched.quota import QuotaBook
from fedsched.reasons import STATIC_REASONS, Reason, Verdict, fail
from services.scheduler.core import ClusterEvaluation, Decisions, Pending, Placement, Policy, QueuedJob, View
from services.scheduler.core.filters import Quota
from services.scheduler.states import ACTIVE, ShardState

log = logging.getLogger(__name__)

Item = tuple[str, Envelope, dict[str, str] | None]  #: (subject, event, headers) for ``Bus.publish_many``
RESEND_EXPIRY_S = 5.0


def evaluation_record(e: ClusterEvaluation) -> dict[str, Any]:
    """One cluster's verdict as the bus carries it (``JobPlaced``, ``JobPending`` and
    ``ApprovalRequested`` ``evaluations``): cluster, region, passed, reason (a
    :class:`fedsched.reasons.Reason` value or ""), detail, score terms and their total."""
    return {"cluster": e.cluster, "region": e.region, "passed": e.verdict.passed,
            "reason": e.verdict.reason.value if e.verdict.reason else "", "detail": e.verdict.detail,
            "scores": dict(e.scores), "total": e.total}


@dataclass
class PendingApproval:
    """An open request: its id, the proposed region/cluster, its deadline (business s)."""

    approval_id: str
    region: str
    cluster: str
    expires_at: float
    expiry_sent_at: float | None = None  # business time we last published its expiry


@dataclass
class JobApprovals:
    """The approval state of one job.

    Attributes:
        requests: approval requests made so far (numbers the next request id).
        seen: request ids folded.
        pending: the open request, if any (the job is held back meanwhile).
        granted: regions an approver allowed.
        home_only: a request was rejected or timed out: the job stays in its home region.
    """

    requests: int = 0
    seen: set[str] = field(default_factory=set)
    pending: PendingApproval | None = None
    granted: set[str] = field(default_factory=set)
    home_only: bool = False


def placement_milli(bindings: Iterable[Any]) -> int:
    """Milli-GPUs a placement holds: sum over workers of share x devices.

    ``bindings``: the bus's :class:`~fedsched.events.WorkerBinding` (``gpu_indices``) or the
    core's bindings (``devices``). (A missing attribute asked of a pydantic model is slow --
    its ``__getattr__`` builds an error -- so the wire type is recognised first: ~14% of the
    scheduler's CPU went there, once per placement, issue 15.)"""
    total = 0
    for b in bindings:
        devices = b.gpu_indices if type(b) is WorkerBinding else getattr(b, "devices", None)
        if devices is None:
            devices = getattr(b, "gpu_indices", ())
        total += b.gpu_milli * len(devices)
    return total


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h".replace(".0 h", " h")
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


class TenancyGate:
    """Applies the tenancy policy (quotas, cross-region modes, approvals) to the scheduler's queue
    and decisions, and keeps the approval state (see the module docstring).

    Args:
        holder: the tenancy policy in force.
        subjects: subject names (events it builds are published by the service).
        prices: the price catalog (egress price and currency for cost estimates).
    """

    def __init__(self, holder: PolicyHolder, subjects: Subjects, prices: PriceCatalog) -> None:
        self.holder = holder
        self.subjects = subjects
        self.prices = prices
        self.state: dict[str, JobApprovals] = {}
        self.started: dict[str, float] = {}  # job -> business start of its running attempt
        self._policies: dict[tuple[Policy, str], Policy] = {}
        # open requests by due time: (business s when an expiry is due, job id, approval id);
        # an entry whose request was decided meanwhile is dropped when it comes up
        self._due: list[tuple[float, str, str]] = []
        self.last_expiry_visits = 0  #: heap entries the last :meth:`expiries` looked at

    # ------------------------------------------------------------------ folding events

    def apply(self, env: Envelope) -> bool:
        """Fold one event; True when a job's eligibility changed (the cycle should run)."""
        fold = GOVERNOR_EVENTS.route(env.type)
        return fold(self, env) if fold is not None else False

    def _on_started(self, env: Envelope) -> bool:
        self.started[env.job_id] = env.occurred_at.timestamp()
        return False

    def _on_ended(self, env: Envelope) -> bool:
        t = env.type
        self.started.pop(env.job_id, None)
        st = self.state.get(env.job_id)
        if t == EventType.JOB_CANCELLED and st is not None:
            st.pending = None
        return False

    def _on_requested(self, env: Envelope) -> bool:
        req = env.payload_as(ApprovalRequested)
        st = self.state.setdefault(env.job_id, JobApprovals())
        if req.approval_id in st.seen:
            return False
        st.seen.add(req.approval_id)
        st.requests += 1
        st.pending = PendingApproval(req.approval_id, req.proposed_region, req.proposed_cluster,
                                     req.expires_at.timestamp())
        heapq.heappush(self._due, (st.pending.expires_at, env.job_id, req.approval_id))
        return True

    def index_pending(self) -> None:
        """Rebuild the deadline heap from :attr:`state` (after a checkpoint was loaded into it).
        O(approvals), once."""
        self._due = [(st.pending.expires_at if st.pending.expiry_sent_at is None
                      else st.pending.expiry_sent_at + RESEND_EXPIRY_S, job_id, st.pending.approval_id)
                     for job_id, st in self.state.items() if st.pending is not None]
        heapq.heapify(self._due)

    def _on_outcome(self, env: Envelope) -> bool:
        t = env.type
        out = env.payload_as(ApprovalDecided)
        st = self.state.get(env.job_id)
        if st is None or st.pending is None or st.pending.approval_id != out.approval_id:
            return False  # already decided (first outcome wins) or unknown
        region = out.proposed_region or st.pending.region
        st.pending = None
        if t == EventType.APPROVAL_APPROVED:
            st.granted.add(region)
        else:
            st.home_only = True
        return True

    def forget(self, job_id: str) -> None:
        """Drop what is kept of a job that ended and left the scheduler's memory."""
        self.state.pop(job_id, None)
        self.started.pop(job_id, None)

    def apply_delivery(self, d: Delivery) -> bool:
        """:meth:`apply` for a delivery."""
        return self.apply(d.envelope)

    # ------------------------------------------------------------------ the cycle

    def effective_policy(self, base: Policy) -> Policy:
        """``base`` with the governance weights and (with quotas) the Quota filter; version
        ``<name>@<digest>/<governance version>``."""
        gov = self.holder.current
        if gov is None:
            return base
        key = (base, gov.version)  # the policy itself (equal fields = same result), never its id
        policy = self._policies.get(key)
        if policy is None:
            weights = tuple((sc, gov.weights.get(sc.name, w)) for sc, w in base.weights)
            filters = base.filters + ((Quota(),) if gov.quota_rules else ())
            policy = replace(base, filters=filters, weights=weights)
            digest = hashlib.sha256(json.dumps(policy.describe(), sort_keys=True).encode()).hexdigest()[:12]
            policy = replace(policy, version=f"{base.name}@{digest}/{gov.version}")
            self._policies = {key: policy}
        return policy

    def _active(self, gov: Governance) -> bool:
        return bool(gov.quota_rules) or any(t.cross_region != "allowed" or t.job_classes for t in gov.tenants.values())

    def narrow(self, queue: list[QueuedJob], view: View) -> list[QueuedJob]:
        """The queue as the policy allows it (step 2 of the module docstring)."""
        gov = self.holder.current
        if gov is None or (not self.state and not self._active(gov)):
            return queue
        book = view.quota
        models = sorted({m for c in view.clusters for m in c.card_models}) if book is not None else []
        regions = sorted({c.region for c in view.clusters})
        out = []
        for qj in queue:
            st = self.state.get(qj.job_id)
            if st is not None and st.pending is not None:
                continue  # awaiting approval
            spec = qj.spec
            update: dict[str, Any] = {}
            if spec.locality != Locality.MUST_LOCAL and spec.tenant in gov.tenants:
                if (st is not None and st.home_only) or gov.mode_for(spec)[0] == "forbidden":
                    update["locality"] = Locality.MUST_LOCAL
            if book is not None and spec.gpus_per_worker and book.limits(spec.tenant):
                wanted = spec.card_models or tuple(models)
                roomy = tuple(m for m in wanted
                              if any(book.room(spec.tenant, m, r, spec.total_gpu_milli) for r in regions))
                if roomy and len(roomy) < len(wanted):
                    update["card_models"] = roomy
            out.append(replace(qj, spec=spec.model_copy(update=update)) if update else qj)
        return out

    def quota_book(self, jobs: Iterable[Any]) -> QuotaBook | None:
        """Quota rules with the usage of every placed or running job (None = no quotas).

        Args:
            jobs: the scheduler's job entries (``tenant``, ``region``, ``placed``).
        """
        gov = self.holder.current
        if gov is None or not gov.quota_rules:
            return None
        return QuotaBook.build(gov.quota_rules, ((j.tenant, j.placed.card_model, j.region,
                                                  placement_milli(j.placed.bindings))
                                                 for j in jobs if j.placed is not None))

    def quota_book_of_totals(self, totals: Mapping[tuple[str, str, str], int]) -> QuotaBook | None:
        """Quota rules with the usage given as running totals (None = no quotas).

        Args:
            totals: (tenant, card model, region) -> milli-GPUs held by placed or running shards,
                kept by the scheduler service as shards are bound and released. Cost
                O(rules + distinct keys), independent of the number of shards.
        """
        gov = self.holder.current
        if gov is None or not gov.quota_rules:
            return None
        return QuotaBook.build(gov.quota_rules, ((t, m, r, milli) for (t, m, r), milli in totals.items() if milli))

    def gate(self, decisions: Decisions, jobs: Mapping[str, Any], view: View, now: float) -> tuple[Decisions, list[Item]]:
        """Admit the cycle's placements in order against the quota; turn cross-region
        placements that need approval into requests (step 4 of the module docstring).

        Returns:
            The decisions to publish (held placements moved to pending) and the approval
            requests to publish with them (then :meth:`confirm`).
        """
        gov = self.holder.current
        if gov is None or not decisions.placements:
            return decisions, []
        book = view.quota.copy() if view.quota is not None else None
        kept: list[Placement] = []
        pending = list(decisions.pending)
        items: list[Item] = []
        for p in decisions.placements:
            entry = jobs[p.job.job_id]
            spec = entry.spec
            milli = placement_milli(p.bindings)
            if book is not None:
                # a preemption gives its victims' quota back (the rules of core.preempt: a job
                # blocked by its tenant's quota evicts that tenant's lower-priority work)
                for v in p.victims:
                    book.add(v.tenant, v.card_model, p.region, -v.gpu_milli)
                verdict = book.check(spec.tenant, p.card_model, p.region, milli)
                if not verdict.passed:
                    _restore(book, p)
                    pending.append(_held(p, verdict))
                    continue
            if p.cross_region:
                mode, source = gov.mode_for(spec)
                st = self.state.get(p.job.job_id)
                if mode == "forbidden" or (st is not None and st.home_only):
                    _restore(book, p)
                    pending.append(_held(p, fail(Reason.NOT_HOME, f"{source}: cross-region not allowed")))
                    continue
                if mode == "approval" and (st is None or p.region not in st.granted):
                    _restore(book, p)
                    items.append(self._request(p, entry, gov, view, jobs, now, source))
                    continue
            if book is not None:
                book.add(spec.tenant, p.card_model, p.region, milli)
            kept.append(p)
        if len(kept) == len(decisions.placements):
            return decisions, items
        return replace(decisions, placements=tuple(kept), pending=tuple(pending)), items

    def confirm(self, items: list[Item], acknowledged: list[bool]) -> None:
        """Write through the approval requests JetStream acknowledged (the job now waits)."""
        for (_, env, _), ok in zip(items, acknowledged):
            if ok and env.type == EventType.APPROVAL_REQUESTED:
                self.apply(env)

    def expiries(self, jobs: Mapping[str, Any], now: float) -> list[Item]:
        """``approval.expired`` for open requests past their deadline (the job falls back to its
        home queue once the event is folded back from the stream).

        Looks only at the requests due by ``now`` (a heap by deadline; an expiry not yet read
        back is due again :data:`RESEND_EXPIRY_S` after it was sent): cost O(due x log n), not
        O(approvals); counted in :attr:`last_expiry_visits`.
        """
        gov = self.holder.current
        items: list[Item] = []
        again: list[tuple[float, str, str]] = []
        visits = 0
        while self._due and self._due[0][0] <= now:
            due = heapq.heappop(self._due)
            visits += 1
            _, job_id, approval_id = due
            st = self.state.get(job_id)
            pa = st.pending if st is not None else None
            if pa is None or pa.approval_id != approval_id:
                continue  # decided (or the job left) since
            if pa.expires_at > now:  # not due after all (a heap entry older than the request)
                again.append((pa.expires_at, job_id, approval_id))
                continue
            entry = jobs.get(job_id)
            if entry is None or entry.state == ShardState.DONE:
                st.pending = None
                continue
            if pa.expiry_sent_at is not None and now - pa.expiry_sent_at < RESEND_EXPIRY_S:
                again.append((pa.expiry_sent_at + RESEND_EXPIRY_S, job_id, approval_id))
                continue
            pa.expiry_sent_at = now
            again.append((now + RESEND_EXPIRY_S, job_id, approval_id))  # sent again unless read back by then
            timeout = gov.approval_timeout_s if gov else 0
            payload = ApprovalDecided(approval_id=pa.approval_id, proposed_region=pa.region,
                                      comment=f"no decision within {_duration(timeout)}; the job falls back to "
                                              f"its home queue ({entry.spec.home_region})")
            event = make_event(EventType.APPROVAL_EXPIRED, payload, producer="scheduler", occurred_at=now,
                               event_id=approval_outcome_id(pa.approval_id), region=pa.region,
                               cluster=pa.cluster, tenant=entry.tenant, project=entry.project, job_id=job_id,
                               attempt=entry.attempt, actor="scheduler", policy_version=self.holder.version)
            items.append((self.subjects.approval(entry.tenant, entry.project), event, entry.headers))
        for due in again:
            heapq.heappush(self._due, due)
        self.last_expiry_visits = visits
        return items

    # ------------------------------------------------------------------ requests

    def _request(self, p: Placement, entry: Any, gov: Governance, view: View, jobs: Mapping[str, Any], now: float,
                 source: str) -> Item:
        spec = entry.spec
        st = self.state.get(p.job.job_id) or JobApprovals()
        event_id = business_event_id(p.job.job_id, "approval", st.requests)
        approval_id = "ap-" + event_id[:20]
        home = spec.home_region
        wait = self._home_wait(spec, view, jobs, now)
        gpus = placement_milli(p.bindings) / 1000
        hours = (spec.estimated_duration_s or 0.0) / 3600
        egress = money(Decimal(p.transfer_bytes) / Decimal(10**9) * self.prices.egress_per_gb)
        cost = home_cost = ""
        if hours:
            cost = str(money(Decimal(str(gpus * hours * p.price_per_gpu_hour)) + egress))
            home_prices = [c.prices[p.card_model] for c in view.clusters
                           if c.region == home and p.card_model in c.prices]
            if home_prices:
                home_cost = str(money(Decimal(str(gpus * hours * min(home_prices)))))
        at_home = [e for e in p.evaluations if e.region == home]
        never = bool(at_home) and all(not e.verdict.passed and e.verdict.reason in STATIC_REASONS for e in at_home)
        if never:
            wait, wait_text = None, ", so it can never run there"
        else:
            wait_text = f", est. wait {_duration(wait)}" if wait is not None else ", est. wait unknown"
        reason = (f"home region {home}: {_home_summary(p, home)}" + wait_text
                  + f"; {p.cluster} ({p.region}) can run it now"
                  + (f", +{_duration(p.transfer_s)} data transfer" if p.transfer_s >= 1 else "")
                  + (f"; est. cost {_cents(cost)} {self.prices.currency}" if cost
                     else f"; egress {_cents(egress)} {self.prices.currency}")
                  + (f" (at home {_cents(home_cost)})" if home_cost else "")
                  + f"; {source} requires approval")
        payload = ApprovalRequested(
            approval_id=approval_id, home_region=home, proposed_region=p.region, proposed_cluster=p.cluster,
            card_model=p.card_model, reason=reason, estimated_wait_s=wait, transfer_s=p.transfer_s, cost=cost,
            home_cost=home_cost, currency=self.prices.currency, expires_at=to_datetime(now + gov.approval_timeout_s),
            evaluations=tuple(evaluation_record(e) for e in p.evaluations), queue=p.queue)
        event = make_event(EventType.APPROVAL_REQUESTED, payload, producer="scheduler", occurred_at=now, event_id=event_id,
                           region=p.region, zone=p.zone, cluster=p.cluster, tenant=entry.tenant,
                           project=entry.project, job_id=p.job.job_id, attempt=p.job.attempt, actor="scheduler",
                           policy_version=gov.version)
        return self.subjects.approval(entry.tenant, entry.project), event, entry.headers

    def _home_wait(self, spec: Any, view: View, jobs: Mapping[str, Any], now: float) -> float | None:
        """Estimated seconds until the home region has room: free milli-GPUs there now plus
        what running jobs free at their estimated ends (start + the submitter's estimate), in end
        order, until the job's demand is met. None when their estimates do not get there."""
        need = spec.total_gpu_milli
        home = spec.home_region
        allowed = set(spec.card_models)
        free = sum(n.gpu_free[i] for c in view.clusters if c.region == home for n in c.nodes if n.healthy
                   for i in range(n.gpus) if not allowed or n.card_model in allowed)
        if free >= need:
            return 0.0
        ends = []
        for j in jobs.values():
            if j.placed is None or j.region != home or j.state not in ACTIVE:
                continue
            if allowed and j.placed.card_model not in allowed:
                continue
            if not j.spec.estimated_duration_s:
                continue
            start = self.started.get(j.job_id, now)
            ends.append((start + j.spec.estimated_duration_s, placement_milli(j.placed.bindings)))
        for end, milli in sorted(ends):
            free += milli
            if free >= need:
                return max(0.0, end - now)
        return None


def _home_summary(p: Placement, home: str) -> str:
    at_home = [e for e in p.evaluations if e.region == home]
    if not at_home:
        return "no cluster there"
    fits = [e for e in at_home if e.verdict.passed and e.total is not None]
    if fits:
        best = max(fits, key=lambda e: e.total)
        return f"{best.cluster} fits but scores {best.total:.2f} < {p.score:.2f}"
    codes: dict[str, int] = {}
    for e in at_home:
        code = e.verdict.reason.value if e.verdict.reason else "excluded"
        codes[code] = codes.get(code, 0) + 1
    return ", ".join(f"{c} ({n} cluster{'s' if n != 1 else ''})" for c, n in codes.items())


def _restore(book: QuotaBook | None, p: Placement) -> None:
    """Count the victims of a placement that is not admitted again (they keep running)."""
    if book is not None:
        for v in p.victims:
            book.add(v.tenant, v.card_model, p.region, v.gpu_milli)


def _held(p: Placement, verdict: Verdict) -> Pending:
    """A placement the gate did not admit, as a pending decision with the gate's verdict."""
    evaluations = tuple(ClusterEvaluation(e.cluster, e.region, verdict) if e.cluster == p.cluster else e
                        for e in p.evaluations)
    return Pending(p.job, f"held: {verdict}", evaluations, True)


#: What the TenancyGate folds (it sees the scheduler's whole EVENTS stream; the scheduler's own table
#: counts unknown types, so this one does not). ``job.started`` and every terminal status keep
#: ``started`` (the business start of a running attempt) current.
GOVERNOR_EVENTS: EventTable = EventTable({
    EventType.JOB_STARTED: TenancyGate._on_started,
    **{t: TenancyGate._on_ended for t in sorted(TERMINAL_STATUSES)},
    EventType.APPROVAL_REQUESTED: TenancyGate._on_requested,
    **{t: TenancyGate._on_outcome for t in APPROVAL_OUTCOMES},
})


def _cents(amount: Decimal | str) -> str:
    """An amount for people, to the cent (half-even): a reason's text; the payload keeps the exact
    value (``cost``, ``home_cost``: 6 places, the store's Decimal(18, 6))."""
    return str(Decimal(str(amount)).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))
