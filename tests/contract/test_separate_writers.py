"""Audit and billing as separate processes (issue 14 item 9): ``fedsched service audit`` and
``fedsched service billing``, each its own process.

* Against one ClickHouse server (the ``clickhouse_server`` fixture: ``FEDSCHED_CLICKHOUSE_URL``
  or a Docker container; skipped with the reason otherwise): both run side by side on one
  database; each writes its table, and a kill -9 of billing followed by a restart bills every
  ended attempt once.
* On the embedded engine (chDB keeps one process per data path): a second writer process on the
  same data dir is refused with the reason (the first holds the data dir), and ``fedsched service
  writers`` runs both in one process -- the documented way to run them on chDB.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsched.store import open_store
from tests.builders import placement, spec, status_event, submitted, unique

ROOT = Path(__file__).resolve().parents[2]


def _service(name: str, nats_url: str, prefix: str, data_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedapp.cli", "service", name, "--nats-url", nats_url,
                             "--data-dir", str(data_dir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "FEDSCHED_SUBJECT_PREFIX": prefix, "PYTHONPATH": str(ROOT), **env},
                            start_new_session=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _jobs(bus, first: int, count: int) -> None:
    """Publish ``count`` jobs that ran one hour each on cn-north-1-c1."""
    t0 = 1.7e9
    for i in range(first, first + count):
        job = spec(gpus=1)
        job_id = f"w{i}"
        placed = placement(job_id, job, "cn-north-1-c1", "cn-north-1", [("n0", (0,))], at=t0)
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(job_id, job, t0))
        await bus.publish(bus.subjects.placements("cn-north-1", "cn-north-1-c1"), placed)
        await bus.publish(bus.subjects.status("cn-north-1", "cn-north-1-c1"),
                          status_event("job.started", placed, t0 + 1, started_at=t0 + 1))
        await bus.publish(bus.subjects.status("cn-north-1", "cn-north-1-c1"),
                          status_event("job.finished", placed, t0 + 3601, started_at=t0 + 1))


async def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.3)


async def test_audit_and_billing_as_two_processes_on_one_clickhouse_server(clickhouse_server, bus, nats_server,
                                                                             tmp_path) -> None:
    url, reason = clickhouse_server
    if url is None:
        pytest.skip(reason)
    database = unique("db")
    env = {"FEDSCHED_CLICKHOUSE_URL": url, "FEDSCHED_CLICKHOUSE_DATABASE": database}
    audit = _service("audit", nats_server.url, bus.prefix, tmp_path / "a", **env)
    billing = _service("billing", nats_server.url, bus.prefix, tmp_path / "b", **env)
    store = None
    try:
        await _jobs(bus, 0, 5)

        def count(table: str, where: str = "") -> int:
            try:
                return int(open_store(url=url, database=database).query(
                    f"SELECT count() FROM {database}.{table} {where}").scalar())
            except Exception:  # noqa: BLE001 - not migrated yet
                return 0

        await _until(lambda: count("usage", "WHERE line = 'compute'") == 5, 60, "billing's five compute lines")
        os.kill(billing.pid, signal.SIGKILL)  # kill -9 billing alone: audit keeps writing
        billing.wait()
        await _jobs(bus, 5, 5)
        await _until(lambda: count("events", "WHERE type = 'job.finished'") == 10, 60, "audit's ten ends")
        billing = _service("billing", nats_server.url, bus.prefix, tmp_path / "b", **env)
        await _until(lambda: count("usage", "WHERE line = 'compute'") == 10, 60, "billing catching up")
        store = open_store(url=url, database=database)
        ids = store.query(f"SELECT count(), uniqExact(usage_id) FROM {database}.usage").rows[0]
        assert ids[0] == ids[1] == 10  # billed once each
    finally:
        _stop(audit, billing)


async def test_on_the_embedded_engine_one_process_holds_the_writers(nats_server, bus, tmp_path) -> None:
    data = tmp_path / "data"
    audit = _service("audit", nats_server.url, bus.prefix, data)
    try:
        await _until(lambda: (data / ".lock").exists() and (data / ".lock").read_text().strip(), 60,
                     "audit to hold the data dir")
        billing = _service("billing", nats_server.url, bus.prefix, data)
        out, _ = billing.communicate(timeout=60)
        assert billing.returncode != 0
        assert b"is in use by another fedsched process" in out
        assert (data.stat().st_mode & 0o777) == 0o700  # every tenant's events and usage: this user only
    finally:
        _stop(audit)
    writers = _service("writers", nats_server.url, bus.prefix, data)
    try:
        await _jobs(bus, 0, 3)
        line = b""
        deadline = time.monotonic() + 60
        while b"running" not in line and time.monotonic() < deadline:
            line = await asyncio.to_thread(writers.stdout.readline)
            assert line or writers.poll() is None, "writers exited"
        assert b"fedsched writers running" in line
    finally:
        _stop(writers)
