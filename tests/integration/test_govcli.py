"""`fedsched tenants put` against a real admission (real gRPC, real NATS): it changes only what
its options name, removing needs an explicit option, it prints the diff as `policy diff` does,
and a concurrent change of the policy is never overwritten (read-modify-write at the version
read; issue 13 item 9)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import typer

from fedsched.api.v1 import governance_pb2 as gpb
from fedapp.cli.admin import TenantEdit, put_tenant
from fedapp.cli.jobs import Api
from fedsched.policystore import read_policy
from tests.builders import TOKENS, running_admission


@pytest.fixture
async def admission(bus):
    async with running_admission(bus, models=()) as svc:
        yield svc


async def _cli(admission, *args: str) -> subprocess.CompletedProcess:
    """The CLI as root, in a child process (the server runs on this event loop: never block it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSCHED_TOKEN", "FEDSCHED_DATA_DIR")}
    cmd = [sys.executable, "-m", "fedapp.cli", *args, "--server", f"127.0.0.1:{admission.port}",
           "--token", TOKENS["root"]]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60, env=env)


async def _tenant(admission, name: str):
    return (await read_policy(admission.bus)).gov.tenant(name)


async def test_a_budget_alone_needs_no_project_and_keeps_everything_else(admission):
    before = await _tenant(admission, "ads")
    out = await _cli(admission, "tenants", "put", "ads", "--budget", "2500")
    assert out.returncode == 0, out.stderr
    after = await _tenant(admission, "ads")
    assert str(after.budget.monthly) == "2500" and after.budget.currency == "CNY"
    assert after.model_copy(update={"budget": None}) == before  # projects, job classes, mode: unchanged
    lines = out.stdout.splitlines()
    assert lines[0] == '  tenant ads: budget None -> {"currency":"CNY","monthly":"2500"}'
    assert len(lines) == 2 and lines[1].startswith("tenant ads updated; policy ")


async def test_project_adds_remove_project_removes_and_the_diff_is_printed(admission):
    added = await _cli(admission, "tenants", "put", "search", "--project", "eval")
    assert added.returncode == 0, added.stderr
    assert (await _tenant(admission, "search")).projects == ("batch", "eval", "serve", "train")
    assert '  tenant search: projects ["batch","serve","train"] -> ["batch","eval","serve","train"]' in added.stdout
    removed = await _cli(admission, "tenants", "put", "search", "--remove-project", "batch")
    assert removed.returncode == 0, removed.stderr
    assert (await _tenant(admission, "search")).projects == ("eval", "serve", "train")
    same = await _cli(admission, "tenants", "put", "search", "--project", "eval")
    assert same.returncode == 0 and "no change" in same.stdout
    typo = await _cli(admission, "tenants", "put", "search", "--remove-project", "evl")
    assert typo.returncode == 2 and "tenant search has no project 'evl'" in typo.stderr
    assert (await _tenant(admission, "search")).projects == ("eval", "serve", "train")


async def test_a_new_tenant_is_created_with_what_is_given(admission):
    out = await _cli(admission, "tenants", "put", "games", "--home-region", "cn-south-1", "--project", "train",
                     "--cross-region", "approval", "--job-class", "fin:forbidden:tags=finance")
    assert out.returncode == 0, out.stderr
    assert "  tenant games: added" in out.stdout and "tenant games created" in out.stdout
    games = await _tenant(admission, "games")
    assert (games.home_region, games.projects, games.cross_region) == ("cn-south-1", ("train",), "approval")
    dropped = await _cli(admission, "tenants", "put", "games", "--remove-job-class", "fin", "--no-budget")
    assert dropped.returncode == 0, dropped.stderr
    assert (await _tenant(admission, "games")).job_classes == ()


class _ConcurrentAdmin(grpc.UnaryUnaryClientInterceptor):
    """Before the CLI's first PutTenant reaches the server, another admin changes the same
    tenant's cross-region mode (a real PutTenant, no expected version)."""

    def __init__(self) -> None:
        self.raced = False

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/PutTenant") and not self.raced:
            self.raced = True
            theirs = gpb.Tenant()
            theirs.CopyFrom(request.tenant)
            theirs.projects.remove("eval")  # the other admin never saw our edit
            theirs.cross_region = gpb.CROSS_REGION_MODE_FORBIDDEN
            continuation(details, gpb.PutTenantRequest(tenant=theirs)).result()
        return continuation(details, request)


def _racing_put(port: int, edit: TenantEdit, expected_version: str = ""):
    with Api(f"127.0.0.1:{port}", TOKENS["root"]) as api:
        racer = _ConcurrentAdmin()
        api.channel = grpc.intercept_channel(api.channel, racer)
        try:
            return put_tenant(api, "search", edit, expected_version)
        finally:
            assert racer.raced


async def test_a_concurrent_change_is_kept_and_the_edit_made_again_on_top_of_it(admission):
    resp = await asyncio.to_thread(_racing_put, admission.port, TenantEdit(add_projects=("eval",)))
    search = await _tenant(admission, "search")
    assert search.cross_region == "forbidden"  # theirs survived
    assert "eval" in search.projects  # ours too
    assert resp.changes == ['tenant search: projects ["batch","serve","train"] -> ["batch","eval","serve","train"]']
    assert resp.previous_version != resp.policy_version == (await read_policy(admission.bus)).version


async def test_with_an_expected_version_a_concurrent_change_refuses_the_edit(admission):
    version = (await read_policy(admission.bus)).version
    with pytest.raises(typer.Exit) as e:
        await asyncio.to_thread(_racing_put, admission.port, TenantEdit(add_projects=("eval",)), version)
    assert e.value.exit_code == 1
    search = await _tenant(admission, "search")
    assert search.cross_region == "forbidden" and "eval" not in search.projects


async def test_approvals_pages_newest_first_and_an_empty_filter_says_so(admission):
    """`fedsched approvals --newest-first --limit 2` pages through every request once, newest
    first, the footer giving the next token; a filter matching nothing prints nothing on stdout
    and names the filters on stderr; long reasons end in an ellipsis."""
    import json
    import time

    from fedsched.clock import to_datetime
    from fedsched.events import ApprovalRequested, make_event
    from tests.builders import until

    ids = [f"ap-{i:020x}" for i in range(5)]
    for i, approval_id in enumerate(ids):  # requested one second apart, oldest first
        request = make_event("approval.requested", ApprovalRequested(
            approval_id=approval_id, home_region="cn-north-1", proposed_region="cn-east-1",
            proposed_cluster="cn-east-1-c1", reason="home region full; " + "x" * 200,
            expires_at=to_datetime(time.time() + 3600)),
            producer="scheduler", occurred_at=time.time() - 100 + i, tenant="search", project="train",
            job_id=f"j-{i}", actor="scheduler")
        await admission.bus.publish(admission.bus.subjects.approval("search", "train"), request)
    assert await until(lambda: len(admission.approvals.by_id) == 5)
    seen, token, pages = [], "", 0
    while True:
        out = await _cli(admission, "approvals", "--newest-first", "--limit", "2",
                         *(["--page-token", token] if token else []))
        assert out.returncode == 0, out.stderr
        seen += [line.split("│")[1].strip() for line in out.stdout.splitlines() if line.startswith("│ ap-")]
        pages += 1
        footer = out.stdout.strip().splitlines()[-1]
        assert " of 5 matching requests shown" in footer, out.stdout
        if "--page-token" not in footer:
            break
        token = footer.split("--page-token ", 1)[1].strip()
    assert seen == list(reversed(ids)) and pages == 3
    assert "…" in out.stdout and "x" * 100 not in out.stdout
    listed = json.loads((await _cli(admission, "approvals", "-o", "json")).stdout)
    assert [a["approval_id"] for a in listed["approvals"]] == ids and {a["state"] for a in listed["approvals"]} == {
        "pending"}
    none = await _cli(admission, "approvals", "--state", "approved", "--tenant", "search")
    assert none.returncode == 0 and none.stdout == ""
    assert "no approval requests match --tenant search --state approved" in none.stderr
