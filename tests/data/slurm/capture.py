"""Capture the Slurm JSON samples in this directory from a running local Slurm.

    deploy/slurm/local-slurm.sh start /tmp/fs-capture
    SLURM_CONF=/tmp/fs-capture/slurm.conf /work/venv/bin/python tests/data/slurm/capture.py /tmp/fs-capture

Submits tagged jobs built by ``sbatch_call`` (exit 0 on 2 A100s, exit 3, a sleep past a
1-minute limit, a running job cancelled, a pending job cancelled, a 2-task gang, one asking for
more GPUs than exist), and writes: ``sinfo_idle.json``, ``sinfo_mixed.json`` (jobs running),
``sinfo_drain.json`` (node drained with a reason), ``squeue_running.json`` (jobs pending and
running), ``squeue_final.json`` (all finished), ``jobcomp.log`` (the jobcomp/filetxt records).
Takes about 90 s (the time-limit job). Needs root, like the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from services.inventory.slurm_json import AttemptTag, SbatchRequest, parse_sbatch_output, sbatch_call  # noqa: E402

HERE = Path(__file__).resolve().parent


def run(*argv: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=True).stdout


def dump(name: str, text: str) -> None:
    (HERE / name).write_text(json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n")


def submit(req: SbatchRequest) -> int:
    call = sbatch_call(req)
    Path(call.output_path).parent.mkdir(parents=True, exist_ok=True)
    return parse_sbatch_output(run(*call.argv, env=dict(call.env)))


def main(directory: str) -> None:
    out = f"{directory}/out"
    node = json.loads(run("sinfo", "--json"))["nodes"][0]["name"]
    dump("sinfo_idle.json", run("sinfo", "--json"))
    base = dict(output_dir=out, partition="gpu")
    ids = {
        "timeout": submit(SbatchRequest(AttemptTag("cap-timeout", 1), ["sleep", "600"], estimate_s=5, **base)),
        "ok": submit(SbatchRequest(AttemptTag("cap-ok", 1), "echo ok $SLURM_GPUS_ON_NODE; sleep 3", gpu_type="a100",
                                   gpus_per_node=2, env={"FEDSCHED_MSG": "a,b=c"}, **base)),
        "exit3": submit(SbatchRequest(AttemptTag("cap-exit3", 2), "sleep 2; exit 3", **base)),
        "gang": submit(SbatchRequest(AttemptTag("cap-gang", 1, 0), "echo rank $SLURM_PROCID of $SLURM_NTASKS; sleep 3",
                                     gpu_type="t4", gpus_per_node=2, tasks_per_node=2, **base)),
        "cancel": submit(SbatchRequest(AttemptTag("cap-cancel", 1), ["sleep", "600"], **base)),
        "pending": submit(SbatchRequest(AttemptTag("cap-pending", 1), ["true"], gpu_type="a100", gpus_per_node=4, **base)),
    }
    try:
        submit(SbatchRequest(AttemptTag("cap-toobig", 1), ["true"], gpu_type="a100", gpus_per_node=8, **base))
    except subprocess.CalledProcessError as e:
        print("toobig refused:", e.stderr.strip())
    running = {ids[k] for k in ("timeout", "ok", "gang", "cancel")}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = json.loads(run("squeue", "--json"))["jobs"]
        if running <= {j["job_id"] for j in jobs if j["job_state"] == "RUNNING"}:
            break
        time.sleep(0.2)
    dump("squeue_running.json", run("squeue", "--json"))
    dump("sinfo_mixed.json", run("sinfo", "--json"))
    run("scancel", str(ids["cancel"]), str(ids["pending"]))
    run("scontrol", "update", f"nodename={node}", "state=drain", "reason=fedsched capture drain")
    dump("sinfo_drain.json", run("sinfo", "--json"))
    run("scontrol", "update", f"nodename={node}", "state=resume")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        jobs = json.loads(run("squeue", "--json"))["jobs"]
        if all(j["job_state"] not in ("PENDING", "RUNNING", "COMPLETING") for j in jobs):
            break
        time.sleep(1)
    dump("squeue_final.json", run("squeue", "--json"))
    shutil.copy(f"{directory}/jobcomp.log", HERE / "jobcomp.log")
    print(json.dumps(ids))


if __name__ == "__main__":
    main(sys.argv[1])
