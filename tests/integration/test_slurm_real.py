"""The Slurm parsers and sbatch builder against a real slurmctld + slurmd (``slurm_cluster``).

One module-scoped batch submits every kind of job at once (exit 0 on GPUs, exit 3, a running job
cancelled with scancel, a 2-task gang, an environment value with commas) and waits for all of
them and for the session's time-limit probe (a sleep past its 1-minute limit, submitted when
``slurm_cluster`` started: Slurm's limits are whole minutes enforced at its next check, 65-95 s,
so in a whole run it has ended before this module begins); the tests then read what Slurm
really reports.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fedsched.jobs import AttemptState
from services.inventory.slurm_json import (
    AttemptTag, NodeHealth, SbatchRequest, outcome, parse_jobcomp_line, parse_jobs, parse_nodes,
    parse_sbatch_output, sbatch_call,
)

pytestmark = pytest.mark.slurm


def squeue(cluster):
    return parse_jobs(json.loads(cluster.run("squeue", "--json").stdout))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def submit(cluster, req: SbatchRequest) -> int:
    call = sbatch_call(req)
    Path(call.output_path).parent.mkdir(parents=True, exist_ok=True)
    return parse_sbatch_output(cluster.run(*call.argv, extra_env=dict(call.env)).stdout)


@pytest.fixture(scope="module")
def batch(slurm_cluster):
    """Submit the job kinds, cancel one once it runs, wait until all are final."""
    c = slurm_cluster
    out = str(c.dir / "out")
    base = dict(output_dir=out, partition=c.partition)
    reqs = {
        "ok": SbatchRequest(AttemptTag("it-ok", 1), "echo gpus=$SLURM_GPUS_ON_NODE msg=$FEDSCHED_MSG; sleep 1",
                            gpu_type="a100", gpus_per_node=2, env={"FEDSCHED_MSG": "a,b=c d"}, **base),
        "exit3": SbatchRequest(AttemptTag("it-exit3", 1), "exit 3", **base),
        "cancel": SbatchRequest(AttemptTag("it-cancel", 1), ["sleep", "600"], **base),
        "gang": SbatchRequest(AttemptTag("it-gang", 1), "echo rank=$SLURM_PROCID world=$SLURM_NTASKS",
                              gpu_type="t4", gpus_per_node=1, tasks_per_node=2, **base),
    }
    t0 = time.monotonic()
    ids = {k: submit(c, r) for k, r in reqs.items()}
    submit_s = time.monotonic() - t0
    reqs["timeout"], ids["timeout"] = c.time_limit_probe
    wait_for(lambda: any(j.job_id == ids["cancel"] and j.state == "RUNNING" for j in squeue(c)), 30, "cancel job to run")
    c.run("scancel", str(ids["cancel"]))
    jobs = wait_for(lambda: (lambda js: js if all(js[i].finished for i in ids.values()) else None)(
        {j.job_id: j for j in squeue(c)}), 180, "all jobs to finish")
    return {k: jobs[i] for k, i in ids.items()}, reqs, submit_s


def test_node_inventory_from_real_sinfo(slurm_cluster):
    (node,) = parse_nodes(json.loads(slurm_cluster.run("sinfo", "--json").stdout))
    assert node.name == slurm_cluster.node and node.partitions == (slurm_cluster.partition,)
    assert {g.slurm_type: g.count for g in node.gpus} == slurm_cluster.gpus
    assert {g.card_model for g in node.gpus} == {"nvidia-a100-40gb", "nvidia-t4-16gb"}
    assert node.cpus == 16 and node.memory_mib == 65536 and node.health is NodeHealth.HEALTHY


def test_drain_and_resume_are_seen(slurm_cluster):
    c = slurm_cluster
    c.run("scontrol", "update", f"nodename={c.node}", "state=drain", "reason=it-drain")
    try:
        (node,) = parse_nodes(json.loads(c.run("sinfo", "--json").stdout))
        assert node.health is NodeHealth.DRAINED and node.reason == "it-drain"
    finally:
        c.run("scontrol", "update", f"nodename={c.node}", "state=resume")
    wait_for(lambda: parse_nodes(json.loads(c.run("sinfo", "--json").stdout))[0].health is NodeHealth.HEALTHY,
             30, "node healthy again")


def test_each_job_ends_in_its_state_with_its_exit_code(batch):
    jobs, _, _ = batch
    got = {k: (j.state, outcome(j).state, outcome(j).reason, outcome(j).exit_code) for k, j in jobs.items()}
    assert got == {
        "ok": ("COMPLETED", AttemptState.SUCCEEDED, "", 0),
        "exit3": ("FAILED", AttemptState.FAILED, "exit_code", 3),
        "timeout": ("TIMEOUT", AttemptState.FAILED, "timeout", None),
        "cancel": ("CANCELLED", AttemptState.LOST, "cancelled_externally", None),
        "gang": ("COMPLETED", AttemptState.SUCCEEDED, "", 0),
    }
    assert outcome(jobs["cancel"], stop_requested=True).state is AttemptState.CANCELLED


def test_jobs_carry_their_attempt_and_real_times(batch):
    jobs, reqs, _ = batch
    for k, job in jobs.items():
        if k == "timeout":  # the session's probe goes untagged (tests/conftest.py)
            assert job.tag is None and job.comment in (None, "")
        else:
            assert job.tag == reqs[k].tag and job.comment == reqs[k].tag.comment
        assert job.start_time.tzinfo is not None and job.start_time <= job.end_time
        assert job.nodes == ("fsnode1",)
    assert 60 <= jobs["timeout"].elapsed_s <= 150 and jobs["timeout"].time_limit_s == 60


def test_output_files_hold_env_and_ranks(batch):
    jobs, reqs, _ = batch
    ok = Path(sbatch_call(reqs["ok"]).output_path).read_text()
    assert "gpus=2 msg=a,b=c d" in ok
    gang = sorted(Path(sbatch_call(reqs["gang"]).output_path).read_text().split("\n"))
    assert [l for l in gang if l] == ["0: rank=0 world=2", "1: rank=1 world=2"]  # srun --label
    assert "DUE TO TIME LIMIT" in Path(sbatch_call(reqs["timeout"]).output_path).read_text()


def test_jobcomp_log_records_the_same_jobs(batch, slurm_cluster):
    jobs, _, _ = batch
    lines = (slurm_cluster.dir / "jobcomp.log").read_text().splitlines()
    comp = {j.job_id: j for j in (parse_jobcomp_line(l) for l in lines if l.strip())}
    for k, job in jobs.items():
        c = comp[job.job_id]
        assert (c.state, c.tag, c.start_time, c.end_time) == (job.state, job.tag, job.start_time, job.end_time), k


def test_sacct_json_needs_slurmdbd(slurm_cluster):
    """Documented fact: without slurmdbd there is no ``sacct --json``; jobcomp is the record."""
    r = slurm_cluster.run("sacct", "--json", check=False)
    assert r.returncode != 0 or "disabled" in (r.stdout + r.stderr)
