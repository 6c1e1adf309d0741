"""``SystemService.GetStatus`` on the embedded system: every service with its state, version and
lag; a stopped scheduler and a silent agent show ``down`` with the reason."""

from __future__ import annotations

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.version import package_version
from fedapp.client import aio_channel
from services.inventory.trace import TraceNode
from tests.builders import embedded_federation, until

pytestmark = pytest.mark.e2e


async def test_status_shows_every_service_and_a_stopped_scheduler_is_down(nats_server, chdb_path, tmp_path):
    split = {c: [TraceNode(f"{c}-n", 64000, 262144, 2, "nvidia-t4-16gb", 16)] for c in ("cn-north-1-c1", "cn-east-1-c1")}
    async with embedded_federation(nats_server.url, chdb_path, tmp_path, split, stale_after_s=1.0) as (system, stub):
        await stub.SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(tenant="search", project="train", gpus_per_worker=1,
                                                                 cpu_milli=1000)))
        async with aio_channel(system.grpc_target, system.admin_token) as ch:
            status = pb_grpc.SystemServiceStub(ch)

            async def services():
                return {s.name: s for s in (await status.GetStatus(pb.GetStatusRequest())).services}

            async def all_ok():
                return all(s.state == "ok" for s in (await services()).values())
            assert await until(all_ok, timeout=20), await services()
            got = await services()
            assert set(got) == {"admission", "scheduler", "audit", "billing", "agent/cn-north-1/cn-north-1-c1",
                                "agent/cn-east-1/cn-east-1-c1"}
            assert got["admission"].version == got["scheduler"].version == package_version() != "unknown"
            assert "cycles" in got["scheduler"].detail and "audit-events lag" in got["audit"].detail
            assert 0 <= got["agent/cn-north-1/cn-north-1-c1"].last_seen_age_seconds < 1.0
            resp = await status.GetStatus(pb.GetStatusRequest())
            assert resp.version == package_version()

            await system.stop_scheduler()
            got = await services()
            assert got["scheduler"].state == "down" and "no answer on" in got["scheduler"].detail
            # the others are unaffected (waited for: with stale_after_s=1.0, a loaded machine can
            # make any service's report a moment late)
            async def audit_ok():
                return (await services())["audit"].state == "ok"
            assert await until(audit_ok, timeout=10), await services()

            system.agents[0].stop()
            name = f"agent/{system.agents[0].cluster.region}/{system.agents[0].cluster.name}"

            async def agent_down():
                s = (await services())[name]
                return s.state == "down" and s.detail.startswith("silent for")
            assert await until(agent_down, timeout=10)
