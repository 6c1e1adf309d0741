"""The web console in a real browser: Debian's chromium driven by Playwright (async API) against
the whole embedded system (real NATS, real chDB, trace agents), the console served as
``fedsched up`` serves it (:func:`fedapp.web.serve.serve_system`).

* every page loads without console errors, failed requests, error statuses or requests to
  anywhere but the console;
* a job submitted through gRPC appears in the jobs page (its table refreshes itself);
* an approver approves a pending cross-region request in the page and the job then runs in the
  proposed region;
* a non-approver sees the job awaiting approval but no button, and the endpoint answers 403
  with the API's refusal.

Screenshots of every page go to ``$FEDSCHED_SCREENSHOTS`` (default: a temporary directory).
Skipped, saying why, when no chromium or no Playwright is installed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from datetime import UTC
from decimal import Decimal
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.clock import ClockState, ReplayClock
from fedsched.settings import Settings
from fedapp.runtime import System, SystemOptions
from tests.builders import DATA, TOKENS, Stubs, channel, policy_text, unique

CHROMIUM = os.environ.get("FEDSCHED_CHROMIUM", "/usr/bin/chromium")

try:
    from playwright.async_api import async_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    async_playwright = None

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(async_playwright is None, reason="Playwright's Python package is not installed (test extra)"),
    pytest.mark.skipif(not (Path(CHROMIUM).exists() or shutil.which("chromium")),
                       reason=f"no chromium at {CHROMIUM} (Debian package `chromium`; .ci/run installs it)"),
]

SPEED = 120.0  # business seconds per wall second
POLICY = policy_text("approvals: {timeout_s: 36000}\n")  # 300 s wall: no request expires during the tests
PAGES = ("/jobs", "/queues", "/clusters", "/approvals", "/policy", "/reports")


def _spec(tenant: str, project: str, runtime_s: float, **kw) -> pb.JobSpec:
    return pb.JobSpec(tenant=tenant, project=project, gpus_per_worker=1, cpu_milli=1000,
                      annotations={"trace.runtime_s": str(runtime_s)}, **kw)


async def _wait_job(stub, job_id: str, pred, timeout: float = 30.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if pred(job):
            return job
        assert time.monotonic() < deadline, f"{job_id} stuck: {pb.JobState.Name(job.state)} {job.reason}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def console(nats_server, chdb_path, tmp_path_factory):
    """The embedded system with a few finished jobs (billed) and its console on a free port."""
    from fedapp.web.serve import serve_system

    settings = Settings(data_dir=tmp_path_factory.mktemp("web"), nats_url=nats_server.url,
                        subject_prefix=unique("w"), clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2)
    clock = ReplayClock(ClockState(time.time(), time.time(), SPEED, 1))
    system = System(SystemOptions(settings=settings, clock=clock, nodes_csv=DATA / "openb_node_list_gpu_node.csv",
                                  policy_text=POLICY))
    await system.start()
    server = None
    try:
        deadline = time.monotonic() + 20
        while not (len(system.scheduler.clusters) == 6 and system.admission.known_models):
            assert time.monotonic() < deadline, "agents did not report"
            await asyncio.sleep(0.05)
        async with channel(system.grpc_target, "alice") as a, channel(system.grpc_target, "carol") as c:
            done = [(await Stubs(a).jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec("search", "train", 120)))).job_id,
                    (await Stubs(c).jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec("nlp", "batch", 240)))).job_id]
            for job_id, s in zip(done, (Stubs(a), Stubs(c))):
                await _wait_job(s.jobs, job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        await system.drain_writers(timeout_s=30)
        server = await serve_system(system, port=0, chart_refresh_s=1.0, jobs_refresh_s=0.5)
        yield system, server, done
    finally:
        if server is not None:
            await server.stop()
        await system.stop()


@pytest.fixture(scope="module")
async def chromium():
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
                                    headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        await b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("FEDSCHED_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Watched:
    """A signed-in page whose console errors, page errors, failed requests, error responses and
    requests leaving the console are collected."""

    def __init__(self, page, base: str) -> None:
        self.page, self.base = page, base
        self.problems: list[str] = []
        self.foreign: list[str] = []
        page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("requestfailed", self._failed)
        page.on("response", lambda r: self.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
        page.on("request", lambda r: None if r.url.startswith(base) else self.foreign.append(r.url))

    def _failed(self, request) -> None:
        # leaving a page aborts what it still loads (a refresh fetch, the icon): navigation, not a failure
        if not (request.resource_type != "document" and "ERR_ABORTED" in (request.failure or "")):
            self.problems.append(f"failed: {request.url} {request.failure}")


async def _signed_in(browser, base: str, who: str) -> Watched:
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    page = await context.new_page()
    watched = Watched(page, base)
    await page.goto(base + "/jobs")
    assert page.url.startswith(base + "/login")  # not signed in: sent to the form
    await page.fill("#token", TOKENS[who])
    await page.click("form[action='/login'] button[type=submit]")
    await page.wait_for_url(base + "/jobs")
    cookies = {c["name"]: c for c in await context.cookies()}
    token = cookies["fedsched_token"]
    assert token["httpOnly"] and token["sameSite"] == "Strict" and token["value"] == TOKENS[who]
    return watched


async def test_every_page_loads_without_console_errors_or_foreign_requests(console, chromium, shots):
    system, server, done = console
    w = await _signed_in(chromium, server.url, "root")
    for path in (*PAGES, f"/jobs/{done[0]}"):
        response = await w.page.goto(server.url + path)
        assert response.status == 200, path
        await w.page.wait_for_load_state("load")
        name = "job" if path.startswith("/jobs/") else path.strip("/")
        await w.page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert w.problems == [] and w.foreign == []
    # the job page shows every cluster's verdict, its events from the audit log and its cost from billing
    await w.page.goto(f"{server.url}/jobs/{done[0]}")
    verdicts = await w.page.locator("table.verdicts tbody tr").count()
    assert verdicts == len(system.scheduler.clusters)
    events = await w.page.locator("table.events tbody tr td:nth-child(2)").all_inner_texts()
    assert {"job.submitted", "job.placed", "job.started", "job.finished"} <= set(events)
    assert await w.page.locator("table.cost tbody tr").count() >= 1
    assert re.search(r"\d+\.\d\d CNY", await w.page.locator("#cost").inner_text())
    # the charts are drawn from the billed usage, and refresh themselves
    await w.page.goto(server.url + "/reports")
    chart = w.page.locator("figure[data-chart=gpu_hours_by_tenant]")
    assert int(await chart.get_attribute("data-points")) > 0
    shown = {await r.get_attribute("data-tenant"): (await r.locator("td").all_inner_texts())[2]
             for r in await w.page.locator("table.totals tbody tr").all()}
    billed = system.read_query(f"SELECT tenant, toString(sum(cost)) FROM {system.settings.clickhouse_database}.usage "
                               f"GROUP BY tenant").rows
    assert shown == {t: f"{Decimal(c).quantize(Decimal('0.01')):,}" for t, c in billed}  # to the cent, as billed
    assert set(shown) >= {"search", "nlp"}
    await w.page.locator("#report-charts[data-refreshed]").wait_for(state="attached", timeout=10_000)
    assert await w.page.locator("figure[data-chart=cost_by_tenant]").count() == 1
    # policy versions with a diff view: a change applied through the API shows as -/+ lines
    async with channel(system.grpc_target, "root") as ch:
        applied = await Stubs(ch).policy.ApplyPolicy(gpb.ApplyPolicyRequest(
            yaml=POLICY + "quotas: [{tenant: nlp, card: T4, region: cn-east-1, guaranteed_gpus: 8}]\n"))
    await w.page.goto(server.url + "/policy")
    assert await w.page.locator("table.versions tbody tr").count() >= 2
    assert await w.page.locator("table.versions tbody tr").first.get_attribute("data-version") == applied.version
    added = await w.page.locator("pre.diff .add").all_inner_texts()
    assert f"+++ {applied.version}" not in added and "+  guaranteed_gpus: 8.0" in added
    await w.page.screenshot(path=str(shots / "policy-diff.png"), full_page=True)
    # clusters with capacity per card model
    await w.page.goto(server.url + "/clusters")
    shown = {await r.get_attribute("data-cluster") for r in await w.page.locator("tr[data-cluster]").all()}
    assert shown == set(system.scheduler.clusters)
    assert w.problems == [] and w.foreign == []


async def test_a_job_submitted_through_grpc_appears_in_the_jobs_page(console, chromium):
    system, server, _ = console
    w = await _signed_in(chromium, server.url, "alice")
    await w.page.goto(server.url + "/jobs?tenant=search")
    async with channel(system.grpc_target, "alice") as ch:
        job_id = (await Stubs(ch).jobs.SubmitJob(pb.SubmitJobRequest(
            spec=_spec("search", "serve", 60, name="from-grpc")))).job_id
    row = w.page.locator(f"tr[data-job-id='{job_id}']")
    await row.wait_for(timeout=10_000)  # the table refreshes itself: no reload
    assert "from-grpc" in await row.inner_text()
    await row.locator("a").click()
    await w.page.wait_for_url(f"{server.url}/jobs/{job_id}")
    assert job_id in await w.page.locator("h1").inner_text()
    assert w.problems == []


async def _pending_approval(system, job_id: str, timeout: float = 30.0) -> gpb.Approval:
    async with channel(system.grpc_target, "bob") as ch:
        s = Stubs(ch)
        await _wait_job(s.jobs, job_id, lambda j: j.state == pb.JOB_STATE_AWAITING_APPROVAL, timeout)
        listed = await s.approvals.ListApprovals(gpb.ListApprovalsRequest(tenant="ads"))
    return next(a for a in listed.approvals if a.job_id == job_id and a.state == gpb.APPROVAL_STATE_PENDING)


async def _submit_needing_approval(system, name: str) -> str:
    # A10 cards exist only in cn-east-1 and cn-south-1; ads lives in cn-north-1 and needs approval to leave
    async with channel(system.grpc_target, "carol") as ch:
        return (await Stubs(ch).jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(
            "ads", "train", 1200, name=name, card_models=["A10"], estimated_duration_seconds=1200)))).job_id


async def test_an_approver_approves_in_the_page_and_the_job_runs(console, chromium, shots):
    system, server, _ = console
    job_id = await _submit_needing_approval(system, "needs-approval")
    request = await _pending_approval(system, job_id)
    w = await _signed_in(chromium, server.url, "bob")
    await w.page.goto(server.url + "/approvals")
    row = w.page.locator(f"tr[data-approval-id='{request.approval_id}']")
    await w.page.screenshot(path=str(shots / "approvals-approver.png"), full_page=True)
    await row.locator("input[name=comment]").fill("east is idle")
    await row.locator("button.approve").click()
    await w.page.wait_for_url(re.compile(r".*/approvals\?decided="))
    assert f"{request.approval_id} approved" in await w.page.locator(".flash.ok").inner_text()
    async with channel(system.grpc_target, "carol") as ch:
        job = await _wait_job(Stubs(ch).jobs, job_id,
                              lambda j: j.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED))
    assert job.attempts[-1].region == request.proposed_region and job.attempts[-1].cross_region
    decided = w.page.locator(f"table.decided tr[data-approval-id='{request.approval_id}']")
    assert "bob" in await decided.inner_text() and "east is idle" in await decided.inner_text()
    assert w.problems == []


async def test_a_non_approver_sees_no_button_and_the_endpoint_answers_403(console, chromium, shots):
    system, server, _ = console
    job_id = await _submit_needing_approval(system, "not-yours-to-approve")
    request = await _pending_approval(system, job_id)
    w = await _signed_in(chromium, server.url, "carol")  # submits for ads, approves nothing
    await w.page.goto(server.url + "/approvals")
    await w.page.locator(f"table.awaiting tr[data-job-id='{job_id}']").wait_for()
    await w.page.screenshot(path=str(shots / "approvals-submitter.png"), full_page=True)
    assert await w.page.locator("button.approve, button.reject, form.decide").count() == 0
    csrf = await w.page.locator("form.logout input[name=csrf]").get_attribute("value")
    answer = await w.page.request.post(f"{server.url}/approvals/{request.approval_id}/approve",
                                       form={"csrf": csrf, "comment": "let me"}, max_redirects=0)
    assert answer.status == 403
    assert "carol is not an approver of ads" in await answer.text()
    async with channel(system.grpc_target, "carol") as ch:
        job = await Stubs(ch).jobs.GetJob(pb.GetJobRequest(job_id=job_id))
    assert job.state == pb.JOB_STATE_AWAITING_APPROVAL  # nothing was decided
    # the queues page counts it as waiting in its home region
    await w.page.goto(server.url + "/queues")
    row = w.page.locator("tr[data-queue='cn-north-1/batch']")
    assert int(await row.get_attribute("data-queued")) >= 1
    await w.page.screenshot(path=str(shots / "queues-waiting.png"), full_page=True)
    assert w.problems == []


async def test_the_approvals_banner_never_shows_text_from_the_url(console, chromium):
    """Issue 14 follow-up: a link could make the approvals page announce any text
    (``?decided=Your account is suspended``); banners are now fixed messages chosen by a code,
    shown only for a decision the page lists."""
    _, server, _ = console
    w = await _signed_in(chromium, server.url, "bob")
    for query in ("msg=Your%20account%20is%20suspended",
                  "decided=Your%20account%20is%20suspended&as=approved",
                  "decided=ap-00000000000000000000&as=Your%20account%20is%20suspended",
                  "decided=ap-00000000000000000000&as=approved"):  # no such decision
        response = await w.page.goto(f"{server.url}/approvals?{query}")
        assert response.status == 200
        assert await w.page.locator(".flash.ok").count() == 0, query
        assert "suspended" not in await w.page.locator("main").inner_text(), query
    assert w.problems == []


async def test_the_job_page_shows_the_workload_datasets_annotations_and_deadline_as_text(console, chromium, shots):
    """Issue 14 follow-up: the job page shows what the job runs (secrets by reference only),
    its datasets, annotations and start deadline -- as text, never as markup."""
    system, server, _ = console
    deadline = Timestamp(seconds=int(system.options.clock.time()) + 7 * 86400)
    spec = _spec("search", "train", 60, name="with-workload",
                 datasets=[pb.Dataset(name="clicks-2026", home_region="cn-north-1", size_bytes=5 * 1024**3)],
                 start_deadline=deadline,
                 workload=pb.Workload(image="registry.example/train:2.0", command=["python", "-m", "train"],
                                      args=["--tag", "<b>bold</b>"],
                                      env={"MODE": "<img src=x id=injected onerror=alert(1)>"},
                                      secret_env={"HF_TOKEN": "hf-credentials/token"}))
    spec.annotations["owner"] = "<script>document.title='pwned'</script>"
    async with channel(system.grpc_target, "alice") as ch:
        job_id = (await Stubs(ch).jobs.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id
    w = await _signed_in(chromium, server.url, "alice")
    await w.page.goto(f"{server.url}/jobs/{job_id}")
    await w.page.screenshot(path=str(shots / "job-workload.png"), full_page=True)
    workload = await w.page.locator("#workload").inner_text()
    assert "registry.example/train:2.0" in workload and "python -m train" in workload
    assert "--tag <b>bold</b>" in workload
    assert "<img src=x id=injected onerror=alert(1)>" in await w.page.locator("tr[data-env=MODE]").inner_text()
    assert "hf-credentials/token" in await w.page.locator("tr[data-secret-env=HF_TOKEN]").inner_text()
    assert await w.page.locator("#injected, #workload b, #annotations script").count() == 0
    dataset = await w.page.locator("tr[data-dataset=clicks-2026]").inner_text()
    assert "cn-north-1" in dataset and "5.0 GiB" in dataset
    owner = await w.page.locator("tr[data-annotation=owner]").inner_text()
    assert "<script>document.title='pwned'</script>" in owner and await w.page.title() != "pwned"
    shown = await w.page.locator("#start-deadline").inner_text()
    assert shown == deadline.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M:%S") + " UTC"
    assert w.problems == [] and w.foreign == []
