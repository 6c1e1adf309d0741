"""The README's commands as a user runs them: `fedsched up`, submit, sql through the running
system, Ctrl-C, and a second `up` that remembers."""

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


def _up(data_dir: Path, grpc: str, nats_port: int) -> subprocess.Popen:
    # metrics on free ports (several `up`s run at once); a restart on a loaded machine can take
    # longer than the default 10 s after which the scheduler declares a silent cluster lost (then
    # the resumed job would run a second attempt): this test is about resuming, not staleness
    env = dict(os.environ, FEDSCHED_NATS_PORT=str(nats_port), PYTHONUNBUFFERED="1", FEDSCHED_METRICS_PORT="0",
               FEDSCHED_STALE_AFTER_S="30")
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
            if show.returncode == 0 and json.loads(show.stdout)["state"] == "running":  # the table's word
                break
            time.sleep(0.3)
        assert json.loads(show.stdout)["state"] == "running", show.stdout
        bad = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--gpus", "2",
                   "--gpu-milli", "500", "--token", token_file.read_text().strip())  # a share needs --gpus 1
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "spec.gpu_milli" in bad.stderr
        out_of_range = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--gpu-milli",
                            "5000")  # beyond what admission accepts (1..1000): refused before any call
        assert out_of_range.returncode == 2 and "--gpu-milli" in out_of_range.stderr
        runs = []

        def audited() -> bool:  # the audit writer has stored the job's events
            runs.append(_run("sql", "--nats-url", f"nats://127.0.0.1:{nats_port}", "-o", "json",
                             "SELECT count() AS n FROM fedsched.events WHERE job_id = '" + job_id + "'",
                             data_dir=tmp_path))
            return runs[-1].returncode != 0 or json.loads(runs[-1].stdout)[0]["n"] > 0

        assert until_sync(audited, timeout=20, interval=0.2)
        q = runs[-1]
        assert q.returncode == 0, q.stderr
        assert '"n"' in q.stdout
        # `up` holds the embedded store (chDB opens a path in one process only): sql and report with
        # just the data dir (no --nats-url, no token, no FEDSCHED_DATA_DIR) are answered by `up`
        assert (tmp_path / "store-query.json").exists()
        same_dir = _run("sql", "--data-dir", str(tmp_path), "-o", "json",
                        "SELECT count() AS n FROM fedsched.events WHERE job_id = '" + job_id + "'")
        assert same_dir.returncode == 0, same_dir.stderr
        assert json.loads(same_dir.stdout)[0]["n"] > 0
        no_files = _run("sql", "--data-dir", str(tmp_path), "SELECT * FROM file('/etc/passwd', 'LineAsString')")
        assert no_files.returncode == 1 and "passwd" not in no_files.stdout  # still the read-only handle
        report = _run("report", "--data-dir", str(tmp_path), "--only", "summary", "-o", "json")
        assert report.returncode == 0, report.stderr
        assert "summary" in json.loads(report.stdout)["reports"]
        _store_queries_are_read_only(nats_port, grpc, tmp_path)
        _explain_and_odd_text(grpc, tmp_path, job_id)
        _second_up_is_refused(tmp_path, grpc)
        _governance_commands(grpc, tmp_path)
    finally:
        out = _stop(proc)
    assert "stopped" in out
    proc = _up(tmp_path, grpc, nats_port)
    try:
        again = _run("job", job_id, "--server", grpc, "-o", "json", data_dir=tmp_path)
        assert again.returncode == 0 and json.loads(again.stdout)["state"] == "running", again.stdout
        dup = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--kind", "inference",
                   "--gpus", "1", "--gpu-milli", "500", "--cpu-milli", "2000", "--duration", "3600",
                   "--request-id", "cli-1", data_dir=tmp_path)
        assert job_id in dup.stdout and "duplicate" in dup.stdout, dup.stdout + dup.stderr
        changed = _run("submit", "--server", grpc, "--tenant", "vision", "--project", "serve", "--gpus", "1",
                       "--gpu-milli", "500", "--cpu-milli", "2000", "--request-id", "cli-1", data_dir=tmp_path)
        assert changed.returncode == 1 and "ALREADY_EXISTS" in changed.stderr and job_id in changed.stderr, \
            changed.stdout + changed.stderr
    finally:
        _stop(proc)
    assert not (tmp_path / "store-query.json").exists()  # stopped: sql opens the store itself
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


def _store_queries_are_read_only(nats_port: int, grpc: str, data_dir: Path) -> None:
    """A write through `sql` is refused, and does not stop audit from writing afterwards."""
    url = f"nats://127.0.0.1:{nats_port}"
    outsider = _run("sql", "--nats-url", url, "SELECT 1")  # no data dir: neither the bus password nor a token
    assert outsider.returncode == 1 and "cannot connect to NATS" in outsider.stderr, outsider.stderr
    forged = _run("sql", "--nats-url", f"nats://someone:guess@127.0.0.1:{nats_port}", "SELECT 1")
    assert forged.returncode == 1 and "cannot connect to NATS" in forged.stderr, forged.stderr
    bus_only = data_dir / "bus-only"  # the bus users (ops), but no admin token
    bus_only.mkdir()
    (bus_only / "nats.users").write_text((data_dir / "nats.users").read_text())
    anonymous = _run("sql", "--nats-url", url, "SELECT 1", data_dir=bus_only)
    assert anonymous.returncode == 1 and "admin's token" in anonymous.stderr, anonymous.stderr
    sam = _run("principal", "put", "sam-reader", "--role", "submitter:search", "--server", grpc, "-o", "json",
               data_dir=data_dir)
    not_admin = _run("sql", "--nats-url", url, "SELECT 1", "--token", json.loads(sam.stdout)["token"],
                     data_dir=data_dir)
    assert not_admin.returncode == 1 and "not an admin" in not_admin.stderr, not_admin.stderr
    secret = _run("sql", "--nats-url", url, f"SELECT * FROM file('{data_dir / 'admin.token'}', 'LineAsString')",
                  data_dir=data_dir)
    assert secret.returncode == 1 and "read-only" in secret.stderr.lower(), secret.stdout + secret.stderr
    scalar = _run("sql", "--nats-url", url, f"SELECT file('{data_dir / 'admin.token'}')", "-o", "json",
                  data_dir=data_dir)  # the scalar function, which readonly=1 alone lets through
    assert scalar.returncode == 1 and "file() reads a file of the host" in scalar.stderr, scalar.stdout + scalar.stderr
    assert (data_dir / "admin.token").read_text().strip() not in scalar.stdout + scalar.stderr
    ins = _run("sql", "--nats-url", url, "INSERT INTO fedsched.events (event_id) VALUES ('forged')", data_dir=data_dir)
    assert ins.returncode == 1 and "read-only" in ins.stderr.lower(), ins.stderr
    ddl = _run("sql", "--nats-url", url, "DROP TABLE fedsched.usage", data_dir=data_dir)
    assert ddl.returncode == 1, ddl.stdout
    sub = _run("submit", "--server", grpc, "--tenant", "search", "--project", "train", "--gpus", "1",
               "--duration", "60", "-o", "json", data_dir=data_dir)
    assert sub.returncode == 0, sub.stderr
    later = json.loads(sub.stdout)["job_id"]

    def written() -> bool:
        q = _run("sql", "--nats-url", url, "-o", "json",
                 f"SELECT count() AS n FROM fedsched.events WHERE job_id = '{later}'", data_dir=data_dir)
        assert q.returncode == 0, q.stderr
        return json.loads(q.stdout)[0]["n"] > 0

    assert until_sync(written, timeout=30, interval=0.5)  # the writer's handle is not read-only
    as_csv = _run("sql", "--nats-url", url, "-o", "csv", f"SELECT job_id, occurred_at, "
                  f"'2026-11-30T22:55:00+09:00' AS note FROM fedsched.events "
                  f"WHERE job_id = '{later}' ORDER BY occurred_at LIMIT 1", data_dir=data_dir)
    assert as_csv.returncode == 0, as_csv.stderr  # through the running system: times arrive as JSON text
    header, row = as_csv.stdout.splitlines()
    assert header == "job_id,occurred_at,note", header  # a DateTime column converted, a String kept
    assert re.fullmatch(rf"{later},\d{{4}}-\d\d-\d\dT[\d:.]+Z,2026-11-30T22:55:00\+09:00", row), row
    many = _run("sql", "--nats-url", url, "SELECT number FROM system.numbers LIMIT 10005", "-o", "json",
                data_dir=data_dir)
    assert many.returncode == 0 and len(json.loads(many.stdout)) == 10000
    assert "more than 10000 rows; only the first 10000" in many.stderr
    wide = _run("sql", "--nats-url", url, "SELECT number, repeat('x', 1000) AS pad FROM numbers(9000)", "-o", "json",
                data_dir=data_dir)  # > 8 MB: cut to what fits in one NATS message, and said so
    assert wide.returncode == 0 and 0 < len(json.loads(wide.stdout)) < 9000 and "only the first" in wide.stderr
    dead = _run("sql", "--nats-url", f"nats://127.0.0.1:{free_port()}", "SELECT 1")
    assert dead.returncode == 1 and "cannot connect to NATS" in dead.stderr


def _explain_and_odd_text(grpc: str, data_dir: Path, job_id: str) -> None:
    """`explain` (table and JSON), and user text that looks like rich markup prints as itself."""
    table = _run("explain", job_id, "--server", grpc, data_dir=data_dir)
    assert table.returncode == 0, table.stderr
    assert job_id in table.stdout and "placed" in table.stdout and "cn-" in table.stdout
    as_json = _run("explain", job_id, "--server", grpc, "-o", "json", data_dir=data_dir)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["job_id"] == job_id
    odd = _run("submit", "--server", grpc, "--tenant", "[/x]", "--project", "[bold]p", data_dir=data_dir)
    assert odd.returncode == 1 and "INVALID_ARGUMENT" in odd.stderr and "[/x]" in odd.stderr, odd.stderr
    assert "Traceback" not in odd.stderr
    helped = _run("principal", "put", "--help")
    assert helped.returncode == 0 and "T1,T2[/P1,P2]" in helped.stdout, helped.stdout + helped.stderr


def _second_up_is_refused(data_dir: Path, grpc: str) -> None:
    """The same data dir, or the same gRPC port, cannot be used by a second `up`."""
    env = dict(os.environ, FEDSCHED_NATS_PORT=str(free_port()), FEDSCHED_METRICS_PORT="0")
    same_dir = subprocess.run([*FEDSCHED, "up", "--data-dir", str(data_dir), "--grpc-address", f"127.0.0.1:{free_port()}"],
                              capture_output=True, text=True, timeout=60, env=env)
    assert same_dir.returncode == 1 and "in use by another fedsched process" in same_dir.stderr, same_dir.stderr
    other = data_dir / "other"
    same_port = subprocess.run([*FEDSCHED, "up", "--data-dir", str(other), "--grpc-address", grpc, "--no-agents"],
                               capture_output=True, text=True, timeout=90, env=env)
    assert same_port.returncode == 1 and f"gRPC address {grpc} is in use" in same_port.stderr, same_port.stderr
    assert "Traceback" not in same_port.stderr and not other.exists()  # said before anything started


def test_killed_up_leaves_no_nats_server_behind(tmp_path):
    """SIGKILL of `up` (no chance to clean up) still ends its nats-server child, so the data dir
    and port are free for the next `up`."""
    import socket

    nats_port = free_port()
    proc = _up(tmp_path, f"127.0.0.1:{free_port()}", nats_port)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", nats_port), timeout=0.5).close()
            time.sleep(0.2)
        except OSError:
            break
    else:
        raise AssertionError("the nats-server outlived its killed parent")
    proc = _up(tmp_path, f"127.0.0.1:{free_port()}", nats_port)
    _stop(proc)
