"""CPU per message of a :class:`~fedsched.bus.StreamFollower` (the scheduler's and admission's
way of reading the events stream), client and server.

    python bench/follower_cpu.py [--messages 20000] [--rate 1500] [--batch 500]

1. Start an embedded nats-server in a temporary directory and make the streams.
2. A publisher (a child process, so its CPU is not counted here) publishes ``--messages``
   ``job.started`` events to the events stream at ``--rate`` messages/s (0: as fast as it can),
   in bursts of ``--burst`` (a scheduler cycle's worth, or 1: one at a time).
3. This process follows the stream with one follower from sequence 1 until every message is
   handled, and prints its CPU seconds (user + system) per message, the nats-server's CPU per
   message over the same time (from ``/proc``; it includes storing the publisher's messages),
   the pull requests the follower sent (builds that count them) and the wall time.

``--backlog`` publishes everything first and then follows (a restart reading its history).
A benchmark, not a test: run it by hand and record the figure with ``uptime`` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsched.bus import Bus, StreamFollower  # noqa: E402
from fedsched.events import JobStatus, business_event_id, make_event  # noqa: E402
from fedsched.natsd import EmbeddedNats  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def publish(url: str, prefix: str, n: int, rate: float, burst: int) -> None:
    """The child: ``n`` events at ``rate``/s in bursts of ``burst``."""
    bus = await Bus.connect(url, prefix, name="bench-publisher")
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    t0 = time.monotonic()
    for first in range(0, n, burst):
        items = [(subject, make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000),
                                      producer="bench", occurred_at=time.time(),
                                      event_id=business_event_id("job", i, "started"), region="cn-north-1",
                                      cluster="cn-north-1-c1", tenant="search", project="train", job_id=f"j-{i}",
                                      attempt=1), None) for i in range(first, min(n, first + burst))]
        assert all(await bus.publish_many(items))
        if rate > 0:
            ahead = t0 + (first + burst) / rate - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
    await bus.close()


async def follow(url: str, prefix: str, n: int, batch: int) -> dict:
    bus = await Bus.connect(url, prefix, name="bench-follower")
    seen = 0
    done = asyncio.Event()

    def handle(_delivery) -> None:
        nonlocal seen
        seen += 1
        if seen >= n:
            done.set()

    follower = StreamFollower(bus, "EVENTS", handle, name="bench", batch=batch)
    task = asyncio.create_task(follower.run())
    await done.wait()
    follower.stop()
    await task
    feed_requests = getattr(follower, "pull_requests", None)  # (older builds do not count them)
    await bus.close()
    return {"requests": feed_requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--rate", type=float, default=1500.0, help="messages/s published (0: as fast as possible)")
    ap.add_argument("--burst", type=int, default=10, help="messages per publish_many")
    ap.add_argument("--batch", type=int, default=500, help="the follower's batch")
    ap.add_argument("--backlog", action="store_true", help="publish everything first, then follow")
    ap.add_argument("--child", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        asyncio.run(publish(a.child[0], a.child[1], a.messages, a.rate, a.burst))
        return
    tmp = Path(tempfile.mkdtemp(prefix="fedsched-follower-"))
    nats = EmbeddedNats(tmp / "nats")
    nats.start()
    try:
        async def setup() -> None:
            bus = await Bus.connect(nats.url, "bench")
            await bus.ensure_streams()
            await bus.close()
        asyncio.run(setup())
        cmd = [sys.executable, __file__, "--messages", str(a.messages), "--rate", str(a.rate), "--burst",
               str(a.burst), "--child", nats.url, "bench"]
        child = subprocess.Popen(cmd)
        if a.backlog:
            child.wait()
        s0, c0, t0 = proc_cpu_s(nats.pid), time.process_time(), time.monotonic()
        got = asyncio.run(follow(nats.url, "bench", a.messages, a.batch))
        requests = "" if got["requests"] is None else f", {got['requests']} pull requests"
        s1, c1, t1 = proc_cpu_s(nats.pid), time.process_time(), time.monotonic()
        child.wait()
        n = a.messages
        print(f"{n} messages ({'backlog' if a.backlog else f'{a.rate:g}/s in bursts of {a.burst}'}), batch {a.batch}: "
              f"follower {1e6 * (c1 - c0) / n:.1f} us/message, nats-server {1e6 * (s1 - s0) / n:.1f} us/message "
              f"(over {t1 - t0:.1f} s{requests}, load average {os.getloadavg()[0]:.1f})")
    finally:
        nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
