"""`fedsched up` with a taken gRPC or web port says so in one line and starts nothing (a tryout
saw NATS started, the data dir initialised, the lease taken, then two tracebacks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("which", ["grpc", "web"])
def test_a_taken_port_is_one_error_line_and_nothing_is_started(tmp_path, which):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = ["--grpc-address", f"127.0.0.1:{port}", "--web-port", "0"] if which == "grpc" else \
            ["--grpc-address", "127.0.0.1:0", "--web-port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSCHED_")}
        done = subprocess.run([sys.executable, "-m", "fedapp.cli", "up", "--data-dir", str(tmp_path / "d"), *args],
                              capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=120,
                              cwd=ROOT)
    assert done.returncode == 1
    assert f"127.0.0.1:{port} is in use" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "d").exists()  # nothing initialised
