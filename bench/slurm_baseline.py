"""Plain-Slurm baseline on this machine: how fast ``sbatch`` submits and Slurm runs trivial jobs.

Starts a local Slurm with ``deploy/slurm/local-slurm.sh`` in a fresh directory on free ports
(timing ``start`` and ``stop``), submits ``--jobs`` trivial batch jobs (``--wrap true``) one
``sbatch`` process after another, then polls ``squeue --json`` until every job is final, and
prints (JSON):

* ``start_s`` / ``stop_s``: the script's start (until the node is idle) and stop;
* ``sbatch_per_s``: jobs / wall time of the submit loop (one ``sbatch`` process per job);
* ``complete_per_s``: jobs / (last job's end - first submit), submit-to-complete throughput;
* ``submit_to_start_p50_s`` / ``_p99_s``: Slurm's start_time - submit_time per job (1 s resolution).

    sudo python bench/slurm_baseline.py --jobs 200

The fedsched-through-Slurm figure is to be measured against this in the same run once the
backend exists (issue 12). Needs root and slurm-wlm + munge.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.inventory.slurm_json import parse_jobs  # noqa: E402

SCRIPT = ROOT / "deploy" / "slurm" / "local-slurm.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all jobs")
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="fs-slurm-bench-"))
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
           "FEDSCHED_SLURM_CTLD_PORT": str(free_port()), "FEDSCHED_SLURMD_PORT": str(free_port())}
    t0 = time.monotonic()
    subprocess.run([str(SCRIPT), "start", str(directory)], env=env, check=True, capture_output=True, text=True)
    start_s = time.monotonic() - t0
    client = {**env, "SLURM_CONF": str(directory / "slurm.conf")}
    try:
        out = directory / "out"
        t_submit = time.monotonic()
        ids = set()
        for i in range(args.jobs):
            r = subprocess.run(["sbatch", "--parsable", f"--job-name=bench-{i}", f"--output={out}/%j.out",
                                "--wrap=true"], env=client, check=True, capture_output=True, text=True)
            ids.add(int(r.stdout.strip().split(";")[0]))
        submit_wall = time.monotonic() - t_submit
        deadline = time.monotonic() + args.timeout
        while True:
            jobs = [j for j in parse_jobs(json.loads(subprocess.run(
                ["squeue", "--json"], env=client, check=True, capture_output=True, text=True).stdout)) if j.job_id in ids]
            if len(jobs) == len(ids) and all(j.finished for j in jobs):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"not all jobs finished in {args.timeout}s")
            time.sleep(0.5)
        done_wall = time.monotonic() - t_submit
        first_submit = min(j.submit_time for j in jobs)
        last_end = max(j.end_time for j in jobs)
        waits = sorted((j.start_time - j.submit_time).total_seconds() for j in jobs)
        states = {}
        for j in jobs:
            states[j.state] = states.get(j.state, 0) + 1
    finally:
        t1 = time.monotonic()
        subprocess.run([str(SCRIPT), "stop", str(directory)], env=env, capture_output=True)
        stop_s = time.monotonic() - t1
    span = max((last_end - first_submit).total_seconds(), 1.0)
    print(json.dumps({
        "jobs": args.jobs, "states": states, "start_s": round(start_s, 2), "stop_s": round(stop_s, 2),
        "sbatch_per_s": round(args.jobs / submit_wall, 1),
        "complete_per_s_slurm_times": round(args.jobs / span, 1),
        "complete_per_s_observed": round(args.jobs / done_wall, 1),
        "submit_to_start_p50_s": statistics.median(waits),
        "submit_to_start_p99_s": waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "cpus": os.cpu_count(),
    }, indent=1))


if __name__ == "__main__":
    main()
