"""The operator's CLI against the embedded system, as a user runs it (subprocesses): `watch`
exit codes with real jobs (succeeded, failed, cancelled, timing out, not found), bulk actions by
selector (no terminal and no --yes refuses; --yes acts, one line per job), `hold`/`release`,
`priority`, `clusters` and `status`."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from services.inventory.trace import TraceNode
from tests.builders import embedded_federation, until

pytestmark = pytest.mark.e2e

FEDSCHED = [sys.executable, "-m", "fedapp.cli"]
#: fedsched watch's documented exit codes (fedapp/cli/jobs.py WatchExit, README)
SUCCEEDED, FAILED, CANCELLED, TIMEOUT, NOT_FOUND = 0, 3, 4, 5, 6


async def cli(system, *args: str, timeout: float = 60) -> tuple[int, str, str]:
    """Run the CLI against the system with its admin token; stdin is not a terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSCHED_")}
    env.update(FEDSCHED_GRPC_ADDRESS=system.grpc_target, FEDSCHED_TOKEN=system.admin_token)
    proc = await asyncio.create_subprocess_exec(*FEDSCHED, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


async def on_a_terminal(system, answer: str, *args: str) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as stdin and stdout, typing ``answer``: (exit code, output)."""
    import pty

    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSCHED_")}
    env.update(FEDSCHED_GRPC_ADDRESS=system.grpc_target, FEDSCHED_TOKEN=system.admin_token)
    controller, terminal = pty.openpty()
    proc = await asyncio.create_subprocess_exec(*FEDSCHED, *args, stdin=terminal, stdout=terminal,
                                                stderr=terminal, env=env)
    os.close(terminal)
    os.write(controller, answer.encode())
    code = await asyncio.wait_for(proc.wait(), 60)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: all read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    return code, b"".join(chunks).decode(errors="replace")


def job(name: str, runtime_s: float, **annotations: str) -> pb.SubmitJobRequest:
    """A 1-GPU job running ``runtime_s`` business seconds on the trace agents (600x wall time)."""
    return pb.SubmitJobRequest(spec=pb.JobSpec(
        tenant="search", project="train", name=name, gpus_per_worker=1, cpu_milli=1000,
        estimated_duration_seconds=runtime_s, annotations={"trace.runtime_s": str(runtime_s), **annotations}))


@pytest.fixture
async def fed(nats_server, chdb_path, tmp_path):
    split = {"cn-north-1-c1": [TraceNode("n1", 64000, 262144, 4, "nvidia-t4-16gb", 16)],
             "cn-east-1-c1": [TraceNode("e1", 64000, 262144, 2, "nvidia-v100-32gb", 32)]}
    async with embedded_federation(nats_server.url, chdb_path, tmp_path, split) as (system, stub):
        yield system, stub


async def test_watch_exit_codes_with_real_jobs(fed):
    system, stub = fed
    ok = (await stub.SubmitJob(job("ok", 60))).job_id                 # 0.1 s of wall time
    bad = (await stub.SubmitJob(job("bad", 60, **{"trace.outcome": "failed"}))).job_id
    long = (await stub.SubmitJob(job("long", 6_000_000))).job_id      # ~3 hours of wall time
    results = await asyncio.gather(cli(system, "watch", ok), cli(system, "watch", bad),
                                   cli(system, "watch", long, "--timeout", "1"),
                                   cli(system, "watch", "j-" + "0" * 20))
    (c_ok, out_ok, _), (c_bad, _, _), (c_to, _, e_to), (c_nf, _, e_nf) = results
    assert c_ok == SUCCEEDED and "succeeded" in out_ok.splitlines()[-1]
    assert c_bad == FAILED
    assert c_to == TIMEOUT and "timeout:" in e_to
    assert c_nf == NOT_FOUND and "NOT_FOUND" in e_nf

    watching = asyncio.create_task(cli(system, "watch", long))
    code, out, _ = await cli(system, "cancel", long, "--reason", "not needed")
    assert code == 0 and f"{long} cancel requested" in out
    code, out, _ = await watching
    assert code == CANCELLED and "cancelled" in out.splitlines()[-1]


async def test_bulk_actions_ask_unless_yes_and_report_each_job(fed):
    system, stub = fed
    # fill the cluster's 4 + 2 GPUs so the batch-* jobs stay queued
    # (the batch-* jobs are submitted only once the fillers run: submitted together, a cycle could place a
    # 0.1 s batch job before a filler and it would have ended before the selector ran)
    for i in range(6):
        await stub.SubmitJob(job(f"filler-{i}", 6_000_000))

    async def fillers_running():
        code, out, _ = await cli(system, "jobs", "--state", "running", "-o", "json")
        return code == 0 and len(json.loads(out)) == 6
    assert await until(fillers_running, timeout=30)
    ids = [(await stub.SubmitJob(job(f"batch-{i}", 60))).job_id for i in range(3)]

    code, _, err = await cli(system, "hold", "--name", "batch-*", "--state", "queued")
    assert code == 2 and "add --yes" in err  # a selector without a terminal and without --yes
    code, out, _ = await cli(system, "hold", "--name", "batch-*", "--state", "queued", "--yes", "--reason", "wait")
    assert code == 0, out
    assert sorted(line.split()[0] for line in out.splitlines()[:-1]) == sorted(ids)
    assert out.splitlines()[-1] == "3 of 3 done"
    code, out, _ = await cli(system, "jobs", "--state", "held", "-o", "json")
    assert sorted(j["job_id"] for j in json.loads(out)) == sorted(ids)

    code, out, err = await cli(system, "priority", ids[0], "critical", "--reason", "deadline")
    assert code == 0 and ids[0] in out
    code, out, err = await cli(system, "hold", ids[0], ids[1])  # already held: fine, one line each
    assert code == 0 and out.count("already held") == 2
    code, out, _ = await cli(system, "cancel", ids[2])  # a held job can be cancelled
    assert code == 0 and f"{ids[2]} cancel requested" in out
    assert (await cli(system, "watch", ids[2]))[0] == CANCELLED

    # on a terminal the selector asks first, with the count of jobs it would act on
    answer_no = await on_a_terminal(system, "n\n", "release", "--state", "held", "--tenant", "search")
    assert answer_no[0] == 1 and "Release 2 jobs? [y/N]" in answer_no[1] and "nothing done" in answer_no[1]
    answer_yes = await on_a_terminal(system, "y\n", "release", "--state", "held", "--tenant", "search")
    assert answer_yes[0] == 0 and "2 of 2 done" in answer_yes[1]
    code, out, err = await cli(system, "release", ids[0])  # not held any more: that job fails, exit 1
    assert code == 1 and "FAILED_PRECONDITION" in err
    code, _, err = await cli(system, "cancel")
    assert code == 2 and "give job ids" in err
    code, out, err = await cli(system, "cancel", "--tenant", "nobody", "--yes")  # nothing matches: said, exit 0
    assert code == 0 and "0 of 0 done" in out and "no job matches the selector" in err
    code, _, err = await cli(system, "cancel", ids[0], "--reason", "x" * 501)
    assert code == 2 and "at most 500" in err


async def test_clusters_and_status(fed):
    system, stub = fed
    await stub.SubmitJob(job("q", 6_000_000))
    code, out, _ = await cli(system, "clusters", "-o", "json")
    data = json.loads(out)
    assert code == 0 and {c["cluster"] for c in data["clusters"]} == {"cn-north-1-c1", "cn-east-1-c1"}
    north = next(c for c in data["clusters"] if c["cluster"] == "cn-north-1-c1")
    assert north["cards"][0]["card_model"] == "nvidia-t4-16gb" and north["cards"][0]["gpus_total"] == 4
    code, out, _ = await cli(system, "clusters", "--region", "cn-east-1")
    assert code == 0 and "cn-east-1-c1" in out and "cn-north-1-c1" not in out and "nvidia-v100-32gb" in out

    async def all_ok():
        code, out, _ = await cli(system, "status", "-o", "json")
        return code == 0 and all(s["state"] == "ok" for s in json.loads(out)["services"])
    assert await until(all_ok, timeout=20)
    code, out, _ = await cli(system, "status")
    assert code == 0 and "scheduler" in out and "agent/cn-east-1/cn-east-1-c1" in out
    await system.stop_scheduler()
    code, out, _ = await cli(system, "status")
    assert code == 1 and "down" in out
