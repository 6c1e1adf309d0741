"""bench/e2e_throughput.py still measures something: on a tiny embedded run every job it offers is
seen placed and started (the bench follows the events stream as the operator's user; when that user
lost the right to subscribe to business subjects, the bench silently saw no placement at all), and
each job's latency breakdown is found (its job.submitted and job.placed events read)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_the_end_to_end_bench_sees_every_job_it_offers_placed_and_started(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "e2e_throughput.py"), "--mode", "embedded", "--jobs", "40",
         "--rate", "100", "--batch", "8", "--settle", "20", "--stall", "60", "--timeout", "120",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run] = json.loads(out.read_text())
    assert run["submitted"] == 40 and run["errors"] == 0, run
    assert run["placed"] == 40, proc.stdout[-3000:]
    assert run["started"] == 40, proc.stdout[-3000:]
    assert run["breakdown_jobs"] == 40, proc.stdout[-3000:]
    parts = run["breakdown_ms"]
    assert set(parts) == {"origin->accepted", "accepted->decided", "decided->seen"}, parts
    # one clock, read right: each moment after the one before it, and no time zone's hours between them
    assert all(0 <= p["p50"] <= p["p99"] < 600_000 for p in parts.values()), parts
    assert run["exit_code"] == 0
    assert "permissions violation" not in proc.stderr, proc.stderr[-2000:]
