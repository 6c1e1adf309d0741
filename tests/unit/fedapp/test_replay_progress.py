"""The replay driver's live counters: a job ended by the scheduler (``job.cancelled``, e.g. after
``unschedulable_timeout``) counts once as cancelled and is no longer unplaceable, so the replay
waits for the jobs still running instead of stopping early (a fresh user's full replay stopped
with one 8-GPU job running and unbilled)."""

from __future__ import annotations

from pathlib import Path

from fedapp.replay.driver import ReplayDriver, ReplayOptions, _JobTrack
from fedsched.events import EventType, JobPending, JobStatus, make_event
from fedsched.settings import Settings


def _event(type_, payload, job_id, attempt=0):
    return make_event(type_, payload, producer="test", occurred_at=1.7e9, tenant="t", project="p", job_id=job_id,
                      attempt=attempt)


def _driver(tmp_path: Path, jobs: list[str]) -> ReplayDriver:
    driver = ReplayDriver(ReplayOptions(nodes_csv=tmp_path / "n.csv", pods_csv=tmp_path / "p.csv",
                                        settings=Settings(data_dir=tmp_path)))
    for job_id in jobs:
        track = _JobTrack(job=None, job_id=job_id, state="submitted")
        driver.by_job_id[job_id] = track
        driver.progress.submitted += 1
    return driver


def _done(p) -> int:
    return p.finished + p.failed + p.cancelled + p.rejected + p.unplaceable


def test_a_job_ended_by_the_scheduler_counts_once_and_is_not_also_unplaceable(tmp_path):
    d = _driver(tmp_path, ["j-unplaceable", "j-running"])
    track = d.by_job_id["j-unplaceable"]
    d._on_pending(_event(EventType.JOB_PENDING, JobPending(reason="card_model", fits_empty=False), "j-unplaceable"),
                  track)
    assert (d.progress.unplaceable, _done(d.progress)) == (1, 1)
    d._on_ended(_event(EventType.JOB_CANCELLED, JobStatus(reason="unschedulable_timeout: ..."), "j-unplaceable"),
                track)
    assert (d.progress.cancelled, d.progress.unplaceable, d.progress.finished) == (1, 0, 0)
    assert _done(d.progress) == 1  # the other job still runs: the replay must not stop yet
    # a second end of the same job (e.g. the scheduler's job.cancelled after its last attempt) is no-op
    d._on_ended(_event(EventType.JOB_CANCELLED, JobStatus(reason="cancelled"), "j-unplaceable"), track)
    assert _done(d.progress) == 1


def test_json_outputs_are_strict_nan_and_infinity_become_null():
    """``sql -o json``, ``report -o json`` and ``replay --report-json`` print what strict parsers
    accept (the average of no rows is NaN in ClickHouse)."""
    import json
    from decimal import Decimal

    from fedapp.cli.text import strict_json

    def refuse(name):
        raise ValueError(name)

    text = strict_json({"p50": float("nan"), "rows": [[float("inf"), -float("inf"), 1.5]], "cost": Decimal("1.20")})
    assert json.loads(text, parse_constant=refuse) == {"p50": None, "rows": [[None, None, 1.5]], "cost": "1.20"}
