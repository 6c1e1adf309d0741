"""The console as the README starts it: served by `fedsched up` (``--web-port``, its URL printed
at start) and as its own service (`fedsched web --grpc ... --nats-url ...`, reading the audit
log through the running system's query service), over plain HTTP with a cookie jar."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from fedsched.natsd import free_port

pytestmark = pytest.mark.e2e

FEDSCHED = [sys.executable, "-m", "fedapp.cli"]


def _start(args: list[str], ready: str, env: dict[str, str], timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """Start ``fedsched args`` and return it with the first stdout line matching ``ready``."""
    proc = subprocess.Popen([*FEDSCHED, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(ready, line)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{args[0]} did not start:\n" + "".join(lines))


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


async def _signed_in(base: str, token: str) -> aiohttp.ClientSession:
    session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
    form = await (await session.get(base + "/login")).text()
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', form).group(1)
    r = await session.post(base + "/login", data={"csrf": csrf, "token": token, "next": "/jobs"}, allow_redirects=False)
    assert r.status == 303, await r.text()
    return session


async def test_up_serves_the_console_and_fedsched_web_serves_it_on_its_own(tmp_path):
    grpc, nats_port = f"127.0.0.1:{free_port()}", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSCHED_TOKEN", "FEDSCHED_DATA_DIR")}
    env.update(FEDSCHED_NATS_PORT=str(nats_port), FEDSCHED_DATA_DIR=str(tmp_path))
    up, up_url = _start(["up", "--data-dir", str(tmp_path), "--grpc-address", grpc, "--web-port", "0"],
                        r"web console: (http://127\.0\.0\.1:\d+)", env)
    web = None
    try:
        token = (tmp_path / "admin.token").read_text().strip()
        session = await _signed_in(up_url, token)
        async with session:
            # every agent's first inventory reaches admission within a few seconds of the start
            deadline, seen = time.monotonic() + 30, set()
            while len(seen) < 6 and time.monotonic() < deadline:
                clusters = await (await session.get(up_url + "/clusters")).text()
                seen = set(re.findall(r'<tr data-cluster="([^"]+)">', clusters))
                if len(seen) < 6:
                    await asyncio.sleep(0.5)
            assert len(seen) >= 6, seen
            policy = await session.get(up_url + "/policy")
            assert policy.status == 200 and "bootstrap" in await policy.text()
        submit = subprocess.run([*FEDSCHED, "submit", "--server", grpc, "--tenant", "search", "--project", "train",
                                 "--gpus", "1", "--duration", "600", "--name", "via-cli"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert submit.returncode == 0, submit.stderr
        job_id = re.search(r"j-[0-9a-f]+", submit.stdout).group(0)
        web, web_url = _start(["web", "--grpc", grpc, "--port", "0", "--nats-url", f"nats://127.0.0.1:{nats_port}"],
                              r"web console: (http://127\.0\.0\.1:\d+)", env, timeout=30)
        session = await _signed_in(web_url, token)
        async with session:
            jobs = await (await session.get(web_url + "/jobs")).text()
            assert f'data-job-id="{job_id}"' in jobs and "via-cli" in jobs
            deadline = time.monotonic() + 30
            while True:  # the audit writer stores the events a moment after they happen
                page = await (await session.get(f"{web_url}/jobs/{job_id}")).text()
                if "<code>job.submitted</code>" in page and "<code>job.started</code>" in page:
                    break
                assert time.monotonic() < deadline, page
                await asyncio.sleep(0.3)
            assert "not connected" not in page
    finally:
        if web is not None:
            _stop(web)
        out = _stop(up)
    assert "stopped; state kept" in out
