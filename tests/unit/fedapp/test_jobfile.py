"""Job files of `fedsched submit -f` (fedapp/cli/jobfile.py) and the `jobs` flag helpers:
proto field names (and the flags' spellings), enum names as the CLI prints them, times in UTC,
and every mistake named with its position."""

from __future__ import annotations

import datetime as dt

import pytest

from fedapp.cli.jobfile import JobFileError, parse_job_file
from fedapp.cli.jobs import WHEN_FORMS, WhenError, parse_when, with_optional_values
from fedsched.api.v1 import jobs_pb2 as pb


def test_one_mapping_a_list_and_a_jobs_key():
    many, (one,) = parse_job_file("tenant: search\nproject: train\n")
    assert not many and one.spec.tenant == "search"
    many, reqs = parse_job_file('[{"tenant": "a", "request_id": "k1"}, {"tenant": "b"}]')
    assert many and [(r.spec.tenant, r.request_id) for r in reqs] == [("a", "k1"), ("b", "")]
    many, reqs = parse_job_file("jobs:\n  - {tenant: a}\n")
    assert many and len(reqs) == 1


def test_enums_by_short_or_full_name_and_flag_spellings():
    _, (r,) = parse_job_file("kind: fine-tune\npriority: PRIORITY_CLASS_BEST_EFFORT\nlocality: must_local\n"
                             "gpus: 2\ncard_model: T4\nduration: 60\nmemory-mib: 512\n")
    s = r.spec
    assert (s.kind, s.priority, s.locality) == (pb.JOB_KIND_FINE_TUNE, pb.PRIORITY_CLASS_BEST_EFFORT,
                                                pb.LOCALITY_MUST_LOCAL)
    assert (s.gpus_per_worker, list(s.card_models), s.estimated_duration_seconds, s.memory_mib) == (2, ["T4"], 60.0, 512)


@pytest.mark.parametrize("value,want", [
    ("2030-01-02T03:04:05", "2030-01-02T03:04:05Z"),          # no timezone: UTC
    ("2030-01-02T03:04:05Z", "2030-01-02T03:04:05Z"),
    ("'2030-01-02T05:04:05+02:00'", "2030-01-02T03:04:05Z"),   # converted to UTC
    ("2030-01-02", "2030-01-02T00:00:00Z"),
], ids=["naive", "zulu", "offset", "date"])
def test_start_deadline_is_iso_8601_and_utc_when_no_zone_is_given(value, want):
    _, (r,) = parse_job_file(f"start_deadline: {value}\n")
    assert r.spec.start_deadline.ToJsonString() == want


@pytest.mark.parametrize("text,message", [
    ("- {tenant: a}\n- {gpu_per_worker: 2}\n", "jobs[1].gpu_per_worker: unknown field; did you mean gpus_per_worker?"),
    ("workload: {image: x, comand: [a]}\n", "job.workload.comand: unknown field; did you mean command?"),
    ("datasets: [{name: d, size: 3}]\n", "job.datasets[0].size: unknown field; did you mean size_bytes?"),
    ("workers: two\n", "job.workers: want a whole number, got 'two'"),
    ("workers: -1\n", "job.workers: -1 is out of range"),
    ("preemptible: yes please\n", "job.preemptible: want true or false"),
    ("kind: sleeping\n", "job.kind: 'sleeping' is not one of training, fine_tune"),
    ("gpus: 1\ngpus_per_worker: 2\n", "job.gpus_per_worker: given twice (also as gpus)"),
    ("annotations: {a: true}\n", "job.annotations[a]: want text"),
    ("start_deadline: soon\n", "job.start_deadline: 'soon' is not an ISO-8601 date-time"),
    ("[]\n", "the list of jobs is empty"),
    ("42\n", "want a job mapping or a list of them"),
    ("- 3\n", "jobs[0]: want a mapping"),
    ("tenant: [unclosed\n", "not valid YAML"),
    ("tenant: ads\ntenant: nlp\n", "key 'tenant' is given twice"),
    ("annotations: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper than 64 levels"),
    ("jobs: [{tenant: a}]\ntenant: b\n", "a file with 'jobs:' holds only that list (also got tenant)"),
    ("jobs: 5\n", "jobs: want a list of job mappings, got int"),
], ids=["key-in-list", "workload-key", "dataset-key", "type", "range", "bool", "enum", "twice", "map-value",
        "deadline", "empty", "scalar", "item", "yaml", "duplicate-key", "too-deep", "wrapper-extra", "wrapper-type"])
def test_every_mistake_names_its_position(text, message):
    with pytest.raises(JobFileError) as e:
        parse_job_file(text)
    assert message in str(e.value)


def test_map_values_written_as_numbers_become_text():
    _, (r,) = parse_job_file("workload: {image: x, env: {EPOCHS: 3, LR: 0.5}}\nannotations: {ticket: 1234}\n")
    assert dict(r.spec.workload.env) == {"EPOCHS": "3", "LR": "0.5"} and dict(r.spec.annotations) == {"ticket": "1234"}


def test_watch_takes_an_optional_period():
    assert with_optional_values(["jobs", "--watch"]) == ["jobs", "--watch", "2"]
    assert with_optional_values(["jobs", "--watch", "--state", "queued"]) == ["jobs", "--watch", "2", "--state", "queued"]
    assert with_optional_values(["jobs", "--watch", "5"]) == ["jobs", "--watch", "5"]
    assert with_optional_values(["submit", "--watch"]) == ["submit", "--watch"]  # only `jobs` has it


def test_since_and_until_take_iso_8601_or_an_age():
    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
    assert parse_when("2h", "--since", now) == now - dt.timedelta(hours=2)
    assert parse_when("1.5d", "--since", now) == now - dt.timedelta(hours=36)
    assert parse_when("90m", "--since", now) == now - dt.timedelta(minutes=90)
    assert parse_when("2026-11-30T08:00:00", "--since", now) == dt.datetime(2026, 11, 30, 8, tzinfo=dt.UTC)
    assert parse_when("2026-11-30T08:00:00+01:00", "--since", now).astimezone(dt.UTC).hour == 7
    assert parse_when("2026-11-30T08:00:00Z", "--since", now) == dt.datetime(2026, 11, 30, 8, tzinfo=dt.UTC)
    assert parse_when("1w", "--since", now).tzinfo is dt.UTC


@pytest.mark.parametrize("text, reason", [
    ("-5m", "has a sign"),
    ("+5m", "has a sign"),
    ("0", "a number without a unit"),
    ("5", "a number without a unit"),
    ("0s", "zero age"),
    ("0.0h", "zero age"),
    ("yesterday", "neither an age nor an ISO-8601 time"),
    ("5 m", "neither an age nor an ISO-8601 time"),
    ("1e3m", "neither an age nor an ISO-8601 time"),
    ("infd", "neither an age nor an ISO-8601 time"),
    ("5M", "upper-case unit"),
    ("2026-11-30T12:00:01Z", "in the future"),
    ("2027-01-01", "in the future"),
    ("1969-12-31T23:59:59Z", "before 1970"),
    ("100000w", "before 1970"),
    ("2026-13-01", "not a valid ISO-8601 time"),
    ("", "is empty"),
], ids=lambda v: repr(v))
def test_odd_since_values_are_refused_saying_why_and_the_accepted_forms(text, reason):
    """Issue 14 follow-up: ``--since -5m`` (a future time), ``0``, ``5``, ``yesterday`` and future
    times were accepted or refused without saying what would do."""
    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
    with pytest.raises(WhenError) as e:
        parse_when(text, "--since", now)
    assert reason in e.value.reason and e.value.flag == "--since"
    assert str(e.value).endswith(WHEN_FORMS) and "30m, 2h, 1.5d" in str(e.value)


def test_submit_batches_stay_under_the_request_limit_in_items_and_bytes():
    """SubmitJobs calls of at most 1000 items and 3 MiB (admission's default request limit is
    4 MiB: a file of big jobs would otherwise fail whole with RESOURCE_EXHAUSTED)."""
    from fedapp.cli.jobs import SUBMIT_BATCH, SUBMIT_BATCH_BYTES, _chunks
    from fedsched.api.v1 import jobs_pb2 as pb

    small = [pb.SubmitJobRequest(spec=pb.JobSpec(tenant="a", name=f"s{i}")) for i in range(2500)]
    assert [len(c) for c in _chunks(small)] == [SUBMIT_BATCH, SUBMIT_BATCH, 500]
    big = [pb.SubmitJobRequest(spec=pb.JobSpec(tenant="a", annotations={f"k{k}": "x" * 1024 for k in range(64)}))
           for _ in range(100)]
    chunks = list(_chunks(big))
    assert sum(len(c) for c in chunks) == 100 and len(chunks) >= 3
    assert all(sum(r.ByteSize() for r in c) <= SUBMIT_BATCH_BYTES for c in chunks)
