"""A checkpoint is captured by ``fork`` (:class:`fedsched.snapshots.ForkedCapture`) in a process
that serves gRPC (admission). With calls in flight, gRPC's C-core fork handlers crashed the
child with SIGSEGV before it ran a line: under load, 8 of 38 admission checkpoints were lost and
each failure was retried a second later -- a fork of a 1 GB process every second. ``fedapp``
turns those handlers off (``GRPC_ENABLE_FORK_SUPPORT``) before gRPC loads; the child never uses
gRPC. The case runs in a fresh interpreter, as a service process would: ``fedapp`` imported
first, then gRPC, a server with four clients calling it, and forks while they do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = r'''
import asyncio, sys
import fedapp  # every entry point imports it before gRPC
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from fedsched.snapshots import ForkedCapture, SnapshotError

async def main(forks):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    async def client():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not stop.is_set():
                await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest()) for _ in range(20)))
    clients = [asyncio.create_task(client()) for _ in range(4)]
    await asyncio.sleep(0.3)
    failed = 0
    for _ in range(forks):
        try:
            assert await ForkedCapture(lambda: b"state" * 100).result() == b"state" * 100
        except SnapshotError:
            failed += 1
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.gather(*clients, return_exceptions=True)
    await server.stop(0)
    print("failed", failed)

asyncio.run(main(int(sys.argv[1])))
'''


def test_forks_of_a_process_serving_grpc_calls_all_deliver_their_checkpoint() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROGRAM, "60"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["failed", "0"], out.stdout + out.stderr[-2000:]
