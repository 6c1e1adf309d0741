"""Names outside the topology in force are refused at every entry point of admission (real NATS):
SubmitJob home/allowed/forbidden regions, PutTenant, SetQuota, PolicyService Apply/Diff -- each
INVALID_ARGUMENT naming the field and the known names; without a topology, admission keeps
learning regions from inventories."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.clock import SystemClock
from fedsched.policystore import read_policy
from fedsched.topology import KnownNames
from services.admission.service import AdmissionService
from tests.builders import Stubs, channel, policy_doc, policy_text, store_policy

NAMES = KnownNames(("cn-north-1", "cn-east-1", "cn-south-1"),
                   ("cn-north-1a", "cn-east-1a", "cn-south-1a"),
                   ("cn-north-1-c1", "cn-east-1-c1", "cn-south-1-c1"))
KNOWN = "(regions: cn-north-1, cn-east-1, cn-south-1)"


@pytest.fixture
async def admission(bus):
    await store_policy(bus, policy_doc())
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", names=NAMES)
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    svc.known_regions.add("eu-west-1")  # an agent from outside the topology reported: still not a region here
    yield svc
    svc.stop()
    await task


def _spec(**kw) -> pb.JobSpec:
    spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1,
                      cpu_milli=4000, memory_mib=8192, card_models=["T4"])
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(spec, k).extend(v)
        else:
            setattr(spec, k, v)
    return spec


async def _refused(call, field: str, words: str = KNOWN) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(f"{field}: "), e.value.details()
    assert "eu-west-1" in e.value.details() and words in e.value.details(), e.value.details()


async def test_every_entry_point_refuses_a_region_outside_the_topology(admission):
    before = (await read_policy(admission.bus)).version
    async with channel(admission.port, "root") as ch:
        s = Stubs(ch)
        await _refused(s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(home_region="eu-west-1"))),
                       "spec.home_region", "known: cn-east-1, cn-north-1, cn-south-1")
        await _refused(s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(allowed_regions=["cn-north-1", "eu-west-1"]))),
                       "spec.allowed_regions", "known: cn-east-1, cn-north-1, cn-south-1")
        await _refused(s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(forbidden_regions=["eu-west-1"]))),
                       "spec.forbidden_regions", "known: cn-east-1, cn-north-1, cn-south-1")
        await _refused(s.tenants.PutTenant(gpb.PutTenantRequest(tenant=gpb.Tenant(
            name="games", home_region="eu-west-1", projects=["train"]))), "tenant.home_region")
        await _refused(s.tenants.PutTenant(gpb.PutTenantRequest(tenant=gpb.Tenant(
            name="games", home_region="cn-north-1", projects=["train"], regions=["cn-north-1", "eu-west-1"]))),
            "tenant.regions[1]")
        await _refused(s.tenants.SetQuota(gpb.SetQuotaRequest(quota=gpb.Quota(
            tenant="search", card="T4", region="eu-west-1", guaranteed_gpus=4))), "quota.region")
        bad = policy_text("quotas: [{tenant: nlp, card: T4, region: eu-west-1, guaranteed_gpus: 8}]\n")
        await _refused(s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=bad)), "yaml.quotas[0].region")
        await _refused(s.policy.DiffPolicy(gpb.ApplyPolicyRequest(yaml=bad)), "yaml.quotas[0].region")
        moved = policy_text().replace("{name: vision, home_region: cn-south-1", "{name: vision, home_region: eu-west-1")
        await _refused(s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=moved)), "yaml.tenants[3].home_region")
        # names inside the topology pass every one of those entry points
        ok = await s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(allowed_regions=["cn-north-1", "cn-east-1"],
                                                                    forbidden_regions=["cn-south-1"])))
        quota = await s.tenants.SetQuota(gpb.SetQuotaRequest(quota=gpb.Quota(
            tenant="search", card="T4", region="cn-east-1", guaranteed_gpus=4)))
    assert ok.job_id and quota.created
    assert (await read_policy(admission.bus)).version != before  # only the good quota changed it


async def test_without_a_topology_admission_learns_regions_from_inventories(bus):
    await store_policy(bus, policy_doc())
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(svc.ready.wait(), 20)
        async with channel(svc.port, "root") as ch:
            s = Stubs(ch)
            await _refused(s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(allowed_regions=["eu-west-1"]))),
                           "spec.allowed_regions", "known: cn-east-1, cn-north-1, cn-south-1")
            svc.known_regions.add("eu-west-1")  # an agent of eu-west-1 reported inventory
            ok = await s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec(allowed_regions=["eu-west-1"])))
        assert ok.job_id
    finally:
        svc.stop()
        await task
