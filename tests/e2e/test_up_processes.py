"""`fedsched up --processes`: the services as separate OS processes on one nats-server; a job
runs to SUCCEEDED, SIGTERM stops every process (checked by pid), and a child that dies is
reported and stops `up` with exit 1 (it is not restarted)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsched.natsd import free_port
from tests.builders import until_sync

pytestmark = pytest.mark.e2e

FEDSCHED = [sys.executable, "-m", "fedapp.cli"]
TOPOLOGY = """\
regions:
  - name: cn-north-1
    zones: [cn-north-1a]
clusters:
  - name: cn-north-1-a
    region: cn-north-1
    zone: cn-north-1a
    backend: trace
    trace: {nodes: nodes.csv}
"""


def _topology(tmp: Path) -> Path:
    (tmp / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n"
                                   + "".join(f"n-{i},96000,786432,8,T4\n" for i in range(4)))
    path = tmp / "topology.yaml"
    path.write_text(TOPOLOGY)
    return path


def _up(tmp: Path, grpc: str) -> tuple[subprocess.Popen, dict[str, int], list[str]]:
    """Start `up --processes`; returns the process, the pids it printed (name -> pid) and its
    output so far."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FEDSCHED_NATS_URL", None)
    proc = subprocess.Popen([*FEDSCHED, "up", "--processes", "--no-web", "--data-dir", str(tmp / "data"),
                             "--grpc-address", grpc, "--topology", str(_topology(tmp))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Ctrl-C stops" in line:
            pids = {m[1]: int(m[2]) for m in (re.match(r"\s+(\S+) pid (\d+)", x) for x in lines) if m}
            return proc, pids, lines
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("up --processes did not start:\n" + "".join(lines))


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cli(*args: str, data_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FEDSCHED_TOKEN"}
    env["FEDSCHED_DATA_DIR"] = str(data_dir)
    return subprocess.run([*FEDSCHED, *args], capture_output=True, text=True, timeout=60, env=env)


def test_up_processes_runs_a_job_and_sigterm_leaves_no_process(tmp_path):
    grpc = f"127.0.0.1:{free_port()}"
    proc, pids, _ = _up(tmp_path, grpc)
    try:
        assert set(pids) == {"store", "scheduler", "agents", "admission", "nats-server"}
        assert len(set(pids.values())) == 5 and proc.pid not in pids.values()
        assert all(_alive(p) for p in pids.values())
        sub = _cli("submit", "--server", grpc, "--tenant", "search", "--project", "train", "--gpus", "1",
                   "--duration", "1", "-o", "json", data_dir=tmp_path / "data")
        assert sub.returncode == 0, sub.stderr
        job_id = json.loads(sub.stdout)["job_id"]
        watched = subprocess.run([*FEDSCHED, "watch", job_id, "--server", grpc, "--timeout", "60"],
                                 capture_output=True, text=True, timeout=90,
                                 env=dict(os.environ, FEDSCHED_DATA_DIR=str(tmp_path / "data")))
        assert watched.returncode == 0 and "succeeded" in watched.stdout, watched.stdout + watched.stderr
        # the store child holds the embedded store: `sql` on the data dir is answered by it
        record = json.loads((tmp_path / "data" / "store-query.json").read_text())
        assert record["pid"] == pids["store"] and "@" not in record["nats_url"]
        counted = _cli("sql", "--data-dir", str(tmp_path / "data"), "-o", "json",
                       "SELECT count() AS n FROM fedsched.events WHERE job_id = '" + job_id + "'", data_dir=tmp_path)
        assert counted.returncode == 0 and json.loads(counted.stdout)[0]["n"] > 0, counted.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert "stopped; state kept" in out
    assert not (tmp_path / "data" / "store-query.json").exists()
    assert until_sync(lambda: not any(_alive(p) for p in pids.values()), timeout=10), \
        {n: p for n, p in pids.items() if _alive(p)}


def test_a_child_that_dies_is_reported_and_stops_up_with_exit_1(tmp_path):
    proc, pids, _ = _up(tmp_path, f"127.0.0.1:{free_port()}")
    try:
        os.kill(pids["scheduler"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    assert re.search(rf"scheduler \(pid {pids['scheduler']}\) exited with code -9 -- not restarted", out), out
    assert until_sync(lambda: not any(_alive(p) for p in pids.values()), timeout=10), \
        {n: p for n, p in pids.items() if _alive(p)}
