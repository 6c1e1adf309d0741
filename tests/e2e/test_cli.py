"""The README's commands as a user runs them: `fedsched up`, submit, sql through the running
system, Ctrl-C, and a second `up` that remembers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsched.natsd import free_port

pytestmark = pytest.mark.e2e

FEDSCHED = [sys.executable, "-m", "fedsched.cli"]


def _up(data_dir: Path, grpc: str, nats_port: int) -> subprocess.Popen:
    env = dict(os.environ, FEDSCHED_NATS_PORT=str(nats_port), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([*FEDSCHED, "up", "--data-dir", str(data_dir), "--grpc-address", grpc],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "fedsched is up" in line:
            return proc
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("up did not start:\n" + "".join(lines))


def _run(*args: str, data_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSCHED_TOKEN", "FEDSCHED_DATA_DIR")}
    if data_dir is not None:
        env["FEDSCHED_DATA_DIR"] = str(data_dir)  # the CLI reads <data_dir>/admin.token
    return subprocess.run([*FEDSCHED, *args], capture_output=True, text=True, timeout=60, env=env)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def test_up_submit_sql_ctrl_c_and_resume(tmp_path):
    grpc = f"127.0.0.1:{free_port()}"
    nats_port = free_port()
    proc = _up(tmp_path, grpc, nats_port)
    try:
        token_file = tmp_path / "admin.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        anonymous = _run("jobs", "--server", grpc)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        sub = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--kind", "inference",
                   "--gpus", "1", "--gpu-milli", "500", "--cpu-milli", "2000", "--duration", "3600",
                   "--request-id", "cli-1", "-o", "json", data_dir=tmp_path)
        assert sub.returncode == 0, sub.stderr
        job_id = json.loads(sub.stdout)["job_id"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            show = _run("job", job_id, "--server", grpc, "-o", "json", data_dir=tmp_path)
            if '"JOB_STATE_RUNNING"' in show.stdout:
                break
            time.sleep(0.3)
        assert '"JOB_STATE_RUNNING"' in show.stdout, show.stdout
        bad = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--workers", "0",
                   "--token", token_file.read_text().strip())
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "spec.workers" in bad.stderr
        time.sleep(1.0)  # let audit write
        q = _run("sql", "--nats-url", f"nats://127.0.0.1:{nats_port}", "-o", "json",
                 "SELECT count() AS n FROM fedsched.events WHERE job_id = '" + job_id + "'")
        assert q.returncode == 0, q.stderr
        assert '"n"' in q.stdout
        locked = _run("sql", "--data-dir", str(tmp_path), "SELECT 1")
        assert locked.returncode == 1 and "--nats-url" in (locked.stderr + locked.stdout)
        _governance_commands(grpc, tmp_path)
    finally:
        out = _stop(proc)
    assert "stopped" in out
    proc = _up(tmp_path, grpc, nats_port)
    try:
        again = _run("job", job_id, "--server", grpc, "-o", "json", data_dir=tmp_path)
        assert again.returncode == 0 and '"JOB_STATE_RUNNING"' in again.stdout, again.stdout
        dup = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--gpus", "1",
                   "--gpu-milli", "500", "--cpu-milli", "2000", "--request-id", "cli-1", data_dir=tmp_path)
        assert job_id in dup.stdout and "duplicate" in dup.stdout
    finally:
        _stop(proc)
    offline = _run("sql", "--data-dir", str(tmp_path), "-o", "json",
                   "SELECT countIf(type = 'job.started') AS started FROM fedsched.events WHERE job_id = '" + job_id + "'")
    assert offline.returncode == 0, offline.stderr
    assert '"started": 1' in offline.stdout


def _governance_commands(grpc: str, data_dir: Path) -> None:
    """policy show/diff, tenants, principal put with a new token, and that token's rights."""
    shown = _run("policy", "show", "--server", grpc, "-o", "json", data_dir=data_dir)
    assert shown.returncode == 0, shown.stderr
    version = json.loads(shown.stdout)["version"]
    example = Path(__file__).resolve().parents[2] / "deploy" / "policy" / "example.yaml"
    diff = _run("policy", "diff", str(example), "--server", grpc, data_dir=data_dir)
    assert diff.returncode == 0 and "tenant ads: cross_region allowed -> approval" in diff.stdout, diff.stderr
    assert f"policy {version} ->" in diff.stdout and "not applied" in diff.stdout
    tenants = _run("tenants", "--server", grpc, "-o", "json", data_dir=data_dir)
    assert {t["name"] for t in json.loads(tenants.stdout)["tenants"]} == {"search", "ads", "nlp", "vision", "recsys"}
    made = _run("principal", "put", "sam", "--role", "submitter:search/train", "--server", grpc, "-o", "json",
                data_dir=data_dir)
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)["token"]
    own = _run("jobs", "--tenant", "search", "--server", grpc, "--token", token)
    assert own.returncode == 0, own.stderr
    other = _run("jobs", "--tenant", "ads", "--server", grpc, "--token", token)
    assert other.returncode == 1 and "PERMISSION_DENIED" in other.stderr
