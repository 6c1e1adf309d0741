"""The agents process's CPU per job: every cluster's region agent in one process, as ``fedsched
up --processes`` runs them.

    python bench/agent_cpu.py [--jobs 20000] [--rate 700] [--segment 10000]

1. Start an embedded nats-server in a temporary directory and make the streams; a scheduler
   lease is acquired (KV bucket ``<prefix>_leases``, as the active scheduler holds it) so the
   agents judge fencing as they do live: each batch of orders reads the lease's tenure, each
   placement carries the tenure's fencing token.
2. A topology like ``bench/e2e_throughput.py``'s: 3 regions x 2 trace clusters of 8-GPU T4 nodes
   (96 cores, 768 GiB), ``--spare`` (1.25) x the GPUs the jobs need; one
   :class:`~services.inventory.agent.ClusterAgent` per cluster on a connection of its own, with a
   :class:`~services.inventory.agent.TraceBackend`, heartbeats every second and a snapshot every
   10 (the defaults of ``up``). The agents start (rebuild and reconcile an empty history) before
   anything is measured.
3. A publisher (a child process, so its CPU is not counted) publishes ``--jobs`` valid one-GPU
   ``job.placed`` events as the scheduler makes them (its event ids, its fencing token, a trace
   context, an evaluation per cluster; bindings fill the nodes in order, as the scheduler packs
   them) in scheduler-cycle batches, at ``--rate`` jobs/s (0: as fast as it can). Jobs run for an
   hour: they keep running, so the running set grows with the run.
4. This process runs the agents until every placement is started and reported, and prints its
   CPU seconds (user + system, every thread) per job, the share of it spent in garbage
   collection, and per ``--segment`` jobs (running jobs grow through the run: the figures at
   20k and 100k running show whether the cost stays flat). It then reads the status subjects
   back and checks one ``job.started`` per job, no other status, and no dead letter.

``--gc default|off|young=N|freeze`` sets this process's collector policy before the agents
start (default: CPython's, as the agents process runs today). ``--cpu-profile FILE`` samples
this process's CPU time over the offer (:class:`CpuSampler`: on a loaded machine py-spy's
wall-clock samples over-weight system calls that let another process run) into collapsed stacks.

A benchmark, not a test: run it by hand and record the figure with ``uptime`` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsched import telemetry  # noqa: E402
from fedsched.bus import Bus  # noqa: E402
from fedsched.clock import SystemClock  # noqa: E402
from fedsched.events import Envelope, JobPlaced, WorkerBinding, make_event  # noqa: E402
from fedsched.jobs import JobSpec  # noqa: E402
from fedsched.lease import nats_lease  # noqa: E402
from fedsched.metrics import AgentMetrics  # noqa: E402
from fedsched.natsd import EmbeddedNats  # noqa: E402
from services.inventory.agent import ClusterAgent, SharedReads, TraceBackend, shared_lease_reader  # noqa: E402
from services.inventory.trace import CLUSTERS, TraceNode  # noqa: E402
from services.scheduler.service import order_event_id  # noqa: E402

GPUS_PER_NODE = 8
T4 = "nvidia-t4-16gb"
TENANTS = ("search", "ads", "nlp", "vision", "recsys")
RUNTIME_S = 3600.0
LEASE_TTL_S = 24 * 3600.0  # held for the whole run without renewals (the tenure does not change)


def nodes_per_cluster(jobs: int, spare: float) -> int:
    """Nodes of each of the 6 clusters: ``spare`` x the GPUs of ``jobs`` one-GPU jobs."""
    return max(1, math.ceil(jobs * spare / GPUS_PER_NODE / len(CLUSTERS)))


def cluster_nodes(cluster: str, count: int) -> list[TraceNode]:
    """The trace nodes of ``cluster`` (what e2e_throughput's topology CSV gives)."""
    return [TraceNode(f"{cluster}-n{i:05d}", 96000, 786432, GPUS_PER_NODE, T4, 16) for i in range(count)]


def placement(i: int, token: int, spec_cache: dict) -> tuple[str, Envelope, dict[str, str]]:
    """Job ``i``'s ``job.placed`` as (cluster index, event, headers): cluster ``i % 6``, the
    next free GPU of that cluster's nodes in order."""
    c = i % len(CLUSTERS)
    cluster = CLUSTERS[c]
    slot = i // len(CLUSTERS)
    node, gpu = f"{cluster.name}-n{slot // GPUS_PER_NODE:05d}", slot % GPUS_PER_NODE
    tenant = TENANTS[i % len(TENANTS)]
    job_id = f"j-agentbench-{i:07d}"
    spec = JobSpec(tenant=tenant, project="batch", name=f"e2e-{i}", kind="batch", gpus_per_worker=1, cpu_milli=4000,
                   memory_mib=8192, card_models=(T4,), home_region=cluster.region, estimated_duration_s=RUNTIME_S,
                   annotations={"trace.runtime_s": str(RUNTIME_S)})
    evaluations = spec_cache.setdefault("evaluations", tuple(
        {"cluster": k.name, "region": k.region, "passed": True, "reason": "", "detail": "",
         "scores": {"home": 1.0 if k.region == cluster.region else 0.0, "price": 0.5, "wait": 0.25, "data": 0.0},
         "total": 1.75} for k in CLUSTERS))
    payload = JobPlaced(spec=spec, card_model=T4, bindings=(WorkerBinding(worker=0, node=node, gpu_indices=(gpu,),
                                                                          gpu_milli=1000, cpu_milli=4000,
                                                                          memory_mib=8192),),
                        score=1.75, explanation="home region, cheapest", price_per_gpu_hour=0.35,
                        evaluations=evaluations, queue="batch", est_cost=0.35, fencing_token=token)
    event = make_event("job.placed", payload, producer="scheduler", occurred_at=time.time(),
                       event_id=order_event_id(job_id, 1, 0, "placed", token), region=cluster.region,
                       zone=cluster.zone, cluster=cluster.name, tenant=tenant, project="batch", job_id=job_id,
                       attempt=1, actor="scheduler", policy_version="bench")
    headers = telemetry.child_headers(None, "scheduler.place", job_id=job_id, cluster=cluster.name)
    return c, event, headers


async def publish(a) -> None:
    """The publisher (child process): every placement, in cycles of ``a.batch``, at ``a.rate``
    jobs/s (0: as fast as possible)."""
    bus = await Bus.connect(a.nats_url, a.prefix, name="bench-scheduler")
    cache: dict = {}
    t0 = time.monotonic()
    for lo in range(0, a.jobs, a.batch):
        items = []
        for i in range(lo, min(a.jobs, lo + a.batch)):
            c, event, headers = placement(i, a.token, cache)
            items.append((bus.subjects.placements(CLUSTERS[c].region, CLUSTERS[c].name), event, headers))
        assert all(await bus.publish_many(items)), "a placement was not acknowledged"
        if a.rate > 0:
            due = t0 + (lo + a.batch) / a.rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
    await bus.close()


def cpu_s() -> float:
    """This process's CPU seconds (user + system, every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class GcClock:
    """CPU seconds spent in garbage collections (``gc.callbacks``; the collecting thread's CPU
    time: wall time would count the waits of a loaded machine), by generation."""

    def __init__(self) -> None:
        self.total = 0.0
        self.full = 0.0
        self.collections = [0, 0, 0]
        self.fulls: list[tuple[float, int]] = []  # (CPU seconds, objects collected) of each full collection
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.thread_time()
            return
        d = time.thread_time() - self._t
        self.total += d
        self.collections[info["generation"]] += 1
        if info["generation"] == 2:
            self.full += d
            self.fulls.append((d, info["collected"]))


class CpuSampler:
    """A statistical profiler on this process's CPU time (``ITIMER_PROF``: a sample every
    ``interval_s`` of CPU, user + system, so time spent runnable but waiting for a core -- this
    machine's 2 cores are shared -- is never sampled, unlike py-spy's wall-clock samples). The
    stacks go to ``path`` as collapsed stacks (``frame;frame;... count``, py-spy's raw format).
    A sample lands on the Python frame running when the signal is handled: a system call or a
    garbage collection is charged to the frame that made it."""

    def __init__(self, path: str, interval_s: float = 0.002) -> None:
        import collections
        import signal
        self.path = path
        self.interval_s = interval_s
        self.stacks: "collections.Counter[str]" = collections.Counter()
        self._signal = signal
        signal.signal(signal.SIGPROF, self._sample)

    def _sample(self, signum, frame) -> None:
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})")
            frame = frame.f_back
        self.stacks[";".join(reversed(names))] += 1

    def start(self) -> None:
        self._signal.setitimer(self._signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def stop(self) -> None:
        self._signal.setitimer(self._signal.ITIMER_PROF, 0, 0)
        with open(self.path, "w") as f:
            for stack, n in self.stacks.items():
                f.write(f"{stack} {n}\n")


class CountingWrites:
    """Counts the socket writes of a NATS connection's transport (wrapping it: every write still
    goes out; each is a system call and a wake-up of the server)."""

    def __init__(self, transport) -> None:
        self.inner = transport
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1
        self.inner.write(data)

    def writelines(self, lines) -> None:
        self.writes += 1
        self.inner.writelines(lines)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def set_gc_policy(policy: str) -> None:
    """Apply ``--gc``: ``default`` (CPython's), ``off``, ``young=N`` (young threshold N),
    ``freeze`` (freeze the heap alive now, young threshold 20,000: fedsched.gctune's service
    policy)."""
    if policy == "default":
        return
    if policy == "off":
        gc.disable()
    elif policy.startswith("young="):
        gc.set_threshold(int(policy.split("=", 1)[1]), *gc.get_threshold()[1:])
    elif policy == "freeze":
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, *gc.get_threshold()[1:])
    else:
        raise SystemExit(f"--gc {policy!r}: default, off, young=N or freeze")


async def count_statuses(bus: Bus) -> tuple[dict[str, int], int, int]:
    """The status events on the bus: (type -> count, distinct started jobs, dead letters)."""
    js = bus.js
    types: dict[str, int] = {}
    started: set[str] = set()
    sub = await js.subscribe(f"{bus.prefix}.status.>", ordered_consumer=True)
    info = await js.stream_info(bus.stream_name("EVENTS"), subjects_filter=f"{bus.prefix}.status.>")
    total = sum((info.state.subjects or {}).values())
    for _ in range(total):
        msg = await sub.next_msg(timeout=10)
        env = Envelope.from_bytes(msg.data)
        types[env.type] = types.get(env.type, 0) + 1
        if env.type == "job.started":
            started.add(env.job_id)
    await sub.unsubscribe()
    dlq = await js.stream_info(bus.stream_name("DLQ"))
    return types, len(started), int(dlq.state.messages or 0)


async def main(a) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fedsched-agentcpu-"))
    nats = EmbeddedNats(tmp / "nats")
    nats.start()
    setup = await Bus.connect(nats.url, a.prefix, name="setup")
    await setup.ensure_streams()
    lease = await nats_lease(setup, "scheduler", "bench/scheduler-1", ttl_s=LEASE_TTL_S)
    assert await lease.step() and lease.token > 0, "the bench could not take the scheduler lease"
    per_cluster = nodes_per_cluster(a.jobs, a.spare)
    clock = SystemClock()
    metrics = AgentMetrics()
    agents: list[ClusterAgent] = []
    lease_reads = SharedReads()
    for cluster in CLUSTERS:
        backend = TraceBackend(cluster_nodes(cluster.name, per_cluster), clock=clock)
        bus = await Bus.connect(nats.url, a.prefix, name=f"agent-{cluster.name}")
        # as fedapp.runtime makes them: the agents share their reads of the scheduler lease
        agents.append(ClusterAgent(bus, clock, cluster, backend, heartbeat_interval_s=1.0, tick_s=0.01,
                                   metrics=metrics, tenure=shared_lease_reader(lease_reads, bus)))
    set_gc_policy(a.gc)
    tasks = [asyncio.create_task(agent.run(), name=agent.durable) for agent in agents]
    deadline = time.monotonic() + 60
    while not all(agent._consumer is not None and agent.sequence >= 1 for agent in agents):
        assert time.monotonic() < deadline, "the agents did not start"
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.5)  # every agent through its first heartbeat

    batches = [0]
    handle = ClusterAgent.handle

    async def counted(self, deliveries):  # (the consumers take agent.handle when they start: wrap the instances)
        batches[0] += 1
        return await handle(self, deliveries)

    for agent in agents:
        agent._consumer.handler = counted.__get__(agent)
    counters = []
    for agent in agents:
        agent.bus.nc._transport = counting = CountingWrites(agent.bus.nc._transport)
        counters.append(counting)
    stats0 = [dict(agent.bus.nc.stats) for agent in agents]
    gclock = GcClock()
    gc.callbacks.append(gclock)
    cmd = [sys.executable, __file__, "--publish-only", "--nats-url", nats.url, "--prefix", a.prefix,
           "--jobs", str(a.jobs), "--rate", str(a.rate), "--batch", str(a.batch), "--token", str(lease.token)]
    sampler = CpuSampler(a.cpu_profile) if a.cpu_profile else None
    publisher = subprocess.Popen(cmd)
    c0, t0, reads0 = cpu_s(), time.monotonic(), lease_reads.calls
    if sampler is not None:
        sampler.start()
    segments: list[tuple[int, float, float, float]] = []  # (started jobs, cpu s, gc s, wall s) at each mark
    mark = a.segment
    deadline = t0 + a.timeout
    next_scan = 0.0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        running = sum(len(agent.running) for agent in agents)
        while mark <= a.jobs and running >= mark:
            segments.append((mark, cpu_s(), gclock.total, time.monotonic()))
            mark += a.segment
        # (the scan of every running job only once all are running, at most twice a second: it is
        # this process's CPU too)
        if running >= a.jobs and publisher.poll() is not None and time.monotonic() >= next_scan:
            next_scan = time.monotonic() + 0.5
            if all(all(j.started_at is not None for j in agent.running.values()) for agent in agents):
                break
    c1, t1 = cpu_s(), time.monotonic()
    if sampler is not None:
        sampler.stop()
    gc_s, gc_full = gclock.total, gclock.full
    gc.callbacks.remove(gclock)
    if publisher.poll() is None:
        publisher.kill()
    publisher.wait()
    writes = sum(c.writes for c in counters)
    sent = sum(agent.bus.nc.stats["out_msgs"] - s0["out_msgs"] for agent, s0 in zip(agents, stats0))
    got = sum(agent.bus.nc.stats["in_msgs"] - s0["in_msgs"] for agent, s0 in zip(agents, stats0))
    for agent in agents:
        agent.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    running = sum(len(agent.running) for agent in agents)
    cpu = c1 - c0
    print(f"agents: {a.jobs} jobs {'backlog' if a.rate <= 0 else f'at {a.rate:g}/s'} over {len(agents)} clusters of "
          f"{per_cluster} nodes: cpu {cpu:.2f} s = {1000 * cpu / a.jobs:.3f} ms/job "
          f"({1000 * (cpu - gc_s) / a.jobs:.3f} ms/job without GC), wall {t1 - t0:.1f} s; "
          f"load {os.getloadavg()[0]:.1f}; gc policy {a.gc}")
    print(f"  garbage collection: {gc_s:.2f} s ({100 * gc_s / cpu if cpu else 0:.0f}% of the CPU), collections "
          f"{gclock.collections} (full {gc_full:.2f} s)")
    print(f"  per job: {writes / a.jobs:.2f} socket writes, {sent / a.jobs:.2f} messages sent, "
          f"{got / a.jobs:.2f} received (the agents' connections); {a.jobs / max(batches[0], 1):.1f} placements "
          f"per batch handled, {(lease_reads.calls - reads0) / max(batches[0], 1):.2f} lease reads per batch")
    print(f"  full collections (CPU s, objects collected): "
          f"{', '.join(f'{d:.2f}/{n}' for d, n in gclock.fulls)}; tracked objects now {len(gc.get_objects())}")
    prev = (0, c0, 0.0, t0)
    for seg in segments:
        n = seg[0] - prev[0]
        d_cpu, d_gc = seg[1] - prev[1], seg[2] - prev[2]
        print(f"  jobs {prev[0]:>6}-{seg[0]:<6}: {1000 * d_cpu / n:.3f} ms/job, without GC "
              f"{1000 * (d_cpu - d_gc) / n:.3f}, GC {100 * d_gc / d_cpu if d_cpu else 0:.0f}%, "
              f"{n / max(seg[3] - prev[3], 1e-9):.0f} jobs/s")
        prev = seg
    types, distinct, dead = await count_statuses(setup)
    print(f"  status events: {types}; distinct jobs started {distinct}; dead letters {dead}; running {running}")
    await setup.close()
    for agent in agents:
        await agent.bus.close()
    nats.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    assert running == a.jobs and types == {"job.started": a.jobs} and distinct == a.jobs and dead == 0, \
        "a placement was not started and reported exactly once"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20000)
    p.add_argument("--rate", type=float, default=700.0, help="placements/s offered (0: as fast as possible)")
    p.add_argument("--batch", type=int, default=100, help="placements per publish (a scheduler cycle's)")
    p.add_argument("--spare", type=float, default=1.25, help="GPUs in the clusters per GPU the jobs need")
    p.add_argument("--segment", type=int, default=10000, help="print the CPU per job of every this many jobs")
    p.add_argument("--gc", default="default", help="this process's collector: default, off, young=N, freeze")
    p.add_argument("--cpu-profile", default="", help="sample this process's CPU into this file (collapsed stacks)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--prefix", default="bench")
    p.add_argument("--nats-url", default="")
    p.add_argument("--token", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--publish-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    asyncio.run(publish(args) if args.publish_only else main(args))
