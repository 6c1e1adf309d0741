"""The versioned policy on real NATS and real chDB: apply/diff/show through gRPC, every service
following the newest version, tenant/quota/principal changes as audited events (who, old ->
new, version), the guards, and the first-start bootstrap."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as jpb
from fedsched.auth import hash_token
from fedsched.clock import SystemClock
from fedsched.errors import ValidationError
from fedsched.tenancy import Governance, bundled_policy_text, parse_policy, policy_version
from fedsched.policystore import PolicyFollower, PolicyHolder, bootstrap, read_policy
from fedsched.store import AsyncStore
from services.admission.service import AdmissionService
from services.audit.service import AuditService
from tests.builders import TOKENS, Stubs, channel, policy_doc, policy_text, principals_yaml, store_policy, until


@pytest.fixture
async def gov_world(bus, store):
    """Admission + audit on one prefix, and a bare follower standing in for another service."""
    await store_policy(bus, policy_doc())
    admission = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    audit = AuditService(bus, AsyncStore(store), linger_s=0.05)
    other = PolicyHolder()
    follower = PolicyFollower(bus, other, name="other-service")
    tasks = [asyncio.create_task(admission.run()), asyncio.create_task(audit.run()),
             asyncio.create_task(follower.run())]
    await asyncio.wait_for(admission.ready.wait(), 20)
    yield admission, audit, other, store
    admission.stop(), audit.stop(), follower.stop()
    await asyncio.gather(*tasks)



async def _audited(audit, store, where: str, timeout=10.0) -> list[tuple]:
    deadline = time.monotonic() + timeout
    while True:
        if await audit.lag() == 0:
            rows = store.query(f"SELECT type, actor, policy_version, payload FROM {store.database}.events "
                               f"WHERE {where} ORDER BY occurred_at").rows
            if rows or time.monotonic() > deadline:
                return rows
        await asyncio.sleep(0.05)


async def test_apply_publishes_a_new_version_every_service_follows_and_the_audit_log_records(gov_world):
    admission, audit, other, store = gov_world
    text = policy_text("quotas: [{tenant: nlp, card: T4, region: cn-east-1, guaranteed_gpus: 8}]\n"
                       "scheduling: {weights: {home: 0.5}}\n")
    async with channel(admission.port, "root") as ch:
        s = Stubs(ch)
        before = (await s.policy.GetPolicy(gpb.GetPolicyRequest())).version
        diff = await s.policy.DiffPolicy(gpb.ApplyPolicyRequest(yaml=text))
        assert not diff.applied and "quota nlp/T4/cn-east-1: added" in diff.changes
        assert "scheduling.weights: {} -> {\"home\":0.5}" in diff.changes
        assert (await s.policy.GetPolicy(gpb.GetPolicyRequest())).version == before  # diff applies nothing
        applied = await s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=text, expected_version=before))
        again = await s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=text))
        shown = await s.policy.GetPolicy(gpb.GetPolicyRequest())
    assert applied.applied and applied.previous_version == before and applied.changes == diff.changes
    assert applied.version == diff.version == policy_version(parse_policy(text)) == shown.version
    assert not again.applied and shown.applied_by == "root" and "guaranteed_gpus: 8" in shown.yaml
    assert await until(lambda: other.version == applied.version)  # another service follows within moments
    assert other.current.weights == {"home": 0.5}
    rows = await _audited(audit, store, "type = 'policy.applied'")
    assert [(t, actor, v) for t, actor, v, _ in rows] == [("policy.applied", "root", applied.version)]
    assert json.loads(rows[0][3])["previous_version"] == before


async def test_tenant_quota_and_principal_changes_are_events_with_old_and_new(gov_world):
    admission, audit, other, store = gov_world
    async with channel(admission.port, "root") as ch:
        s = Stubs(ch)
        made = await s.tenants.PutTenant(gpb.PutTenantRequest(tenant=gpb.Tenant(
            name="games", home_region="cn-south-1", projects=["train"], cross_region=gpb.CROSS_REGION_MODE_APPROVAL,
            budget=gpb.Budget(monthly="5000"))))
        changed = await s.tenants.PutTenant(gpb.PutTenantRequest(tenant=gpb.Tenant(
            name="games", projects=["train", "serve"], cross_region=gpb.CROSS_REGION_MODE_FORBIDDEN)))
        quota = await s.tenants.SetQuota(gpb.SetQuotaRequest(quota=gpb.Quota(
            tenant="games", card="A100", region="cn-south-1", guaranteed_gpus=2.5)))
        await s.tenants.DeleteQuota(gpb.DeleteQuotaRequest(tenant="games", card="A100", region="cn-south-1"))
        issued = await s.tenants.PutPrincipal(gpb.PutPrincipalRequest(
            name="gina", roles=[gpb.RoleGrant(role="submitter", tenants=["games"], projects=["serve"])]))
    assert made.created and not changed.created and quota.created and issued.created and issued.token
    assert changed.tenant.home_region == "cn-south-1"  # an empty home region keeps the current one
    async with channel(admission.port, None) as ch:  # the new principal's token works at once
        listed = await Stubs(ch).tenants.ListTenants(gpb.ListTenantsRequest(),
                                                     metadata=(("authorization", f"Bearer {issued.token}"),))
    assert [t.name for t in listed.tenants] == ["games"]
    stored = await read_policy(admission.bus)
    assert stored.gov.principal("gina").token_sha256 == hash_token(issued.token)
    assert issued.token not in json.dumps(stored.gov.doc.model_dump(mode="json"))
    rows = await _audited(audit, store, "type IN ('tenant.updated', 'quota.updated', 'principal.updated')")
    assert [(t, actor) for t, actor, _, _ in rows] == [
        ("tenant.updated", "root"), ("tenant.updated", "root"), ("quota.updated", "root"), ("quota.updated", "root"),
        ("principal.updated", "root")]
    second = json.loads(rows[1][3])
    assert second["old"]["cross_region"] == "approval" and second["new"]["cross_region"] == "forbidden"
    assert second["old"]["projects"] == ["train"] and second["new"]["projects"] == ["serve", "train"]
    removed = json.loads(rows[3][3])
    assert removed["old"]["guaranteed_gpus"] == 2.5 and removed["new"] is None
    person = json.loads(rows[4][3])
    assert person["token_issued"] and "token_sha256" not in json.dumps(person)
    versions = [v for _, _, v, _ in rows]
    assert versions[3] == versions[1]  # deleting the quota restores the content, hence the version, before it
    assert len(set(versions)) == 4 and versions[-1] == stored.version
    assert await until(lambda: other.version == stored.version)


async def test_guards_refuse_lockouts_stale_versions_and_invalid_documents(gov_world):
    admission, *_ = gov_world
    stored = await read_policy(admission.bus)
    head = policy_text().split("principals:")[0]
    others = [n for n in TOKENS if n != "root"]
    cases = {
        "no admin left": (gpb.ApplyPolicyRequest(yaml=head + principals_yaml(others)),
                          grpc.StatusCode.FAILED_PRECONDITION, "the policy would have no admin"),
        "removing own admin": (gpb.ApplyPolicyRequest(yaml=head + principals_yaml(others) + f"  - {{name: boss, "
                                                      f"token_sha256: {'c' * 64}, roles: [{{role: admin}}]}}\n"),
                               grpc.StatusCode.FAILED_PRECONDITION, "would remove your own admin rights (root)"),
        "stale expected version": (gpb.ApplyPolicyRequest(yaml=policy_text(), expected_version="0" * 12),
                                   grpc.StatusCode.FAILED_PRECONDITION, f"the policy is at version {stored.version}"),
        "invalid document": (gpb.ApplyPolicyRequest(yaml=policy_text().replace("home_region: cn-east-1",
                                                                               "home_region: East", 1)),
                             grpc.StatusCode.INVALID_ARGUMENT, "yaml.tenants[2].home_region:"),
    }
    async with channel(admission.port, "root") as ch:
        for case, (request, code, text) in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await Stubs(ch).policy.ApplyPolicy(request)
            assert e.value.code() == code and text in e.value.details(), (case, e.value.details())
    assert (await read_policy(admission.bus)).version == stored.version  # nothing changed


async def test_first_start_bootstrap_writes_a_private_admin_token_once(bus, tmp_path):
    path = tmp_path / "data" / "admin.token"
    token = await bootstrap(bus, bundled_policy_text(), path, now=time.time())
    assert token and path.read_text().strip() == token
    assert os.stat(path).st_mode & 0o777 == 0o600
    stored = await read_policy(bus)
    principal = stored.gov.authenticate(token)
    assert principal.name == "admin" and principal.is_admin
    assert token not in path.with_name("other").as_posix() and token not in json.dumps(
        stored.gov.doc.model_dump(mode="json"))
    assert await bootstrap(bus, policy_text(), path, now=time.time()) == token  # second start: nothing changes
    assert (await read_policy(bus)).version == stored.version
    assert set(Governance.of(stored.gov.doc).tenants) == {"search", "ads", "nlp", "vision", "recsys"}


async def test_bootstrap_adopts_a_token_a_deployment_mounted_and_never_rewrites_it(bus, tmp_path):
    """A Kubernetes Secret mounted read-only at admin_token_file: its token becomes the admin's."""
    path = tmp_path / "secret" / "admin.token"
    path.parent.mkdir()
    path.write_text("tok-from-the-secret-0123456789\n")
    path.chmod(0o400)
    path.parent.chmod(0o500)  # read-only, like a Secret volume: a write would fail (unless root)
    written = path.stat().st_mtime_ns
    try:
        token = await bootstrap(bus, bundled_policy_text(), path, now=time.time())
        assert token == "tok-from-the-secret-0123456789"
        assert (await read_policy(bus)).gov.authenticate(token).is_admin
        assert await bootstrap(bus, bundled_policy_text(), path, now=time.time()) == token  # a restart
        assert path.stat().st_mtime_ns == written  # never rewritten
    finally:
        path.parent.chmod(0o700)


async def test_bootstrap_refuses_a_mounted_token_that_is_no_token(bus, tmp_path):
    path = tmp_path / "admin.token"
    path.write_text("short token\n")
    with pytest.raises(ValidationError) as e:
        await bootstrap(bus, bundled_policy_text(), path, now=time.time())
    assert e.value.field == "admin_token_file"
    assert await read_policy(bus) is None  # nothing stored


async def test_a_follower_on_an_empty_bucket_reports_that_no_policy_is_stored(bus):
    holder = PolicyHolder()
    follower = PolicyFollower(bus, holder, name="empty")
    task = asyncio.create_task(follower.run())
    await asyncio.wait_for(follower.initial.wait(), 10)
    assert holder.current is None and not holder.ready.is_set()
    await store_policy(bus, policy_doc())
    await asyncio.wait_for(holder.ready.wait(), 10)
    assert holder.version == policy_version(policy_doc())
    follower.stop()
    await task


async def _run_shards(bus, job_id: str, spec, card: str, region: str, cluster: str) -> None:
    """Place and start every shard of a job, as the scheduler and the cluster's agent would."""
    from fedsched.events import JobPlaced, JobStatus, WorkerBinding, make_event

    for shard in range(spec.shards):
        bindings = tuple(WorkerBinding(worker=w, node=f"n{shard}", gpu_indices=tuple(range(spec.gpus_per_worker)),
                                       gpu_milli=1000) for w in range(spec.workers))
        common = dict(occurred_at=time.time(), region=region, cluster=cluster, tenant=spec.tenant,
                      project=spec.project, job_id=job_id, attempt=1)
        await bus.publish(bus.subjects.placements(region, cluster), make_event(
            "job.placed", JobPlaced(spec=spec, card_model=card, bindings=bindings, shard=shard), producer="scheduler",
            **common))
        await bus.publish(bus.subjects.status(region, cluster), make_event(
            "job.started", JobStatus(card_model=card, gpu_milli=spec.total_gpu_milli, shard=shard), producer="agent",
            **common))


async def test_list_quotas_counts_every_running_shard(bus):
    """2 shards x 2 GPUs running on T4 in cn-north-1: 4000 milli-GPU in use, not 2000."""
    await store_policy(bus, policy_doc("quotas: [{tenant: search, card: T4, region: cn-north-1, "
                                       "guaranteed_gpus: 8}]\n"))
    admission = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    admission.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(admission.run())
    try:
        await asyncio.wait_for(admission.ready.wait(), 20)
        async with channel(admission.port, "root") as ch:
            s = Stubs(ch)
            sub = await s.jobs.SubmitJob(jpb.SubmitJobRequest(spec=jpb.JobSpec(
                tenant="search", project="batch", kind=jpb.JOB_KIND_BATCH, shards=2, gpus_per_worker=2,
                card_models=["T4"], home_region="cn-north-1", locality=jpb.LOCALITY_MUST_LOCAL)))
            rec = admission.view.jobs[sub.job_id]
            await _run_shards(bus, sub.job_id, rec.spec, "nvidia-t4-16gb", "cn-north-1", "cn-north-1-c1")
            assert await until(lambda: all(sh.state.value == "running" for sh in rec.shards))
            quotas = (await s.tenants.ListQuotas(gpb.ListQuotasRequest(tenant="search"))).quotas
        assert [(q.card, q.region, q.used_milli) for q in quotas] == [("T4", "cn-north-1", 4000)]
    finally:
        admission.stop()
        await task


async def test_a_quota_means_the_same_from_policy_yaml_and_from_set_quota(gov_world):
    """``borrowing_limit_gpus`` absent: no limit with a cohort, no borrowing without one -- the same
    effective quota whether applied as policy YAML or set through gRPC SetQuota."""
    admission, *_ = gov_world
    quotas = [gpb.Quota(tenant="search", card="T4", region="cn-north-1", guaranteed_gpus=2, cohort="north"),
              gpb.Quota(tenant="ads", card="T4", region="cn-north-1", guaranteed_gpus=1)]

    async def effective(s: Stubs) -> list[tuple]:
        listed = (await s.tenants.ListQuotas(gpb.ListQuotasRequest())).quotas
        version = (await s.policy.GetPolicy(gpb.GetPolicyRequest())).version
        assert await until(lambda: admission.policy.version == version)
        return sorted([(q.tenant, q.card, q.region, q.guaranteed_gpus, q.HasField("borrowing_limit_gpus")
                        and q.borrowing_limit_gpus, q.cohort) for q in listed]
                      + [(r.label, r.nominal_milli, r.borrowing_limit_milli, r.ceiling_milli, r.cohort)
                         for r in admission.policy.current.quota_rules], key=str)

    async with channel(admission.port, "root") as ch:
        s = Stubs(ch)
        await s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=policy_text(
            "quotas:\n  - {tenant: search, card: T4, region: cn-north-1, guaranteed_gpus: 2, cohort: north}\n"
            "  - {tenant: ads, card: T4, region: cn-north-1, guaranteed_gpus: 1}\n")))
        from_yaml = await effective(s)
        for q in quotas:
            await s.tenants.DeleteQuota(gpb.DeleteQuotaRequest(tenant=q.tenant, card=q.card, region=q.region))
        assert not (await s.tenants.ListQuotas(gpb.ListQuotasRequest())).quotas
        for q in quotas:
            await s.tenants.SetQuota(gpb.SetQuotaRequest(quota=q))
        from_grpc = await effective(s)
    assert from_yaml == from_grpc
    assert ("search/T4/cn-north-1", 2000, None, None, "north") in from_yaml  # with a cohort: no limit
    assert ("ads/T4/cn-north-1", 1000, 0, 1000, "") in from_yaml  # without one: never borrows


async def test_policy_versions_are_listed_newest_first_with_their_yaml_for_admins_only(gov_world):
    from fedsched.tenancy import yaml_diff

    admission, _, _, _ = gov_world
    texts = [policy_text(f"quotas: [{{tenant: nlp, card: T4, region: cn-east-1, guaranteed_gpus: {n}}}]\n")
             for n in (4, 6)]
    async with channel(admission.port, "root") as ch, channel(admission.port, "alice") as other:
        s = Stubs(ch)
        applied = [(await s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=t))).version for t in texts]
        listed = await s.policy.ListPolicyVersions(gpb.ListPolicyVersionsRequest())
        two = await s.policy.ListPolicyVersions(gpb.ListPolicyVersionsRequest(limit=2))
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await Stubs(other).policy.ListPolicyVersions(gpb.ListPolicyVersionsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await s.policy.ListPolicyVersions(gpb.ListPolicyVersionsRequest(limit=501))
    versions = [v.version for v in listed.versions]
    assert versions[:2] == applied[::-1] and len(versions) >= 3  # + the fixture's first policy
    assert [v.version for v in two.versions] == applied[::-1]
    newest, previous = listed.versions[0], listed.versions[1]
    assert newest.applied_by == "root" and newest.applied_at.seconds > 0
    assert "guaranteed_gpus: 6" in newest.yaml and "guaranteed_gpus: 4" in previous.yaml
    lines = yaml_diff(previous.yaml, newest.yaml, old_label=previous.version, new_label=newest.version)
    assert lines[0] == f"--- {previous.version}" and lines[1] == f"+++ {newest.version}"
    assert [ln for ln in lines if ln[:1] in "+-" and ln[:3] not in ("---", "+++")] == [
        "-  guaranteed_gpus: 4.0", "+  guaranteed_gpus: 6.0"]
    assert yaml_diff(newest.yaml, newest.yaml) == []
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
