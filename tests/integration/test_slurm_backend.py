"""SlurmBackend on the real local Slurm: what the contract suite cannot show on one node.

* a drained node (``scontrol update state=drain``) is unschedulable in the inventory and its
  running attempt keeps running;
* a node set DOWN kills its jobs (Slurm: NODE_FAIL) -> FAILED reason ``node_failed`` with the node;
* someone else's ``scancel`` -> LOST ``cancelled_externally``; an attempt without a command is
  refused, not retryable; a relaunch by a fresh backend (agent restart) adopts, never resubmits.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fedsched.events import WorkerBinding
from fedsched.naming import canonical_card_model
from fedsched.workload import Workload
from services.inventory.backend import NODE_FAILED, AttemptKey, AttemptSpec, BackendError, Phase
from services.inventory.slurm import SlurmBackend, SlurmConfig
from tests.builders import spec, unique

pytestmark = pytest.mark.slurm
A100 = canonical_card_model("a100")


def _backend(cluster, tmp_path) -> SlurmBackend:
    return SlurmBackend(SlurmConfig(partition=cluster.partition, output_dir=str(tmp_path / "out"),
                                    conf=cluster.env["SLURM_CONF"], env={"PATH": cluster.env["PATH"]}, poll_s=0.2,
                                    jobcomp_log=str(cluster.dir / "jobcomp.log")))


def _attempt(cluster, script: str | None, *, job_id: str | None = None) -> AttemptSpec:
    wl = Workload(image="ignored", command=("/bin/sh", "-c", script)) if script is not None else None
    job = spec(gpus=1, workload=wl)
    return AttemptSpec(AttemptKey(job_id or unique("sb"), 1, 0), job.tenant, job.project, job, A100,
                       (WorkerBinding(worker=0, node=cluster.node, gpu_indices=(0,), gpu_milli=1000),))


async def _until(backend, key, phase, timeout_s: float = 60.0):
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += [s for s in backend.ready() if s.key == key]
        if any(s.phase == phase for s in got):
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached {phase}: {got}")


async def _node_usable(cluster) -> None:
    """Resume the node if drained/down and wait until Slurm offers it again (and no fedsched job runs)."""
    import json

    from services.inventory.slurm_json import NodeHealth, parse_jobs, parse_nodes

    live = [str(j.job_id) for j in parse_jobs(json.loads(cluster.run("squeue", "--json").stdout))
            if j.tag is not None and not j.finished]
    if live:
        cluster.run("scancel", *live, check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (node,) = parse_nodes(json.loads(cluster.run("sinfo", "--json").stdout))
        if node.health is NodeHealth.HEALTHY:
            return
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=resume", check=False)
        await asyncio.sleep(0.5)
    raise AssertionError("the Slurm node did not come back")


@pytest.fixture
async def backend(slurm_cluster, tmp_path):
    await _node_usable(slurm_cluster)
    b = _backend(slurm_cluster, tmp_path)
    yield b
    await b.close()
    await _node_usable(slurm_cluster)


async def test_drain_makes_the_node_unschedulable_and_running_work_continues(backend, slurm_cluster):
    a = _attempt(slurm_cluster, "sleep 30")
    await backend.launch(a)
    await _until(backend, a.key, Phase.RUNNING)
    slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.node}", "state=drain", "reason=e2e")
    node = next(n for n in await backend.inventory() if n.name == slurm_cluster.node)
    assert node.unschedulable and node.healthy
    assert [o.phase for o in await backend.list_attempts() if o.key == a.key] == [Phase.RUNNING]
    await backend.stop(a.key, "test")


async def _probe_ended(cluster, timeout_s: float = 150.0) -> None:
    """Wait for the session's time-limit probe (tests/conftest.py) to end: it runs on the only
    node until Slurm ends it, 65-95 s after the cluster started, and test_slurm_real reads its
    TIMEOUT. A node set DOWN before then kills it (NODE_FAIL): run right after this module (the
    cluster started by it), test_slurm_real failed three tests."""
    job_id = cluster.time_limit_probe[1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = cluster.run("squeue", "-h", "-j", str(job_id), "-o", "%T").stdout.strip()
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return
        await asyncio.sleep(1.0)
    raise AssertionError(f"the time-limit probe {job_id} still runs after {timeout_s:g} s")


async def test_a_node_set_down_fails_the_attempt_with_node_failed(backend, slurm_cluster):
    await _probe_ended(slurm_cluster)
    a = _attempt(slurm_cluster, "sleep 60")
    await backend.launch(a)
    await _until(backend, a.key, Phase.RUNNING)
    slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.node}", "state=down", "reason=e2e")
    got = await _until(backend, a.key, Phase.FAILED)
    assert (got[-1].reason, got[-1].exit_code, got[-1].node) == (NODE_FAILED, None, slurm_cluster.node)
    # (the node's DOWN state is not asserted: local-slurm.sh's ReturnToService lets the live slurmd
    # bring it back at its next registration; sinfo DOWN -> unhealthy is covered by the parsers' tests)


async def test_scancel_by_someone_else_is_lost(backend, slurm_cluster):
    a = _attempt(slurm_cluster, "sleep 60")
    await backend.launch(a)
    await _until(backend, a.key, Phase.RUNNING)
    slurm_cluster.run("scancel", "--name", f"fedsched-{a.key.job_id}-a1-s0")
    got = await _until(backend, a.key, Phase.LOST)
    assert got[-1].reason == "cancelled_externally"


async def test_no_command_is_refused_not_retryable(backend, slurm_cluster):
    with pytest.raises(BackendError) as e:
        await backend.launch(_attempt(slurm_cluster, None))
    assert e.value.retryable is False and "workload command" in str(e.value)


async def test_a_fresh_backend_adopts_instead_of_resubmitting(backend, slurm_cluster, tmp_path):
    a = _attempt(slurm_cluster, "echo adopted; sleep 1; exit 3")
    await backend.launch(a)
    await _until(backend, a.key, Phase.RUNNING)
    await backend.close()
    again = _backend(slurm_cluster, tmp_path)  # an agent restart: a new process, a new backend
    try:
        await again.launch(a)
        assert again.submitted == []
        got = await _until(again, a.key, Phase.FAILED)
        assert (got[-1].exit_code, got[-1].reason) == (3, "exit_code")
        assert [line async for line in again.logs(a.key, 0)] == ["adopted"]
    finally:
        await again.close()
