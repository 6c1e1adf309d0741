"""Files and stdin are read only as far as their size limit (a tryout grew `submit -f /dev/zero`
to 20 GB and `yes | fedsched submit -f -` to 7 GB before any size check): /dev/zero, an endless
input, is refused with the limit named, quickly and without reading it all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedsched.errors import ValidationError
from fedsched.yamltext import MAX_YAML_CHARS, read_text

ROOT = Path(__file__).resolve().parents[3]


def test_a_configuration_file_without_end_is_refused_at_the_limit() -> None:
    with pytest.raises(ValidationError) as e:
        read_text(Path("/dev/zero"), "topology")
    assert e.value.field == "topology" and f"larger than {MAX_YAML_CHARS}" in e.value.reason


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_submit_from_an_endless_input_exits_2_naming_the_limit(how) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDSCHED_GRPC_ADDRESS": "127.0.0.1:9", "FEDSCHED_TOKEN": "x"}
    args = [sys.executable, "-m", "fedapp.cli", "submit", "-f", "/dev/zero" if how == "file" else "-"]
    stdin = open("/dev/zero", "rb") if how == "stdin" else subprocess.DEVNULL
    try:
        done = subprocess.run(args, stdin=stdin, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    finally:
        if how == "stdin":
            stdin.close()
    assert done.returncode == 2 and "larger than" in done.stderr, done.stderr
