"""The administrative gRPC services of admission: TenantService, ApprovalService, PolicyService
(``proto/fedsched/api/v1/governance.proto``).

Tenants, quotas and principals are parts of the one versioned policy document
(:mod:`fedsched.tenancy`): every change made here reads the stored policy, applies the
change, validates the whole document, stores it as a new version with a compare-and-set on the
KV revision (:class:`PolicyEditor`), and publishes an event naming the caller, the old and the
new value and the new version (``tenant.updated``, ``quota.updated``, ``principal.updated``,
``policy.applied``) -- so the audit log says who changed what, when, from what to what.

Two guards keep the federation governable: the policy must keep at least one admin, and an
admin cannot remove their own admin rights (FAILED_PRECONDITION).

Approvals: an approver of the job's tenant (or an admin) approves or rejects a pending request
with ``approval.approved`` / ``approval.rejected``; the event id is shared with the scheduler's
``approval.expired`` (:func:`~fedsched.events.approval_outcome_id`), so a decision racing the
timeout either wins or is reported as FAILED_PRECONDITION, never both.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import json
import math
import re
from typing import Callable

from fedsched import auth
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import ROLES, Principal, hash_token, new_token
from fedsched.bus import Bus
from fedsched.clock import Clock
from fedsched.errors import ConflictError, NotFoundError, PermissionDeniedError, ValidationError
from fedsched.events import (ApprovalDecided, GovernanceChanged, Subjects, approval_outcome_id, business_event_id,
                             make_event)
from fedsched.events import EventType
from fedsched.tenancy import (WILDCARD, Governance, GrantDoc, PolicyDoc, PrincipalDoc, QuotaDoc, TenantDoc,
                                 canonical, carry_bootstrap, check_grant, check_topology_names, diff, parse_entry,
                                 parse_policy, parse_policy_data, policy_version, public_view, resolve_card, to_yaml,
                                 with_principal)
from fedsched.jobs import JobState, Locality
from fedsched.naming import check_known, check_name
from fedsched.policystore import PolicyHolder, StoredPolicy, announce, read_history, read_policy, write_policy
from fedsched.ports import Publisher
from fedsched.quota import QuotaBook
from services.admission.approvalview import ApprovalRecord, ApprovalView
from services.admission.budgets import SpendBook, month_of
from services.admission.jobview import JobView
from services.admission.convert import KIND_FROM_PB, KIND_TO_PB, LOCALITY_FROM_PB, LOCALITY_TO_PB, _ts


MODE_FROM_PB = {gpb.CROSS_REGION_MODE_FORBIDDEN: "forbidden", gpb.CROSS_REGION_MODE_APPROVAL: "approval",
                gpb.CROSS_REGION_MODE_ALLOWED: "allowed"}
MODE_TO_PB = {v: k for k, v in MODE_FROM_PB.items()}
APPROVAL_STATE_TO_PB = {"pending": gpb.APPROVAL_STATE_PENDING, "approved": gpb.APPROVAL_STATE_APPROVED,
                        "rejected": gpb.APPROVAL_STATE_REJECTED, "expired": gpb.APPROVAL_STATE_EXPIRED}
APPROVAL_STATE_FROM_PB = {v: k for k, v in APPROVAL_STATE_TO_PB.items()}
APPROVAL_ID = re.compile(r"ap-[0-9a-f]{20}")
MAX_YAML = 1_000_000


def _require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise PermissionDeniedError(f"{principal.name} is not an admin")


def _expected(version: str) -> str:
    if version and not re.fullmatch(r"[0-9a-f]{12}", version):
        raise ValidationError("expected_version", "a policy version: 12 hex characters")
    return version


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise ValidationError(field, "must be a finite number")
    return value


def governance_in_force(policy: PolicyHolder) -> Governance:
    """The governance policy in force (:meth:`PolicyHolder.in_force`).

    Raises:
        UnavailableError: no policy applied yet (the interceptor refuses calls before one is).
    """
    return policy.in_force()


class PolicyEditor:
    """Read-modify-write of the stored policy with compare-and-set (see the module docstring).

    Args:
        store: the connection holding the policy KV bucket (:mod:`fedsched.policystore`).
        clock: business clock (the stored version's ``applied_at``).
        policy: the holder updated with what was stored.
    """

    def __init__(self, store: Bus, clock: Clock, policy: PolicyHolder, names=None) -> None:
        self.store = store
        self.clock = clock
        self.policy = policy
        self.names = names  #: the topology's names (fedsched.topology.KnownNames) or None: not checked

    async def change(self, mutate: Callable[[PolicyDoc], PolicyDoc], *, actor: Principal,
                     expected_version: str = "") -> tuple[StoredPolicy, StoredPolicy | None]:
        """Apply ``mutate`` to the stored policy and store the result as a new version.

        Returns:
            (the policy before, the stored new one -- None if nothing changed).

        Raises:
            ConflictError: ``expected_version`` is stale, the change would leave no admin or
                remove the caller's admin rights, or the policy kept changing meanwhile.
            ValidationError: the changed document does not validate, or names a region or
                cluster outside the topology (:func:`~fedsched.tenancy.check_topology_names`).
        """
        for attempt in range(3):
            before = await read_policy(self.store)
            if before is None:
                raise ConflictError("no policy is stored yet")
            if expected_version and before.version != expected_version:
                raise ConflictError(f"the policy is at version {before.version}, not {expected_version}; "
                                    "review the change against it and retry")
            doc = mutate(before.gov.doc)
            if self.names is not None:
                check_topology_names(doc, self.names)
            _guard(doc, actor)
            if policy_version(doc) == before.version:
                self.policy.set(before)
                return before, None
            try:
                stored = await write_policy(self.store, doc, actor=actor.name, now=self.clock.time(),
                                            expected_revision=before.revision)
            except ConflictError:
                if attempt == 2:
                    raise
                continue
            self.policy.set(stored)
            return before, stored
        raise ConflictError("the policy kept changing; retry")  # pragma: no cover - loop always returns


def _guard(doc: PolicyDoc, actor: Principal) -> None:
    admins = [p.name for p in doc.principals if any(g.role == "admin" for g in p.roles)]
    if not admins:
        raise ConflictError("the policy would have no admin principal; keep at least one")
    if actor.is_admin and actor.name not in admins:
        raise ConflictError(f"the change would remove your own admin rights ({actor.name}); "
                            "let another admin do it")


def _replace(doc: PolicyDoc, section: str, keep: Callable[[dict], bool], add: dict | None) -> PolicyDoc:
    data = canonical(doc)
    data[section] = [e for e in data[section] if keep(e)] + ([add] if add is not None else [])
    return parse_policy_data(data)


# --------------------------------------------------------------------------- conversions


def tenant_to_pb(t: TenantDoc, spend: str = "") -> gpb.Tenant:
    """The wire form of a tenant."""
    msg = gpb.Tenant(name=t.name, home_region=t.home_region, projects=list(t.projects),
                     cross_region=MODE_TO_PB[t.cross_region], regions=list(t.regions), month_spend=spend,
                     default_locality=LOCALITY_TO_PB[t.default_locality] if t.default_locality else 0)
    for c in t.job_classes:
        msg.job_classes.append(gpb.JobClass(name=c.name, kinds=[KIND_TO_PB[k] for k in c.kinds],
                                            residency_tags=list(c.residency_tags),
                                            cross_region=MODE_TO_PB[c.cross_region]))
    if t.budget is not None:
        msg.budget.CopyFrom(gpb.Budget(monthly=str(t.budget.monthly), currency=t.budget.currency))
    return msg


def _mode(value: int, field: str, default: str) -> str:
    if value == gpb.CROSS_REGION_MODE_UNSPECIFIED:
        return default
    if value not in MODE_FROM_PB:
        raise ValidationError(field, f"unknown enum value {value}")
    return MODE_FROM_PB[value]


def tenant_from_pb(t: gpb.Tenant, current: TenantDoc | None) -> TenantDoc:
    """Validate a wire tenant (fields under ``tenant.``); empty home region and unspecified
    mode keep the current values (``allowed`` for a new tenant)."""
    check_name("tenant", t.name, "tenant.name")
    locality: Locality | None = None
    if t.default_locality:
        if t.default_locality not in LOCALITY_FROM_PB:
            raise ValidationError("tenant.default_locality", f"unknown enum value {t.default_locality}")
        locality = LOCALITY_FROM_PB[t.default_locality]
    classes = []
    for i, c in enumerate(t.job_classes):
        kinds = []
        for k in c.kinds:
            if k == pb.JOB_KIND_UNSPECIFIED or k not in KIND_FROM_PB:
                raise ValidationError(f"tenant.job_classes[{i}].kinds", f"unknown job kind {k}")
            kinds.append(KIND_FROM_PB[k].value)
        if c.cross_region == gpb.CROSS_REGION_MODE_UNSPECIFIED:
            raise ValidationError(f"tenant.job_classes[{i}].cross_region", "required")
        classes.append({"name": c.name, "kinds": kinds, "residency_tags": list(c.residency_tags),
                        "cross_region": _mode(c.cross_region, f"tenant.job_classes[{i}].cross_region", "")})
    budget = None
    if t.HasField("budget") and t.budget.monthly:
        budget = {"monthly": t.budget.monthly, "currency": t.budget.currency or "CNY"}
    data = {"name": t.name, "home_region": t.home_region or (current.home_region if current else ""),
            "projects": list(t.projects), "regions": list(t.regions), "job_classes": classes, "budget": budget,
            "cross_region": _mode(t.cross_region, "tenant.cross_region", current.cross_region if current else "allowed"),
            "default_locality": locality}
    return parse_entry(TenantDoc, data, "tenant")


def quota_to_pb(q: QuotaDoc, used_milli: int = 0) -> gpb.Quota:
    """The wire form of a quota."""
    msg = gpb.Quota(tenant=q.tenant, card=q.card, region=q.region, guaranteed_gpus=q.guaranteed_gpus,
                    cohort=q.cohort, used_milli=used_milli)
    if q.borrowing_limit_gpus is not None:
        msg.borrowing_limit_gpus = q.borrowing_limit_gpus
    return msg


def approval_to_pb(r: ApprovalRecord) -> gpb.Approval:
    """The wire form of an approval record."""
    msg = gpb.Approval(approval_id=r.approval_id, job_id=r.job_id, tenant=r.tenant, project=r.project,
                       state=APPROVAL_STATE_TO_PB[r.state], home_region=r.home_region,
                       proposed_region=r.proposed_region, proposed_cluster=r.proposed_cluster,
                       card_model=r.card_model, reason=r.reason, cost=r.cost, home_cost=r.home_cost,
                       currency=r.currency, transfer_seconds=r.transfer_s, decided_by=r.decided_by,
                       comment=r.comment, policy_version=r.policy_version,
                       decision_policy_version=r.decision_policy_version)
    for name, value in (("requested_at", r.requested_at), ("expires_at", r.expires_at), ("decided_at", r.decided_at)):
        ts = _ts(value)
        if ts is not None:
            getattr(msg, name).CopyFrom(ts)
    return msg


# --------------------------------------------------------------------------- TenantService


class TenantServicer(gpb_grpc.TenantServiceServicer):
    """Tenants, quotas and principals (writes: admins; reads: a tenant's submitters/approvers).

    Args:
        store: the connection holding the policy KV bucket.
        clock: business clock (budget months, stored versions).
        policy: the governance policy in force.
        spend: month-to-date spend per tenant.
        view: the job read model (quota usage).
        publisher: where governance events go (default: ``store``).
        subjects: subject names (default: ``store.subjects``).
        names: the topology's region/zone/cluster names (:class:`fedsched.topology.KnownNames`);
            tenants and quotas naming others are refused (INVALID_ARGUMENT). None = not checked.
    """

    def __init__(self, store: Bus, clock: Clock, policy: PolicyHolder, spend: SpendBook, view: JobView, *,
                 publisher: Publisher | None = None, subjects: Subjects | None = None, names=None) -> None:
        self.names = names
        self.clock = clock
        self.policy = policy
        self.spend = spend
        self.view = view
        self.publisher = publisher if publisher is not None else store
        self.subjects = subjects if subjects is not None else store.subjects
        self.editor = PolicyEditor(store, clock, policy, names)

    def _gov(self) -> Governance:
        return governance_in_force(self.policy)

    async def _publish(self, event_type: EventType, kind: str, key: str, old, new, before: StoredPolicy,
                       after: StoredPolicy, actor: Principal, tenant: str = "", token_issued: bool = False) -> None:
        payload = GovernanceChanged(kind=kind, key=key, old=public_view(kind, old), new=public_view(kind, new),
                                    previous_version=before.version, token_issued=token_issued)
        event = make_event(event_type, payload, producer="admission", occurred_at=after.applied_at,
                           event_id=business_event_id(kind, key, after.revision, after.version), actor=actor.name,
                           policy_version=after.version, tenant=tenant)
        subject = self.subjects.governance_tenant(tenant) if tenant else self.subjects.governance_policy()
        await self.publisher.publish(subject, event)

    async def ListTenants(self, request: gpb.ListTenantsRequest, context) -> gpb.ListTenantsResponse:
        principal = auth.current()
        if principal.readable_tenants() == frozenset():
            raise PermissionDeniedError(f"{principal.name} has no tenant rights")
        gov = self._gov()
        month = month_of(self.clock.time())
        return gpb.ListTenantsResponse(
            tenants=[tenant_to_pb(t, str(self.spend.spend(t.name, month))) for t in gov.doc.tenants
                     if principal.can_read(t.name)], policy_version=gov.version)

    async def PutTenant(self, request: gpb.PutTenantRequest, context) -> gpb.PutTenantResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        if not request.HasField("tenant"):
            raise ValidationError("tenant", "required")
        gov = self._gov()
        old = gov.tenant(request.tenant.name)
        new = tenant_from_pb(request.tenant, old)
        if self.names is not None:
            self.names.check("region", new.home_region, "tenant.home_region")
            for j, r in enumerate(new.regions):
                self.names.check("region", r, f"tenant.regions[{j}]")
        entry = new.model_dump(mode="json")
        before, after = await self.editor.change(
            lambda doc: _replace(doc, "tenants", lambda t: t["name"] != new.name, entry),
            actor=principal, expected_version=expected)
        if after is not None:
            old_now = before.gov.tenant(new.name)
            await self._publish(EventType.TENANT_UPDATED, "tenant", new.name, old_now, new, before, after, principal,
                                tenant=new.name)
        version = (after or before).version
        return gpb.PutTenantResponse(tenant=tenant_to_pb(new), created=old is None, policy_version=version,
                                     previous_version=before.version,
                                     changes=diff(before.gov.doc, after.gov.doc) if after is not None else [])

    def _usage(self, gov: Governance) -> QuotaBook:
        """Quota usage in force: every placed or running shard's gang (workers x GPUs per worker,
        milli-GPUs) on its attempt's card model and region -- as the scheduler counts it."""
        running = (JobState.PLACED, JobState.RUNNING)
        allocations = ((r.spec.tenant, s.current.card_model, s.current.region, r.spec.total_gpu_milli)
                       for r in self.view.jobs.values() if r.state in running
                       for s in r.shards if s.state in running and s.current is not None)
        return QuotaBook.build(gov.quota_rules, allocations)

    async def ListQuotas(self, request: gpb.ListQuotasRequest, context) -> gpb.ListQuotasResponse:
        principal = auth.current()
        if request.tenant:
            check_name("tenant", request.tenant, "tenant")
            if not principal.can_read(request.tenant):
                raise PermissionDeniedError(f"{principal.name} may not read quotas of {request.tenant}")
        elif principal.readable_tenants() == frozenset():
            raise PermissionDeniedError(f"{principal.name} has no tenant rights")
        gov = self._gov()
        if request.tenant:  # an admin may read any tenant: a typo would list nothing, silently
            check_known("tenant", request.tenant, gov.tenants, "tenant")
        book = self._usage(gov)
        out = [quota_to_pb(q, book.used.get(i, 0)) for i, q in enumerate(gov.doc.quotas)
               if (not request.tenant or q.tenant == request.tenant) and principal.can_read(q.tenant)]
        return gpb.ListQuotasResponse(quotas=out, policy_version=gov.version)

    async def SetQuota(self, request: gpb.SetQuotaRequest, context) -> gpb.SetQuotaResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        if not request.HasField("quota"):
            raise ValidationError("quota", "required")
        q = request.quota
        check_name("tenant", q.tenant, "quota.tenant")
        gov = self._gov()
        if gov.tenant(q.tenant) is None:
            raise ValidationError("quota.tenant", f"unknown tenant {q.tenant!r}")
        borrow = q.borrowing_limit_gpus if q.HasField("borrowing_limit_gpus") else None  # absent: no limit (QuotaDoc)
        data = {"tenant": q.tenant, "card": q.card or WILDCARD, "region": q.region or WILDCARD,
                "guaranteed_gpus": _finite(q.guaranteed_gpus, "quota.guaranteed_gpus"),
                "borrowing_limit_gpus": None if borrow is None else _finite(borrow, "quota.borrowing_limit_gpus"),
                "cohort": q.cohort}
        new = parse_entry(QuotaDoc, data, "quota")
        if self.names is not None and new.region != WILDCARD:
            self.names.check("region", new.region, "quota.region")
        resolve_card(new.card, gov.doc, "quota.card")
        if not new.cohort and new.borrowing_limit_gpus not in (0, None):
            raise ValidationError("quota.borrowing_limit_gpus", "borrowing needs a cohort to borrow from")
        existed = any(x.key == new.key for x in gov.doc.quotas)
        before, after = await self.editor.change(
            lambda doc: _replace(doc, "quotas", lambda e: (e["tenant"], e["card"], e["region"]) != new.key,
                                 new.model_dump(mode="json")),
            actor=principal, expected_version=expected)
        if after is not None:
            old = next((x for x in before.gov.doc.quotas if x.key == new.key), None)
            await self._publish(EventType.QUOTA_UPDATED, "quota", new.label, old, new, before, after, principal,
                                tenant=new.tenant)
        return gpb.SetQuotaResponse(quota=quota_to_pb(new), created=not existed,
                                    policy_version=(after or before).version)

    async def DeleteQuota(self, request: gpb.DeleteQuotaRequest, context) -> gpb.DeleteQuotaResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        check_name("tenant", request.tenant, "tenant")
        key = (request.tenant, request.card or WILDCARD, request.region or WILDCARD)
        gov = self._gov()
        if not any(x.key == key for x in gov.doc.quotas):
            raise NotFoundError("quota", "/".join(key))
        before, after = await self.editor.change(
            lambda doc: _replace(doc, "quotas", lambda e: (e["tenant"], e["card"], e["region"]) != key, None),
            actor=principal, expected_version=expected)
        if after is not None:
            old = next((x for x in before.gov.doc.quotas if x.key == key), None)
            await self._publish(EventType.QUOTA_UPDATED, "quota", "/".join(key), old, None, before, after, principal,
                                tenant=request.tenant)
        return gpb.DeleteQuotaResponse(policy_version=(after or before).version)

    async def PutPrincipal(self, request: gpb.PutPrincipalRequest, context) -> gpb.PutPrincipalResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        check_name("principal", request.name, "name")
        if not request.roles:
            raise ValidationError("roles", "at least one role")
        gov = self._gov()
        grants = []
        for i, r in enumerate(request.roles):
            if r.role not in ROLES:
                raise ValidationError(f"roles[{i}].role", f"one of {', '.join(ROLES)}")
            grant = parse_entry(GrantDoc, {"role": r.role, "tenants": list(r.tenants), "projects": list(r.projects),
                                           "region": r.region, "cluster": r.cluster}, f"roles[{i}]")
            check_grant(grant, gov.doc, f"roles[{i}]")
            grants.append(grant)
        old = gov.principal(request.name)
        token = new_token() if request.issue_token or old is None else ""
        new = PrincipalDoc(name=request.name, token_sha256=hash_token(token) if token else old.token_sha256,
                           roles=tuple(grants), bootstrap=bool(old and old.bootstrap))
        before, after = await self.editor.change(lambda doc: with_principal(doc, new), actor=principal,
                                                 expected_version=expected)
        if after is not None:
            await self._publish(EventType.PRINCIPAL_UPDATED, "principal", new.name, before.gov.principal(new.name), new,
                                before, after, principal, token_issued=bool(token))
        return gpb.PutPrincipalResponse(name=new.name, token=token, created=old is None,
                                        policy_version=(after or before).version)


# --------------------------------------------------------------------------- ApprovalService



def _approval_key(rec, newest: bool) -> tuple[float, str]:
    """The sort key of an approval request in a ListApprovals page, ascending: oldest first by
    request time; newest first by decision time (request time while pending), negated. Ties
    go by approval id, so the order is total and a cursor resumes exactly after its request."""
    if newest:
        return (-(rec.decided_at or rec.requested_at), rec.approval_id)
    return (rec.requested_at, rec.approval_id)


def _approval_filter_digest(tenant: str, states: set, newest: bool) -> str:
    """16 hex of SHA-256 over a ListApprovals request's filters and order (what its page tokens
    are bound to)."""
    text = json.dumps([tenant, sorted(str(s) for s in states), newest])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _encode_approval_token(key: tuple[float, str], digest: str, total: int) -> str:
    """An opaque ListApprovals page token: ``base64url(JSON)`` of the last listed key, the
    filters' digest and the first page's total."""
    doc = {"v": 1, "k": [key[0], key[1]], "f": digest, "n": total}
    return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode_approval_token(token: str, digest: str) -> tuple[tuple[float, str], int]:
    """The cursor and total of a ListApprovals page token issued for the filters ``digest``.

    Raises:
        ValidationError: ``page_token``: not a ListApprovals token, or one for other filters or
            another order.
    """
    try:
        doc = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        key, total = (float(doc["k"][0]), str(doc["k"][1])), int(doc["n"])
        if doc.get("v") != 1 or not math.isfinite(key[0]) or total < 0:
            raise ValueError("bad token")
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValidationError("page_token", "not a token returned by ListApprovals") from e
    if doc.get("f") != digest:
        raise ValidationError("page_token", "was issued for other filters or another order; repeat them, or start "
                                            "again without a page token")
    return key, total

class ApprovalServicer(gpb_grpc.ApprovalServiceServicer):
    """Cross-region approval requests (approvers of the job's tenant, admins).

    Args:
        publisher: where decisions go (``approval.approved`` / ``approval.rejected``); its
            acknowledgement says whether the outcome was a duplicate.
        subjects: subject names.
        clock: business clock (decision time, expiry).
        policy: the governance policy in force (its version on the event).
        approvals: the approval read model (decisions are written through).
        view: the job read model (decisions are written through).
    """

    def __init__(self, publisher: Publisher, subjects: Subjects, clock: Clock, policy: PolicyHolder,
                 approvals: ApprovalView, view: JobView) -> None:
        self.publisher = publisher
        self.subjects = subjects
        self.clock = clock
        self.policy = policy
        self.approvals = approvals
        self.view = view

    async def ListApprovals(self, request: gpb.ListApprovalsRequest, context) -> gpb.ListApprovalsResponse:
        """The approval requests the caller may decide, a page at a time (``page_size``, default
        100, at most 1000): oldest request first, or with ``APPROVAL_ORDER_NEWEST_FIRST`` the
        newest decision first (pending requests by request time); ``next_page_token`` continues
        with the same filters and order.

        Raises:
            PermissionDeniedError: the caller approves for no tenant (or not for ``tenant``).
            ValidationError: a bad tenant, state, order, page size or page token.
        """
        principal = auth.current()
        if request.tenant:
            check_name("tenant", request.tenant, "tenant")
            if not principal.can_approve(request.tenant):
                raise PermissionDeniedError(f"{principal.name} is not an approver of {request.tenant}")
            gov = self.policy.current
            if gov is not None:  # an admin approves for any tenant: a typo would list nothing, silently
                check_known("tenant", request.tenant, gov.tenants, "tenant")
        elif not principal.is_admin and not any(g.role == "approver" for g in principal.grants):
            raise PermissionDeniedError(f"{principal.name} is not an approver")
        size = request.page_size or 100
        if size > 1000:
            raise ValidationError("page_size", "must be <= 1000")
        states = set()
        for i, s in enumerate(request.states):
            if s not in APPROVAL_STATE_FROM_PB:
                raise ValidationError(f"states[{i}]", f"unknown state {s}")
            states.add(APPROVAL_STATE_FROM_PB[s])
        if request.order not in gpb.ApprovalOrder.values():
            raise ValidationError("order", f"unknown order {request.order}")
        newest = request.order == gpb.APPROVAL_ORDER_NEWEST_FIRST
        digest = _approval_filter_digest(request.tenant, states, newest)
        cursor, total = _decode_approval_token(request.page_token, digest) if request.page_token else (None, None)
        records = [r for r in self.approvals.by_id.values()
                   if (not request.tenant or r.tenant == request.tenant) and (not states or r.state in states)
                   and principal.can_approve(r.tenant)]
        if total is None:
            total = len(records)
        keyed = [(_approval_key(r, newest), r) for r in records]
        if cursor is not None:
            keyed = [(k, r) for k, r in keyed if k > cursor]
        page = heapq.nsmallest(size + 1, keyed, key=lambda kr: kr[0])  # O(n log size): no full sort per page
        more = len(page) > size
        page = page[:size]
        token = _encode_approval_token(page[-1][0], digest, total) if more else ""
        return gpb.ListApprovalsResponse(approvals=[approval_to_pb(r) for _, r in page], next_page_token=token,
                                         total=total)

    async def Approve(self, request: gpb.DecideApprovalRequest, context) -> gpb.Approval:
        return await self._decide(request, EventType.APPROVAL_APPROVED)

    async def Reject(self, request: gpb.DecideApprovalRequest, context) -> gpb.Approval:
        return await self._decide(request, EventType.APPROVAL_REJECTED)

    async def _decide(self, request: gpb.DecideApprovalRequest, event_type: EventType) -> gpb.Approval:
        principal = auth.current()
        if not request.approval_id:
            raise ValidationError("approval_id", "required")
        if not APPROVAL_ID.fullmatch(request.approval_id):
            raise ValidationError("approval_id", "an approval id: 'ap-' and 20 hex characters")
        if len(request.comment) > 500 or not request.comment.isprintable():
            raise ValidationError("comment", "at most 500 printable characters")
        rec = self.approvals.by_id.get(request.approval_id)
        if rec is None:
            raise NotFoundError("approval", request.approval_id)
        if not principal.can_approve(rec.tenant):
            raise PermissionDeniedError(f"{principal.name} is not an approver of {rec.tenant}")
        if rec.state != "pending":
            raise ConflictError(f"approval {rec.approval_id} is already {rec.state}"
                                + (f" (by {rec.decided_by})" if rec.decided_by else ""))
        now = self.clock.time()
        if now >= rec.expires_at:
            raise ConflictError(f"approval {rec.approval_id} timed out; the job falls back to its home region")
        gov = governance_in_force(self.policy)
        payload = ApprovalDecided(approval_id=rec.approval_id, comment=request.comment,
                                  proposed_region=rec.proposed_region)
        event = make_event(event_type, payload, producer="admission", occurred_at=now,
                           event_id=approval_outcome_id(rec.approval_id), region=rec.proposed_region,
                           cluster=rec.proposed_cluster, tenant=rec.tenant, project=rec.project, job_id=rec.job_id,
                           actor=principal.name, policy_version=gov.version)
        ack = await self.publisher.publish(self.subjects.approval(rec.tenant, rec.project), event)
        if ack.duplicate:
            raise ConflictError(f"approval {rec.approval_id} was decided (or timed out) a moment ago")
        self.approvals.apply(event)
        self.view.apply(event)
        return approval_to_pb(rec)


# --------------------------------------------------------------------------- PolicyService


def _policy_document(stored: StoredPolicy) -> gpb.PolicyDocument:
    """One stored version on the wire: version, canonical YAML, who applied it and when."""
    msg = gpb.PolicyDocument(version=stored.version, yaml=to_yaml(stored.gov.doc), applied_by=stored.applied_by)
    ts = _ts(stored.applied_at) if stored.applied_at else None
    if ts is not None:
        msg.applied_at.CopyFrom(ts)
    return msg


class PolicyServicer(gpb_grpc.PolicyServiceServicer):
    """The whole policy document (admins).

    Args:
        store: the connection holding the policy KV bucket (and announcing applied policies).
        clock: business clock (stored versions).
        policy: the governance policy in force.
        names: the topology's names (:class:`fedsched.topology.KnownNames`): a policy naming
            other regions or clusters is refused (INVALID_ARGUMENT, field ``yaml.<path>``).
            None = not checked.
    """

    def __init__(self, store: Bus, clock: Clock, policy: PolicyHolder, names=None) -> None:
        self.store = store
        self.policy = policy
        self.names = names
        self.editor = PolicyEditor(store, clock, policy, names)

    async def GetPolicy(self, request: gpb.GetPolicyRequest, context) -> gpb.PolicyDocument:
        _require_admin(auth.current())
        stored = self.policy.stored
        if stored is None:
            raise NotFoundError("policy", "current")
        return _policy_document(stored)

    async def ListPolicyVersions(self, request: gpb.ListPolicyVersionsRequest,
                                 context) -> gpb.ListPolicyVersionsResponse:
        """The stored policy versions, newest first, each with its canonical YAML (admins).

        The policy store keeps the last :data:`fedsched.policystore.HISTORY` revisions of the
        KV key, so this reads at most that many whatever ``limit`` says.

        Raises:
            PermissionDeniedError: not an admin (the YAML holds token hashes).
            ValidationError: ``limit`` above 500.
        """
        _require_admin(auth.current())
        limit = request.limit or 50
        if limit > 500:
            raise ValidationError("limit", "must be <= 500")
        history = await read_history(self.store, limit)
        return gpb.ListPolicyVersionsResponse(versions=[_policy_document(p) for p in history])

    def _parse(self, request: gpb.ApplyPolicyRequest) -> PolicyDoc:
        if not request.yaml.strip():
            raise ValidationError("yaml", "required: the policy document")
        if len(request.yaml) > MAX_YAML:
            raise ValidationError("yaml", f"at most {MAX_YAML} characters")
        try:
            doc = parse_policy(request.yaml)
        except ValidationError as e:
            raise ValidationError(f"yaml.{e.field}" if e.field != "policy" else "yaml", e.reason) from e
        if self.names is not None:
            check_topology_names(doc, self.names, prefix="yaml.")
        return doc

    async def DiffPolicy(self, request: gpb.ApplyPolicyRequest, context) -> gpb.ApplyPolicyResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        new = self._parse(request)
        current = await read_policy(self.store)
        if current is None:
            raise ConflictError("no policy is stored yet")
        if expected and current.version != expected:
            raise ConflictError(f"the policy is at version {current.version}, not {expected}")
        merged = carry_bootstrap(current.gov.doc, new)
        _guard(merged, principal)
        version = policy_version(merged)
        return gpb.ApplyPolicyResponse(version=version, previous_version=current.version,
                                       changes=diff(current.gov.doc, merged), applied=False)

    async def ApplyPolicy(self, request: gpb.ApplyPolicyRequest, context) -> gpb.ApplyPolicyResponse:
        principal = auth.current()
        _require_admin(principal)
        expected = _expected(request.expected_version)
        new = self._parse(request)
        before, after = await self.editor.change(lambda doc: carry_bootstrap(doc, new), actor=principal,
                                                 expected_version=expected)
        if after is None:
            return gpb.ApplyPolicyResponse(version=before.version, previous_version=before.version, applied=False)
        changes = diff(before.gov.doc, after.gov.doc)
        await announce(self.store, after, previous_version=before.version, changes=changes, source="apply")
        return gpb.ApplyPolicyResponse(version=after.version, previous_version=before.version, changes=changes,
                                       applied=True)
