"""The committed gRPC modules match proto/ (regenerate with scripts/gen_proto.sh)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", *protos], check=True, cwd=ROOT / "proto")
    for gen in tmp_path.rglob("*.py"):
        committed = ROOT / gen.relative_to(tmp_path)
        assert committed.read_text() == gen.read_text(), f"{committed} is stale: run scripts/gen_proto.sh"
