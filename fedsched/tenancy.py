"""The tenancy policy, versioned: tenants, projects, principals, quotas, budgets,
cross-region modes, approval timeout, scheduling weights and admission limits.

One YAML document (format: ``deploy/policy/example.yaml``; the bundled default that matches the
trace replay is ``fedsched/catalog/policy.yaml``) is validated into a :class:`PolicyDoc`, put
in canonical form (lists sorted by their keys) and hashed: the **version** is the first 12 hex
characters of the SHA-256 of the canonical JSON, so the same content always has the same
version whatever the order or formatting of the file. ``fedsched policy apply`` publishes it to
NATS KV (:mod:`fedsched.policystore`); every service follows the newest version and stamps it
on the events it decides.

Cross-region modes (per tenant, narrowed per job class): ``forbidden`` < ``approval`` <
``allowed``; a job's mode is the most restrictive of its tenant's mode and the mode of every job
class it matches (a class matches by job kind and/or data-residency tag). A job may narrow its
tenant's policy (locality ``must_local``, fewer regions) but never widen it (see
:meth:`Governance.admit_spec`).

Everything here is pure: parsing raises :class:`~fedsched.errors.ValidationError` whose field
is the document path (``tenants[2].cross_region``); no I/O except reading the bundled file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import cached_property
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from fedsched import naming
from fedsched.auth import ANY, Grant, Principal, hash_token
from fedsched.errors import InvalidName, ValidationError
from fedsched.jobs import JobKind, JobSpec, Locality
from fedsched.policynames import SCORER_NAMES
from fedsched.quota import QuotaRule
from fedsched.yamltext import load_yaml

Mode = Literal["forbidden", "approval", "allowed"]
MODES: tuple[str, ...] = ("forbidden", "approval", "allowed")  #: most restrictive first
_RANK = {m: i for i, m in enumerate(MODES)}
WILDCARD = "*"


def restrictive(*modes: str) -> str:
    """The most restrictive of ``modes`` (``forbidden`` < ``approval`` < ``allowed``)."""
    return min(modes, key=lambda m: _RANK[m])


# --------------------------------------------------------------------------- the document


class _Doc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check(kind: str, value: str) -> str:
    """``naming.check_name`` as a ValueError, so pydantic reports the document path."""
    try:
        return naming.check_name(kind, value)
    except InvalidName as e:
        raise ValueError(e.reason) from None


class JobClassDoc(_Doc):
    """A class of jobs with its own (narrower) cross-region mode.

    Attributes:
        name: label of the class.
        kinds: job kinds it covers (empty = any kind).
        residency_tags: jobs carrying any of these tags (empty = any).
        cross_region: its mode; the job gets the most restrictive of tenant and classes.
    """

    name: str
    kinds: tuple[JobKind, ...] = ()
    residency_tags: tuple[str, ...] = ()
    cross_region: Mode

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check("queue", v)

    @field_validator("residency_tags")
    @classmethod
    def _tags(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({_check("residency_tag", t) for t in v}))

    def matches(self, spec: JobSpec) -> bool:
        """The job is of this class (every criterion given holds)."""
        if self.kinds and spec.kind not in self.kinds:
            return False
        return not self.residency_tags or bool(set(self.residency_tags) & set(spec.residency_tags))


class BudgetDoc(_Doc):
    """A monthly budget: currency units per calendar month (UTC)."""

    monthly: Decimal = Field(gt=0, le=Decimal("1e15"))
    currency: str = Field(default="CNY", pattern=r"^[A-Z]{3}$")

    @field_validator("monthly", mode="before")
    @classmethod
    def _exact(cls, v: Any) -> Any:
        if isinstance(v, float):
            return str(v)  # 0.1 stays 0.1, not 0.1000000000000000055...
        return v


class RetryBudgetDoc(_Doc):
    """A tenant's retry budget: how many times the federation runs its work again.

    Two kinds of retry (Armada and Kueue likewise keep infrastructure failures apart from job
    failures):

    * a **job failure** (``job.failed``: the workload exited in error) is retried while the job's
      own ``spec.retry_limit`` allows;
    * an **infrastructure loss** (``job.stopped`` ``cluster_lost``: the federation lost the
      cluster the attempt ran on) does *not* count against ``retry_limit`` -- the job did
      nothing wrong -- but at most ``max_infra_retries`` times per shard, so a job that keeps
      landing on failing clusters does not loop for ever.

    Both kinds count against ``per_month``: retried attempts of the tenant's jobs started in a
    calendar month (UTC, business time of the failure or loss). A retry past either cap ends the
    job (``job.cancelled`` with reason ``retries_exhausted: ...``). Money: every attempt,
    retried or lost, is billed for the interval it ran (a lost one up to when it was declared
    lost), so retries spend the tenant's monthly budget like any other work.

    Attributes:
        max_infra_retries: infrastructure losses retried per shard (default 3).
        per_month: retries per calendar month over all the tenant's jobs (None = no cap).
    """

    max_infra_retries: int = Field(default=3, ge=0, le=100)
    per_month: int | None = Field(default=None, ge=0, le=10**9)


#: The retry budget of a tenant whose policy sets none.
DEFAULT_RETRY_BUDGET = RetryBudgetDoc()


class TenantDoc(_Doc):
    """A tenant.

    Attributes:
        name: canonical tenant name.
        home_region: where its data and people are (default home of its jobs).
        projects: its projects.
        cross_region: ``forbidden``, ``approval`` or ``allowed``.
        default_locality: locality of jobs that do not say (None: ``must_local`` when
            cross-region is forbidden, else ``global``).
        regions: regions its jobs may use at all (empty = any).
        job_classes: narrower modes for some jobs.
        budget: monthly budget (None = none).
        retries: retry budget (None = :data:`DEFAULT_RETRY_BUDGET`).
    """

    name: str
    home_region: str
    projects: tuple[str, ...] = Field(min_length=1)
    cross_region: Mode = "allowed"
    default_locality: Locality | None = None
    regions: tuple[str, ...] = ()
    job_classes: tuple[JobClassDoc, ...] = ()
    budget: BudgetDoc | None = None
    retries: RetryBudgetDoc | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check("tenant", v)

    @field_validator("home_region")
    @classmethod
    def _home(cls, v: str) -> str:
        return _check("region", v)

    @field_validator("projects")
    @classmethod
    def _projects(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = tuple(sorted({_check("project", p) for p in v}))
        if len(out) != len(v):
            raise ValueError("a project is listed twice")
        return out

    @field_validator("regions")
    @classmethod
    def _regions(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({_check("region", r) for r in v}))

    @field_validator("job_classes")
    @classmethod
    def _classes(cls, v: tuple[JobClassDoc, ...]) -> tuple[JobClassDoc, ...]:
        names = [c.name for c in v]
        if len(set(names)) != len(names):
            raise ValueError("job class names must be unique within a tenant")
        for c in v:
            if not c.kinds and not c.residency_tags:
                raise ValueError(f"job class {c.name!r} must name kinds and/or residency_tags")
        return tuple(sorted(v, key=lambda c: c.name))


class QuotaDoc(_Doc):
    """A quota: tenant x card (model, family/class alias, card class name or ``*``) x region
    (or ``*``), ``guaranteed_gpus`` nominal, ``borrowing_limit_gpus`` above it, and a ``cohort``
    to borrow from / lend to ("" = none). GPUs may be fractional (multiples of 0.001).

    ``borrowing_limit_gpus`` absent (or null) means **no limit** -- as Kueue's
    ``borrowingLimit`` -- in every entry point (policy YAML, gRPC ``SetQuota``, the CLI); 0 means
    no borrowing. A quota without a cohort cannot borrow, so there an absent limit is stored as 0
    (any other value is an error), and both entry points store the same quota.
    """

    tenant: str
    card: str = WILDCARD
    region: str = WILDCARD
    guaranteed_gpus: float = Field(ge=0, le=1e6)
    borrowing_limit_gpus: float | None = Field(default=None, ge=0, le=1e6)
    cohort: str = ""

    @model_validator(mode="before")
    @classmethod
    def _no_cohort_no_borrowing(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("cohort") and data.get("borrowing_limit_gpus") is None:
            data = {**data, "borrowing_limit_gpus": 0}
        return data

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str) -> str:
        return _check("tenant", v)

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return v if v == WILDCARD else _check("region", v)

    @field_validator("cohort")
    @classmethod
    def _cohort(cls, v: str) -> str:
        return v if v == "" else _check("cohort", v)

    @field_validator("guaranteed_gpus", "borrowing_limit_gpus")
    @classmethod
    def _milli(cls, v: float | None) -> float | None:
        if v is not None and abs(v * 1000 - round(v * 1000)) > 1e-6:
            raise ValueError("must be a multiple of 0.001 GPU")
        return v

    @property
    def key(self) -> tuple[str, str, str]:
        """(tenant, card, region): the quota's identity."""
        return (self.tenant, self.card, self.region)

    @property
    def label(self) -> str:
        """``tenant/card/region``."""
        return "/".join(self.key)


class GrantDoc(_Doc):
    """One role of a principal (see :mod:`fedsched.auth` for what each role may do)."""

    role: Literal["submitter", "approver", "admin", "agent"]
    tenants: tuple[str, ...] = ()
    projects: tuple[str, ...] = ()
    region: str = ""
    cluster: str = ""

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({t if t == ANY else _check("tenant", t) for t in v}))

    @field_validator("projects")
    @classmethod
    def _projects(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({_check("project", p) for p in v}))

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return _check("region", v) if v else v

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, v: str) -> str:
        return _check("cluster", v) if v else v


class PrincipalDoc(_Doc):
    """A caller: name, the SHA-256 of its token (never the token), its grants.

    ``bootstrap: true`` marks the admin the embedded system created at first start; a later
    ``policy apply`` keeps it unless the new document names a principal with the same name.
    """

    name: str
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    roles: tuple[GrantDoc, ...] = Field(min_length=1)
    bootstrap: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check("principal", v)

    @field_validator("roles")
    @classmethod
    def _sorted(cls, v: tuple[GrantDoc, ...]) -> tuple[GrantDoc, ...]:
        return tuple(sorted(v, key=lambda g: json.dumps(g.model_dump(mode="json"), sort_keys=True)))


class ApprovalsDoc(_Doc):
    """The approval workflow: how long a cross-region request waits for a decision before the
    job falls back to its home queue (business seconds)."""

    timeout_s: float = Field(default=3600.0, gt=0, le=30 * 86400)


class SchedulingDoc(_Doc):
    """Scheduling weights: scorer name -> weight, replacing the running policy's weight of that
    scorer (scorers: see ``services/scheduler/core/scorers.py``)."""

    weights: dict[str, float] = Field(default_factory=dict)

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        known = known_scorers()
        for name, w in v.items():
            if name not in known:
                raise ValueError(f"unknown scorer {name!r} (known: {', '.join(sorted(known))})")
            if not 0 <= w <= 100:
                raise ValueError(f"weight of {name} must be 0..100")
        return dict(sorted(v.items()))


class LimitsDoc(_Doc):
    """Admission limits (per job; request size is a server setting, ``grpc_max_request_bytes``)."""

    max_workers: int = Field(default=1024, ge=1, le=4096)
    max_gpus_per_worker: int = Field(default=16, ge=1, le=64)
    max_cpu_milli: int = Field(default=1_024_000, ge=1, le=10**9)
    max_memory_mib: int = Field(default=16 * 1024 * 1024, ge=1, le=10**9)
    max_datasets: int = Field(default=64, ge=0, le=1024)
    max_request_id: int = Field(default=128, ge=1, le=1024)
    max_duration_s: float = Field(default=365 * 86400.0, gt=0, le=10 * 365 * 86400)


class PolicyDoc(_Doc):
    """The whole policy document (see the module docstring)."""

    tenants: tuple[TenantDoc, ...] = Field(min_length=1)
    card_classes: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    quotas: tuple[QuotaDoc, ...] = ()
    principals: tuple[PrincipalDoc, ...] = ()
    approvals: ApprovalsDoc = ApprovalsDoc()
    scheduling: SchedulingDoc = SchedulingDoc()
    limits: LimitsDoc = LimitsDoc()


def known_scorers() -> frozenset[str]:
    """Names of the scorers the scheduling policies use (:data:`fedsched.policynames.SCORER_NAMES`)."""
    return SCORER_NAMES


# --------------------------------------------------------------------------- parsing


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before", "function-plain") or str(part).startswith("function-"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _first(e: PydanticValidationError) -> ValidationError:
    err = e.errors()[0]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return ValidationError(_loc(err.get("loc", ())) or "policy", msg)


def parse_entry(model: type[BaseModel], data: dict, prefix: str) -> Any:
    """Validate one entry (a tenant, quota, grant ...) reporting ``prefix.<path>`` on error.

    Raises:
        ValidationError: the first problem.
    """
    try:
        return model.model_validate(data)
    except PydanticValidationError as e:
        first = _first(e)
        field = prefix if first.field == "policy" else f"{prefix}.{first.field}"
        raise ValidationError(field, first.reason) from e


def check_grant(grant: GrantDoc, doc: PolicyDoc, field: str) -> None:
    """Cross-check one grant against the document's tenants (see :func:`parse_policy_data`).

    Raises:
        ValidationError: ``field.<attribute>`` names the problem.
    """
    _check_grant(grant, {t.name: t for t in doc.tenants}, field)


def resolve_card(card: str, doc: PolicyDoc, field: str) -> frozenset[str] | None:
    """Card models a quota's ``card`` means in ``doc`` (None = any).

    Raises:
        InvalidName: not a card model, alias, class or ``*`` (``field`` named).
    """
    return _resolve_card(card, doc.card_classes, field)


def parse_policy_data(data: Any) -> PolicyDoc:
    """Validate a decoded document (dict) into a :class:`PolicyDoc`, cross-checked.

    Raises:
        ValidationError: the first problem, ``field`` = its document path.
    """
    if not isinstance(data, dict):
        raise ValidationError("policy", "must be a mapping with at least 'tenants'")
    try:
        doc = PolicyDoc.model_validate(data)
    except PydanticValidationError as e:
        raise _first(e) from e
    _cross_check(doc)
    return doc


def parse_policy(text: str) -> PolicyDoc:
    """Parse and validate the YAML (or JSON) text of a policy document.

    Raises:
        ValidationError: malformed YAML or a broken rule (``field`` = document path).
    """
    return parse_policy_data(load_yaml(text, "policy"))


def _cross_check(doc: PolicyDoc) -> None:
    tenants = {t.name: t for t in doc.tenants}
    if len(tenants) != len(doc.tenants):
        dup = next(t.name for t in doc.tenants if sum(x.name == t.name for x in doc.tenants) > 1)
        raise ValidationError("tenants", f"tenant {dup!r} is listed twice")
    for name, members in doc.card_classes.items():
        naming.check_name("card_class", name, f"card_classes.{name}")
        if not members:
            raise ValidationError(f"card_classes.{name}", "must list at least one card model")
        for j, m in enumerate(members):
            _resolve_card(m, {}, f"card_classes.{name}[{j}]")
    seen_q: set[tuple[str, str, str]] = set()
    for i, q in enumerate(doc.quotas):
        f = f"quotas[{i}]"
        if q.tenant not in tenants:
            raise ValidationError(f"{f}.tenant", f"unknown tenant {q.tenant!r}")
        _resolve_card(q.card, doc.card_classes, f"{f}.card")
        if q.key in seen_q:
            raise ValidationError(f, f"quota {q.label} is listed twice")
        seen_q.add(q.key)
        if q.cohort == "" and q.borrowing_limit_gpus not in (0, None):
            raise ValidationError(f"{f}.borrowing_limit_gpus", "borrowing needs a cohort to borrow from")
    names: set[str] = set()
    hashes: set[str] = set()
    for i, p in enumerate(doc.principals):
        f = f"principals[{i}]"
        if p.name in names:
            raise ValidationError(f"{f}.name", f"principal {p.name!r} is listed twice")
        if p.token_sha256 in hashes:
            raise ValidationError(f"{f}.token_sha256", "two principals share one token")
        names.add(p.name)
        hashes.add(p.token_sha256)
        for j, g in enumerate(p.roles):
            _check_grant(g, tenants, f"{f}.roles[{j}]")


def _check_grant(g: GrantDoc, tenants: dict[str, TenantDoc], f: str) -> None:
    if g.role in ("submitter", "approver"):
        if not g.tenants:
            raise ValidationError(f"{f}.tenants", f"a {g.role} needs at least one tenant (or '*')")
        for t in g.tenants:
            if t != ANY and t not in tenants:
                raise ValidationError(f"{f}.tenants", f"unknown tenant {t!r}")
        if g.role == "approver" and g.projects:
            raise ValidationError(f"{f}.projects", "an approver covers whole tenants")
        if g.projects and ANY not in g.tenants:
            offered = set().union(*(tenants[t].projects for t in g.tenants))
            for p in g.projects:
                if p not in offered:
                    raise ValidationError(f"{f}.projects", f"no tenant of this grant has project {p!r}")
        if g.region or g.cluster:
            raise ValidationError(f"{f}.cluster", f"a {g.role} is not bound to a cluster")
    elif g.role == "agent":
        if not g.region or not g.cluster:
            raise ValidationError(f"{f}.cluster", "an agent needs its region and cluster")
        if g.tenants or g.projects:
            raise ValidationError(f"{f}.tenants", "an agent is not bound to tenants")
    elif g.tenants or g.projects or g.region or g.cluster:
        raise ValidationError(f"{f}.tenants", "admin is global: no tenants, projects, region or cluster")


def check_topology_names(doc: PolicyDoc, names: Any, prefix: str = "") -> None:
    """Refuse a policy naming a region or cluster outside the topology in force.

    Checked: ``tenants[i].home_region``, ``tenants[i].regions[j]``, ``quotas[i].region`` (but
    ``*``), ``principals[i].roles[j].region`` / ``.cluster`` (agent grants).

    Args:
        doc: the policy.
        names: the names in force (a :class:`fedsched.topology.KnownNames`: ``check(kind,
            value, field)``).
        prefix: put before every field path (``yaml.`` for a request's document).

    Raises:
        ValidationError: the first unknown name; field = its path in the document, the message
            lists the known names.
    """
    for i, t in enumerate(doc.tenants):
        names.check("region", t.home_region, f"{prefix}tenants[{i}].home_region")
        for j, r in enumerate(t.regions):
            names.check("region", r, f"{prefix}tenants[{i}].regions[{j}]")
    for i, q in enumerate(doc.quotas):
        if q.region != WILDCARD:
            names.check("region", q.region, f"{prefix}quotas[{i}].region")
    for i, p in enumerate(doc.principals):
        for j, g in enumerate(p.roles):
            if g.region:
                names.check("region", g.region, f"{prefix}principals[{i}].roles[{j}].region")
            if g.cluster:
                names.check("cluster", g.cluster, f"{prefix}principals[{i}].roles[{j}].cluster")


def _resolve_card(card: str, classes: dict[str, tuple[str, ...]], field: str) -> frozenset[str] | None:
    """Card models a quota's ``card`` means (None = any)."""
    if card == WILDCARD:
        return None
    if card in classes:
        out: set[str] = set()
        for j, m in enumerate(classes[card]):
            out |= _resolve_card(m, {}, f"card_classes.{card}[{j}]") or set()
        return frozenset(out)
    if isinstance(card, str) and card.startswith("unlisted-") and naming.is_name("cluster", card):
        return frozenset({card})
    return frozenset(m.name for m in naming.default_catalog().resolve(card, field=field))


# --------------------------------------------------------------------------- canonical form


def canonical(doc: PolicyDoc) -> dict[str, Any]:
    """The document as plain data in canonical order (what the version hashes)."""
    data = doc.model_dump(mode="json")
    data["tenants"] = sorted(data["tenants"], key=lambda t: t["name"])
    data["quotas"] = sorted(data["quotas"], key=lambda q: (q["tenant"], q["card"], q["region"]))
    data["principals"] = sorted(data["principals"], key=lambda p: p["name"])
    data["card_classes"] = {k: sorted(set(v)) for k, v in sorted(data["card_classes"].items())}
    return data


def canonical_json(doc: PolicyDoc) -> str:
    """Compact, key-sorted JSON of :func:`canonical`."""
    return json.dumps(canonical(doc), sort_keys=True, separators=(",", ":"))


def policy_version(doc: PolicyDoc) -> str:
    """The content hash: first 12 hex characters of SHA-256 of :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()[:12]


def to_yaml(doc: PolicyDoc) -> str:
    """The canonical document as YAML (token hashes included: admins only)."""
    return yaml.safe_dump(canonical(doc), sort_keys=False, allow_unicode=True, width=120)


def bundled_policy_text() -> str:
    """Text of the bundled default policy (``fedsched/catalog/policy.yaml``)."""
    return resources.files("fedsched.catalog").joinpath("policy.yaml").read_text("utf-8")


def with_principal(doc: PolicyDoc, principal: PrincipalDoc) -> PolicyDoc:
    """``doc`` with ``principal`` added or replaced (by name)."""
    others = tuple(p for p in doc.principals if p.name != principal.name)
    return parse_policy_data({**canonical(doc), "principals": [*(p.model_dump(mode="json") for p in others),
                                                                   principal.model_dump(mode="json")]})


def carry_bootstrap(current: PolicyDoc | None, new: PolicyDoc) -> PolicyDoc:
    """``new`` plus the current policy's ``bootstrap`` principals it does not name itself
    (so applying a hand-written file never locks out the embedded system's admin)."""
    if current is None:
        return new
    names = {p.name for p in new.principals}
    hashes = {p.token_sha256 for p in new.principals}
    keep = [p for p in current.principals if p.bootstrap and p.name not in names and p.token_sha256 not in hashes]
    if not keep:
        return new
    return parse_policy_data({**canonical(new), "principals": [*canonical(new)["principals"],
                                                               *(p.model_dump(mode="json") for p in keep)]})


# --------------------------------------------------------------------------- diff


def _section(data: dict, name: str) -> dict[str, Any]:
    if name == "tenants":
        return {t["name"]: t for t in data["tenants"]}
    if name == "quotas":
        return {"/".join((q["tenant"], q["card"], q["region"])): q for q in data["quotas"]}
    if name == "principals":
        return {p["name"]: p for p in data["principals"]}
    return data.get(name) or {}


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


def yaml_diff(old_yaml: str, new_yaml: str, *, old_label: str = "old", new_label: str = "new",
              context: int = 3) -> list[str]:
    """A unified diff (:func:`difflib.unified_diff`, ``context`` lines around each change) from
    one policy version's canonical YAML (:func:`to_yaml`, as ``PolicyService`` returns it) to
    another's, one line per item without line ends; empty when they are the same text.

    Unlike :func:`diff` this is textual: it shows whatever the YAML holds (token hashes
    included), so it is for admins, who are the only ones to see the YAML at all.
    """
    import difflib

    return list(difflib.unified_diff(old_yaml.splitlines(), new_yaml.splitlines(), fromfile=old_label,
                                     tofile=new_label, n=context, lineterm=""))


def diff(old: PolicyDoc | None, new: PolicyDoc) -> list[str]:
    """What changes from ``old`` to ``new``, one line per change (token hashes never shown)."""
    a = canonical(old) if old is not None else {"tenants": [], "quotas": [], "principals": [], "card_classes": {},
                                                "approvals": {}, "scheduling": {}, "limits": {}}
    b = canonical(new)
    out: list[str] = []
    singular = {"tenants": "tenant", "quotas": "quota", "principals": "principal", "card_classes": "card class"}
    for name in ("tenants", "quotas", "principals", "card_classes"):
        sa, sb = _section(a, name), _section(b, name)
        for key in sorted(set(sa) | set(sb)):
            label = f"{singular[name]} {key}"
            if key not in sa:
                out.append(f"{label}: added")
            elif key not in sb:
                out.append(f"{label}: removed")
            elif sa[key] != sb[key]:
                if name == "card_classes":
                    out.append(f"{label}: {_show(sa[key])} -> {_show(sb[key])}")
                    continue
                for f in sorted(set(sa[key]) | set(sb[key])):
                    va, vb = sa[key].get(f), sb[key].get(f)
                    if va == vb:
                        continue
                    if f == "token_sha256":
                        out.append(f"{label}: token rotated")
                    else:
                        out.append(f"{label}: {f} {_show(va)} -> {_show(vb)}")
    for name in ("approvals", "scheduling", "limits"):
        sa, sb = a.get(name) or {}, b.get(name) or {}
        for f in sorted(set(sa) | set(sb)):
            if sa.get(f) != sb.get(f):
                out.append(f"{name}.{f}: {_show(sa.get(f))} -> {_show(sb.get(f))}")
    return out


def public_view(kind: str, value: BaseModel | None) -> dict | None:
    """A tenant, quota or principal as event data (a principal's token hash left out)."""
    if value is None:
        return None
    data = value.model_dump(mode="json")
    if kind == "principal":
        data.pop("token_sha256", None)
    return data


# --------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class Governance:
    """A validated policy, indexed for the services (immutable).

    Attributes:
        doc: the document.
        version: its content hash (:func:`policy_version`).
    """

    doc: PolicyDoc
    version: str
    tenants: dict[str, TenantDoc] = field(default_factory=dict, repr=False)
    _principals: dict[str, Principal] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, doc: PolicyDoc) -> "Governance":
        """Index ``doc``."""
        principals = {}
        for p in doc.principals:
            principals[p.token_sha256] = Principal(p.name, tuple(
                Grant(g.role, frozenset(g.tenants), frozenset(g.projects), g.region, g.cluster) for g in p.roles))
        return cls(doc, policy_version(doc), {t.name: t for t in doc.tenants}, principals)

    @classmethod
    def parse(cls, text: str) -> "Governance":
        """Parse, validate and index YAML text."""
        return cls.of(parse_policy(text))

    # ---- identities

    def authenticate(self, token: str) -> Principal | None:
        """The principal holding ``token``, or None (lookup by SHA-256)."""
        return self._principals.get(hash_token(token))

    def principal(self, name: str) -> PrincipalDoc | None:
        """The principal entry called ``name``."""
        return next((p for p in self.doc.principals if p.name == name), None)

    # ---- tenants and jobs

    def tenant(self, name: str) -> TenantDoc | None:
        """The tenant called ``name``, or None."""
        return self.tenants.get(name)

    def mode_for(self, spec: JobSpec) -> tuple[str, str]:
        """The job's cross-region mode and where it comes from (``tenant search`` or
        ``job class search/pii``); unknown tenants are ``forbidden``."""
        tenant = self.tenants.get(spec.tenant)
        if tenant is None:
            return "forbidden", f"unknown tenant {spec.tenant}"
        mode, source = tenant.cross_region, f"tenant {tenant.name}"
        for c in tenant.job_classes:
            if c.matches(spec) and _RANK[c.cross_region] < _RANK[mode]:
                mode, source = c.cross_region, f"job class {tenant.name}/{c.name}"
        return mode, source

    def default_locality(self, spec: JobSpec) -> Locality:
        """Locality of a job that did not state one."""
        tenant = self.tenants[spec.tenant]
        if self.mode_for(spec)[0] == "forbidden":
            return Locality.MUST_LOCAL
        return tenant.default_locality or Locality.GLOBAL

    def admit_spec(self, spec: JobSpec, *, locality_given: bool) -> JobSpec:
        """Check that a job only narrows its tenant's policy, and apply the tenant's defaults.

        Rules: the home region and allowed regions lie within the tenant's ``regions`` (if
        set; with none given the job gets them); under ``forbidden`` the job must be
        ``must_local`` (the default then) and may allow no other region.

        Raises:
            ValidationError: the job widens the policy (field ``spec.locality``,
                ``spec.home_region`` or ``spec.allowed_regions``).
        """
        tenant = self.tenants[spec.tenant]
        update: dict[str, Any] = {}
        if tenant.regions:
            if spec.home_region not in tenant.regions:
                raise ValidationError("spec.home_region", f"tenant {tenant.name} may only use "
                                      f"{', '.join(tenant.regions)} (policy {self.version})")
            outside = [r for r in spec.allowed_regions if r not in tenant.regions]
            if outside:
                raise ValidationError("spec.allowed_regions", f"{', '.join(outside)} outside tenant {tenant.name}'s "
                                      f"regions {', '.join(tenant.regions)} (policy {self.version})")
            if not spec.allowed_regions:
                update["allowed_regions"] = tenant.regions
        mode, source = self.mode_for(spec)
        if mode == "forbidden":
            if locality_given and spec.locality != Locality.MUST_LOCAL:
                raise ValidationError("spec.locality", f"{source} forbids cross-region jobs: only must_local "
                                      f"(policy {self.version}); a job may narrow its tenant's policy, never widen it")
            away = [r for r in spec.allowed_regions if r != spec.home_region]
            if away:
                raise ValidationError("spec.allowed_regions", f"{source} forbids cross-region jobs; "
                                      f"{', '.join(away)} is not the home region {spec.home_region}")
        if not locality_given:
            locality = self.default_locality(spec)
            if locality != spec.locality:  # a copy only for a change (the spec is immutable)
                update["locality"] = locality
        return spec.model_copy(update=update) if update else spec

    def budget(self, tenant: str) -> BudgetDoc | None:
        """The tenant's monthly budget, or None."""
        t = self.tenants.get(tenant)
        return t.budget if t else None

    def retry_budget(self, tenant: str) -> RetryBudgetDoc:
        """The tenant's retry budget (:data:`DEFAULT_RETRY_BUDGET` when its policy sets none or
        the tenant is unknown)."""
        t = self.tenants.get(tenant)
        return t.retries if t is not None and t.retries is not None else DEFAULT_RETRY_BUDGET

    # ---- quotas

    @cached_property
    def quota_rules(self) -> tuple[QuotaRule, ...]:
        """The quotas as rules for :class:`~fedsched.quota.QuotaBook`."""
        rules = []
        for q in self.doc.quotas:
            borrow = None if q.borrowing_limit_gpus is None else round(q.borrowing_limit_gpus * 1000)
            rules.append(QuotaRule(
                tenant=q.tenant, models=_resolve_card(q.card, self.doc.card_classes, "card"),
                regions=None if q.region == WILDCARD else frozenset({q.region}),
                nominal_milli=round(q.guaranteed_gpus * 1000), borrowing_limit_milli=borrow if q.cohort else 0,
                cohort=q.cohort, label=q.label))
        return tuple(rules)

    # ---- scheduling

    @property
    def approval_timeout_s(self) -> float:
        """How long an approval request waits (business seconds)."""
        return self.doc.approvals.timeout_s

    @property
    def weights(self) -> dict[str, float]:
        """Scorer weights that override the running policy's."""
        return self.doc.scheduling.weights


def decimal_or_none(text: str) -> Decimal | None:
    """``text`` as a Decimal, or None when it is not a finite number."""
    try:
        value = Decimal(text)
    except (InvalidOperation, TypeError, ValueError):
        return None
    return value if value.is_finite() else None
