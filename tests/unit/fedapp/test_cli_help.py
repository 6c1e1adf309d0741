"""Every command's help: ``-h`` works, nothing prints as raw markup, and every range it states is
what admission accepts; ``--version``; money to the cent; one gRPC address variable on both sides."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
import typer
from typer.testing import CliRunner

from fedapp.cli import app
from fedapp.cli.jobs import GRPC_ENV, GRPC_ENV_DEPRECATED, server_address
from fedapp.cli.text import money
from fedsched.settings import Settings
from fedsched.tenancy import LimitsDoc
from fedsched.version import package_version

ROOT = typer.main.get_command(app)


def _commands(group=ROOT, prefix=()):
    yield prefix, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*prefix, name))


COMMANDS = list(_commands())
RUNNER = CliRunner()


def _help(path) -> str:
    result = RUNNER.invoke(app, [*path, "-h"], terminal_width=200)
    assert result.exit_code == 0, (path, result.output)
    return result.output


#: markup that must never reach the reader: rich tags, escaped brackets, reST literals, emoji codes
RAW = re.compile(r"\[/?(?:bold|italic|dim|red|green|yellow|blue|cyan|magenta|b|i|u|link)\b[^\]]*\]|\\\[|``|:[a-z_]+:")


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=[" ".join(p) or "fedsched" for p, _ in COMMANDS])
def test_help_renders_with_dash_h_and_without_raw_markup(path):
    text = _help(path)
    assert "Usage:" in text
    assert not RAW.findall(text), RAW.findall(text)


#: What admission accepts (the server's rules, cited): the policy's limits (fedsched.tenancy
#: LimitsDoc defaults, enforced by services/admission/convert.py spec_from_pb), gpu_milli 1..1000
#: (convert.py _gang), page sizes <= 1000 (ListJobs, ListApprovals), reasons <= 500 characters
#: (CancelJob, the bulk actions, SetJobPriority).
LIMITS = LimitsDoc()
EXPECTED: dict[tuple[str, str], str] = {
    ("submit", "--gpu-milli"): "1<=x<=1000",
    ("submit", "--workers"): f"default {LIMITS.max_workers})",
    ("submit", "--gpus"): f"default {LIMITS.max_gpus_per_worker})",
    ("submit", "--cpu-milli"): f"default {LIMITS.max_cpu_milli})",
    ("submit", "--memory-mib"): f"default {LIMITS.max_memory_mib})",
    ("submit", "--duration"): f"default {LIMITS.max_duration_s:.0f})",
    ("jobs", "--limit"): "1<=x<=1000",
    ("approvals", "--limit"): "1<=x<=1000",
    **{(cmd, "--reason"): "at most 500 characters" for cmd in ("cancel", "hold", "release", "priority")},
}


def _option_help(path: tuple[str, ...], flag: str) -> str:
    cmd = dict(COMMANDS)[path]
    ctx = cmd.context_class(cmd)
    for param in cmd.params:
        if flag in getattr(param, "opts", ()):
            record = param.get_help_record(ctx)
            return " ".join(record) if record else ""
    raise AssertionError(f"{' '.join(path)} has no {flag}")


@pytest.mark.parametrize("where, expected", EXPECTED.items(), ids=[" ".join(k) for k in EXPECTED])
def test_help_states_the_range_admission_accepts(where, expected):
    text = _option_help((where[0],), where[1])
    assert expected in text, text


def test_no_help_states_a_range_beyond_what_admission_accepts():
    """Every ``lo<=x<=hi`` shown stays within admission's largest limit (the wire's 2**32 - 1 and
    2**64 - 1 are not what it accepts)."""
    biggest = max(LIMITS.max_memory_mib, LIMITS.max_cpu_milli, 1000)
    for path, _ in COMMANDS:
        for hi in re.findall(r"<=x<=([\d.]+)", _help(path)):
            assert float(hi) <= biggest, (path, hi)


def test_version_prints_the_package_version():
    result = RUNNER.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"fedsched {package_version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", package_version())


@pytest.mark.parametrize("stored, currency, shown", [
    ("12.3456", "CNY", "12.35 CNY"), ("4.5", "CNY", "4.50 CNY"), ("0", "", "0.00"), ("", "CNY", "-"),
    (Decimal("1000000.005"), "USD", "1000000.00 USD"), ("n/a", "", "n/a"),
])
def test_money_is_shown_to_the_cent(stored, currency, shown):
    assert money(stored, currency) == shown


def test_one_grpc_address_variable_on_both_sides(monkeypatch, capsys):
    monkeypatch.delenv(GRPC_ENV_DEPRECATED, raising=False)
    monkeypatch.setenv(GRPC_ENV, "10.0.0.5:6000")
    assert Settings().grpc_address == "10.0.0.5:6000"  # the server's setting
    assert server_address("") == "10.0.0.5:6000"       # the client's
    monkeypatch.setenv(GRPC_ENV, "0.0.0.0:6001")      # a listen address is reached on loopback
    assert server_address("") == "127.0.0.1:6001"
    assert server_address("h:1") == "h:1"             # the flag wins
    monkeypatch.delenv(GRPC_ENV)
    monkeypatch.setenv(GRPC_ENV_DEPRECATED, "10.0.0.6:7000")
    assert server_address("") == "10.0.0.6:7000"
    assert f"{GRPC_ENV_DEPRECATED} is deprecated" in capsys.readouterr().err


def test_every_option_says_what_it_is():
    """A flag shown with only its type (``--data-dir <path>``, ``--comment <str>``) leaves the
    reader guessing: every shown option but -h carries a help text."""
    bare = [f"{' '.join(path)} {param.opts[0]}" for path, cmd in COMMANDS for param in cmd.params
            if param.param_type_name == "option" and not getattr(param, "hidden", False)
            and "--help" not in param.opts and not (param.help or "").strip()]
    assert not bare, bare


def test_web_reads_the_one_grpc_address_variable_like_every_api_command():
    text = " ".join(_option_help(("web",), "--grpc").split())
    assert f"default: {GRPC_ENV}, else 127.0.0.1:50051" in text
    assert f"env var: {GRPC_ENV_DEPRECATED}]" not in text


def test_web_takes_the_admission_address_as_server_like_every_api_command():
    """``fedsched web`` named its gRPC address ``--grpc`` where every other command says
    ``--server`` (review): both are taken, and the help shows ``--server`` first."""
    assert _option_help(("web",), "--server") == _option_help(("web",), "--grpc")
    assert _option_help(("web",), "--server").startswith("--server, --grpc")
    for path, cmd in COMMANDS:
        for param in cmd.params:
            if "--grpc" in getattr(param, "opts", ()) and path != ("web",):
                raise AssertionError(f"{' '.join(path)} names its address --grpc")


def test_root_help_names_every_command():
    text = _help(())
    for name in ROOT.commands:
        assert re.search(rf"\b{re.escape(name)}\b", text.split("Commands:")[0]), name
