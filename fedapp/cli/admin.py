"""CLI commands over the governance API: approvals, approve, reject, tenants, quota, principal,
policy apply|show|diff, and ``token new`` (local).

Like the job commands (:mod:`fedapp.cli.jobs`) they talk to admission at ``--server`` with the
token from ``--token`` / ``FEDSCHED_TOKEN`` / ``<data_dir>/admin.token``, print tables, or JSON
with ``--output json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

import grpc
import typer
from rich.table import Table

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.auth import ROLES, hash_token, new_token
from fedapp.cli.text import Output, clip, console, err, error_line, money
from fedapp.cli.wire import enum_word, message_dict
from fedsched.errors import ValidationError
from fedapp.cli.jobs import KINDS, LOCALITIES, OUTPUT, SERVER, TOKEN, Api, fail_rpc
from fedsched.yamltext import read_text


class PolicyOutput(str, Enum):
    """``policy show --output``."""

    yaml = "yaml"
    json = "json"


MODES = {"forbidden": gpb.CROSS_REGION_MODE_FORBIDDEN, "approval": gpb.CROSS_REGION_MODE_APPROVAL,
         "allowed": gpb.CROSS_REGION_MODE_ALLOWED}
APPROVAL_STATES = {"pending": gpb.APPROVAL_STATE_PENDING, "approved": gpb.APPROVAL_STATE_APPROVED,
                   "rejected": gpb.APPROVAL_STATE_REJECTED, "expired": gpb.APPROVAL_STATE_EXPIRED}


def _json(msg) -> None:
    console.print_json(json.dumps(message_dict(msg)))


def _pick(value: str, table: dict, flag: str) -> int:
    if value not in table:
        err.print(error_line(flag, f"must be one of {', '.join(table)}"))
        raise typer.Exit(2)
    return table[value]


def _name(enum, value: int) -> str:
    """An enum value as tables and JSON output spell it (:mod:`fedapp.cli.wire`); "-" for unset."""
    return enum_word(enum.DESCRIPTOR, value) if value else "-"


def _ts(ts) -> str:
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if ts.seconds else ""


def parse_role(text: str) -> gpb.RoleGrant:
    """``admin`` | ``submitter:T1,T2[/P1,P2]`` | ``approver:T1,T2`` | ``agent:REGION/CLUSTER``."""
    role, _, rest = text.partition(":")
    if role not in ROLES:
        err.print(error_line("--role", f"{text!r}: role must be one of {', '.join(ROLES)}"))
        raise typer.Exit(2)
    if role == "agent":
        region, _, cluster = rest.partition("/")
        return gpb.RoleGrant(role=role, region=region, cluster=cluster)
    tenants, _, projects = rest.partition("/")
    return gpb.RoleGrant(role=role, tenants=[t for t in tenants.split(",") if t],
                         projects=[p for p in projects.split(",") if p])


def _job_class(spec: str) -> gpb.JobClass:
    """``NAME:MODE[:kinds=k1,k2][:tags=t1,t2]`` (``--job-class``)."""
    parts = spec.split(":")
    if len(parts) < 2:
        err.print(error_line("--job-class", f"{spec!r}: NAME:MODE[:kinds=...][:tags=...]"))
        raise typer.Exit(2)
    jc = gpb.JobClass(name=parts[0], cross_region=_pick(parts[1], MODES, "--job-class mode"))
    for extra in parts[2:]:
        key, _, values = extra.partition("=")
        items = [v for v in values.split(",") if v]
        if key == "kinds":
            jc.kinds.extend(_pick(k, KINDS, "--job-class kinds") for k in items)
        elif key == "tags":
            jc.residency_tags.extend(items)
        else:
            err.print(error_line("--job-class", f"{spec!r}: unknown part {key!r} (kinds=..., tags=...)"))
            raise typer.Exit(2)
    return jc


@dataclass(frozen=True)
class TenantEdit:
    """What ``tenants put`` changes in a tenant; everything not named is kept.

    Attributes:
        home_region, cross_region, default_locality: set when given ("" / 0 = keep).
        add_projects / remove_projects, add_regions / remove_regions: list edits; removing
            a value the tenant does not have is an error (a typo must not pass silently).
        job_classes: classes added, or replacing the one with the same name.
        remove_job_classes: names of classes removed.
        budget: monthly amount set ("" = keep); currency: its currency ("" = keep, else CNY).
        no_budget: remove the budget.
    """

    home_region: str = ""
    add_projects: tuple[str, ...] = ()
    remove_projects: tuple[str, ...] = ()
    cross_region: int = 0
    default_locality: int = 0
    add_regions: tuple[str, ...] = ()
    remove_regions: tuple[str, ...] = ()
    job_classes: tuple[gpb.JobClass, ...] = ()
    remove_job_classes: tuple[str, ...] = ()
    budget: str = ""
    currency: str = ""
    no_budget: bool = False

    def check(self) -> None:
        """Raise :class:`ValidationError` (field = the option) for contradictory options."""
        for field, added, removed in (("project", self.add_projects, self.remove_projects),
                                      ("region", self.add_regions, self.remove_regions),
                                      ("job-class", [c.name for c in self.job_classes], self.remove_job_classes)):
            both = sorted(set(added) & set(removed))
            if both:
                raise ValidationError(f"remove-{field}", f"{', '.join(both)} both added and removed")
        if self.no_budget and (self.budget or self.currency):
            raise ValidationError("no-budget", "cannot be combined with --budget or --currency")

    def apply(self, current: gpb.Tenant | None, name: str) -> gpb.Tenant:
        """The tenant after the edit (``current`` None: a new tenant named ``name``).

        Raises:
            ValidationError: a removal names something the tenant does not have, or
                ``--currency`` without a budget to apply it to.
        """
        t = gpb.Tenant(name=name)
        if current is not None:
            t.CopyFrom(current)
            t.ClearField("month_spend")  # output only
        if self.home_region:
            t.home_region = self.home_region
        if self.cross_region:
            t.cross_region = self.cross_region
        if self.default_locality:
            t.default_locality = self.default_locality
        _edit_list(t.projects, self.add_projects, self.remove_projects, "remove-project", name)
        _edit_list(t.regions, self.add_regions, self.remove_regions, "remove-region", name)
        classes = {c.name: c for c in t.job_classes}
        for n in self.remove_job_classes:
            if classes.pop(n, None) is None:
                raise ValidationError("remove-job-class", f"tenant {name} has no job class {n!r}")
        for c in self.job_classes:
            classes[c.name] = c
        del t.job_classes[:]
        t.job_classes.extend(classes.values())
        if self.no_budget:
            t.ClearField("budget")
        elif self.budget:
            t.budget.CopyFrom(gpb.Budget(monthly=self.budget, currency=self.currency or t.budget.currency or "CNY"))
        elif self.currency:
            if not t.budget.monthly:
                raise ValidationError("currency", f"tenant {name} has no budget; give --budget too")
            t.budget.currency = self.currency
        return t


def _edit_list(values, add: tuple[str, ...], remove: tuple[str, ...], flag: str, name: str) -> None:
    kept = list(values)
    for v in remove:
        if v not in kept:
            raise ValidationError(flag, f"tenant {name} has no {flag.removeprefix('remove-')} {v!r}")
        kept.remove(v)
    kept.extend(v for v in add if v not in kept)
    del values[:]
    values.extend(kept)


def put_tenant(api: Api, name: str, edit: TenantEdit, expected_version: str = "",
               attempts: int = 3) -> gpb.PutTenantResponse:
    """Read the tenant, apply ``edit``, write it back at the version read (compare-and-set).

    A put that fails because the policy moved on since the read (FAILED_PRECONDITION, and a
    newer version on a second read) is made again on the new version, at most ``attempts``
    times; with ``expected_version`` it is reported instead. Exits 1 (after printing) on any
    other RPC error, 2 on a bad edit.
    """
    stub = gpb_grpc.TenantServiceStub(api.channel)
    for attempt in range(attempts):
        listed = api.call(stub.ListTenants, gpb.ListTenantsRequest())
        if expected_version and listed.policy_version != expected_version:
            err.print(error_line("FAILED_PRECONDITION:", f"the policy is at version {listed.policy_version}, not "
                                                         f"{expected_version}; review the change against it and retry"))
            raise typer.Exit(1)
        current = next((t for t in listed.tenants if t.name == name), None)
        try:
            tenant = edit.apply(current, name)
        except ValidationError as e:
            err.print(error_line(f"--{e.field}:", e.reason))
            raise typer.Exit(2) from None
        request = gpb.PutTenantRequest(tenant=tenant, expected_version=listed.policy_version)
        try:
            return stub.PutTenant(request, timeout=30, metadata=api.metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or expected_version or attempt == attempts - 1:
                fail_rpc(e)
            now = api.call(stub.ListTenants, gpb.ListTenantsRequest()).policy_version
            if now == listed.policy_version:
                fail_rpc(e)  # not a concurrent change: a guard refused it
            err.print(f"the policy changed meanwhile ({listed.policy_version} -> {now}); editing the new version")
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------ approvals


def approvals(
    tenant: str = typer.Option("", "--tenant", help="Only this tenant's requests."),
    state: list[str] = typer.Option([], "--state", help="pending, approved, rejected, expired (repeatable; "
                                                          "default all)."),
    limit: int = typer.Option(100, "--limit", min=1, max=1000, help="Page size (requests per page)."),
    newest_first: bool = typer.Option(False, "--newest-first", help="Newest decision first (pending requests by "
                                                                    "request time); default: oldest request first."),
    page_token: str = typer.Option("", "--page-token", help="Continue from this token (printed below a page; only "
                                                            "with the same filters and order)."),
    server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN,
):
    """List cross-region approval requests (approvers: of their tenants), a page at a time."""
    states = [_pick(s, APPROVAL_STATES, "--state") for s in state]
    order = gpb.APPROVAL_ORDER_NEWEST_FIRST if newest_first else gpb.APPROVAL_ORDER_OLDEST_FIRST
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.ApprovalServiceStub(api.channel).ListApprovals,
                        gpb.ListApprovalsRequest(tenant=tenant, states=states, page_size=limit, order=order,
                                                 page_token=page_token))
    applied = ([f"--tenant {tenant}"] if tenant else []) + [f"--state {s}" for s in state]
    if not resp.approvals and applied and not page_token:  # nothing matched: say why on stderr
        if output == "json":
            _json(resp)
        err.print(f"no approval requests match {' '.join(applied)}")
        return
    if output == "json":
        _json(resp)
        return
    t = Table("approval", "job", "tenant/project", "state", "proposed", "cost", "expires", "decided by", "reason")
    for a in resp.approvals:
        t.add_row(a.approval_id, a.job_id, f"{a.tenant}/{a.project}",
                  _name(gpb.ApprovalState, a.state),
                  f"{a.proposed_cluster} ({a.proposed_region})", money(a.cost, a.currency),
                  _ts(a.expires_at), a.decided_by or "-", clip(a.reason, 90))
    console.print(t)
    more = f"; next page: --page-token {resp.next_page_token}" if resp.next_page_token else ""
    console.print(f"{len(resp.approvals)} of {resp.total} matching requests shown{more}")


def _decide(approval_id: str, comment: str, server: str, output: str, token: str, approve: bool) -> None:
    """Approve (``approve`` true) or reject one approval request and print the decision."""
    with Api(server, token) as api:
        stub = gpb_grpc.ApprovalServiceStub(api.channel)
        a = api.call(stub.Approve if approve else stub.Reject,
                     gpb.DecideApprovalRequest(approval_id=approval_id, comment=comment))
    if output == "json":
        _json(a)
    else:
        console.print(f"{a.approval_id} {_name(gpb.ApprovalState, a.state)} by {a.decided_by}: "
                      f"job {a.job_id} -> {a.proposed_cluster} ({a.proposed_region})")


def approve(approval_id: str = typer.Argument(..., help="The request's id (`fedsched approvals`)."),
            comment: str = typer.Option("", "--comment", help="Why (recorded with the decision, audited)."),
            server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Approve a cross-region request: the job may run in the proposed region."""
    _decide(approval_id, comment, server, output, token, True)


def reject(approval_id: str = typer.Argument(..., help="The request's id (`fedsched approvals`)."),
           comment: str = typer.Option("", "--comment", help="Why (recorded with the decision, audited)."),
           server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Reject a cross-region request: the job stays in its home region."""
    _decide(approval_id, comment, server, output, token, False)


# ------------------------------------------------------------------ tenants


def tenants(ctx: typer.Context, server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """List tenants (with their month-to-date spend)."""
    if ctx.invoked_subcommand:
        return
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.TenantServiceStub(api.channel).ListTenants, gpb.ListTenantsRequest())
    if output == "json":
        _json(resp)
        return
    t = Table("tenant", "home", "projects", "cross-region", "job classes", "regions", "budget", "spend (month)",
              title=f"policy {resp.policy_version}")
    for x in resp.tenants:
        classes = ", ".join(f"{c.name}:{_name(gpb.CrossRegionMode, c.cross_region)}"
                            for c in x.job_classes)
        t.add_row(x.name, x.home_region, ",".join(x.projects),
                  _name(gpb.CrossRegionMode, x.cross_region), classes or "-",
                  ",".join(x.regions) or "any",
                  money(x.budget.monthly, x.budget.currency), money(x.month_spend or "0", x.budget.currency))
    console.print(t)


def tenants_put(
    name: str = typer.Argument(...),
    home_region: str = typer.Option("", "--home-region", help="Home region (required for a new tenant)."),
    project: list[str] = typer.Option([], "--project", help="Add a project (repeatable)."),
    remove_project: list[str] = typer.Option([], "--remove-project", help="Remove a project (repeatable)."),
    cross_region: str = typer.Option("", "--cross-region", help="forbidden, approval or allowed (default: keep)."),
    default_locality: str = typer.Option("", "--default-locality", help="must_local, prefer_local or global."),
    region: list[str] = typer.Option([], "--region", help="Add a region its jobs may use (repeatable; a tenant "
                                                          "without any may use every region)."),
    remove_region: list[str] = typer.Option([], "--remove-region", help="Remove an allowed region (repeatable)."),
    job_class: list[str] = typer.Option([], "--job-class",
                                        help="Add or replace the class NAME: NAME:MODE[:kinds=k1,k2][:tags=t1,t2] "
                                             "(repeatable)."),
    remove_job_class: list[str] = typer.Option([], "--remove-job-class", help="Remove the class NAME (repeatable)."),
    budget: str = typer.Option("", "--budget", help="Set the monthly budget (currency units)."),
    currency: str = typer.Option("", "--currency", help="Currency of the budget (default: keep, else CNY)."),
    no_budget: bool = typer.Option(False, "--no-budget", help="Remove the budget."),
    expected_version: str = typer.Option("", "--expected-version", help="Refuse if the policy moved on."),
    server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN,
):
    """Create a tenant, or change only what the options name (admins); prints what changed.

    The put is a read-modify-write: the tenant is read with the policy version, changed, and
    written back only if the policy is still at that version (a concurrent change is never
    overwritten: the edit is made again on the new version, at most 3 times; with
    --expected-version it is refused instead).
    """
    edit = TenantEdit(home_region=home_region, add_projects=tuple(project), remove_projects=tuple(remove_project),
                      cross_region=_pick(cross_region, MODES, "--cross-region") if cross_region else 0,
                      default_locality=_pick(default_locality, LOCALITIES, "--default-locality")
                      if default_locality else 0,
                      add_regions=tuple(region), remove_regions=tuple(remove_region),
                      job_classes=tuple(_job_class(spec) for spec in job_class),
                      remove_job_classes=tuple(remove_job_class), budget=budget, currency=currency,
                      no_budget=no_budget)
    try:
        edit.check()
    except ValidationError as e:
        err.print(error_line(f"--{e.field}:", e.reason))
        raise typer.Exit(2) from None
    with Api(server, token) as api:
        resp = put_tenant(api, name, edit, expected_version)
    if output == "json":
        _json(resp)
        return
    for line in resp.changes:
        console.print(f"  {line}", highlight=False, markup=False)
    if not resp.changes:
        console.print(f"no change: tenant {name} already so in policy {resp.policy_version}")
    else:
        console.print(f"tenant {resp.tenant.name} {'created' if resp.created else 'updated'}; "
                      f"policy {resp.previous_version} -> {resp.policy_version}")


# ------------------------------------------------------------------ quotas


def quota(ctx: typer.Context, tenant: str = typer.Option("", "--tenant", help="Only this tenant's quotas."), server: str = SERVER,
          output: Output = OUTPUT, token: str = TOKEN):
    """Show quotas (guaranteed, borrowing limit, cohort, in use)."""
    if ctx.invoked_subcommand:
        return
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.TenantServiceStub(api.channel).ListQuotas, gpb.ListQuotasRequest(tenant=tenant))
    if output == "json":
        _json(resp)
        return
    t = Table("tenant", "card", "region", "guaranteed GPUs", "borrowing limit", "cohort", "in use GPUs",
              title=f"policy {resp.policy_version}")
    for q in resp.quotas:
        borrow = f"{q.borrowing_limit_gpus:g}" if q.HasField("borrowing_limit_gpus") else "unlimited"
        t.add_row(q.tenant, q.card, q.region, f"{q.guaranteed_gpus:g}", borrow, q.cohort or "-",
                  f"{q.used_milli / 1000:g}")
    console.print(t)


def quota_set(
    tenant: str = typer.Argument(...),
    card: str = typer.Option("*", "--card", help="Card model, alias, card class or *."),
    region: str = typer.Option("*", "--region", help="Region or *."),
    guaranteed: float = typer.Option(..., "--guaranteed", help="Guaranteed (nominal) GPUs."),
    borrowing_limit: Optional[float] = typer.Option(None, "--borrowing-limit",
                                                    help="GPUs above nominal from the cohort (default: none "
                                                         "without a cohort, unlimited with one)."),
    cohort: str = typer.Option("", "--cohort", help="Cohort whose members lend each other unused guaranteed GPUs "
                                                   "(borrowing)."),
    expected_version: str = typer.Option("", "--expected-version",
                                         help="Refuse if the policy in force is not this version."),
    server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN,
):
    """Create or replace a quota (admins)."""
    q = gpb.Quota(tenant=tenant, card=card, region=region, guaranteed_gpus=guaranteed, cohort=cohort)
    if borrowing_limit is not None:
        q.borrowing_limit_gpus = borrowing_limit
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.TenantServiceStub(api.channel).SetQuota,
                        gpb.SetQuotaRequest(quota=q, expected_version=expected_version))
    if output == "json":
        _json(resp)
    else:
        console.print(f"quota {tenant}/{card}/{region} {'created' if resp.created else 'updated'}; "
                      f"policy {resp.policy_version}")


def quota_delete(tenant: str = typer.Argument(...),
                 card: str = typer.Option("*", "--card", help="Card model, alias, card class or * (as set)."),
                 region: str = typer.Option("*", "--region", help="Region or * (as set)."),
                 expected_version: str = typer.Option("", "--expected-version",
                                                      help="Refuse if the policy in force is not this version."),
                 server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Delete a quota (admins)."""
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.TenantServiceStub(api.channel).DeleteQuota,
                        gpb.DeleteQuotaRequest(tenant=tenant, card=card, region=region,
                                               expected_version=expected_version))
    if output == "json":
        _json(resp)
    else:
        console.print(f"quota {tenant}/{card}/{region} deleted; policy {resp.policy_version}")


# ------------------------------------------------------------------ principals and tokens


def principal_put(
    name: str = typer.Argument(...),
    role: list[str] = typer.Option(..., "--role", help="admin | submitter:T1,T2[/P1,P2] | approver:T1,T2 | "
                                                       "agent:REGION/CLUSTER (repeatable)."),
    new_token_: bool = typer.Option(False, "--new-token", help="Issue a fresh token (always for a new principal)."),
    expected_version: str = typer.Option("", "--expected-version",
                                         help="Refuse if the policy in force is not this version."),
    server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN,
):
    """Create or update a principal; a new token is printed once (only its hash is stored)."""
    request = gpb.PutPrincipalRequest(name=name, roles=[parse_role(r) for r in role], issue_token=new_token_,
                                      expected_version=expected_version)
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.TenantServiceStub(api.channel).PutPrincipal, request)
    if output == "json":
        _json(resp)
        return
    console.print(f"principal {resp.name} {'created' if resp.created else 'updated'}; policy {resp.policy_version}")
    if resp.token:
        console.print(f"token (shown once; give it to {resp.name}): {resp.token}", highlight=False)


def token_new(output: Output = OUTPUT):
    """Print a fresh random token and its sha256 (put the hash in a policy file's principals)."""
    tok = new_token()
    if output == "json":
        console.print_json(json.dumps({"token": tok, "token_sha256": hash_token(tok)}))
    else:
        console.print(f"token:        {tok}\ntoken_sha256: {hash_token(tok)}", highlight=False)


# ------------------------------------------------------------------ policy


def _read(path: Path) -> str:
    """The policy file's text; exits 2 (after printing) when it cannot be read."""
    try:
        return read_text(path, "policy")
    except ValidationError as e:
        err.print(error_line("error:", e.reason))
        raise typer.Exit(2) from None


def _changes(resp: gpb.ApplyPolicyResponse, output: str, verb: str) -> None:
    """Print what ``policy apply`` / ``policy diff`` changed (``verb`` ends the summary line)."""
    if output == "json":
        _json(resp)
        return
    if not resp.changes:
        console.print(f"no change: policy {resp.previous_version} already in force")
        return
    for line in resp.changes:
        console.print(f"  {line}", highlight=False, markup=False)
    console.print(f"policy {resp.previous_version} -> {resp.version} {verb}")


def policy_apply(file: Path = typer.Argument(..., help="Policy YAML (format: deploy/policy/example.yaml)."),
                 expected_version: str = typer.Option("", "--expected-version",
                                                      help="Refuse if the policy in force is not this version."),
                 server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Validate FILE and make it the policy in force (every service follows it)."""
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.PolicyServiceStub(api.channel).ApplyPolicy,
                        gpb.ApplyPolicyRequest(yaml=_read(file), expected_version=expected_version))
    _changes(resp, output, "applied" if resp.applied else "")


def policy_diff(file: Path = typer.Argument(..., help="Policy YAML (format: deploy/policy/example.yaml)."), server: str = SERVER, output: Output = OUTPUT,
                token: str = TOKEN):
    """Show what applying FILE would change (nothing is applied)."""
    with Api(server, token) as api:
        resp = api.call(gpb_grpc.PolicyServiceStub(api.channel).DiffPolicy,
                        gpb.ApplyPolicyRequest(yaml=_read(file)))
    _changes(resp, output, "(would be; not applied)")


def policy_show(server: str = SERVER, output: PolicyOutput = typer.Option(PolicyOutput.yaml, "--output", "-o",
                                                                         help="yaml or json"),
                token: str = TOKEN):
    """Print the policy in force (canonical YAML with its version)."""
    with Api(server, token) as api:
        doc = api.call(gpb_grpc.PolicyServiceStub(api.channel).GetPolicy, gpb.GetPolicyRequest())
    if output == "json":
        _json(doc)
        return
    console.print(f"# policy {doc.version}, applied by {doc.applied_by or '?'} at {_ts(doc.applied_at)}",
                  highlight=False, markup=False)
    console.print(doc.yaml, highlight=False, markup=False)


# ------------------------------------------------------------------ registration


def register(app: typer.Typer) -> None:
    """Add the governance commands to ``app`` (in this order in ``fedsched --help``)."""
    app.command("approvals")(approvals)
    app.command("approve")(approve)
    app.command("reject")(reject)

    tenants_app = typer.Typer(help="List tenants; `tenants put` creates or updates one (admins).",
                              invoke_without_command=True, no_args_is_help=False)
    tenants_app.callback()(tenants)
    tenants_app.command("put")(tenants_put)
    app.add_typer(tenants_app, name="tenants")

    quota_app = typer.Typer(help="Show quotas with their usage; `quota set` / `quota delete` change them (admins).",
                            invoke_without_command=True, no_args_is_help=False)
    quota_app.callback()(quota)
    quota_app.command("set")(quota_set)
    quota_app.command("delete")(quota_delete)
    app.add_typer(quota_app, name="quota")

    principal_app = typer.Typer(help="Principals (callers) and their roles (admins).", no_args_is_help=True)
    principal_app.command("put")(principal_put)
    app.add_typer(principal_app, name="principal")

    token_app = typer.Typer(help="Tokens, locally (no server).", no_args_is_help=True)
    token_app.command("new")(token_new)
    app.add_typer(token_app, name="token")

    policy_app = typer.Typer(help="The versioned governance policy (admins).", no_args_is_help=True)
    policy_app.command("apply")(policy_apply)
    policy_app.command("diff")(policy_diff)
    policy_app.command("show")(policy_show)
    app.add_typer(policy_app, name="policy")
