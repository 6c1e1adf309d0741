"""End-to-end throughput: submit -> placed through the whole running federation.

Starts ``fedsched up`` (``--mode embedded``: every service in one process; ``--mode processes``:
``up --processes``, admission / scheduler / audit+billing / agents as separate processes) on a
generated topology of trace clusters with room to spare (3 regions x 2 clusters of 8-GPU T4
nodes, ``--spare`` x the GPUs the jobs need, so nothing waits for capacity), waits until every
cluster reports healthy, then offers ``--jobs`` one-GPU jobs through the gRPC API:

- at max rate (``--rate 0``): ``--concurrency`` concurrent callers, each sending ``SubmitJob``
  (``--batch 0``) or ``SubmitJobs`` batches of ``--batch`` jobs (falls back to ``SubmitJob`` if
  the server does not implement it);
- at a fixed rate (``--rate R`` jobs/s): one job every 1/R s on a timetable, each its own call
  (``--batch 0``) or ``--batch`` B at a time in one ``SubmitJobs`` every B/R s, as a client
  coalescing its submits would send them (at most ``--max-in-flight`` calls outstanding; the
  offered rate achieved is printed). A job's latency counts from its moment on the timetable,
  so the wait for its batch is part of it.

A job counts as *placed* when its first ``job.placed`` event reaches the bench on the bus (a
plain NATS subscription to ``<prefix>.placements.>``, the agents' subject); its first
``job.started`` (``<prefix>.status.>``) is counted too, and so are attempts the scheduler
declared lost (``job.stopped`` ``cluster_lost``: it judged their cluster stale, no heartbeat read
for ``stale_after_s``; the job is queued and placed again). ``job.placed`` events beyond one per
job are re-placements (after a loss, or a placement not started within ``reclaim_after_s``). Latency = that moment minus
the moment the submit call was made (both on this process's monotonic clock). Printed:
submit->placed throughput per ``--window`` seconds of the run (so decay shows) with the p50/p99
latency of the jobs submitted in each window (so a stall shows when it happened), overall
throughput, p50/p99/max latency and where it went (origin -> admission's acceptance, the
``job.submitted`` event's ``occurred_at``; -> the scheduler's decision, ``job.placed``'s; -> the
bench's receipt), the submit RPC's own p50/p99, CPU seconds per process of the
system over the offer (from ``/proc``; plus the bench client's) and RSS (now and peak). The
CPU to the last placement leaves out work the placements left behind (agents' starts, audit and
billing rows), so with ``--settle S`` (default 60) the bench then waits -- at most S seconds --
until every placed job was seen started and the writers' durable consumers (``audit-events``,
``billing``, ``billing-transfer``) have nothing pending, and prints each process's CPU per placed
job up to then: the whole cost of a job, the figure that bounds sustained throughput.

    python bench/e2e_throughput.py --mode embedded --mode processes --jobs 20000
    python bench/e2e_throughput.py --mode embedded --jobs 5000 --rate 500

Jobs run ``--runtime`` seconds (default 3600: they keep running, so the running set grows with
the run, as in the issue's measurement). Figures depend on the machine (2 cores here, shared by
the bench client, nats-server and the services). ``--py-spy SECONDS`` also samples every Python
process of the system for that long, starting ``--py-spy-after`` s into the offer, with py-spy
(``pip install py-spy``), into ``<out>/<mode>-<name>.txt`` (``--profile-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsched.api.v1 import jobs_pb2 as pb  # noqa: E402
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc  # noqa: E402
from fedapp.client import aio_channel, with_local_credentials  # noqa: E402
from fedsched.auth import TOKEN_FILE, read_token_file  # noqa: E402
from fedsched.natsd import free_port  # noqa: E402

REGIONS = ("cn-north-1", "cn-east-1", "cn-south-1")  # the bundled policy's tenants live here
TENANTS = ("search", "ads", "nlp", "vision", "recsys")
GPUS_PER_NODE = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- topology


def write_topology(work: Path, jobs: int, spare: float, clusters_per_region: int = 2) -> tuple[Path, int]:
    """A topology with ``spare`` x the GPUs ``jobs`` one-GPU jobs need, over 3 regions x
    ``clusters_per_region`` trace clusters of 8-GPU T4 nodes (96 cores, 768 GiB each).

    Returns:
        (topology path, number of clusters).
    """
    n_clusters = len(REGIONS) * clusters_per_region
    nodes_per_cluster = max(1, math.ceil(jobs * spare / GPUS_PER_NODE / n_clusters))
    lines = ["regions:"]
    lines += [f"  - name: {r}\n    zones: [{r}a]" for r in REGIONS]
    lines.append("clusters:")
    for r in REGIONS:
        for c in range(clusters_per_region):
            name = f"{r}-c{c + 1}"
            csv = work / f"{name}.csv"
            csv.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
                f"{name}-n{i:05d},96000,786432,{GPUS_PER_NODE},T4\n" for i in range(nodes_per_cluster)))
            lines.append(f"  - name: {name}\n    region: {r}\n    zone: {r}a\n    backend: trace\n"
                         f"    trace: {{nodes: {csv.name}}}")
    path = work / "topology.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, n_clusters


def job_spec(i: int, runtime_s: float) -> pb.JobSpec:
    """Job ``i``: one T4, 4 cores, 8 GiB, runs ``runtime_s`` on the trace agents."""
    return pb.JobSpec(tenant=TENANTS[i % len(TENANTS)], project="batch", kind=pb.JOB_KIND_BATCH, gpus_per_worker=1,
                      cpu_milli=4000, memory_mib=8192, card_models=["T4"], estimated_duration_seconds=runtime_s,
                      annotations={"trace.runtime_s": str(runtime_s)}, name=f"e2e-{i}")


# --------------------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[str, int, float] | None:
    """(comm, ppid, CPU seconds user+system) of ``pid`` from /proc, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def _memory_mib(pid: int) -> tuple[float, float]:
    """(RSS now, peak RSS) of ``pid`` in MiB (0 when gone)."""
    rss = hwm = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, hwm


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


@dataclass
class System:
    """A running ``fedsched up`` (subprocess) and what it printed."""

    proc: subprocess.Popen
    grpc_target: str
    nats_port: int
    data_dir: Path
    names: dict[int, str] = field(default_factory=dict)  # pid -> name

    def processes(self) -> dict[int, str]:
        """pid -> name of every live process of the system (named as ``up`` printed them)."""
        out = {}
        for pid in descendants(self.proc.pid):
            st = _stat(pid)
            if st is None:
                continue
            name = self.names.get(pid) or ("up" if pid == self.proc.pid else st[0])
            out[pid] = name
        return out


def start_system(mode: str, work: Path, topology: Path, timeout_s: float = 180, verbose: bool = False) -> System:
    """Start ``fedsched up`` (``--processes`` in mode ``processes``; ``verbose``: ``-v``, its INFO log
    in ``<work>/up-<mode>.log``) and wait until it serves."""
    data_dir = work / f"data-{mode}"
    grpc_target = f"127.0.0.1:{free_port()}"
    nats_port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", FEDSCHED_NATS_PORT=str(nats_port),
               FEDSCHED_METRICS_PORT="0")  # free metrics ports: another `fedsched up` may hold 9464
    for k in ("FEDSCHED_NATS_URL", "FEDSCHED_CLICKHOUSE_URL", "FEDSCHED_DATA_DIR"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "fedapp.cli", "up", "--no-web", "--data-dir", str(data_dir), "--grpc-address",
            grpc_target, "--topology", str(topology)] + (["--processes"] if mode == "processes" else []) + (
                ["--verbose"] if verbose else [])
    log = open(work / f"up-{mode}.log", "w")  # noqa: SIM115 - kept open while it runs
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "Ctrl-C stops" in line:
            names = {int(m[2]): m[1] for m in (re.match(r"\s+(\S+) pid (\d+)", x) for x in lines) if m}
            # keep draining stdout so `up` never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return System(proc, grpc_target, nats_port, data_dir, names)
    proc.kill()
    raise RuntimeError("fedsched up did not start:\n" + "".join(lines) + (work / f"up-{mode}.log").read_text())


def stop_system(system: System) -> int:
    """SIGTERM, wait (60 s, then SIGKILL); returns the exit code."""
    system.proc.send_signal(signal.SIGTERM)
    try:
        return system.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        system.proc.kill()
        return system.proc.wait()


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    """What one offer recorded (monotonic seconds)."""

    submitted: dict[str, float] = field(default_factory=dict)  # job id -> submit call start
    accepted_rpc: list[float] = field(default_factory=list)  # submit RPC latencies (s), per call
    placed: dict[str, float] = field(default_factory=dict)  # job id -> first job.placed seen on the bus
    started: dict[str, float] = field(default_factory=dict)  # job id -> first job.started seen on the bus
    placements: int = 0  # job.placed events (a job placed again after a lost attempt counts again)
    #: job id -> occurred_at (wall s) of its job.submitted (admission's acceptance) and first job.placed
    #: (the scheduler's decision): the latency breakdown
    accepted_at: dict[str, float] = field(default_factory=dict)
    decided_at: dict[str, float] = field(default_factory=dict)
    lost: int = 0  # job.stopped with reason cluster_lost (the scheduler judged the cluster stale)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    t0: float = 0.0
    offer_end: float = 0.0
    batch_fallback: bool = False
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(text)


async def follow_placements(nats_port: int, data_dir: Path, run: Run, prefix: str):
    """Follow ``<prefix>.placements.>`` and ``<prefix>.status.>`` (from the events stream, as the operator's
    user) and note when each job's ``job.placed`` / ``job.started`` arrives."""
    import nats

    nc = await nats.connect(with_local_credentials(f"nats://127.0.0.1:{nats_port}", data_dir), name="bench")

    async def on_msg(msg) -> None:
        now = time.monotonic()
        data = msg.data
        if b'"job.placed"' not in data[:400]:
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        if event.get("type") == "job.placed":
            run.placements += 1
            job_id = event.get("job_id", "")
            run.placed.setdefault(job_id, now)
            run.decided_at.setdefault(job_id, _epoch(event.get("occurred_at")))

    async def on_job(msg) -> None:
        if b'"job.submitted"' not in msg.data[:400]:
            return
        try:
            event = json.loads(msg.data)
        except ValueError:
            return
        run.accepted_at.setdefault(event.get("job_id", ""), _epoch(event.get("occurred_at")))

    async def on_status(msg) -> None:
        now = time.monotonic()
        head = msg.data[:400]
        if b'"job.started"' in head:
            run.started.setdefault(json.loads(msg.data).get("job_id", ""), now)
        elif b'"job.stopped"' in head and b"cluster_lost" in msg.data:
            run.lost += 1

    # the operator's user may not subscribe to business subjects (fedapp.natsauth.ops_user): read them
    # from the events stream through ordered push consumers delivering to this connection's inboxes
    from nats.js.api import DeliverPolicy

    js = nc.jetstream()
    await js.subscribe(f"{prefix}.placements.>", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                       pending_msgs_limit=-1, pending_bytes_limit=-1)
    await js.subscribe(f"{prefix}.status.>", cb=on_status, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                       pending_msgs_limit=-1, pending_bytes_limit=-1)
    await js.subscribe(f"{prefix}.jobs.>", cb=on_job, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
                       pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    return nc


def _epoch(iso: str | None) -> float:
    """Seconds since the epoch of an envelope's ``occurred_at`` (ISO-8601 UTC); NaN if absent."""
    if not iso:
        return math.nan
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def wait_clusters(stub, expected: int, timeout_s: float = 120) -> None:
    """Until ``expected`` clusters are listed healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await stub.ListClusters(pb.ListClustersRequest(), timeout=10)
            if sum(1 for c in resp.clusters if c.healthy) >= expected:
                return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                await asyncio.sleep(3)  # an older admission: give the agents' first snapshots time
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {expected} clusters healthy after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def submit_one(stub, run: Run, i: int, runtime_s: float, tag: str, origin: float | None = None) -> None:
    """Job ``i`` in one ``SubmitJob`` (request id ``<tag>-<i>``): its origin (``origin``, the
    job's moment on a timetable, else the send time) and the call's latency into ``run``, or
    the error."""
    t = time.monotonic()
    try:
        resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=job_spec(i, runtime_s), request_id=f"{tag}-{i}"),
                                    timeout=60)
        run.submitted[resp.job_id] = t if origin is None else origin
        run.accepted_rpc.append(time.monotonic() - t)
    except grpc.aio.AioRpcError as e:
        run.error(f"{e.code().name}: {e.details()}")


async def submit_many(stub, run: Run, first: int, n: int, runtime_s: float, tag: str,
                      origins: list[float] | None = None) -> None:
    """Jobs ``first`` .. ``first + n - 1`` in one ``SubmitJobs`` call; each accepted job's origin
    (``origins[k]``, its moment on a timetable, else the send time) into ``run``. If the server
    does not implement ``SubmitJobs``, sends them one ``SubmitJob`` each (``run.batch_fallback``)."""
    t = time.monotonic()
    items = [pb.SubmitJobRequest(spec=job_spec(i, runtime_s), request_id=f"{tag}-{i}") for i in range(first, first + n)]
    try:
        resp = await stub.SubmitJobs(pb.SubmitJobsRequest(items=items), timeout=60)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            run.batch_fallback = True
            for k, i in enumerate(range(first, first + n)):
                await submit_one(stub, run, i, runtime_s, tag, None if origins is None else origins[k])
            return
        run.error(f"{e.code().name}: {e.details()}")
        return
    run.accepted_rpc.append(time.monotonic() - t)
    for k, r in enumerate(resp.results):
        if r.code:
            run.error(f"item code {r.code}: {r.message}")
        else:
            run.submitted[r.response.job_id] = t if origins is None else origins[k]


async def offer_max(stub, run: Run, jobs: int, concurrency: int, batch: int, runtime_s: float, tag: str) -> None:
    """``concurrency`` callers take jobs from one counter until ``jobs`` are sent."""
    next_i = 0

    async def caller() -> None:
        nonlocal next_i
        while next_i < jobs:
            first = next_i
            n = min(max(batch, 1), jobs - first)
            next_i += n
            if batch and not run.batch_fallback:
                await submit_many(stub, run, first, n, runtime_s, tag)
            else:
                for i in range(first, first + n):
                    await submit_one(stub, run, i, runtime_s, tag)

    await asyncio.gather(*(caller() for _ in range(concurrency)))


async def offer_rate(stub, run: Run, jobs: int, rate: float, runtime_s: float, tag: str, max_in_flight: int,
                     batch: int = 0) -> None:
    """Job ``i`` is due at ``i / rate`` s on a timetable (checked in 5 ms ticks): with ``batch``
    0 each due job is its own ``SubmitJob``; else the due jobs go ``batch`` at a time in one
    ``SubmitJobs`` (one call every ``batch / rate`` s, as a client coalescing its submits would
    send them). Either way a job's latency counts from its moment on the timetable, so the time
    it waited for its batch (or for a tick) is part of it."""
    in_flight = asyncio.Semaphore(max_in_flight)
    tasks = set()
    size = max(batch, 1)

    async def send(first: int, n: int) -> None:
        origins = [start + k / rate for k in range(first, first + n)]
        try:
            if batch and not run.batch_fallback:
                await submit_many(stub, run, first, n, runtime_s, tag, origins)
            else:
                for k, i in enumerate(range(first, first + n)):
                    await submit_one(stub, run, i, runtime_s, tag, origins[k])
        finally:
            in_flight.release()

    start = time.monotonic()
    i = 0
    while i < jobs:
        due = min(jobs, int((time.monotonic() - start) * rate) + 1)
        while due - i >= size or (due == jobs and i < jobs):
            n = min(size, jobs - i)
            await in_flight.acquire()
            task = asyncio.create_task(send(i, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += n
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def cpu_snapshot(system: System) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) of the system's processes."""
    out = {}
    for pid, name in system.processes().items():
        st = _stat(pid)
        if st is not None:
            out[pid] = (name, st[2])
    return out


def py_spy(system: System, seconds: float, out_dir: Path, mode: str) -> list[subprocess.Popen]:
    """Start py-spy (raw collapsed stacks) on every Python process of the system."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    procs = []
    for pid, name in system.processes().items():
        st = _stat(pid)
        if st is None or not st[0].startswith("python"):
            continue
        out = out_dir / f"{mode}-{name}.txt"
        procs.append(subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "50",
                                       "-f", "raw", "-o", str(out), "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


async def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    """Start the system in ``mode``, offer the jobs, wait for placements, measure, stop."""
    topology, n_clusters = write_topology(work, args.jobs, args.spare)
    system = start_system(mode, work, topology, verbose=args.verbose)
    prefix = os.environ.get("FEDSCHED_SUBJECT_PREFIX", "fed")
    run = Run()
    nc = None
    try:
        token = read_token_file(system.data_dir / TOKEN_FILE)
        nc = await follow_placements(system.nats_port, system.data_dir, run, prefix)
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        async with aio_channel(system.grpc_target, token, options=options) as ch:
            await wait_clusters(pb_grpc.ClusterServiceStub(ch), n_clusters)
            stub = pb_grpc.JobServiceStub(ch)
            cpu0 = cpu_snapshot(system)
            me0 = time.process_time()
            load0 = os.getloadavg()[0]
            run.t0 = time.monotonic()
            print(f"  [{mode}] offer starts at {time.strftime('%H:%M:%S', time.gmtime())} UTC (t=0)", flush=True)
            spies = []
            if args.py_spy:
                asyncio.get_running_loop().call_later(
                    args.py_spy_after, lambda: spies.extend(py_spy(system, args.py_spy, args.profile_dir, mode)))
            tag = f"e2e{int(time.time())}"
            offer = (offer_max(stub, run, args.jobs, args.concurrency, args.batch, args.runtime, tag)
                     if args.rate <= 0 else
                     offer_rate(stub, run, args.jobs, args.rate, args.runtime, tag, args.max_in_flight, args.batch))
            offering = asyncio.create_task(offer)
            deadline = run.t0 + args.timeout
            last_print = run.t0
            last_count, last_change = 0, run.t0
            while True:
                await asyncio.sleep(0.2)
                now = time.monotonic()
                if now - last_print >= args.window:
                    last_print = now
                    print(f"  [{mode}] t={now - run.t0:6.1f}s submitted {len(run.submitted):6d} "
                          f"placed {len(run.placed):6d} started {len(run.started):6d} lost {run.lost:6d}", flush=True)
                if offering.done() and not run.offer_end:
                    run.offer_end = now
                    offering.result()
                if offering.done() and sum(1 for j in run.submitted if j in run.placed) >= len(run.submitted):
                    break
                if now > deadline:
                    print(f"  [{mode}] timeout after {args.timeout:.0f} s", flush=True)
                    break
                if len(run.placed) != last_count:
                    last_count, last_change = len(run.placed), now
                elif offering.done() and now - last_change > args.stall:
                    print(f"  [{mode}] no new placement for {args.stall:.0f} s; stopping the wait", flush=True)
                    break
            end = time.monotonic()
            cpu1 = cpu_snapshot(system)
            me1 = time.process_time()
            memory = {pid: _memory_mib(pid) for pid in cpu1}
            run.load = (load0, os.getloadavg()[0])
            settled = None
            if args.settle > 0:  # the work placements leave behind: starts, audit and billing rows
                settled = await settle(nc, run, prefix, args.settle, system)
            for spy in spies:
                spy.wait(timeout=args.py_spy + 60)
    finally:
        if nc is not None:
            await nc.close()
        code = stop_system(system)
    return report(mode, args, run, end, cpu0, cpu1, memory, me1 - me0, code, settled)


#: durable consumers whose backlog is the writers' share of the work (audit, billing)
WRITERS = (("EVENTS", "audit-events"), ("EVENTS", "billing"), ("EVENTS", "billing-transfer"))


async def settle(nc, run: Run, prefix: str, timeout_s: float, system: System):
    """After the last placement: wait (at most ``timeout_s``) until every placed job was seen
    started and the writers' durable consumers (audit, billing) have nothing pending, then take
    the CPU of every process again. Returns (seconds waited, CPU snapshot, writers' backlog
    left or None when it cannot be read)."""
    t0 = time.monotonic()
    js = nc.jetstream(timeout=2)
    backlog = None
    while True:
        try:
            backlog = 0
            for stream, durable in WRITERS:
                info = await js.consumer_info(f"{prefix.upper()}_{stream}", durable)
                backlog += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        except Exception:  # noqa: BLE001 - not readable with these credentials: starts only
            backlog = None
        if (len(run.started) >= len(run.placed) and not backlog) or time.monotonic() - t0 > timeout_s:
            break
        await asyncio.sleep(0.5)
    return time.monotonic() - t0, cpu_snapshot(system), backlog


def report(mode: str, args, run: Run, end: float, cpu0, cpu1, memory, client_cpu: float, exit_code: int,
           settled=None) -> dict:
    """Print and return the figures of one run."""
    lat = [run.placed[j] - t for j, t in run.submitted.items() if j in run.placed]
    placed_times = sorted(run.placed[j] for j in run.submitted if j in run.placed)
    last = placed_times[-1] if placed_times else run.t0
    span = max(1e-9, last - run.t0)
    offered = (f"max rate, {args.concurrency} callers" + (f", SubmitJobs x{args.batch}" if args.batch else ", SubmitJob")
               + (" (SubmitJobs unimplemented: fell back to SubmitJob)" if run.batch_fallback else "")
               if args.rate <= 0 else f"{args.rate:g} jobs/s offered"
               + (f" in SubmitJobs x{args.batch}" if args.batch else ", one SubmitJob each"))
    offer_s = (run.offer_end or end) - run.t0
    print(f"\n== {mode}: {args.jobs} jobs, {offered}; {os.cpu_count()} CPUs, load average {run.load[0]:.1f} at the "
          f"start, {run.load[1]:.1f} at the end (other work on the machine competes for the CPUs)")
    print(f"  submitted {len(run.submitted)} ({run.errors} errors) in {offer_s:.1f} s "
          f"= {len(run.submitted) / max(offer_s, 1e-9):.0f} jobs/s accepted")
    for s in run.error_samples:
        print(f"    error: {s}")
    print(f"  placed    {len(lat)} of {len(run.submitted)}; submit->placed throughput {len(lat) / span:.0f} jobs/s "
          f"over {span:.1f} s (first submit to last placement)")
    windows: list[str] = []
    w = args.window
    n_windows = int(span // w) + 1
    counts = [0] * n_windows
    for t in placed_times:
        counts[min(n_windows - 1, int((t - run.t0) // w))] += 1
    sub_counts = [0] * n_windows
    by_window: list[list[float]] = [[] for _ in range(n_windows)]  # latencies of the jobs submitted in it
    for j, t in run.submitted.items():
        k = min(n_windows - 1, max(0, int((t - run.t0) // w)))
        sub_counts[k] += 1
        if j in run.placed:
            by_window[k].append(run.placed[j] - t)
    for k, (c, s) in enumerate(zip(counts, sub_counts)):
        tail = (f"  submitted then: p50 {pct(by_window[k], .5) * 1000:6.0f} ms, p99 {pct(by_window[k], .99) * 1000:6.0f} ms"
                if by_window[k] else "")
        windows.append(f"    {k * w:5.0f}-{(k + 1) * w:<5.0f}s  submitted {s / w:7.0f}/s  placed {c / w:7.0f}/s{tail}")
    print(f"  per {w:g} s window:")
    print("\n".join(windows))
    started = [run.started[j] - t for j, t in run.submitted.items() if j in run.started]
    print(f"  started   {len(started)} of {len(run.submitted)}; {run.placements} job.placed events, {run.lost} "
          f"attempts declared lost (job.stopped cluster_lost: the scheduler judged their cluster stale, no heartbeat "
          f"read for stale_after_s; the job is queued and placed again)")
    if started:
        print(f"  latency submit->started (first job.started): p50 {pct(started, .5) * 1000:.0f} ms, "
              f"p99 {pct(started, .99) * 1000:.0f} ms, max {max(started) * 1000:.0f} ms")
    if lat:
        print(f"  latency submit->placed: p50 {pct(lat, .5) * 1000:.0f} ms, p99 {pct(lat, .99) * 1000:.0f} ms, "
              f"max {max(lat) * 1000:.0f} ms")
    # where the time goes, per job: (1) its origin to admission's acceptance (client, gRPC, admission:
    # the job.submitted event's occurred_at), (2) to the scheduler's decision (admission's publish,
    # the scheduler's read, its wait for the cycle, the cycle: job.placed's occurred_at), (3) to the
    # bench's receipt of job.placed (publish, stream, delivery); wall clocks of this one machine
    skew = time.time() - time.monotonic()  # monotonic -> wall (both read now: drift over a run is nil)
    parts: list[list[float]] = [[], [], []]
    names = ("origin->accepted", "accepted->decided", "decided->seen")
    for j, t in run.submitted.items():
        a, d, r = run.accepted_at.get(j, math.nan), run.decided_at.get(j, math.nan), run.placed.get(j)
        if r is None or math.isnan(a) or math.isnan(d):
            continue
        for k, v in enumerate((a - (t + skew), d - a, (r + skew) - d)):
            parts[k].append(v)
    if parts[0]:
        print(f"  latency breakdown ({len(parts[0])} jobs), p50 / p99 ms: " + "; ".join(
            f"{n} {pct(v, .5) * 1000:.0f} / {pct(v, .99) * 1000:.0f}" for n, v in zip(names, parts)))
    if run.accepted_rpc:
        print(f"  submit RPC latency: p50 {pct(run.accepted_rpc, .5) * 1000:.1f} ms, "
              f"p99 {pct(run.accepted_rpc, .99) * 1000:.1f} ms")
    wall = end - run.t0
    print(f"  CPU seconds over the {wall:.1f} s run (share of one core; CPU ms per placed job: the cost that "
          f"bounds throughput whatever else runs), and RSS now / peak (MiB):")
    rows = []
    for pid, (name, cpu) in sorted(cpu1.items(), key=lambda kv: kv[1][0]):
        used = cpu - cpu0.get(pid, (name, 0.0))[1]
        rss, hwm = memory.get(pid, (0.0, 0.0))
        rows.append({"process": name, "pid": pid, "cpu_s": round(used, 2), "rss_mib": round(rss), "peak_mib": round(hwm)})
        per_job = used / max(len(lat), 1) * 1000
        rows[-1]["cpu_ms_per_job"] = round(per_job, 3)
        print(f"    {name:16s} pid {pid:7d}  cpu {used:7.1f} s ({used / wall * 100:4.0f}%, {per_job:5.2f} ms/job)  "
              f"rss {rss:6.0f}  peak {hwm:6.0f}")
    print(f"    {'bench client':16s} {'':11s}  cpu {client_cpu:7.1f} s ({client_cpu / wall * 100:4.0f}%)")
    settled_rows = []
    if settled is not None:
        waited, cpu2, backlog = settled
        total = 0.0
        print(f"  CPU until settled ({waited:.1f} s after the last placement: {len(run.started)} of {len(run.placed)} "
              f"started, writers' backlog {'unknown' if backlog is None else backlog}), ms per placed job:")
        for pid, (name, cpu) in sorted(cpu2.items(), key=lambda kv: kv[1][0]):
            used = cpu - cpu0.get(pid, (name, 0.0))[1]
            total += used
            settled_rows.append({"process": name, "cpu_s": round(used, 2),
                                 "cpu_ms_per_job": round(used / max(len(lat), 1) * 1000, 3)})
            print(f"    {name:16s} cpu {used:7.1f} s  {used / max(len(lat), 1) * 1000:5.2f} ms/job")
        print(f"    {'all':16s} cpu {total:7.1f} s  {total / max(len(lat), 1) * 1000:5.2f} ms/job")
    print(f"  fedsched up exited {exit_code}")
    return {"mode": mode, "jobs": args.jobs, "rate": args.rate, "batch": args.batch, "concurrency": args.concurrency,
            "submitted": len(run.submitted), "errors": run.errors, "placed": len(lat),
            "throughput_jobs_s": len(lat) / span, "span_s": span,
            "windows_placed_per_s": [c / w for c in counts],
            "latency_ms": {"p50": pct(lat, .5) * 1000 if lat else None, "p99": pct(lat, .99) * 1000 if lat else None,
                           "max": max(lat) * 1000 if lat else None},
            "breakdown_jobs": len(parts[0]),
            "breakdown_ms": {n: {"p50": pct(v, .5) * 1000, "p99": pct(v, .99) * 1000} for n, v in zip(names, parts) if v},
            "started": len(started), "placements": run.placements, "lost": run.lost,
            "processes": rows, "settled": settled_rows, "client_cpu_s": client_cpu, "exit_code": exit_code, "load_average": run.load}


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="fedsched-e2e-"))
    results = []
    try:
        for mode in args.mode or ["embedded", "processes"]:
            results.append(await run_mode(mode, args, work))
    finally:
        if args.keep:
            print(f"data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", choices=["embedded", "processes"],
                        help="repeatable; default both")
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--rate", type=float, default=0.0, help="jobs/s offered; 0 = max rate")
    parser.add_argument("--concurrency", type=int, default=64, help="callers at max rate")
    parser.add_argument("--batch", type=int, default=0,
                        help="SubmitJobs items per call (0 = one SubmitJob per job); at a fixed rate, one call every batch/rate s")
    parser.add_argument("--max-in-flight", type=int, default=2000, help="fixed rate: outstanding calls at most")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per throughput window")
    parser.add_argument("--runtime", type=float, default=3600.0, help="each job's run time on the trace agents (s)")
    parser.add_argument("--spare", type=float, default=1.25, help="GPUs in the topology / GPUs the jobs need")
    parser.add_argument("--timeout", type=float, default=1200.0, help="give up waiting for placements after (s)")
    parser.add_argument("--stall", type=float, default=120.0,
                        help="after the offer, stop waiting once no new job was placed for this long (s)")
    parser.add_argument("--settle", type=float, default=60.0,
                        help="after the last placement, wait this long at most for every start and for audit and "
                             "billing to catch up, and report the CPU per job to then (0 = do not wait)")
    parser.add_argument("--py-spy", type=float, default=0.0, help="sample every Python process this long (s)")
    parser.add_argument("--py-spy-after", type=float, default=10.0, help="start sampling this far into the offer (s)")
    parser.add_argument("--profile-dir", type=Path, default=Path("."), help="where py-spy writes")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    parser.add_argument("--verbose", action="store_true",
                        help="run `up` with --verbose (its INFO log, e.g. checkpoints and collector compactions, in "
                             "the kept work dir's up-<mode>.log; with --keep)")
    asyncio.run(main(parser.parse_args()))
