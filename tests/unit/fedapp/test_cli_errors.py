"""The CLI on bad input: a clear message and exit code, never a traceback; every --help renders."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from fedapp.cli import app

FEDSCHED = [sys.executable, "-m", "fedapp.cli"]


def _paths(group, prefix: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if hasattr(cmd, "commands"):
            yield from _paths(cmd, (*prefix, name))


def test_every_command_help_renders():
    root = typer.main.get_command(app)
    paths = list(_paths(root))
    assert ("principal", "put") in paths and ("explain",) in paths and len(paths) > 20
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output, result.exception)


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*FEDSCHED, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("args, code, message", [
    (("schema", "--cluster", "x; DROP TABLE y"), 1, "--cluster"),
    (("schema", "--database", "a-b"), 1, "--database"),
    (("schema", "--out", "/nonexistent-dir/x.sql"), 1, "/nonexistent-dir/x.sql"),
    (("up", "--data-dir", "/etc/hostname"), 2, "not a directory"),
    (("replay", "--timeout", "0"), 2, "--timeout"),
    (("submit", "--tenant", "t", "--project", "p", "--workers", "-1"), 2, "--workers"),
    (("submit", "--tenant", "t", "--project", "p", "--cpu-milli", str(2**64)), 2, "--cpu-milli"),
    (("sql", "--nats-url", "nats://127.0.0.1:1", "SELECT 1"), 1, "cannot connect to NATS"),
    (("jobs", "-o", "xml"), 2, "--output"),
    (("jobs", "--since", "-5m"), 2, "has a sign: an age counts back from now"),
    (("jobs", "--since", "yesterday"), 2, "accepted: an age before now"),
    (("jobs", "--since", "2999-01-01"), 2, "is in the future"),
    (("jobs", "--since", "1h", "--until", "2h"), 2, "is not after --since"),
    (("jobs", "--token", "abc\ndef"), 1, "printable ASCII"),
    (("up", "--grpc-address", "127.0.0.1:99999", "--data-dir", "/tmp/fedsched-never-made"), 2, "port 0-65535"),
    (("report", "--from", "2023-03-01", "--to", "2023-02-01"), 2, "is not before"),
])
def test_bad_input_is_a_message_not_a_traceback(args, code, message):
    result = _run(*args)
    out = result.stdout + result.stderr
    assert result.returncode == code, out
    assert message in out.replace("\n", " ") or message in out, out
    assert "Traceback" not in out


def test_a_trace_that_is_not_utf8_is_named(tmp_path):
    pods = tmp_path / "pods.csv"
    pods.write_bytes(b"name,creation_time\n\xff\xfe,0\n")
    result = _run("replay", "--pods", str(pods), "--timeout", "60", "-q")
    assert result.returncode == 1 and "not UTF-8" in result.stderr and "Traceback" not in result.stderr
