"""The CLI's output rules: one spelling of every API enum (tables, filters, JSON) and the
console's width in a pipe, with COLUMNS, and on a terminal."""

from __future__ import annotations

import io

import pytest
from rich.table import Table

from fedapp.cli.text import PIPE_WIDTH, CliConsole
from fedapp.cli.wire import enum_number, enum_word, enum_words, message_dict
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb

ENUMS = [pb.JobState, pb.JobKind, pb.PriorityClass, pb.Locality, pb.JobOrder, gpb.ApprovalState, gpb.CrossRegionMode]


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.DESCRIPTOR.name)
def test_every_word_names_its_value_and_back(enum):
    words = enum_words(enum.DESCRIPTOR)
    assert words and all(w == w.lower() and "_state_" not in w for w in words)
    assert [enum_number(enum.DESCRIPTOR, w) for w in words] == [v.number for v in enum.DESCRIPTOR.values
                                                                if v.number != 0]
    assert enum_number(enum.DESCRIPTOR, "unspecified") is None


@pytest.mark.parametrize("word, number", [("queued", pb.JOB_STATE_QUEUED), ("Awaiting-Approval",
                                          pb.JOB_STATE_AWAITING_APPROVAL), ("JOB_STATE_QUEUED", None),
                                          ("sleeping", None)], ids=["plain", "case-and-dash", "full-name", "unknown"])
def test_state_words(word, number):
    assert enum_number(pb.JobState.DESCRIPTOR, word) == number


def test_message_dict_spells_enums_in_fields_lists_and_nested_messages():
    job = pb.Job(job_id="j-1", state=pb.JOB_STATE_HELD,
                 spec=pb.JobSpec(kind=pb.JOB_KIND_FINE_TUNE, priority=pb.PRIORITY_CLASS_BEST_EFFORT))
    request = pb.ListJobsRequest(states=[pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING], order=pb.JOB_ORDER_OLDEST_FIRST)
    assert message_dict(job) == {"job_id": "j-1", "state": "held",
                                 "spec": {"kind": "fine_tune", "priority": "best_effort"}}
    listed = message_dict(pb.ListJobsResponse(jobs=[job]))
    assert listed["jobs"][0]["state"] == "held" and listed["jobs"][0]["spec"]["kind"] == "fine_tune"
    assert message_dict(request) == {"states": ["queued", "running"], "order": "oldest_first"}
    assert enum_word(pb.JobState.DESCRIPTOR, 999) == "999"  # a newer server's value is still shown


def _render(console: CliConsole, buffer: io.StringIO) -> list[str]:
    table = Table("job", "name")
    table.add_row("j-1", "n" * 300)
    console.print(table)
    return buffer.getvalue().splitlines()


def test_a_pipe_is_wide_columns_wins_and_a_terminal_keeps_its_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    pipe = io.StringIO()
    lines = _render(CliConsole(file=pipe), pipe)
    assert CliConsole(file=io.StringIO()).width == PIPE_WIDTH and "n" * 300 in lines[3]
    monkeypatch.setenv("COLUMNS", "80")
    narrow = io.StringIO()
    assert max(len(line) for line in _render(CliConsole(file=narrow), narrow)) == 80
    monkeypatch.delenv("COLUMNS")
    tty = CliConsole(file=io.StringIO(), force_terminal=True, width=132)
    assert tty.width == 132
    assert CliConsole(file=io.StringIO(), force_terminal=True).width != PIPE_WIDTH


def _table_text(jobs, width: int) -> str:
    import io

    from rich.console import Console

    from fedapp.cli.jobs import _jobs_table

    out = Console(width=width, file=io.StringIO(), force_terminal=False)
    out.print(_jobs_table(jobs, width))
    return out.file.getvalue()


def _job(i: int, reason: str, state):
    from google.protobuf.timestamp_pb2 import Timestamp

    from fedsched.api.v1 import jobs_pb2 as pb

    return pb.Job(job_id=f"j-{i:020d}", state=state, reason=reason, submitted_at=Timestamp(seconds=1_700_000_000),
                  spec=pb.JobSpec(tenant="search", project="train", name="n" * 40, workers=1, gpus_per_worker=1))


@pytest.mark.parametrize("width", [80, 100, 120, 160, 300])
def test_a_long_reason_never_squeezes_ids_or_states_and_every_line_fits(width):
    """A tryout found every pending job's long reason squeezing the state and other columns to
    nothing (a cell that cannot wrap claims its whole length): the reason takes what is left."""
    from fedsched.api.v1 import jobs_pb2 as pb

    jobs = [_job(1, "no cluster fits: " + "insufficient gpus on c1 (free 0 of 8), " * 6, pb.JOB_STATE_QUEUED),
            _job(2, "short", pb.JOB_STATE_SUCCEEDED)]
    text = _table_text(jobs, width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines)
    for j, state in ((jobs[0], "queued"), (jobs[1], "succeeded")):
        row = next(line for line in lines if j.job_id in line)  # the whole id, on one line with its state
        assert f" {state} " in row
    assert "no cluster" in text and ("…" in text or width >= 300)


def test_control_characters_and_markup_in_a_reason_are_shown_not_obeyed():
    from fedsched.api.v1 import jobs_pb2 as pb

    text = _table_text([_job(1, "x\x1b]0;pwned\x07\x1b[2J [red]RED[/]", pb.JOB_STATE_HELD)], 200)
    assert "\x1b" not in text and "\x07" not in text
    assert "x\\x1b]0;pwned\\x07\\x1b[2J [red]RED[/]" in text


def _awaiting_approval() -> pb.ExplainJobResponse:
    from google.protobuf.timestamp_pb2 import Timestamp

    d = pb.ShardDecision(outcome="awaiting_approval", summary="home region cn-north-1: full; east-c1 can run it now",
                         cluster="east-c1", region="cn-east-1", queue="training", policy_version="v7",
                         approval_id="ap-0123456789abcdef0123", approval_expires_at=Timestamp(seconds=1_700_003_600))
    d.clusters.add(cluster="east-c1", region="cn-east-1", passed=True, total=0.9, scores={"price": 0.9})
    d.clusters.add(cluster="north-c1", region="cn-north-1", passed=False, reason="insufficient_free_resources",
                   detail="0 of 1 GPU free")
    return pb.ExplainJobResponse(job_id="j-1", state=pb.JOB_STATE_AWAITING_APPROVAL, decisions=[d])


def test_explain_shows_a_proposal_awaiting_approval_with_its_request_deadline_and_verdicts(monkeypatch):
    from fedapp.cli import jobs as cli_jobs

    out = io.StringIO()
    monkeypatch.setattr(cli_jobs, "console", CliConsole(file=out, width=200))
    cli_jobs._print_explain(_awaiting_approval())
    text = out.getvalue()
    assert "awaiting_approval east-c1 (cn-east-1) queue training" in text
    assert ("request ap-0123456789abcdef0123, to be approved or rejected by an approver of the job's tenant (role "
            "approver) or an admin by 2023-11-14 23:13:20 UTC") in " ".join(text.split())  # wrapped at 200
    assert "north-c1" in text and "insufficient_free_resources" in text and "not decided" not in text


def test_job_shows_the_specs_deadline_retries_flags_price_datasets_and_annotations_escaped(monkeypatch):
    from google.protobuf.timestamp_pb2 import Timestamp

    from fedapp.cli import jobs as cli_jobs

    spec = pb.JobSpec(tenant="search", project="train", start_deadline=Timestamp(seconds=1_700_003_600),
                      retry_limit=3, preemptible=True, checkpointable=False, max_price_per_gpu_hour=7.5,
                      estimated_duration_seconds=7200, home_region="cn-north-1",
                      datasets=[pb.Dataset(name="corpus", home_region="cn-east-1", size_bytes=900 * 10**9)],
                      annotations={"team": "ranking", "note": "x\x1b]0;pwned\x07 [red]RED[/]"})
    out = io.StringIO()
    monkeypatch.setattr(cli_jobs, "console", CliConsole(file=out, width=200))
    cli_jobs._print_spec(spec)
    text = out.getvalue()
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3}
    assert lines["start deadline"] == "2023-11-14 23:13:20 UTC" and lines["retry limit"] == "3"
    assert (lines["preemptible"], lines["checkpointable"]) == ("yes", "no")
    assert lines["max price / GPU-hour"] == "7.5" and lines["estimated duration"] == "7200 s"
    assert lines["dataset corpus"] == "900 GB in cn-east-1" and lines["annotation team"] == "ranking"
    assert lines["annotation note"] == "x\\x1b]0;pwned\\x07 [red]RED[/]" and "\x1b" not in text
