"""The web console: an aiohttp application rendering Jinja2 templates (see :mod:`fedapp.web`).

Routes (every page but ``/login``, ``/healthz`` and ``/static`` needs the session cookie):

==========================================  ==================================================
``GET /login``, ``POST /login``             the sign-in form: a bearer token, checked with the
                                            API, kept in an HttpOnly SameSite=Strict cookie
``POST /logout``                            forget the token
``GET /jobs``                               ``ListJobs`` with filters (state, tenant, project),
                                            paged; ``?fragment=1`` = only the table (refresh)
``GET /jobs/{job_id}``                      ``GetJob`` (spec, deadline, workload with secrets
                                            by reference, datasets, annotations) + ``ExplainJob``
                                            (every cluster's verdict) + the job's audited events
                                            and billed cost
``GET /queues``, ``GET /clusters``          ``ClusterService.ListClusters``
``GET /approvals``                          pending and decided requests; approvers get buttons
``POST /approvals/{id}/{approve|reject}``   ``Approve`` / ``Reject`` with the user's token
``GET /policy``                             ``ListPolicyVersions`` and a unified diff of two
``GET /reports``, ``GET /reports/charts``   GPU-hours and cost per tenant over time (the charts
                                            refresh themselves every ``chart_refresh_s``)
==========================================  ==================================================

Errors: a failed API call becomes the page's HTTP status (:data:`fedapp.web.api.HTTP_STATUS`:
PERMISSION_DENIED -> 403, NOT_FOUND -> 404, ...) with the server's message; UNAUTHENTICATED
signs the user out. A state-changing POST without a valid CSRF token is 403 before any call.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from hashlib import sha256
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode

import grpc
import jinja2
from aiohttp import web
from markupsafe import Markup

from fedapp.explain import approval_wait
from fedapp.reports.html import line_chart
from fedapp.web.api import Api, ApiConfig, ApiError
from fedapp.web.reads import Reads, cumulative
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import FedError
from fedsched.tenancy import yaml_diff

#: Cookie holding the bearer token (HttpOnly, SameSite=Strict, Path=/).
TOKEN_COOKIE = "fedsched_token"
#: Cookie holding the CSRF nonce; forms carry HMAC(secret, nonce) (signed double submit).
CSRF_COOKIE = "fedsched_csrf"
#: Jobs per page of the jobs list.
PAGE_SIZE = 50
#: Job states a filter can name, in the API's order (same spelling as the CLI: lower case).
STATES = tuple(pb.JobState.Name(v).removeprefix("JOB_STATE_").lower()
               for v in pb.JobState.values() if v != pb.JOB_STATE_UNSPECIFIED)

#: Approvals asked for per state group (the API's page maximum).
MAX_APPROVALS = 1000
DECIDED = (gpb.APPROVAL_STATE_APPROVED, gpb.APPROVAL_STATE_REJECTED, gpb.APPROVAL_STATE_EXPIRED)
#: Decided requests per page of the approvals page (newest decision first, then "Older decisions").
DECIDED_PAGE = 50

_PUBLIC = ("/login", "/healthz", "/static/", "/favicon.ico")


@dataclass
class WebConfig:
    """What the console serves.

    Attributes:
        api: where admission serves gRPC.
        reads: the ClickHouse reads (events, cost, usage charts); None = not configured (those
            sections say so).
        chart_refresh_s: how often the report charts reload themselves (seconds).
        jobs_refresh_s: how often the jobs table reloads itself (seconds; 0 = never).
        secure_cookies: mark cookies Secure (when the console is reached over HTTPS).
        secret: key of the CSRF HMAC (default: random per process, so a restart invalidates
            open forms, not sessions).
    """

    api: ApiConfig
    reads: Reads | None = None
    chart_refresh_s: float = 30.0
    jobs_refresh_s: float = 10.0
    secure_cookies: bool = False
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))


# --------------------------------------------------------------------------- formatting (template filters)


def _ts(value: Any) -> str:
    """A protobuf Timestamp or datetime as ``YYYY-MM-DD HH:MM:SS`` UTC ("" when unset)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=UTC)
    else:
        if not value.seconds and not value.nanos:
            return ""
        dt = value.ToDatetime(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _enum(value: int, enum, prefix: str) -> str:
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def _money(value: Any) -> str:
    """Money to the cent (Decimal; strings as the API sends them); "" for empty."""
    if value in (None, ""):
        return ""
    try:
        return f"{Decimal(str(value)).quantize(Decimal('0.01')):,}"
    except ArithmeticError:
        return str(value)


def _age(seconds: float) -> str:
    """A duration in seconds for people (``-`` when negative = unknown)."""
    if seconds < 0:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _size(n: int) -> str:
    """A byte count for people in binary units (``512 B``, ``1.5 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop returns


def _gpus(spec: pb.JobSpec) -> str:
    workers = spec.workers if spec.HasField("workers") else 1
    gpus = spec.gpus_per_worker if spec.HasField("gpus_per_worker") else 1
    milli = spec.gpu_milli if spec.HasField("gpu_milli") else 1000
    share = f" x {milli / 1000:g}" if milli < 1000 else ""
    return f"{workers} x {gpus}{share}"


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("fedapp.web", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(
        ts=_ts, money=_money, age=_age, gpus=_gpus, size=_size,
        state=lambda v: _enum(v, pb.JobState, "JOB_STATE_"),
        kind=lambda v: _enum(v, pb.JobKind, "JOB_KIND_"),
        priority=lambda v: _enum(v, pb.PriorityClass, "PRIORITY_CLASS_"),
        locality=lambda v: _enum(v, pb.Locality, "LOCALITY_"),
        approval_state=lambda v: _enum(v, gpb.ApprovalState, "APPROVAL_STATE_"))
    return env


# --------------------------------------------------------------------------- the application


CONFIG_KEY = web.AppKey("config", WebConfig)
API_KEY = web.AppKey("api", Api)
ENV_KEY = web.AppKey("templates", jinja2.Environment)
TOKEN_KEY = web.RequestKey("token", str)  #: the signed-in user's bearer token ("" = none)
CSRF_KEY = web.RequestKey("csrf", str)  #: the CSRF token this request's forms carry
FRESH_KEY = web.RequestKey("csrf_fresh", bool)  #: the CSRF nonce was made for this response


def create_app(config: WebConfig, api: Api | None = None) -> web.Application:
    """The console's aiohttp application.

    Args:
        config: what to serve.
        api: the API client to use (tests pass a fake of :class:`~fedapp.web.api.Api`); default:
            one opened on ``config.api`` when the app starts and closed with it.
    """
    app = web.Application(middlewares=[_security_headers, _session, _errors])
    app[CONFIG_KEY] = config
    app[ENV_KEY] = _templates()

    async def open_api(app: web.Application):
        if api is not None:
            app[API_KEY] = api
            yield
            return
        app[API_KEY] = Api(config.api)
        yield
        await app[API_KEY].close()

    app.cleanup_ctx.append(open_api)
    app.add_routes([
        web.get("/", _home), web.get("/healthz", _health), web.get("/favicon.ico", _favicon),
        web.get("/login", login_page), web.post("/login", login), web.post("/logout", logout),
        web.get("/jobs", jobs_page), web.get("/jobs/{job_id}", job_page),
        web.get("/queues", queues_page), web.get("/clusters", clusters_page),
        web.get("/approvals", approvals_page), web.post(r"/approvals/{approval_id}/{decision:approve|reject}", decide),
        web.get("/policy", policy_page),
        web.get("/reports", reports_page), web.get("/reports/charts", report_charts),
        web.static("/static", _static_dir()),
    ])
    return app


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


async def _home(request: web.Request) -> web.Response:
    return _redirect("/jobs")


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _favicon(request: web.Request) -> web.FileResponse:
    return web.FileResponse(_static_dir() / "favicon.svg", headers={"Content-Type": "image/svg+xml"})


def _static_dir() -> Path:
    return Path(str(resources.files("fedapp.web").joinpath("static")))


def render(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    """Render ``template`` with ``context`` plus what every page needs (CSRF token, signed-in
    state, the current section)."""
    env = request.app[ENV_KEY]
    body = env.get_template(template).render(
        csrf=request.get(CSRF_KEY, ""), signed_in=bool(request.get(TOKEN_KEY)), path=request.path, **context)
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


def _csrf_for(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, f"csrf:{nonce}".encode(), sha256).hexdigest()


@web.middleware
async def _security_headers(request: web.Request, handler) -> web.StreamResponse:
    """No framing, no sniffing, no third-party anything (assets ship in the package)."""
    response = await handler(request)
    response.headers.setdefault("Content-Security-Policy",
                                "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                                "frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault("X-Frame-Options", "DENY")
    if not request.path.startswith("/static/"):
        response.headers.setdefault("Cache-Control", "no-store")
    return response


@web.middleware
async def _session(request: web.Request, handler) -> web.StreamResponse:
    """Token from the cookie (pages but the public ones need it), CSRF nonce and token for the
    forms, and the CSRF check of every POST."""
    config = request.app[CONFIG_KEY]
    nonce = request.cookies.get(CSRF_COOKIE, "")
    fresh = not (16 <= len(nonce) <= 64 and nonce.isalnum())
    if fresh:
        nonce = secrets.token_hex(16)
    request[CSRF_KEY] = _csrf_for(config.secret, nonce)
    request[FRESH_KEY] = fresh
    request[TOKEN_KEY] = request.cookies.get(TOKEN_COOKIE, "")
    response = await _guarded(request, handler)
    if fresh:
        response.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="Strict", path="/",
                            secure=config.secure_cookies)
    return response


async def _guarded(request: web.Request, handler) -> web.StreamResponse:
    """The CSRF check of a POST, then the sign-in check, then the handler."""
    if request.method == "POST":
        form = await request.post()
        if not hmac.compare_digest(str(form.get("csrf", "")), request[CSRF_KEY]) or request[FRESH_KEY]:
            return render(request, "error.html", status=403, title="Forbidden",
                          message="The form's CSRF token is missing or stale: reload the page and try again.")
    public = any(request.path == p or (p.endswith("/") and request.path.startswith(p)) for p in _PUBLIC)
    if not public and not request[TOKEN_KEY]:
        if request.method == "GET":
            return _redirect("/login?" + urlencode({"next": request.path_qs}))
        return render(request, "error.html", status=401, title="Sign in first",
                      message="This action needs a signed-in user.")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """A failed API call as a page with the mapped status; UNAUTHENTICATED signs out."""
    try:
        return await handler(request)
    except ApiError as e:
        if e.code == grpc.StatusCode.UNAUTHENTICATED:
            response = render(request, "login.html", status=401, next=request.path_qs,
                              error=f"The API did not accept the token: {e.message}")
            response.del_cookie(TOKEN_COOKIE, path="/")
            return response
        return render(request, "error.html", status=e.http_status, title=_TITLES.get(e.http_status, "Error"),
                      message=e.message, code=e.code.name)


_TITLES = {400: "Invalid request", 403: "Not allowed", 404: "Not found", 409: "Conflict", 501: "Not implemented",
           503: "Unavailable", 504: "Timed out"}


def _bad_page_token(e: ApiError, page_token: str) -> bool:
    """The API refused the page token the link carried (INVALID_ARGUMENT naming ``page_token``)."""
    return (bool(page_token) and e.code == grpc.StatusCode.INVALID_ARGUMENT
            and (e.field == "page_token" or e.message.startswith("page_token:")))


def _first_page_again(request: web.Request, e: ApiError, first_url: str) -> web.Response:
    """The 400 page for a page token the API refused: what was wrong (invalid, or issued for
    other filters or by an earlier server: expired), the API's own words, and a link to the
    first page (``first_url``: this list with the same filters, no token)."""
    return render(request, "error.html", status=400, title=_TITLES[400],
                  message=f"The page token in this link is invalid or expired (the API says: {e.message}). "
                          "Start again from the first page.", code=e.code.name, first_url=first_url)


def _api(request: web.Request) -> tuple[Api, str]:
    return request.app[API_KEY], request[TOKEN_KEY]


# --------------------------------------------------------------------------- sign in / out


def _safe_next(target: str) -> str:
    """``target`` when it is a path on this site, else ``/jobs`` (the home page).

    A same-site path starts with exactly one ``/`` (not ``//`` or ``/\\``, which browsers read as
    another host) and holds no backslash and no non-printable character (a tab, CR, LF or VT is
    stripped or refused by browsers and HTTP libraries: ``/<TAB>/evil`` becomes ``//evil``); the
    same holds after percent-decoding (up to 3 rounds; a value still encoded after that is refused).
    Source of the rule: OWASP "Unvalidated Redirects and Forwards" cheat sheet.
    """
    forms = [target]
    for _ in range(3):
        decoded = unquote(forms[-1])
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    else:
        return "/jobs"
    for form in forms:
        if (not form.startswith("/") or form.startswith(("//", "/\\")) or "\\" in form
                or not form.isprintable()):
            return "/jobs"
    return target


async def login_page(request: web.Request) -> web.Response:
    """The sign-in form."""
    return render(request, "login.html", next=_safe_next(request.query.get("next", "/jobs")), error="")


async def login(request: web.Request) -> web.Response:
    """Check the token with the API (``ListTenants``: UNAUTHENTICATED = not a token of this
    federation; a token without tenant rights is still a valid one), then keep it in the cookie."""
    form = await request.post()
    token = str(form.get("token", "")).strip()
    target = _safe_next(str(form.get("next", "/jobs")))
    if not token:
        return render(request, "login.html", status=400, next=target, error="Paste your bearer token.")
    api = request.app[API_KEY]
    try:
        await api.list_tenants(token)
    except ApiError as e:
        if e.code == grpc.StatusCode.UNAUTHENTICATED:
            return render(request, "login.html", status=401, next=target,
                          error=f"The API did not accept this token: {e.message}")
        if e.code != grpc.StatusCode.PERMISSION_DENIED:
            raise
    response = _redirect(target)
    response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict", path="/",
                        secure=request.app[CONFIG_KEY].secure_cookies)
    return response


async def logout(request: web.Request) -> web.Response:
    """Forget the token."""
    response = _redirect("/login")
    response.del_cookie(TOKEN_COOKIE, path="/")
    return response


# --------------------------------------------------------------------------- jobs


async def jobs_page(request: web.Request) -> web.Response:
    """Jobs with filters (``state`` repeatable, ``tenant``, ``project``), newest first, paged
    (``page`` = the API's page token)."""
    api, token = _api(request)
    q = request.query
    unknown = [s for s in q.getall("state", []) if s not in STATES]
    if unknown:  # never drop a filter silently (the list would show every job): the console's error page
        return render(request, "error.html", status=400, title=_TITLES[400],
                      message=f"Unknown state {unknown[0]!r} in the filter; states: {', '.join(STATES)}.")
    states = q.getall("state", [])
    tenant, project = q.get("tenant", "").strip(), q.get("project", "").strip()
    req = pb.ListJobsRequest(tenant=tenant, project=project, page_size=PAGE_SIZE, page_token=q.get("page", ""),
                             states=[pb.JobState.Value("JOB_STATE_" + s.upper()) for s in states],
                             order=pb.JOB_ORDER_NEWEST_FIRST)
    filters = {"state": states, "tenant": tenant, "project": project}
    base = [("state", s) for s in states] + [(k, v) for k, v in (("tenant", tenant), ("project", project)) if v]
    try:
        listed = await api.list_jobs(token, req)
    except ApiError as e:
        if _bad_page_token(e, req.page_token):
            return _first_page_again(request, e, "/jobs" + ("?" + urlencode(base) if base else ""))
        raise
    context = dict(jobs=listed.jobs, total=listed.total, filters=filters, states=STATES,
                   next_url=("/jobs?" + urlencode(base + [("page", listed.next_page_token)])
                             if listed.next_page_token else ""),
                   refresh_url="/jobs?" + urlencode(base + [("page", q.get("page", "")), ("fragment", "1")]),
                   refresh_s=request.app[CONFIG_KEY].jobs_refresh_s)
    if q.get("fragment"):
        return render(request, "jobs_table.html", **context)
    try:
        tenants = (await api.list_tenants(token)).tenants
    except ApiError as e:
        if e.code != grpc.StatusCode.PERMISSION_DENIED:
            raise
        tenants = []
    projects = sorted({p for t in tenants for p in t.projects})
    return render(request, "jobs.html", tenants=tenants, projects=projects, **context)


async def job_page(request: web.Request) -> web.Response:
    """One job: spec, attempts, the scheduler's explanation, audited events and cost. The API
    authorises the read (``GetJob``) before anything is read from ClickHouse."""
    api, token = _api(request)
    job_id = request.match_info["job_id"]
    job = await api.get_job(token, job_id)
    explain = await api.explain(token, job_id)
    reads = request.app[CONFIG_KEY].reads
    events, event_total, cost, total_cost, currency, unreadable = [], 0, [], Decimal(0), "", ""
    if reads is not None:
        try:
            events, event_total = await reads.job_events(job.job_id)
            cost = await reads.job_cost(job.job_id)
        except (FedError, OSError) as e:  # the page still shows what the API said
            unreadable = f"ClickHouse did not answer: {e}"
        total_cost = sum((c.cost for c in cost), Decimal(0))
        currency = next((c.currency for c in cost if c.currency), "")
    return render(request, "job.html", job=job, explain=explain, reads=reads is not None, events=events,
                  event_total=event_total, cost=cost, total_cost=total_cost, currency=currency,
                  unreadable=unreadable, awaiting=approval_texts(job, explain))


def approval_texts(job: pb.Job, explain: pb.ExplainJobResponse) -> dict[int, str]:
    """Shard -> what its proposal awaiting approval needs and what happens without it
    (:func:`fedapp.explain.approval_wait`), for the job page's ``awaiting``."""
    return {d.shard: approval_wait(d, tenant=job.spec.tenant, home_region=job.spec.home_region,
                                   deadline=f"{_ts(d.approval_expires_at)} UTC" if d.approval_expires_at.seconds else "")
            for d in explain.decisions if d.outcome == "awaiting_approval"}


# --------------------------------------------------------------------------- capacity


async def _clusters(request: web.Request) -> tuple[pb.ListClustersResponse | None, str]:
    """ListClusters, or None and why when this admission does not implement it yet."""
    api, token = _api(request)
    try:
        return await api.list_clusters(token), ""
    except ApiError as e:
        if e.code == grpc.StatusCode.UNIMPLEMENTED:
            return None, "This admission does not serve ClusterService.ListClusters yet (update the server)."
        raise


async def queues_page(request: web.Request) -> web.Response:
    """Queued work per home region and job kind (QUEUED + AWAITING_APPROVAL + HELD), oldest wait."""
    listed, missing = await _clusters(request)
    queues = sorted(listed.queues, key=lambda q: (q.region, q.kind)) if listed else []
    return render(request, "queues.html", queues=queues, missing=missing,
                  total=sum(q.queued for q in queues))


async def clusters_page(request: web.Request) -> web.Response:
    """Every cluster's card models with GPUs total / allocated / free, health and heartbeat age."""
    listed, missing = await _clusters(request)
    clusters = sorted(listed.clusters, key=lambda c: (c.region, c.cluster)) if listed else []
    regions: dict[str, list[int]] = {}
    for c in clusters:
        t = regions.setdefault(c.region, [0, 0, 0])
        for card in c.cards:
            t[0] += card.gpus_total
            t[1] += card.gpus_allocated
            t[2] += card.gpus_free
    return render(request, "clusters.html", clusters=clusters, regions=regions, missing=missing)


# --------------------------------------------------------------------------- approvals


async def approvals_page(request: web.Request) -> web.Response:
    """Approvers: pending requests with Approve/Reject, and the decided ones newest first,
    :data:`DECIDED_PAGE` a page (``?decided_page=`` = the API's page token). Others (the API
    refuses them ListApprovals): their jobs awaiting approval, without buttons."""
    api, token = _api(request)
    q = request.query
    pending, decided, awaiting, approver, decided_total, next_url = [], [], [], True, 0, ""
    try:
        pending = list((await api.list_approvals(token, [gpb.APPROVAL_STATE_PENDING], MAX_APPROVALS)).approvals)
        listed = await api.list_approvals(token, DECIDED, DECIDED_PAGE, newest_first=True,
                                          page_token=q.get("decided_page", ""))
        decided, decided_total = list(listed.approvals), listed.total
        if listed.next_page_token:
            next_url = "/approvals?" + urlencode({"decided_page": listed.next_page_token})
    except ApiError as e:
        if _bad_page_token(e, q.get("decided_page", "")):
            return _first_page_again(request, e, "/approvals")
        if e.code != grpc.StatusCode.PERMISSION_DENIED:
            raise
        approver = False
        try:
            awaiting = (await api.list_jobs(token, pb.ListJobsRequest(
                states=[pb.JOB_STATE_AWAITING_APPROVAL], page_size=PAGE_SIZE))).jobs
        except ApiError as e2:
            if e2.code != grpc.StatusCode.PERMISSION_DENIED:
                raise
    flash = _flash(q.get("as", ""), q.get("decided", ""), decided)
    return render(request, "approvals.html", pending=pending, decided=decided, awaiting=awaiting,
                  approver=approver, flash=flash, decided_total=decided_total, next_url=next_url,
                  first_page=not q.get("decided_page"))


#: The approvals page's banners after a decision, chosen by the redirect's ``as`` code (the
#: decided state); the text is ours, never the URL's. Any other code: no banner.
FLASHES = {
    "approved": "Request {approval_id} approved: the job may now be placed in the proposed region.",
    "rejected": "Request {approval_id} rejected: the job stays in its home region.",
}


def _flash(code: str, approval_id: str, decided: list[gpb.Approval]) -> str:
    """The banner for ``?decided=<approval id>&as=<code>`` (where :func:`decide` redirects): the
    fixed message of ``code`` in :data:`FLASHES`, shown only when ``approval_id`` is a request on
    this page decided so (a link cannot make the page claim a decision that was not made);
    "" otherwise (an unknown code, an id not among the decided requests shown, no decision)."""
    template = FLASHES.get(code)
    if template is None or not approval_id:
        return ""
    state = gpb.ApprovalState.Value("APPROVAL_STATE_" + code.upper())
    if not any(a.approval_id == approval_id and a.state == state for a in decided):
        return ""
    return template.format(approval_id=approval_id)


async def decide(request: web.Request) -> web.Response:
    """Approve or reject with the user's token; the API decides who may (a non-approver's
    PERMISSION_DENIED is this endpoint's 403)."""
    api, token = _api(request)
    form = await request.post()
    approval_id = request.match_info["approval_id"]
    approve = request.match_info["decision"] == "approve"
    decided = await api.decide(token, approval_id, approve, str(form.get("comment", "")).strip())
    state = _enum(decided.state, gpb.ApprovalState, "APPROVAL_STATE_")
    return _redirect("/approvals?" + urlencode({"decided": decided.approval_id, "as": state}))


# --------------------------------------------------------------------------- policy


async def policy_page(request: web.Request) -> web.Response:
    """Policy versions (admins) and the unified diff of the canonical YAML from ``from`` to ``to``
    (default: the newest version against the one before it)."""
    api, token = _api(request)
    versions = list((await api.policy_versions(token, limit=50)).versions)
    by_version = {v.version: v for v in versions}
    q = request.query
    new = by_version.get(q.get("to", ""), versions[0] if versions else None)
    old = by_version.get(q.get("from", ""))
    if old is None and new is not None:
        i = versions.index(new)
        old = versions[i + 1] if i + 1 < len(versions) else None
    lines = (yaml_diff(old.yaml, new.yaml, old_label=old.version, new_label=new.version)
             if old is not None and new is not None else [])
    return render(request, "policy.html", versions=versions, old=old, new=new, diff=lines)


# --------------------------------------------------------------------------- reports


async def _charts_context(request: web.Request) -> dict[str, Any]:
    api, token = _api(request)
    reads = request.app[CONFIG_KEY].reads
    if reads is None:
        return dict(reads=False, charts=Markup(""), totals=[], currency="", bucket_s=0, tenants=[], unreadable="")
    try:
        tenants = [t.name for t in (await api.list_tenants(token)).tenants]
    except ApiError as e:
        if e.code != grpc.StatusCode.PERMISSION_DENIED:
            raise
        tenants = []
    try:
        usage = await reads.usage_by_tenant(tenants)
    except (FedError, OSError) as e:
        return dict(reads=True, charts=Markup(""), totals=[], currency="", bucket_s=0, tenants=tenants,
                    unreadable=f"ClickHouse did not answer: {e}")
    unit = usage.currency
    charts = Markup(
        line_chart("gpu_hours_by_tenant", "GPU-hours per tenant, cumulative", usage.times,
                   {t: cumulative(v) for t, v in usage.gpu_hours.items()})
        + line_chart("cost_by_tenant", f"Cost per tenant, cumulative ({unit or 'currency'})", usage.times,
                     {t: cumulative(v) for t, v in usage.cost.items()}))
    totals = sorted(usage.totals.items(), key=lambda kv: (-kv[1][1], kv[0]))
    return dict(reads=True, charts=charts, totals=totals, currency=unit, bucket_s=usage.bucket_s, tenants=tenants,
                unreadable="")


async def reports_page(request: web.Request) -> web.Response:
    """The usage charts, refreshed in place every ``chart_refresh_s`` by the page's script."""
    return render(request, "reports.html", refresh_s=request.app[CONFIG_KEY].chart_refresh_s,
                  rendered_at=datetime.now(UTC), **await _charts_context(request))


async def report_charts(request: web.Request) -> web.Response:
    """Only the charts (what the page's script swaps in)."""
    return render(request, "report_charts.html", rendered_at=datetime.now(UTC), **await _charts_context(request))


# --------------------------------------------------------------------------- serving


@dataclass
class WebServer:
    """A running console: its runner and the port it listens on."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop serving (closes the gRPC channel)."""
        await self.runner.cleanup()


async def start_web(config: WebConfig, host: str = "127.0.0.1", port: int = 8080) -> WebServer:
    """Serve the console on ``host:port`` (0 = a free port) in the running event loop.

    Raises:
        OSError: the port is taken or the address is not local.
    """
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    return WebServer(runner, host, int(bound))

