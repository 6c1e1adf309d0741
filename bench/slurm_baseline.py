"""Plain-Slurm baseline on this machine: how fast ``sbatch`` submits and Slurm runs trivial jobs.

Starts a local Slurm with ``deploy/slurm/local-slurm.sh`` in a fresh directory on free ports
(timing ``start`` and ``stop``), submits ``--single`` jobs one at a time for the latency, then
``--jobs`` trivial batch jobs (``--wrap true``), one ``sbatch`` process after another, polls
``squeue --json`` until every job is final, and prints (JSON):

* ``start_s`` / ``stop_s``: the script's start (until the node is idle) and stop;
* ``sbatch_per_s``: jobs / wall time of the submit loop (one ``sbatch`` process per job);
* ``complete_per_s_slurm_times``: jobs / (last job's end - first submit) by Slurm's records,
  ``complete_per_s_observed``: jobs / (first sbatch call until squeue shows all final);
* ``submit_to_start_p50_s`` / ``_p99_s``: Slurm's start_time - submit_time per job (1 s resolution);
* ``single_submit_to_running_p50_s`` / ``_max_s``: ``--single`` jobs submitted one at a time on
  the idle cluster, from calling sbatch until ``squeue --json`` shows the job started.

    sudo python bench/slurm_baseline.py --jobs 200

The fedsched-through-Slurm figure is to be measured against this in the same run once the
backend exists (issue 12). Needs root and slurm-wlm + munge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    ap.add_argument("--single", type=int, default=10, help="jobs submitted one at a time for the latency")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all jobs")
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="fs-slurm-bench-"))
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
           "FEDSCHED_SLURM_CTLD_PORT": str(free_port()), "FEDSCHED_SLURMD_PORT": str(free_port())}
    t0 = time.monotonic()
    started = subprocess.run([str(SCRIPT), "start", str(directory)], env=env, capture_output=True, text=True)
    start_s = time.monotonic() - t0
    if started.returncode != 0:
        raise SystemExit(f"local Slurm did not start: {started.stderr.strip()} (logs in {directory}/log)")
    client = {**env, "SLURM_CONF": str(directory / "slurm.conf")}
    try:
        # submit -> running latency of one job on an idle cluster, observed by polling squeue
        latencies = []
        for i in range(args.single):
            t = time.monotonic()
            r = subprocess.run(["sbatch", "--parsable", f"--job-name=single-{i}", f"--output={directory}/out/%j.out",
                                "--wrap=true"], env=client, check=True, capture_output=True, text=True)
            job_id = int(r.stdout.strip().split(";")[0])
            while not any(j.job_id == job_id and j.started for j in parse_jobs(json.loads(subprocess.run(
                    ["squeue", "--json"], env=client, check=True, capture_output=True, text=True).stdout))):
                if time.monotonic() - t > 60:
                    raise SystemExit(f"job {job_id} did not start in 60 s")
                time.sleep(0.02)
            latencies.append(time.monotonic() - t)
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
    shutil.rmtree(directory, ignore_errors=True)
    latencies.sort()
    span = max((last_end - first_submit).total_seconds(), 1.0)
    print(json.dumps({
        "jobs": args.jobs, "states": states, "start_s": round(start_s, 2), "stop_s": round(stop_s, 2),
        "sbatch_per_s": round(args.jobs / submit_wall, 1),
        "complete_per_s_slurm_times": round(args.jobs / span, 1),
        "complete_per_s_observed": round(args.jobs / done_wall, 1),
        "submit_to_start_p50_s": statistics.median(waits),
        "submit_to_start_p99_s": waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "single_submit_to_running_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "single_submit_to_running_max_s": round(latencies[-1], 3) if latencies else None,
        "cpus": os.cpu_count(),
    }, indent=1))


if __name__ == "__main__":
    main()
