"""Chaos drill: kill -9 every kind of process during a workload; nothing lost, nothing doubled, same cost.

    python bench/chaos.py [--loops 3] [--jobs 12] [--runtime 20] [--kinds nats,scheduler,agent,writers]

Every process is real and separate (issue 14 items 9 and 10):

* a three-node NATS cluster (:class:`fedsched.natsd.NatsCluster`), streams and KV buckets at R3;
* ``fedsched service`` processes (``python -m fedapp.cli service ...``) against it, each given all
  three URLs: ``admission``, ``scheduler`` twice (one active by the lease, one standby),
  ``agents`` (one trace cluster ``cn-north-1-c1`` of two 8-T4 nodes) and ``writers`` (audit and
  billing in one process: the embedded chDB admits one process per data dir);
* business time is wall time (``SystemClock``): a job runs ``--runtime`` s.

One run (:func:`run_once`): start everything, submit ``--jobs`` one-GPU jobs through gRPC in
pairs, and between pairs kill -9 one process of each kind in ``--kinds`` and start it again --
``nats``: a node (a follower of the events stream on even loops, its leader on odd ones; it
restarts on its store and catches up), ``scheduler``: the *active* replica (from the status
endpoint's lease holder; a new replica replaces it, the standby takes over), ``agent``,
``writers``. Then wait until every job has ended, stop the producers, let the writers drain and
read the audit log and the usage lines with SQL (``<p>.svc.store.query``). Figures:

* ``lost``  = messages in the streams - rows in the audit log (``events``), once the writers are idle;
* ``doubled`` = rows - distinct event ids;
* ``cost``  = sum of the compute lines; a clean run (no kills) first gives the reference.

A process that exits by itself (e.g. a replica whose start timed out while NATS elected
leaders) is started again, as Kubernetes would, and listed in the loop's line.

``--loops N`` repeats the chaos run N times against one clean run and prints one line per loop;
exit status 1 if any loop lost, doubled, or differed in cost. ``tests/e2e/test_chaos_drill.py``
runs one short loop and checks the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import nats  # noqa: E402

from fedapp.client import aio_channel  # noqa: E402
from fedsched.api.v1 import jobs_pb2 as pb  # noqa: E402
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc  # noqa: E402
from fedsched.natsd import NatsCluster, free_port  # noqa: E402

KINDS = ("nats", "scheduler", "agent", "writers")
TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}
TOPOLOGY = """
regions:
  - name: cn-north-1
    zones: [cn-north-1a]
clusters:
  - name: cn-north-1-c1
    region: cn-north-1
    zone: cn-north-1a
    backend: trace
    trace:
      nodes: nodes.csv
"""
NODES = "sn,cpu_milli,memory_mib,num_gpu,gpu,model\nn1,64000,262144,,8,T4\nn2,64000,262144,,8,T4\n"


@dataclass
class DrillResult:
    """One run's figures (see the module docstring)."""

    jobs: int
    succeeded: int
    attempts: int
    stream_messages: int
    audit_rows: int
    distinct_events: int
    cost: Decimal
    kills: list[str] = field(default_factory=list)
    failover_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    crashes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Stream messages missing from the audit log."""
        return self.stream_messages - self.audit_rows

    @property
    def doubled(self) -> int:
        """Audit rows beyond one per event id."""
        return self.audit_rows - self.distinct_events


class Drill:
    """The processes of one run (see the module docstring).

    Args:
        base_dir: working directory (NATS stores, data dir, logs).
        lease_ttl_s: the scheduler lease's TTL (seconds).
        writer_ack_wait_s: the writers' JetStream ack wait (``FEDSCHED_WRITER_ACK_WAIT_S``,
            seconds; None = the product's default, 5 s). A writers process killed with a batch in
            hand leaves it unacknowledged until then, and the drill waits for the writers to drain.
    """

    def __init__(self, base_dir: Path, *, lease_ttl_s: float = 2.0, writer_ack_wait_s: float | None = None) -> None:
        self.base = Path(base_dir)
        self.base.mkdir(parents=True, exist_ok=True)
        self.prefix = "c" + uuid.uuid4().hex[:8]
        self.data_dir = self.base / "data"
        self.cluster = NatsCluster(self.base / "nats")
        self.grpc_port = free_port()
        (self.base / "nodes.csv").write_text(NODES)
        (self.base / "topology.yaml").write_text(TOPOLOGY)
        self.env = {**os.environ, "FEDSCHED_SUBJECT_PREFIX": self.prefix, "FEDSCHED_STREAM_REPLICAS": "3",
                    "FEDSCHED_STALE_AFTER_S": "120", "FEDSCHED_RECLAIM_AFTER_S": "300",
                    "FEDSCHED_SCHEDULER_LEASE_TTL_S": str(lease_ttl_s), "FEDSCHED_HEARTBEAT_INTERVAL_S": "0.5",
                    "PYTHONPATH": str(ROOT)}
        if writer_ack_wait_s is not None:
            self.env["FEDSCHED_WRITER_ACK_WAIT_S"] = str(writer_ack_wait_s)
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.nc = None
        self.token = ""
        self._replica = 0
        self.crashes: list[str] = []  #: processes that exited by themselves (restarted)

    # ------------------------------------------------------------------ processes

    def _spawn(self, kind: str) -> subprocess.Popen:
        name = {"agent": "agents"}.get(kind, kind)
        self._replica += 1
        args = [sys.executable, "-m", "fedapp.cli", "service", name, "--nats-url", self.cluster.client_urls,
                "--data-dir", str(self.data_dir), "--topology", str(self.base / "topology.yaml")]
        if name == "admission":
            args += ["--grpc-address", f"127.0.0.1:{self.grpc_port}"]
        log = open(self.base / f"{kind}-{self._replica}.log", "wb")  # noqa: SIM115 - the child writes it
        proc = subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs.setdefault(kind, []).append(proc)
        return proc

    async def start(self) -> None:
        """Start the NATS cluster and every service; return once admission answers."""
        self.cluster.start()
        await self.cluster.wait_jetstream()
        async def quiet(e: Exception) -> None:  # the drill kills the node this connection uses
            pass

        self.nc = await nats.connect(self.cluster.client_urls.split(","), max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.2, error_cb=quiet)
        # admission first: it creates the streams and stores the first policy (R3 on a cluster
        # that busy cores make slow to answer -- a start that timed out is tried again)
        token_file = self.data_dir / "admin.token"
        for attempt in range(3):
            proc = self._spawn("admission")
            try:
                await _until(lambda: token_file.exists() and token_file.read_text().strip(), 120,
                             "admission's admin token", lambda: _exited(proc))
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                self.procs["admission"].remove(proc)
        self.token = token_file.read_text().strip()
        for kind in ("writers", "scheduler", "scheduler", "agent"):
            self._spawn(kind)
        await _until(self._scheduler_active, 120, "an active scheduler", self._check_alive)

    def _check_alive(self) -> None:
        """Supervise (as Kubernetes restarts a crashed pod): a process that exited by itself --
        e.g. a start that timed out while the cluster elected leaders -- is started again and
        counted in :attr:`crashes`; more than 5 crashes end the run."""
        for kind, procs in self.procs.items():
            for p in list(procs):
                if p.poll() is not None and not getattr(p, "killed", False) and not getattr(p, "stopping", False):
                    p.killed = True  # type: ignore[attr-defined] - handled
                    self.crashes.append(f"{kind} pid {p.pid} exit {p.returncode}")
                    if len(self.crashes) > 5:
                        raise RuntimeError(f"processes keep exiting ({self.crashes}); see {self.base}/*.log")
                    self._spawn(kind)

    async def _scheduler_status(self) -> dict | None:
        try:
            msg = await self.nc.request(f"{self.prefix}.svc.scheduler.status", b"", timeout=1.0)
            return json.loads(msg.data)
        except Exception:  # noqa: BLE001 - none active right now
            return None

    async def _scheduler_active(self) -> bool:
        return await self._scheduler_status() is not None

    def _kill9(self, proc: subprocess.Popen) -> None:
        proc.killed = True  # type: ignore[attr-defined]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    async def kill(self, kind: str, loop: int) -> tuple[str, float | None]:
        """kill -9 one process of ``kind`` and bring it back; returns (what, scheduler failover s)."""
        if kind == "nats":
            info = await self._events_info()
            victim = info["leader"] if loop % 2 else info["replicas"][0]
            self.cluster.kill(victim)
            await asyncio.sleep(1.0)
            self.cluster.restart(victim)
            await _until(self._replicas_current, 90, f"NATS node {victim} to catch up", self._check_alive)
            return f"nats {victim} ({'leader' if loop % 2 else 'follower'})", None
        if kind == "scheduler":
            await _until(self._scheduler_active, 60, "an active scheduler", self._check_alive)
            status = await self._scheduler_status()
            pid = int(status["holder"].split("/")[1])
            proc = next(p for p in self.procs["scheduler"] if p.pid == pid)
            self._kill9(proc)
            killed = time.monotonic()
            self._spawn("scheduler")  # a new standby replaces it
            await _until(self._scheduler_active, 60, "the standby taking over", self._check_alive)
            return f"scheduler pid {pid} (active)", time.monotonic() - killed
        await _until(lambda: any(p.poll() is None for p in self.procs[kind]), 60, f"a live {kind} process",
                     self._check_alive)
        proc = next(p for p in reversed(self.procs[kind]) if p.poll() is None)
        self._kill9(proc)
        await asyncio.sleep(1.0)
        self._spawn(kind)
        return f"{kind} pid {proc.pid}", None

    async def _events_info(self) -> dict:
        js = self.nc.jetstream(timeout=5)
        info = await js.stream_info(f"{self.prefix.upper()}_EVENTS")
        return {"leader": info.cluster.leader, "replicas": [r.name for r in info.cluster.replicas or []],
                "current": all(r.current for r in info.cluster.replicas or []) and len(info.cluster.replicas or []) == 2}

    async def _replicas_current(self) -> bool:
        try:
            return (await self._events_info())["current"]
        except Exception:  # noqa: BLE001 - electing
            return False

    async def stream_messages(self) -> int:
        """Messages in the federation's three streams."""
        js = self.nc.jetstream(timeout=10)
        total = 0
        for suffix in ("EVENTS", "INVENTORY", "DLQ"):
            total += int((await js.stream_info(f"{self.prefix.upper()}_{suffix}")).state.messages)
        return total

    async def sql(self, query: str) -> list[list]:
        """Rows of a read-only query answered by the writers process.

        Raises:
            RuntimeError: the query failed.
        """
        msg = await self.nc.request(f"{self.prefix}.svc.store.query",
                                    json.dumps({"sql": query, "token": self.token}).encode(), timeout=20)
        body = json.loads(msg.data)
        if "error" in body:
            raise RuntimeError(body["error"])
        return body["rows"]

    def stop_producers(self) -> None:
        """SIGTERM admission, schedulers and agents (the writers keep draining)."""
        for kind in ("admission", "scheduler", "agent"):
            for p in self.procs.get(kind, []):
                p.stopping = True  # type: ignore[attr-defined]
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        for kind in ("admission", "scheduler", "agent"):
            for p in self.procs.get(kind, []):
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    self._kill9(p)

    async def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and the NATS cluster."""
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        for procs in self.procs.values():
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    self._kill9(p)
        if self.nc is not None:
            try:
                await self.nc.close()
            except Exception:  # noqa: BLE001
                pass
        self.cluster.stop()


def _exited(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"process exited with {proc.returncode}")


async def _until(check, timeout: float, what: str, alive=None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.2)


async def run_once(base_dir: Path, *, kinds: Sequence[str] = KINDS, jobs: int = 12, runtime_s: float = 20.0,
                   loop: int = 0, lease_ttl_s: float = 2.0, writer_ack_wait_s: float | None = None) -> DrillResult:
    """One run: the workload with a kill -9 of each of ``kinds`` between submissions (none =
    the clean run). See the module docstring and :class:`Drill` for ``writer_ack_wait_s``."""
    t0 = time.monotonic()
    drill = Drill(base_dir, lease_ttl_s=lease_ttl_s, writer_ack_wait_s=writer_ack_wait_s)
    kills: list[str] = []
    failovers: list[float] = []
    try:
        await drill.start()
        ids: list[str] = []
        async with aio_channel(f"127.0.0.1:{drill.grpc_port}", drill.token) as channel:
            stub = pb_grpc.JobServiceStub(channel)
            spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000,
                              annotations={"trace.runtime_s": f"{runtime_s:g}"})
            plan = list(kinds)
            for i in range(jobs):
                for attempt in range(300):  # admission may be restarting its connection
                    try:
                        ids.append((await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=f"r{i}"),
                                                         timeout=10)).job_id)
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.2)
                else:
                    raise TimeoutError(f"submission {i} never accepted")
                if i % 2 == 1 and plan:
                    what, failover = await drill.kill(plan.pop(0), loop)
                    kills.append(what)
                    if failover is not None:
                        failovers.append(failover)
            for kind in plan:  # more kinds than pairs of jobs
                what, failover = await drill.kill(kind, loop)
                kills.append(what)
                if failover is not None:
                    failovers.append(failover)

            async def all_ended() -> bool:
                try:
                    states = [(await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=5)).state for j in ids]
                except grpc.aio.AioRpcError:
                    return False
                return all(s in TERMINAL for s in states)

            await _until(all_ended, 300 + runtime_s, "every job to end", drill._check_alive)
            done = [await stub.GetJob(pb.GetJobRequest(job_id=j), timeout=5) for j in ids]
        drill.stop_producers()

        ended_attempts = sum(1 for j in done for a in j.attempts if a.ended_at.seconds)

        async def drained() -> bool:
            # every stream message in the audit log, and every ended attempt priced once (billing
            # may still be waiting for its placement book after a restart: its usage.recorded
            # events are not in the stream yet, so the first count alone could pass early)
            try:
                logged = int((await drill.sql("SELECT count() FROM fedsched.events"))[0][0])
                priced = int((await drill.sql("SELECT count() FROM fedsched.usage WHERE line = 'compute'"))[0][0])
                return logged >= await drill.stream_messages() and priced >= ended_attempts
            except Exception:  # noqa: BLE001 - the writers may be restarting
                return False

        try:
            await _until(drained, 120, "the writers to drain", drill._check_alive)
        except TimeoutError:
            pass  # counted as lost below
        stream = await drill.stream_messages()  # with the usage.recorded events billing added meanwhile
        rows, distinct = (await drill.sql("SELECT count(), uniqExact(event_id) FROM fedsched.events"))[0]
        cost = (await drill.sql("SELECT toString(sum(cost)) FROM fedsched.usage WHERE line = 'compute'"))[0][0]
        return DrillResult(jobs=jobs, succeeded=sum(1 for j in done if j.state == pb.JOB_STATE_SUCCEEDED),
                           attempts=sum(len(j.attempts) for j in done), stream_messages=stream,
                           audit_rows=int(rows), distinct_events=int(distinct), cost=Decimal(cost), kills=kills,
                           failover_s=failovers, wall_s=time.monotonic() - t0, crashes=list(drill.crashes))
    finally:
        await drill.stop()


def _line(label: str, r: DrillResult, clean: DrillResult | None) -> str:
    vs = "" if clean is None else f" (clean {clean.cost}: {'same' if r.cost == clean.cost else 'DIFFERENT'})"
    fo = f"; scheduler failover {', '.join(f'{x:.2f}' for x in r.failover_s)} s" if r.failover_s else ""
    return (f"{label}: {r.succeeded}/{r.jobs} succeeded, {r.attempts} attempts; lost {r.lost}, doubled "
            f"{r.doubled} of {r.stream_messages} messages; cost {r.cost}{vs}; {r.wall_s:.0f} s{fo}; "
            f"killed: {', '.join(r.kills) or 'nothing'}" +
            (f"; exited by themselves and restarted: {', '.join(r.crashes)}" if r.crashes else ""))


async def main_async(args) -> int:
    base = Path(args.dir or tempfile.mkdtemp(prefix="fedsched-chaos-"))
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    clean = await run_once(base / "clean", kinds=(), jobs=args.jobs, runtime_s=args.runtime)
    print(_line("clean", clean, None), flush=True)
    bad = clean.lost or clean.doubled
    for i in range(args.loops):
        r = await run_once(base / f"loop{i}", kinds=kinds, jobs=args.jobs, runtime_s=args.runtime, loop=i)
        print(_line(f"loop {i}", r, clean), flush=True)
        bad = bad or r.lost or r.doubled or r.cost != clean.cost or r.succeeded != r.jobs
    print(f"logs and data: {base}")
    return 1 if bad else 0


def main() -> None:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--runtime", type=float, default=20.0, help="seconds each job runs")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"process kinds to kill ({', '.join(KINDS)})")
    p.add_argument("--dir", default="", help="working directory (default: a new temporary one)")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
