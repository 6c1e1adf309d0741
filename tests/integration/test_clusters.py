"""``ClusterService.ListClusters`` over real gRPC and a real bus with two live agents: per
cluster card models with total / allocated / free, heartbeat age and health, nodes, running
jobs; queues per (home region, kind); a restarted admission reads only the newest snapshot and
heartbeat of each cluster."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import (T4, V100, StaticBackend, channel, nodes, placement, running_admission, spec, until)

NORTH = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
EAST = ClusterDef("cn-east-1-c1", "cn-east-1", "cn-east-1a", "ethernet", "standard", ("cn",))


@pytest.fixture
async def agents(bus):
    clock = SystemClock()
    north = ClusterAgent(bus, clock, NORTH, StaticBackend(nodes("n", 2, gpus=8, model=T4), clock=clock, runtime_s=None),
                         heartbeat_interval_s=0.1, snapshot_every=1, tick_s=0.01)
    east = ClusterAgent(bus, clock, EAST, StaticBackend(nodes("e", 1, gpus=4, model=V100), clock=clock, runtime_s=None),
                        heartbeat_interval_s=0.1, snapshot_every=1, tick_s=0.01)
    tasks = [asyncio.create_task(a.run()) for a in (north, east)]
    yield north, east
    for a in (north, east):
        a.stop()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _list(port, who="alice", regions=()):
    async with channel(port, who) as ch:
        return await pb_grpc.ClusterServiceStub(ch).ListClusters(pb.ListClustersRequest(regions=regions))


async def test_two_agents_show_capacity_health_and_queues(bus, agents):
    north, _ = agents
    async with running_admission(bus, models=(T4, V100), stale_after_s=5.0) as svc:
        assert await until(lambda: len(svc.cluster_view.clusters) == 2, timeout=10)
        # one 4-GPU job runs on north (a placement its agent takes); one job waits in admission's queue
        job = spec(gpus=4)
        await bus.publish(bus.subjects.placements(NORTH.region, NORTH.name),
                          placement("j-run", job, NORTH.name, NORTH.region, [("n0", (0, 1, 2, 3))]))
        async with channel(svc.port, "alice") as ch:
            await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
                tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, workers=1, gpus_per_worker=1)))

        async def allocated():
            resp = await _list(svc.port)
            row = next((c for c in resp.clusters if c.cluster == NORTH.name), None)
            return row is not None and row.cards and row.cards[0].gpus_allocated == 4 and row.running_jobs == 1
        assert await until(allocated, timeout=10)

        resp = await _list(svc.port)
        by_name = {c.cluster: c for c in resp.clusters}
        assert [c.cluster for c in resp.clusters] == [EAST.name, NORTH.name]  # by region, then cluster
        n, e = by_name[NORTH.name], by_name[EAST.name]
        assert (n.region, n.zone, n.nodes, n.nodes_schedulable, n.healthy) == ("cn-north-1", "cn-north-1a", 2, 2, True)
        assert n.backend == "trace"
        assert [(c.card_model, c.gpus_total, c.gpus_allocated, c.gpus_free) for c in n.cards] == [(T4, 16, 4, 12)]
        assert [(c.card_model, c.gpus_total, c.gpus_allocated, c.gpus_free) for c in e.cards] == [(V100, 4, 0, 4)]
        assert 0 <= n.heartbeat_age_seconds < 2 and e.running_jobs == 0
        assert [(q.region, q.kind, q.queued) for q in resp.queues] == [("cn-north-1", "training", 1)]
        assert resp.queues[0].oldest_wait_seconds >= 0

        only_east = await _list(svc.port, regions=["cn-east-1"])
        assert [c.cluster for c in only_east.clusters] == [EAST.name] and not only_east.queues

        with pytest.raises(grpc.aio.AioRpcError) as e_info:
            await _list(svc.port, who=None)
        assert e_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e_info:
            await _list(svc.port, regions=["Not A Region"])
        assert e_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_silent_agent_turns_unhealthy_and_a_restart_reads_only_the_newest(bus, agents):
    north, east = agents
    async with running_admission(bus, models=(T4, V100)) as svc:
        assert await until(lambda: len(svc.cluster_view.clusters) == 2, timeout=10)
        # both agents publish a snapshot and a heartbeat every 0.1 s: >= 120 messages in the stream
        assert await until(lambda: north.sequence > 30 and east.sequence > 30, timeout=20)
    east.stop()
    async with running_admission(bus, models=(T4, V100), stale_after_s=0.3) as svc:
        # started after many heartbeats: the follower began with one snapshot and one heartbeat
        # per cluster (4), plus what north published while admission started (well under 100)
        assert 4 <= svc._inventory.handled < 40

        async def east_down():
            resp = await _list(svc.port)
            row = {c.cluster: c for c in resp.clusters}
            return EAST.name in row and not row[EAST.name].healthy and row[NORTH.name].healthy
        assert await until(east_down, timeout=10)
