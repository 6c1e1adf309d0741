"""No single point of failure (issue 14 item 10): a three-node NATS cluster with R3 streams and two
scheduler replicas; kill -9 of a NATS node (a follower of the events stream, then its leader) and
of the active scheduler during a small workload loses and doubles nothing, and costs what a clean
run costs.

Fixture ``nats_cluster``: three real nats-server processes routed into one JetStream cluster. Two
runs of the whole system (:class:`~fedapp.runtime.System`, every service on its own connection
given all three URLs, ``stream_replicas=3``, two scheduler replicas, lease TTL 2 s) on that
cluster, each with its own subject prefix and ClickHouse database: a clean run, then the chaos
run. Workload: 10 one-GPU jobs of 90 business seconds on a clock running 30x (3 wall seconds
each), submitted through gRPC 0.4 s apart. Chaos: kill -9 a follower node of ``P_EVENTS``,
bring it back; kill -9 the stream's leader, bring it back; kill the active scheduler (task
cancelled, connection closed, lease not released). Checks per run: every job SUCCEEDED with one
attempt; every message of the streams is in the audit log once (lost = stream messages - audit
rows; doubled = rows - distinct event ids); one compute line per job; and the chaos run's
total cost equals the clean run's to the cent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from decimal import Decimal

import grpc
import pytest

from fedapp.client import aio_channel
from fedapp.runtime import System, SystemOptions
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import ClockState, ReplayClock
from fedsched.settings import Settings
from services.inventory.trace import TraceNode
from tests.builders import unique

pytestmark = pytest.mark.e2e


JOBS = 10
RUNTIME_S = 90
SPEED = 30.0
SPLIT = {"cn-north-1-c1": [TraceNode("n1", 64000, 262144, 8, "nvidia-t4-16gb", 16)]}


@dataclass
class Outcome:
    states: list[int]
    attempts: list[int]
    stream_messages: int
    audit_rows: int
    distinct_events: int
    compute_lines: int
    cost: Decimal
    failover_s: float | None = None


async def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _events_leader(system: System) -> tuple[str, list[str]]:
    info = await system.control.js.stream_info(system.control.stream_name("EVENTS"))
    return info.cluster.leader, [r.name for r in info.cluster.replicas or []]


async def _replicas_current(system: System) -> bool:
    try:
        info = await system.control.js.stream_info(system.control.stream_name("EVENTS"))
    except Exception:  # noqa: BLE001 - electing
        return False
    replicas = info.cluster.replicas or []
    return bool(info.cluster.leader) and len(replicas) == 2 and all(r.current for r in replicas)


async def _chaos(cluster, system: System) -> float:
    """kill -9 a follower node of the events stream, bring it back; kill -9 the stream's leader,
    bring it back; kill the active scheduler. Returns the scheduler failover time (s)."""

    async def current() -> bool:
        return await _replicas_current(system)

    async def one_active() -> bool:
        return system.active_scheduler() is not None

    await asyncio.sleep(1.0)
    _, followers = await _events_leader(system)
    cluster.kill(followers[0])
    await asyncio.sleep(1.5)
    cluster.restart(followers[0])
    await _until(current, 60, "the restarted follower to catch up")
    leader, _ = await _events_leader(system)
    cluster.kill(leader)
    await asyncio.sleep(1.5)
    cluster.restart(leader)
    await _until(current, 60, "the restarted leader to catch up")
    # (a lease whose renewals failed while its KV stream elected a leader may have lapsed: a
    # replica takes it again once NATS answers)
    await _until(one_active, 30, "an active scheduler after the NATS kills")
    await system.kill_scheduler(system.active_scheduler())
    killed = time.monotonic()
    await _until(one_active, 30, "the standby scheduler taking over")
    return time.monotonic() - killed


async def _run(cluster, tmp_path, chdb_path, *, chaos: bool) -> Outcome:
    settings = Settings(data_dir=tmp_path / ("chaos" if chaos else "clean"), nats_url=cluster.client_urls,
                        stream_replicas=3, subject_prefix=unique("ha"), clickhouse_path=chdb_path,
                        clickhouse_database=unique("db"), grpc_address="127.0.0.1:0", heartbeat_interval_s=0.3,
                        schedule_interval_s=0.01, stale_after_s=60, scheduler_lease_ttl_s=2.0,
                        writer_ack_wait_s=5.0)  # a writers' ack lost with a killed node: redelivered in 5 s, not 60
    clock = ReplayClock(ClockState(time.time(), 1.7e9, SPEED, 1))
    system = System(SystemOptions(settings=settings, clock=clock, split=SPLIT, agent_tick_s=0.01))
    await system.start()
    failover_s = None
    try:
        await system.start_scheduler()  # the standby replica
        async with aio_channel(system.grpc_target, system.admin_token) as channel:
            stub = pb_grpc.JobServiceStub(channel)
            spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000,
                              annotations={"trace.runtime_s": str(RUNTIME_S)})
            ids: list[str] = []
            chaos_task = asyncio.create_task(_chaos(cluster, system)) if chaos else None
            for i in range(JOBS):
                for _ in range(100):  # admission may be waiting for a stream leader for a moment
                    try:
                        ids.append((await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=f"r{i}"),
                                                         timeout=10)).job_id)
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.2)
                await asyncio.sleep(0.4)
            if chaos_task is not None:
                failover_s = await chaos_task
            assert len(ids) == JOBS

            async def all_done() -> bool:
                try:
                    jobs = [await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=5) for j in ids]
                except grpc.aio.AioRpcError:
                    return False
                return all(j.state == pb.JOB_STATE_SUCCEEDED for j in jobs)

            try:
                await _until(all_done, 120, "every job to succeed")
            except AssertionError:
                jobs = [await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=5) for j in ids]
                agent = system.agents[0]
                raise AssertionError(
                    f"jobs {[pb.JobState.Name(j.state) for j in jobs]}; attempts {[len(j.attempts) for j in jobs]}; "
                    f"schedulers {[x.status() for x in system.schedulers]}; agent running {sorted(agent.running)} "
                    f"done {len(agent.done)}"
                ) from None
            jobs = [await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=5) for j in ids]
        await system.stop_producers()
        await system.drain_writers(timeout_s=120)
        db = settings.clickhouse_database
        q = system.sync_store.query
        rows, distinct = q(f"SELECT count(), uniqExact(event_id) FROM {db}.events").rows[0]
        lines, cost = q(f"SELECT count(), sum(cost) FROM {db}.usage WHERE line = 'compute' "
                        f"AND job_id IN {{ids:Array(String)}}", {"ids": ids}).rows[0]
        return Outcome([j.state for j in jobs], [len(j.attempts) for j in jobs], await system.stream_messages(),
                       int(rows), int(distinct), int(lines), Decimal(str(cost)), failover_s)
    finally:
        await system.stop()


async def test_killing_nats_nodes_and_the_active_scheduler_loses_and_doubles_nothing(
        nats_cluster, tmp_path, chdb_path) -> None:
    t0 = time.monotonic()
    clean = await _run(nats_cluster, tmp_path, chdb_path, chaos=False)
    t1 = time.monotonic()
    chaos = await _run(nats_cluster, tmp_path, chdb_path, chaos=True)
    print(f"\nclean run {t1 - t0:.1f} s, chaos run {time.monotonic() - t1:.1f} s; scheduler failover "
          f"{chaos.failover_s:.2f} s; cost clean {clean.cost} chaos {chaos.cost}; audit rows "
          f"{chaos.audit_rows} of {chaos.stream_messages} stream messages")
    for run in (clean, chaos):
        assert run.states == [pb.JOB_STATE_SUCCEEDED] * JOBS
        assert run.attempts == [1] * JOBS                       # nothing placed twice
        assert run.audit_rows == run.stream_messages            # nothing lost
        assert run.audit_rows == run.distinct_events            # nothing doubled
        assert run.compute_lines == JOBS
    assert chaos.cost == clean.cost > 0
    assert chaos.failover_s is not None and chaos.failover_s < 2.0 * 2 + 1.0
