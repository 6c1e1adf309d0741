"""The web console's handlers through aiohttp's test client, against a fake of our own API client
(:class:`fedapp.web.api.Api`) that authorises like admission does for three users: sign-in and the
cookie's attributes, CSRF on every POST, the API's refusals mapped to HTTP statuses, no external
URL in any page, and the pure helpers (payload summaries, running totals, the policy diff)."""

from __future__ import annotations

import re
from decimal import Decimal

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fedapp.web import ApiConfig, ApiError, Reads, WebConfig, create_app
from fedapp.web.app import CSRF_COOKIE, TOKEN_COOKIE
from fedapp.web.reads import cumulative, summarize_payload
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import UnavailableError
from fedsched.tenancy import yaml_diff

USERS = {"tok-admin": "admin", "tok-approver": "approver", "tok-submitter": "submitter"}
APPROVAL = "ap-0123456789abcdef0123"


class FakeApi:
    """Answers like admission for :data:`USERS`: unknown tokens are UNAUTHENTICATED, only the
    approver and the admin may list and decide approvals, only the admin reads policy versions."""

    def __init__(self) -> None:
        self.decisions: list[tuple[str, str, bool, str]] = []
        self.requests: list[pb.ListJobsRequest] = []
        self.more_decided: list[gpb.Approval] = []

    def _who(self, token: str) -> str:
        if token not in USERS:
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        return USERS[token]

    async def close(self) -> None:
        pass

    async def list_tenants(self, token):
        self._who(token)
        return gpb.ListTenantsResponse(tenants=[gpb.Tenant(name="ads", projects=["train"])])

    async def list_jobs(self, token, request):
        self._who(token)
        self.requests.append(request)
        if request.page_token and not request.page_token.isdigit():  # admission's words and trailer
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "page_token: not a token returned by ListJobs",
                           "page_token")
        job = pb.Job(job_id="j-1", spec=pb.JobSpec(tenant="ads", project="train", name="<b>bold</b>"),
                     state=pb.JOB_STATE_AWAITING_APPROVAL)
        return pb.ListJobsResponse(jobs=[job], total=1)

    async def get_job(self, token, job_id):
        self._who(token)
        if job_id == "j-full":
            return FULL_JOB
        if job_id != "j-1":
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"job {job_id} not found")
        return pb.Job(job_id="j-1", spec=pb.JobSpec(tenant="ads", project="train"), state=pb.JOB_STATE_QUEUED)

    async def explain(self, token, job_id):
        return pb.ExplainJobResponse(job_id=job_id)

    async def list_clusters(self, token):
        self._who(token)
        raise ApiError(grpc.StatusCode.UNIMPLEMENTED, "unimplemented")

    async def list_approvals(self, token, states=(), page_size=200, *, newest_first=False, page_token=""):
        """Pages like admission's: ``page_token`` is here the index of the page's first request."""
        if self._who(token) == "submitter":
            raise ApiError(grpc.StatusCode.PERMISSION_DENIED, "submitter is not an approver")
        approvals = [gpb.Approval(approval_id=APPROVAL, job_id="j-1", tenant="ads", project="train",
                                  state=gpb.APPROVAL_STATE_PENDING, cost="3.6", currency="CNY"),
                     gpb.Approval(approval_id="ap-ffffffffffffffffffff", job_id="j-0", tenant="ads", project="train",
                                  state=gpb.APPROVAL_STATE_EXPIRED, decided_by="scheduler"), *self.more_decided]
        matching = [a for a in approvals if not states or a.state in states]
        if newest_first:
            matching.sort(key=lambda a: (-a.decided_at.seconds, a.approval_id))
        if page_token and not page_token.isdigit():
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "page_token: was issued for other filters or another "
                           "order; repeat them, or start again without a page token", "page_token")
        start = int(page_token or 0)
        end = start + page_size
        return gpb.ListApprovalsResponse(approvals=matching[start:end], total=len(matching),
                                         next_page_token=str(end) if end < len(matching) else "")

    async def decide(self, token, approval_id, approve, comment=""):
        who = self._who(token)
        if who == "submitter":
            raise ApiError(grpc.StatusCode.PERMISSION_DENIED, "submitter is not an approver of ads")
        self.decisions.append((who, approval_id, approve, comment))
        decided = gpb.Approval(approval_id=approval_id, job_id="j-1", tenant="ads", project="train",
                               state=gpb.APPROVAL_STATE_APPROVED if approve else gpb.APPROVAL_STATE_REJECTED,
                               decided_by=who)
        decided.decided_at.FromSeconds(10_000)
        self.more_decided.append(decided)
        return decided

    async def policy_versions(self, token, limit=50):
        if self._who(token) != "admin":
            raise ApiError(grpc.StatusCode.PERMISSION_DENIED, "not an admin")
        old = gpb.PolicyDocument(version="aaaaaaaaaaaa", yaml="quotas: []\n", applied_by="bootstrap")
        new = gpb.PolicyDocument(version="bbbbbbbbbbbb", yaml="quotas:\n- tenant: ads\n", applied_by="root")
        return gpb.ListPolicyVersionsResponse(versions=[new, old])


FULL_JOB = pb.Job(job_id="j-full", state=pb.JOB_STATE_QUEUED, spec=pb.JobSpec(
    tenant="ads", project="train", name="full",
    workload=pb.Workload(image="registry.example/train:1.2", command=["python", "-m", "train"],
                         args=["--lr", "<0.1>"], env={"MODE": "<img src=x onerror=alert(1)>"},
                         secret_env={"HF_TOKEN": "hf-credentials/token"}, workdir="/work",
                         checkpoint_uri="s3://ckpt/ads/full"),
    annotations={"team": "<b>ranking</b>", "ticket": "OPS-1"},
    datasets=[pb.Dataset(name="ads-logs", home_region="cn-north-1", size_bytes=3 * 1024**4)],
    estimated_duration_seconds=5400))
FULL_JOB.spec.start_deadline.FromSeconds(1_767_225_600)  # 2026-01-01T00:00:00Z


def _down(sql, params):
    raise UnavailableError("store query service did not answer")


@pytest.fixture
async def client(request):
    api = FakeApi()
    reads = Reads(_down, "fedsched") if getattr(request, "param", "") == "store down" else None
    app = create_app(WebConfig(api=ApiConfig("127.0.0.1:1"), reads=reads), api=api)
    async with TestClient(TestServer(app)) as c:
        c.fake = api
        yield c


async def _csrf(client, path: str = "/login") -> str:
    page = await (await client.get(path)).text()
    return re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)


async def _sign_in(client, token: str) -> None:
    csrf = await _csrf(client)
    r = await client.post("/login", data={"csrf": csrf, "token": token, "next": "/jobs"}, allow_redirects=False)
    assert r.status == 303, await r.text()


async def test_pages_need_a_session_and_send_the_user_to_the_form(client):
    r = await client.get("/approvals?x=1", allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == "/login?next=%2Fapprovals%3Fx%3D1"
    r = await client.post("/approvals/ap-x/approve", data={}, allow_redirects=False)
    assert r.status == 403  # no CSRF cookie yet: refused before anything else


async def test_sign_in_checks_the_token_and_keeps_it_in_an_httponly_strict_cookie(client):
    form = await client.get("/login")
    nonce = form.cookies[CSRF_COOKIE]
    assert nonce["httponly"] and nonce["samesite"] == "Strict"
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', await form.text()).group(1)
    assert csrf != nonce.value  # the form carries HMAC(secret, nonce), not the cookie itself
    bad = await client.post("/login", data={"csrf": csrf, "token": "nope", "next": "/jobs"}, allow_redirects=False)
    assert bad.status == 401 and "did not accept this token" in await bad.text()
    assert TOKEN_COOKIE not in bad.cookies
    good = await client.post("/login", data={"csrf": csrf, "token": "tok-admin", "next": "//evil.example/x"},
                             allow_redirects=False)
    assert good.status == 303 and good.headers["Location"] == "/jobs"  # no open redirect
    cookie = good.cookies[TOKEN_COOKIE]
    assert cookie.value == "tok-admin" and cookie["httponly"] and cookie["samesite"] == "Strict"
    assert cookie["path"] == "/"


@pytest.mark.parametrize("target", [
    "/\t/example.com", "/\r\nSet-Cookie: x=1", "/\x0b/example.com", "/\n", "//example.com", "/\\example.com",
    "https://example.com/", "example.com", "/%09/example.com", "/%2F/example.com", "/%5Cexample.com",
    "/%250d%250aX: 1", "/jobs\\..\\x", "/\u2028/example.com",
], ids=["tab", "crlf", "vt", "lf", "protocol-relative", "slash-backslash", "absolute", "relative",
        "encoded-tab", "encoded-slash", "encoded-backslash", "double-encoded-crlf", "backslash", "line-separator"])
async def test_sign_in_redirects_only_to_a_same_site_path(client, target):
    csrf = await _csrf(client)
    r = await client.post("/login", data={"csrf": csrf, "token": "tok-admin", "next": target}, allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == "/jobs", (r.status, r.headers.get("Location"))


async def test_sign_in_keeps_a_same_site_path_with_its_query(client):
    csrf = await _csrf(client)
    target = "/jobs?state=queued&tenant=a%25b"
    r = await client.post("/login", data={"csrf": csrf, "token": "tok-admin", "next": target}, allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == target
    page = await (await client.get("/login?" + "next=%2F%0D%0AX%3A%201")).text()
    assert 'name="next" value="/jobs"' in page


async def test_the_job_page_shows_a_proposal_awaiting_approval_and_its_verdicts(client):
    from google.protobuf.timestamp_pb2 import Timestamp

    async def explain(token, job_id):
        d = pb.ShardDecision(outcome="awaiting_approval", summary="home region cn-north-1: full", cluster="east-c1",
                             region="cn-east-1", queue="training", approval_id=APPROVAL,
                             approval_expires_at=Timestamp(seconds=1_700_003_600))
        d.clusters.add(cluster="north-c1", region="cn-north-1", passed=False, reason="insufficient_free_resources")
        return pb.ExplainJobResponse(job_id=job_id, state=pb.JOB_STATE_AWAITING_APPROVAL, decisions=[d])

    client.fake.explain = explain
    await _sign_in(client, "tok-admin")
    page = await (await client.get("/jobs/j-1")).text()
    assert "awaiting_approval on cn-east-1 / east-c1" in page and f"<code>{APPROVAL}</code>" in page
    assert "2023-11-14 23:13:20" in page and "insufficient_free_resources" in page
    assert "has not decided" not in page
    words = " ".join(page.split())
    assert ("it needs a cross-region approval to run in cn-east-1 (east-c1): request " + APPROVAL + ", to be approved "
            "or rejected by an approver of tenant ads (role approver) or an admin by 2023-11-14 23:13:20 UTC.") in words
    assert "goes back to its home region" not in words


@pytest.mark.parametrize("path, first", [
    ("/jobs?state=queued&tenant=ads&page=bogus", "/jobs?state=queued&amp;tenant=ads"),
    ("/jobs?page=%3Cb%3Ex", "/jobs"),
    ("/approvals?decided_page=stale", "/approvals"),
], ids=["jobs-with-filters", "jobs-markup-token", "approvals"])
async def test_a_bad_page_token_is_a_400_page_that_says_why_and_links_the_first_page(client, path, first):
    await _sign_in(client, "tok-admin")
    r = await client.get(path)
    page = await r.text()
    assert r.status == 400 and r.content_type == "text/html"
    assert "The page token in this link is invalid or expired" in page
    assert "the API says: page_token: " in page  # the API's INVALID_ARGUMENT reason, as it gave it
    assert f'<a href="{first}">Start again from the first page</a>' in page
    assert "INVALID_ARGUMENT" in page and "<b>x" not in page


async def test_another_invalid_argument_is_not_taken_for_a_bad_page_token(client):
    async def refuse(token, request):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "tenant: unknown tenant 'zz'", "tenant")

    client.fake.list_jobs = refuse
    await _sign_in(client, "tok-admin")
    r = await client.get("/jobs?tenant=zz&page=1")
    page = await r.text()
    assert r.status == 400 and "unknown tenant" in page and "Start again from the first page" not in page


async def test_an_unknown_state_filter_is_the_consoles_400_page_with_the_text_escaped(client):
    await _sign_in(client, "tok-admin")
    r = await client.get("/jobs", params={"state": "<b>bogus</b>"})
    page = await r.text()
    assert r.status == 400 and r.content_type == "text/html"
    assert "Unknown state &#39;&lt;b&gt;bogus&lt;/b&gt;&#39;" in page and "<b>bogus" not in page
    assert 'href="/static/console.css"' in page and "queued" in page  # the console's page, listing the states
    assert not client.fake.requests  # nothing was asked of the API


async def test_every_post_needs_the_forms_csrf_token(client):
    await _sign_in(client, "tok-approver")
    r = await client.post(f"/approvals/{APPROVAL}/approve", data={"csrf": "0" * 64}, allow_redirects=False)
    assert r.status == 403 and "CSRF" in await r.text()
    r = await client.post("/logout", data={}, allow_redirects=False)
    assert r.status == 403
    assert client.fake.decisions == []


async def test_an_approver_decides_and_a_non_approver_gets_403_from_the_api(client):
    await _sign_in(client, "tok-approver")
    page = await (await client.get("/approvals")).text()
    assert f'action="/approvals/{APPROVAL}/approve"' in page and "button" in page
    assert 'action="/approvals/ap-ffffffffffffffffffff/approve"' not in page  # decided: no buttons
    assert '<tr data-approval-id="ap-ffffffffffffffffffff">' in page
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)
    r = await client.post(f"/approvals/{APPROVAL}/reject", data={"csrf": csrf, "comment": " stay home "},
                          allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == f"/approvals?decided={APPROVAL}&as=rejected"
    assert client.fake.decisions == [("approver", APPROVAL, False, "stay home")]
    await _sign_in(client, "tok-submitter")
    page = await (await client.get("/approvals")).text()
    assert "j-1" in page and "/approve" not in page and "<button type=\"submit\" class=\"approve\"" not in page
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)
    r = await client.post(f"/approvals/{APPROVAL}/approve", data={"csrf": csrf}, allow_redirects=False)
    assert r.status == 403 and "submitter is not an approver of ads" in await r.text()
    assert len(client.fake.decisions) == 1


async def test_the_approvals_banner_is_a_fixed_message_for_a_real_decision_never_text_from_the_url(client):
    """Issue 14 follow-up: the banner's text came from the URL (escaped, but a link could make
    the console say anything, e.g. ``?decided=Your account is suspended``)."""
    await _sign_in(client, "tok-approver")
    page = await (await client.get("/approvals")).text()
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)
    r = await client.post(f"/approvals/{APPROVAL}/approve", data={"csrf": csrf}, allow_redirects=False)
    page = await (await client.get(r.headers["Location"])).text()
    banner = re.findall(r'<p class="flash ok" role="status">([^<]*)</p>', page)
    assert banner == [f"Request {APPROVAL} approved: the job may now be placed in the proposed region."]
    for spoof in ("/approvals?msg=Your+account+is+suspended",
                  "/approvals?decided=Your+account+is+suspended&as=approved",
                  f"/approvals?decided={APPROVAL}&as=Your+account+is+suspended",
                  f"/approvals?decided={APPROVAL}&as=rejected",  # it was approved: no false claim
                  "/approvals?decided=ap-ffffffffffffffffffff&as=approved",  # expired, not approved
                  f"/approvals?decided={APPROVAL}"):
        page = await (await client.get(spoof)).text()
        assert 'class="flash ok"' not in page and "suspended" not in page, spoof


async def test_decided_requests_show_newest_first_fifty_a_page(client):
    """Issue 16 follow-up: the "decided" list used to show the first 1000 the API listed (the
    oldest); now the newest decision comes first, 50 a page, "Older decisions" leads on."""
    for i in range(119):  # with the fake's one expired request (decided at 0): 120, decided at 1..119 s
        decided = gpb.Approval(approval_id=f"ap-{i:020x}", job_id=f"j-{i}", tenant="ads", project="train",
                               state=gpb.APPROVAL_STATE_APPROVED, decided_by="ann")
        decided.decided_at.FromSeconds(1 + i)
        client.fake.more_decided.append(decided)
    await _sign_in(client, "tok-approver")
    seen, url, pages = [], "/approvals", 0
    while url:
        page = await (await client.get(url)).text()
        pages += 1
        decided_part = page.split("<h2>Decided</h2>", 1)[1]
        rows = re.findall(r'<tr data-approval-id="(ap-[0-9a-f]{20})">', decided_part)
        assert len(rows) == (50 if pages < 3 else 20)
        seen += rows
        assert "120 decided, newest first" in page
        more = re.search(r'<a href="(/approvals\?decided_page=[^"]+)" rel="next">Older decisions', page)
        url = more.group(1).replace("&amp;", "&") if more else ""
    assert pages == 3
    assert seen == [f"ap-{i:020x}" for i in reversed(range(119))] + ["ap-ffffffffffffffffffff"]


async def test_api_refusals_become_http_statuses_and_a_rejected_token_signs_out(client):
    await _sign_in(client, "tok-submitter")
    assert (await client.get("/jobs/j-missing")).status == 404
    assert (await client.get("/policy")).status == 403
    clusters = await client.get("/clusters")  # an older admission without ListClusters: a note, not an error
    assert clusters.status == 200 and "does not serve ClusterService.ListClusters" in await clusters.text()
    client.session.cookie_jar.update_cookies({TOKEN_COOKIE: "revoked"}, response_url=client.make_url("/"))
    r = await client.get("/jobs", allow_redirects=False)
    assert r.status == 401 and 'action="/login"' in await r.text()


async def test_filters_reach_list_jobs_and_text_is_escaped(client):
    await _sign_in(client, "tok-admin")
    bogus = await client.get("/jobs?state=queued&state=bogus")  # never a silently dropped filter
    assert bogus.status == 400 and "Unknown state &#39;bogus&#39;" in await bogus.text()
    r = await client.get("/jobs?state=queued&state=held&tenant=ads&project=train")
    page = await r.text()
    request = client.fake.requests[-1]
    assert list(request.states) == [pb.JOB_STATE_QUEUED, pb.JOB_STATE_HELD]
    assert (request.tenant, request.project, request.order) == ("ads", "train", pb.JOB_ORDER_NEWEST_FIRST)
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page
    fragment = await (await client.get("/jobs?fragment=1")).text()
    assert "<html" not in fragment and 'data-job-id="j-1"' in fragment


async def test_the_job_page_shows_workload_secret_references_datasets_annotations_and_deadline_escaped(client):
    """Issue 14 follow-up: the job page lacked the workload, annotations, datasets and deadline."""
    await _sign_in(client, "tok-submitter")
    page = await (await client.get("/jobs/j-full")).text()
    workload = page.split('id="workload"', 1)[1].split("</section>", 1)[0]
    assert "registry.example/train:1.2" in workload and "python -m train" in workload
    assert "--lr &lt;0.1&gt;" in workload and "/work" in workload and "s3://ckpt/ads/full" in workload
    assert '<tr data-env="MODE">' in workload and "&lt;img src=x onerror=alert(1)&gt;" in workload
    assert "<img" not in page
    assert '<tr data-secret-env="HF_TOKEN">' in workload and "from secret <code>hf-credentials/token</code>" in workload
    datasets = page.split('id="datasets"', 1)[1].split("</section>", 1)[0]
    assert '<tr data-dataset="ads-logs">' in datasets and "cn-north-1" in datasets and "3.0 TiB" in datasets
    annotations = page.split('id="annotations"', 1)[1].split("</section>", 1)[0]
    assert "&lt;b&gt;ranking&lt;/b&gt;" in annotations and "<b>ranking</b>" not in page and "OPS-1" in annotations
    assert '<dd id="start-deadline">2026-01-01 00:00:00 UTC</dd>' in page
    assert "90 min" in page  # the estimated duration
    plain = await (await client.get("/jobs/j-1")).text()  # a trace job: no workload, no deadline
    assert "No workload" in plain and '<dd id="start-deadline">none</dd>' in plain and "No dataset." in plain


async def test_pages_name_no_external_url_and_forbid_framing(client):
    await _sign_in(client, "tok-admin")
    for path in ("/jobs", "/queues", "/clusters", "/approvals", "/policy", "/reports", "/login"):
        r = await client.get(path)
        page = await r.text()
        assert r.status == 200, path
        urls = re.findall(r'(?:src|href|action)="([^"]*)"', page)
        assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), (path, urls)
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Frame-Options"] == "DENY"
    for asset in ("/static/console.css", "/static/console.js", "/static/favicon.svg"):
        body = await (await client.get(asset)).text()
        assert "http://" not in body.replace("http://www.w3.org/2000/svg", "") and "https://" not in body


async def test_the_policy_page_shows_the_unified_diff_of_the_newest_version():
    lines = yaml_diff("quotas: []\n", "quotas:\n- tenant: ads\n", old_label="a", new_label="b")
    assert lines == ["--- a", "+++ b", "@@ -1 +1,2 @@", "-quotas: []", "+quotas:", "+- tenant: ads"]


async def test_policy_page_renders_added_and_removed_lines(client):
    await _sign_in(client, "tok-admin")
    page = await (await client.get("/policy")).text()
    assert '<span class="del">-quotas: []</span>' in page and '<span class="add">+- tenant: ads</span>' in page


@pytest.mark.parametrize("client", ["store down"], indirect=True)
async def test_a_store_that_does_not_answer_leaves_the_pages_up_saying_so(client):
    await _sign_in(client, "tok-admin")
    job = await client.get("/jobs/j-1")
    assert job.status == 200 and "ClickHouse did not answer: store query service did not answer" in await job.text()
    charts = await client.get("/reports/charts")
    assert charts.status == 200 and "ClickHouse did not answer" in await charts.text()


async def test_without_a_store_the_sections_say_they_are_not_connected(client):
    await _sign_in(client, "tok-admin")
    page = await (await client.get("/jobs/j-1")).text()
    assert "audit log is not connected" in page and "Billing data is not connected" in page


def test_payload_summaries_and_running_totals():
    assert summarize_payload('{"spec": {"a": 1}, "cluster": "c1", "reason": "", "gpu_milli": 500}') == \
        "cluster=c1, gpu_milli=500"
    assert summarize_payload("not json") == "not json"
    assert len(summarize_payload('{"x": "' + "y" * 500 + '"}')) <= 160
    assert cumulative([Decimal("0.10"), Decimal("0"), Decimal("0.25")]) == pytest.approx([0.10, 0.10, 0.35])


async def test_the_decision_banner_shows_what_the_api_lists_never_what_the_url_says(client):
    """Issue 14 (left at stop 10): ``/approvals?decided=<id>&as=<text>`` printed both as given, so
    a crafted link showed any words in the console's green banner. A banner is now a fixed
    message, shown only for an approval the API lists in the state the link names."""
    await _sign_in(client, "tok-approver")
    spoof = await (await client.get("/approvals", params={"decided": "Budget raised to 1M CNY,",
                                                          "as": "approved by finance"})).text()
    assert 'class="flash ok"' not in spoof and "approved by finance" not in spoof
    real = await (await client.get("/approvals", params={"decided": "ap-ffffffffffffffffffff",
                                                         "as": "approved"})).text()
    # the API lists it as expired: the URL's "approved" is not believed, so no banner at all
    assert 'class="flash ok"' not in real and "ap-ffffffffffffffffffff approved" not in real
