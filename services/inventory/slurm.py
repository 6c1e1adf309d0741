"""The Slurm execution backend: job attempts run as Slurm batch jobs through Slurm's own commands.

:class:`SlurmBackend` implements :class:`~services.inventory.backend.Backend` with asyncio
subprocesses of ``sbatch``, ``squeue``, ``scancel`` and ``sinfo`` (paths and environment from
:class:`SlurmConfig`; ``SLURM_CONF`` names the cluster). slurmrestd (``rest_url`` + token in the
topology) is not implemented yet: :func:`fedapp.topology` refuses such an entry with the reason.
The pure translation (JSON parsing, the sbatch argument list, Slurm state -> outcome) is
:mod:`services.inventory.slurm_json`; this module only runs commands and keeps the ledger of
what it submitted.

Mapping (Slurm 22.05 as Debian ships it; see ``deploy/slurm/README.md``):

* ``inventory`` = ``sinfo --json``: one :class:`NodeInventory` per node of the configured
  partition; the GRES type with the most GPUs on a node gives its card model
  (:func:`fedsched.naming.canonical_card_model`; a node's other GPU types are not offered);
  DOWN/NOT_RESPONDING -> ``healthy=False``, DRAIN -> ``unschedulable=True``.
* ``launch`` = one ``sbatch`` per attempt: job name ``fedsched-<job>-a<attempt>-s<shard>``,
  ``--comment=fedsched:<job>:<attempt>:<shard> project=<p> tenant=<t>``, ``--nodelist`` = the
  bound nodes, ``--nodes``/``--ntasks-per-node`` from the gang's bindings (workers spread
  evenly over their nodes), ``--gres=gpu:<type>:<gpus per worker x tasks per node>``,
  ``--cpus-per-task``, ``--mem``, ``--partition``/``--account``/``--qos`` from the topology,
  ``--time`` = ceil((estimate - resumed) x (1 + ratio) + margin) minutes when the job has an
  estimate, ``--output`` = ``<output_dir>/<job>/a<attempt>-s<shard>.out``. A gang runs its
  command under ``srun --label`` so every task runs it; each task exports ``RANK`` =
  ``$SLURM_PROCID``, ``WORLD_SIZE`` = ``$SLURM_NTASKS``, ``LOCAL_RANK`` = ``$SLURM_LOCALID``,
  ``LOCAL_WORLD_SIZE`` = ``$SLURM_NTASKS_PER_NODE``, ``GROUP_RANK`` = ``$SLURM_NODEID`` before
  ``exec``-ing the workload's argv; the rest of :func:`fedsched.workload.worker_env` (``MASTER_ADDR``
  = the first bound node, ``MASTER_PORT``, ``FEDSCHED_*``, the workload's env) is exported by
  name. ``workload.image`` is ignored (the command runs on the node's own software); a job
  without ``workload.command`` is refused (not retryable). Idempotent: the first call of any
  method reads ``squeue --json`` and the jobcomp log once, so an attempt submitted before an
  agent restart is adopted, never submitted twice.
* status: a poller runs ``squeue --json`` every ``poll_s`` and, for jobs that left squeue, the new
  lines of the ``jobcomp/filetxt`` log (no ``sacct --json`` without slurmdbd); only changes are
  emitted, timed with Slurm's own submit/start/end times (what billing bills). COMPLETED ->
  SUCCEEDED; FAILED/TIMEOUT/OUT_OF_MEMORY/DEADLINE -> FAILED (exit code, reason ``exit_code``,
  ``timeout``, ``out_of_memory``...); NODE_FAIL -> FAILED reason ``node_failed`` (the interface's
  node failure: the agent fails the whole gang and the scheduler places it again); CANCELLED that
  fedsched did not ask for, BOOT_FAIL, PREEMPTED, a job Slurm no longer knows -> LOST.
* ``stop`` = ``scancel`` (waits until Slurm shows the job final); unknown or ended: no-op.
* ``logs`` reads the per-attempt output file (``follow``: tails it until the attempt ends);
  a gang's lines carry srun's ``<rank>: `` label, which selects the worker.

Times are POSIX seconds from Slurm's records (1 s resolution); the business ``clock`` is not
used (a Slurm cluster runs on the wall clock).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Mapping

from fedsched.events import NodeInventory
from fedsched.workload import worker_env
from services.inventory.backend import (LABEL_PREFIX, NODE_FAILED, AttemptKey, AttemptNotFound, AttemptSpec,
                                        AttemptStatus, BackendError, BackendUnavailable, ObservedAttempt, Phase)
from services.inventory.slurm_json import (AttemptTag, NodeHealth, SbatchRequest, SlurmJob, comment_labels,
                                           outcome, output_path, parse_jobcomp_line, parse_jobs, parse_nodes,
                                           parse_sbatch_output, sbatch_call)
from fedsched.jobs import AttemptState

log = logging.getLogger(__name__)

__all__ = ["SlurmConfig", "SlurmBackend"]

#: Variables each task sets from Slurm's own per-task variables (the rest of worker_env is exported).
PER_TASK_ENV = {
    "RANK": "${SLURM_PROCID:-0}",
    "WORLD_SIZE": "${SLURM_NTASKS:-1}",
    "LOCAL_RANK": "${SLURM_LOCALID:-0}",
    "LOCAL_WORLD_SIZE": "${SLURM_NTASKS_PER_NODE:-1}",
    "GROUP_RANK": "${SLURM_NODEID:-0}",
}

#: stderr fragments of Slurm clients that mean "the controller did not answer" (retry later).
_TRANSIENT = re.compile(r"Unable to contact slurm controller|Socket timed out|Connection refused|"
                        r"Slurm temporarily unable|Resource temporarily unavailable|Zero Bytes were transmitted",
                        re.IGNORECASE)
_ALREADY_DONE = re.compile(r"already completing or completed|Invalid job id|Job has already finished",
                           re.IGNORECASE)
_LABELLED = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass(frozen=True)
class SlurmConfig:
    """How a :class:`SlurmBackend` reaches its cluster and submits.

    Attributes:
        partition: the partition jobs go to and whose nodes the inventory lists.
        output_dir: directory of the per-attempt output files (must be visible to the nodes and
            to the agent: a shared file system on a real cluster).
        conf: ``SLURM_CONF`` (None: the client's default, ``/etc/slurm/slurm.conf``).
        bin_dir: directory of sbatch/squeue/scancel/sinfo (None: found on ``PATH``).
        env: extra environment for the client commands.
        account / qos: ``--account`` / ``--qos`` (None: the user's defaults).
        poll_s: seconds between squeue polls.
        time_margin_s / time_margin_ratio: added to the estimate for ``--time`` (seconds; fraction).
        jobcomp_log: the ``jobcomp/filetxt`` file (None: not read; finished jobs are then only
            seen while squeue still lists them, ``MinJobAge``).
        master_port: ``MASTER_PORT`` of a gang's rendezvous.
        command_timeout_s: a client command not done in this many seconds -> BackendUnavailable.
    """

    partition: str
    output_dir: str
    conf: str | None = None
    bin_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    account: str | None = None
    qos: str | None = None
    poll_s: float = 1.0
    time_margin_s: float = 60.0
    time_margin_ratio: float = 0.0
    jobcomp_log: str | None = None
    master_port: int = 29500
    command_timeout_s: float = 30.0


@dataclass
class _Tracked:
    """One attempt this backend submitted or adopted."""

    key: AttemptKey
    slurm_id: int
    workers: int
    emitted: set = field(default_factory=set)
    stopped: bool = False
    done: bool = False
    missing_polls: int = 0


def _key(tag: AttemptTag) -> AttemptKey:
    return AttemptKey(tag.job_id, tag.attempt, tag.shard)


def _ts(when) -> float | None:
    return None if when is None else when.timestamp()


class SlurmBackend:
    """A Slurm cluster as a :class:`~services.inventory.backend.Backend` (module docstring).

    Attributes:
        kind: ``slurm``. durable: True (Slurm keeps running jobs while the agent is down).
        submitted: Slurm job ids this instance submitted with sbatch (adoptions not counted).
    """

    kind = "slurm"
    durable = True

    def __init__(self, config: SlurmConfig, *, clock=None) -> None:
        self.config = config
        self.clock = clock
        self.submitted: list[int] = []
        self._live: dict[AttemptKey, _Tracked] = {}
        self._ended: dict[AttemptKey, _Tracked] = {}
        self._known: dict[AttemptKey, SlurmJob] = {}      # found at start-up (squeue + jobcomp)
        self._workers: dict[int, int] = {}               # slurm id -> tasks, from squeue
        self._queue: collections.deque[AttemptStatus] = collections.deque()
        self._wake_fut: asyncio.Future | None = None
        self._kicked = False
        self._poller: asyncio.Task | None = None
        self._seeded = False
        self._seed_lock = asyncio.Lock()
        self._launching: dict[AttemptKey, asyncio.Lock] = {}
        self._jobcomp_offset = 0
        self._jobcomp: dict[int, SlurmJob] = {}          # finished records of live attempts only
        self._node_types: dict[str, dict[str, str]] = {}  # node -> card model -> Slurm GRES type
        self._waiters: set[asyncio.Future] = set()
        self.polls = 0

    # ------------------------------------------------------------------ commands

    def _exe(self, name: str) -> str:
        return str(Path(self.config.bin_dir) / name) if self.config.bin_dir else name

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.config.env}
        path = env.get("PATH", "")
        if "/usr/sbin" not in path.split(":"):
            env["PATH"] = path + ":/usr/sbin:/sbin"
        if self.config.conf:
            env["SLURM_CONF"] = self.config.conf
        return {**env, **(extra or {})}

    async def _run(self, *argv: str, extra_env: Mapping[str, str] | None = None, check: bool = True) -> tuple[int, str, str]:
        """Run one Slurm client; returns (exit status, stdout, stderr).

        Raises:
            BackendUnavailable: timeout, missing binary, or a transient failure (controller down).
            BackendError: non-zero exit (not retryable) when ``check``.
        """
        try:
            proc = await asyncio.create_subprocess_exec(self._exe(argv[0]), *argv[1:], env=self._env(extra_env),
                                                        stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            raise BackendUnavailable(f"{argv[0]} could not be started: {e}") from e
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.config.command_timeout_s)
        except asyncio.TimeoutError as e:
            proc.kill()
            await proc.wait()
            raise BackendUnavailable(f"{argv[0]} did not answer in {self.config.command_timeout_s}s") from e
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if check and proc.returncode != 0:
            message = f"{argv[0]} exited {proc.returncode}: {stderr.strip()[-500:]}"
            if _TRANSIENT.search(stderr):
                raise BackendUnavailable(message)
            raise BackendError(message, retryable=False)
        return proc.returncode, stdout, stderr

    async def _squeue(self) -> list[tuple[SlurmJob, dict]]:
        _, out, _ = await self._run("squeue", "--json")
        try:
            doc = json.loads(out)
            return list(zip(parse_jobs(doc), doc["jobs"]))
        except (ValueError, KeyError) as e:
            raise BackendUnavailable(f"squeue --json gave unreadable output: {e}") from e

    def _read_jobcomp(self) -> list[SlurmJob]:
        """The jobcomp records appended since the last call (whole lines only)."""
        path = self.config.jobcomp_log
        if not path:
            return []
        try:
            with open(path, "rb") as f:
                f.seek(self._jobcomp_offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._jobcomp_offset += end
        out = []
        for line in data[:end].decode(errors="replace").splitlines():
            if line.strip():
                try:
                    out.append(parse_jobcomp_line(line))
                except ValueError:
                    log.warning("slurm: unreadable jobcomp line %r", line[:200])
        return out

    # ------------------------------------------------------------------ start-up

    async def _ensure_started(self) -> None:
        """Seed the ledger from the cluster once (squeue + the whole jobcomp log) and start the poller."""
        if not self._seeded:
            async with self._seed_lock:
                if not self._seeded:
                    found: dict[AttemptKey, SlurmJob] = {}
                    for job in self._read_jobcomp():
                        if job.tag is not None:
                            k = _key(job.tag)
                            if k not in found or job.job_id > found[k].job_id:
                                found[k] = job
                    for job, raw in await self._squeue():
                        if job.tag is not None:
                            k = _key(job.tag)
                            self._workers[job.job_id] = int(raw.get("tasks") or 1)
                            if k not in found or job.job_id >= found[k].job_id:
                                found[k] = job
                    self._known = found
                    self._seeded = True
        self._start_poller()

    def _start_poller(self) -> None:
        if self._poller is None or self._poller.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._poller = loop.create_task(self._poll_loop(), name="slurm-poller")

    async def close(self) -> None:
        """Stop the poller (the cluster's jobs keep running)."""
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass
            self._poller = None

    # ------------------------------------------------------------------ inventory

    async def inventory(self) -> list[NodeInventory]:
        _, out, _ = await self._run("sinfo", "--json")
        try:
            nodes = parse_nodes(json.loads(out))
        except (ValueError, KeyError) as e:
            raise BackendUnavailable(f"sinfo --json gave unreadable output: {e}") from e
        result = []
        types: dict[str, dict[str, str]] = {}
        for n in nodes:
            if n.partitions and self.config.partition not in n.partitions:
                continue
            main = max(n.gpus, key=lambda g: (g.count, g.slurm_type), default=None)
            types[n.name] = {g.card_model: g.slurm_type for g in n.gpus}
            count = main.count if main else 0
            # free = capacity: the agent subtracts its own ledger (the Backend contract)
            result.append(NodeInventory(
                name=n.name, card_model=main.card_model if main else "", gpus=count,
                gpu_free_milli=(1000,) * count, cpu_milli=n.cpus * 1000, cpu_free_milli=n.cpus * 1000,
                memory_mib=n.memory_mib, memory_free_mib=n.memory_mib,
                healthy=n.health != NodeHealth.DOWN, unschedulable=n.health == NodeHealth.DRAINED,
                taints=(f"slurm.state={n.state}:NoSchedule",) if n.health != NodeHealth.HEALTHY else (),
            ))
        self._node_types = types
        return result

    # ------------------------------------------------------------------ launch

    async def launch(self, attempt: AttemptSpec) -> None:
        await self._ensure_started()
        key = attempt.key
        lock = self._launching.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._live or key in self._ended:
                return
            known = self._known.get(key)
            if known is not None:  # submitted before this agent started: adopt, never resubmit
                self._track(key, known.job_id, self._workers.get(known.job_id, len(attempt.bindings) or 1))
                return
            request = await self._request(attempt)
            call = sbatch_call(request)
            Path(call.output_path).parent.mkdir(parents=True, exist_ok=True)
            _, out, _ = await self._run(*call.argv, extra_env=call.env)
            try:
                slurm_id = parse_sbatch_output(out)
            except ValueError as e:
                raise BackendError(str(e), retryable=False) from e
            self.submitted.append(slurm_id)
            self._track(key, slurm_id, len(attempt.bindings) or 1)
        self._launching.pop(key, None)

    def _track(self, key: AttemptKey, slurm_id: int, workers: int) -> None:
        self._live[key] = _Tracked(key, slurm_id, workers)
        self._kick()

    async def _request(self, attempt: AttemptSpec) -> SbatchRequest:
        """The sbatch request of ``attempt`` (module docstring). Raises BackendError (not retryable)."""
        spec = attempt.spec
        wl = spec.workload
        if wl is None or not (wl.command or wl.args):
            raise BackendError(f"job {attempt.key.job_id} has no workload command: a Slurm cluster runs the "
                               f"workload's command (workload.command), it has no image entrypoint", retryable=False)
        bindings = sorted(attempt.bindings, key=lambda b: b.worker)
        if not bindings:
            raise BackendError(f"attempt {attempt.key} has no worker bindings", retryable=False)
        if any(b.node not in self._node_types for b in bindings):
            await self.inventory()
        unknown = sorted({b.node for b in bindings if b.node not in self._node_types})
        if unknown:
            raise BackendError(f"node(s) {', '.join(unknown)} not in Slurm partition {self.config.partition}",
                               retryable=False)
        per_node = collections.Counter(b.node for b in bindings)
        nodes = list(dict.fromkeys(b.node for b in bindings))
        tasks = set(per_node.values())
        if len(tasks) != 1:
            raise BackendError(f"attempt {attempt.key}: workers spread unevenly over nodes {dict(per_node)}; "
                               f"Slurm runs the same number of tasks on every node", retryable=False)
        tasks_per_node = tasks.pop()
        gpu_type = None
        if spec.gpus_per_worker and attempt.card_model:
            gpu_type = self._node_types[nodes[0]].get(attempt.card_model)
            if gpu_type is None:
                raise BackendError(f"node {nodes[0]} has no GPUs of model {attempt.card_model}", retryable=False)
        env = worker_env(spec, job_id=attempt.key.job_id, attempt=attempt.key.attempt, rank=0,
                         master_addr=nodes[0], master_port=self.config.master_port, shard=attempt.key.shard)
        env = {k: v for k, v in env.items() if k not in PER_TASK_ENV}
        prefix = "export " + " ".join(f'{k}="{v}"' for k, v in PER_TASK_ENV.items())
        command = f"{prefix}; exec {shlex.join((*wl.command, *wl.args))}"
        estimate = None
        if spec.estimated_duration_s:
            estimate = max(0.0, spec.estimated_duration_s - attempt.resume_from_s)
        return SbatchRequest(
            tag=AttemptTag(attempt.key.job_id, attempt.key.attempt, attempt.key.shard),
            command=command, output_dir=self.config.output_dir, gpu_type=gpu_type,
            gpus_per_node=spec.gpus_per_worker * tasks_per_node, nodes=len(nodes), tasks_per_node=tasks_per_node,
            cpus_per_task=math.ceil(spec.cpu_milli / 1000) if spec.cpu_milli else None,
            memory_mib_per_node=spec.memory_mib * tasks_per_node if spec.memory_mib else None,
            partition=self.config.partition, estimate_s=estimate, time_margin_ratio=self.config.time_margin_ratio,
            time_margin_s=self.config.time_margin_s, env=env, workdir=wl.workdir or None, nodelist=tuple(nodes),
            labels={"tenant": attempt.tenant, "project": attempt.project},
            account=self.config.account, qos=self.config.qos,
        )

    # ------------------------------------------------------------------ status

    async def _poll_loop(self) -> None:
        while True:
            try:
                if self._live:
                    await self.poll()
            except BackendError as e:
                log.warning("slurm: poll failed (%s), retrying", e)
            except Exception:  # noqa: BLE001 - the poller never dies on one bad answer
                log.exception("slurm: poll failed")
            if not self._kicked:
                self._wake_fut = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._wake_fut], timeout=self.config.poll_s)
                self._wake_fut = None
            if self._kicked:
                self._kicked = False
                await asyncio.sleep(min(0.05, self.config.poll_s))  # let a burst of launches land

    async def poll(self) -> int:
        """One status poll: squeue (+ new jobcomp lines); queues the changes; returns how many.

        Work per call: the jobs slurmctld holds (bounded by ``MinJobAge``) plus the live attempts.
        """
        self.polls += 1
        jobs = {}
        for job, raw in await self._squeue():
            jobs[job.job_id] = job
            self._workers[job.job_id] = int(raw.get("tasks") or 1)
        live_ids = {t.slurm_id for t in self._live.values()}
        for job in self._read_jobcomp():
            if job.job_id in live_ids:
                self._jobcomp[job.job_id] = job
        before = len(self._queue)
        for key, t in list(self._live.items()):
            job = jobs.get(t.slurm_id) or self._jobcomp.get(t.slurm_id)
            if job is None and key in self._known and self._known[key].job_id == t.slurm_id and self._known[key].finished:
                job = self._known[key]  # finished before start-up, read from the jobcomp log then
            if job is None:
                t.missing_polls += 1
                if t.missing_polls >= 3 and not t.stopped:
                    self._emit(t, AttemptStatus(key, Phase.LOST, time.time(), reason="lost",
                                                message=f"Slurm no longer knows job {t.slurm_id}"))
                    self._finish(t)
                continue
            t.missing_polls = 0
            self._advance(t, job)
        if len(self._queue) > before:
            self._wake_consumers()
        return len(self._queue) - before

    def _emit(self, t: _Tracked, status: AttemptStatus) -> None:
        if t.stopped:
            return
        t.emitted.add(status.phase)
        self._queue.append(status)

    def _finish(self, t: _Tracked) -> None:
        t.done = True
        self._live.pop(t.key, None)
        self._jobcomp.pop(t.slurm_id, None)
        self._ended[t.key] = t

    def _advance(self, t: _Tracked, job: SlurmJob) -> None:
        """Queue the phases ``job`` has reached that ``t`` has not emitted yet (PENDING, RUNNING, end)."""
        o = outcome(job, stop_requested=t.stopped)
        key = t.key
        if Phase.PENDING not in t.emitted:
            self._emit(t, AttemptStatus(key, Phase.PENDING, _ts(job.submit_time) or time.time()))
        if o.state == AttemptState.PLACED:
            return
        if Phase.RUNNING not in t.emitted and job.started:
            self._emit(t, AttemptStatus(key, Phase.RUNNING, _ts(job.start_time) or time.time(),
                                        node=job.nodes[0] if job.nodes else None))
        if o.state == AttemptState.RUNNING:
            return
        end = _ts(job.end_time) or time.time()
        desc = f"Slurm job {job.job_id} {job.state}"
        if o.state == AttemptState.SUCCEEDED:
            self._emit(t, AttemptStatus(key, Phase.SUCCEEDED, end, exit_code=0))
        elif job.state == "NODE_FAIL":
            self._emit(t, AttemptStatus(key, Phase.FAILED, end, reason=NODE_FAILED,
                                        message=f"{NODE_FAILED}: {desc}",
                                        node=job.nodes[0] if job.nodes else None))
        elif o.state == AttemptState.FAILED:
            if o.reason == "timeout":
                limit = f" of {job.time_limit_s // 60} min" if job.time_limit_s else ""
                message = f"timeout: {desc}, ran past its time limit{limit}"
            elif job.signal:
                message = f"{o.reason}: {desc}, killed by signal {job.signal}"
            else:
                message = f"{o.reason}: {desc}, exit code {job.exit_code}"
            self._emit(t, AttemptStatus(key, Phase.FAILED, end, exit_code=job.exit_code, reason=o.reason,
                                        message=message))
        elif o.state == AttemptState.LOST:
            self._emit(t, AttemptStatus(key, Phase.LOST, end, reason=o.reason, message=f"{o.reason}: {desc}"))
        self._finish(t)

    def _kick(self) -> None:
        """Poll now (a launch or an adoption happened) instead of at the next interval."""
        self._kicked = True
        if self._wake_fut is not None and not self._wake_fut.done():
            self._wake_fut.set_result(None)

    def _wake_consumers(self) -> None:
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_result(None)

    def ready(self) -> list[AttemptStatus]:
        self._start_poller()
        out = list(self._queue)
        self._queue.clear()
        return out

    async def events(self) -> AsyncIterator[AttemptStatus]:
        await self._ensure_started()
        while True:
            while self._queue:
                yield self._queue.popleft()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)

    # ------------------------------------------------------------------ stop / list

    async def _find(self, key: AttemptKey) -> int | None:
        """The Slurm job id of ``key``: tracked, found at start-up, or in squeue now."""
        t = self._live.get(key) or self._ended.get(key)
        if t is not None:
            return t.slurm_id
        if key in self._known:
            return self._known[key].job_id
        found = [j for j, _ in await self._squeue() if j.tag is not None and _key(j.tag) == key]
        return max((j.job_id for j in found), default=None)

    async def stop(self, key: AttemptKey, reason: str) -> None:
        await self._ensure_started()
        t = self._live.get(key)
        if t is not None:
            t.stopped = True
        slurm_id = await self._find(key)
        if slurm_id is None:
            return
        code, _, err = await self._run("scancel", str(slurm_id), check=False)
        if code != 0 and not _ALREADY_DONE.search(err):
            if _TRANSIENT.search(err):
                raise BackendUnavailable(f"scancel {slurm_id}: {err.strip()[-300:]}")
            raise BackendError(f"scancel {slurm_id}: {err.strip()[-300:]}", retryable=False)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            job = next((j for j, _ in await self._squeue() if j.job_id == slurm_id), None)
            if job is None or job.finished:
                break
            await asyncio.sleep(0.1)
        if t is not None:
            self._finish(t)

    async def list_attempts(self) -> list[ObservedAttempt]:
        """Every fedsched job slurmctld holds (newest per attempt; finished ones for ``MinJobAge``)
        plus the finished ones of the jobcomp log read at start-up. Each one listed is tracked
        from now on, so an attempt the agent adopts after a restart has its end reported (its
        PENDING/RUNNING are not repeated when it had started)."""
        await self._ensure_started()
        newest: dict[AttemptKey, tuple[SlurmJob, int]] = {k: (j, self._workers.get(j.job_id, 1))
                                                          for k, j in self._known.items()}
        for job, raw in await self._squeue():
            if job.tag is not None:
                k = _key(job.tag)
                tasks = int(raw.get("tasks") or 1)
                self._workers[job.job_id] = tasks
                if k not in newest or job.job_id >= newest[k][0].job_id:
                    newest[k] = (job, tasks)
        out = []
        for k, (job, tasks) in newest.items():
            t = self._live.get(k) or self._ended.get(k)
            if t is None:  # found on the cluster, not launched by this instance: track it
                t = _Tracked(k, job.job_id, tasks)
                t.emitted.add(Phase.PENDING)
                if job.started:
                    t.emitted.add(Phase.RUNNING)
                self._live[k] = t
                self._kick()
            o = outcome(job, stop_requested=t.stopped)
            phase = {AttemptState.PLACED: Phase.PENDING, AttemptState.RUNNING: Phase.RUNNING,
                     AttemptState.SUCCEEDED: Phase.SUCCEEDED, AttemptState.FAILED: Phase.FAILED}.get(o.state, Phase.LOST)
            if job.state == "NODE_FAIL":
                phase = Phase.FAILED
            per_node = max(1, tasks // max(1, len(job.nodes))) if job.nodes else 0
            nodes = tuple(n for n in job.nodes for _ in range(per_node))
            labels = {**k.labels(), **{LABEL_PREFIX + n: v for n, v in comment_labels(job.comment).items()},
                      LABEL_PREFIX + "slurm-job-id": str(job.job_id)}
            out.append(ObservedAttempt(k, phase, _ts(job.start_time) if job.started else None, nodes, labels))
        return out

    # ------------------------------------------------------------------ logs

    async def logs(self, key: AttemptKey, worker: int | None = None, follow: bool = False) -> AsyncIterator[str]:
        await self._ensure_started()
        t = self._live.get(key) or self._ended.get(key)
        if t is not None:
            workers = t.workers
        else:
            slurm_id = await self._find(key)
            if slurm_id is None:
                raise AttemptNotFound(f"Slurm has no job for attempt {key}")
            workers = self._workers.get(slurm_id, 1)
        if worker is not None and not 0 <= worker < workers:
            raise AttemptNotFound(f"attempt {key} has {workers} worker(s), not worker {worker}")
        path = output_path(self.config.output_dir, AttemptTag(key.job_id, key.attempt, key.shard))
        offset, pending = 0, ""
        while True:
            ended = not follow or (key not in self._live)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            offset += len(data)
            text = pending + data.decode(errors="replace")
            lines = text.split("\n")
            pending = lines.pop() if not ended else ""
            if ended and lines and lines[-1] == "":
                lines.pop()
            for line in lines:
                rank, body = 0, line
                if workers > 1:
                    m = _LABELLED.match(line)
                    if m is None:
                        continue  # the batch script's own lines (none: it only runs srun)
                    rank, body = int(m[1]), m[2]
                if worker is None:
                    yield f"[worker {rank}] {body}"
                elif rank == worker:
                    yield body
            if ended:
                return
            await asyncio.sleep(min(0.5, self.config.poll_s))
