"""`fedsched submit -f`, `submit --dry-run / -v` and `fedsched jobs` against a real admission
(real gRPC, real NATS), the CLI in a child process (issue 16 items 1, 2 and 8): every JobSpec
field round-trips from a file, bad keys are named with their position, a list reports each item,
listings page newest first without repeats, filters combine, tokens are bound to their filters,
pages stay byte-bounded, and --watch redraws."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from fedapp.cli.jobfile import parse_job_file
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.events import EventType, InventorySnapshot, make_event
from fedsched.pricing import load_price_catalog
from services.admission.listing import PAGE_BYTES
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import TOKENS, channel, nodes, running_admission, until


@pytest.fixture
async def admission(bus):
    async with running_admission(bus, what_if_timeout_s=0.5) as svc:
        yield svc


async def _cli(admission, *args: str, stdin: str | None = None, who: str = "root",
               columns: str | None = "250") -> subprocess.CompletedProcess:
    """The CLI in a child process (the servers run on this event loop: never block it); stdout
    is a pipe, ``COLUMNS`` is ``columns`` (None: unset, as in a user's pipe)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSCHED_TOKEN", "FEDSCHED_DATA_DIR", "COLUMNS")}
    if columns is not None:
        env["COLUMNS"] = columns
    cmd = [sys.executable, "-m", "fedapp.cli", *args, "--server", f"127.0.0.1:{admission.port}", "--token", TOKENS[who]]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=120, env=env,
                                   input=stdin)


#: A job file setting every JobSpec field (canonical values, so what GetJob returns is equal).
EVERY_FIELD = """
tenant: search
project: train
name: every-field
kind: batch
priority: high
workers: 2
gpus_per_worker: 1
gpu_milli: 500
cpu_milli: 4000
memory_mib: 16384
card_models: [nvidia-t4-16gb]
min_gpu_memory_gib: 16
requires_rdma: true
home_region: cn-north-1
locality: prefer_local
allowed_regions: [cn-north-1, cn-east-1]
forbidden_regions: [cn-south-1]
residency_tags: [finance]
datasets:
  - {name: corpus, home_region: cn-east-1, size_bytes: 1099511627776}
  - {name: eval-set, home_region: cn-north-1, size_bytes: 1024}
start_deadline: 2030-01-02T03:04:05   # no timezone: UTC
max_price_per_gpu_hour: 12.5
preemptible: true
checkpointable: true
estimated_duration_seconds: 5400
retry_limit: 3
shards: 2
annotations: {team: ranking, ticket: "1234"}
workload:
  image: nvcr.io/nvidia/pytorch:24.05-py3
  command: [torchrun, train.py]
  args: [--lr, "0.1"]
  env: {EPOCHS: 3, MODE: fast}
  secret_env: {HF_TOKEN: hf-credentials/token}
  workdir: /workspace
  checkpoint_uri: s3://ckpt/run-1
"""


async def test_a_file_with_every_field_round_trips_through_submit_and_get(admission, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(EVERY_FIELD)
    _, (sent,) = parse_job_file(EVERY_FIELD)
    # the file sets every field of JobSpec and of Workload (a new field makes this test fail)
    assert {f.name for f, _ in sent.spec.ListFields()} == set(pb.JobSpec.DESCRIPTOR.fields_by_name)
    assert {f.name for f, _ in sent.spec.workload.ListFields()} == set(pb.Workload.DESCRIPTOR.fields_by_name)
    assert sent.spec.start_deadline.ToJsonString() == "2030-01-02T03:04:05Z"
    out = await _cli(admission, "submit", "-f", str(path))
    assert out.returncode == 0, out.stderr
    job_id, state = out.stdout.split()
    assert job_id.startswith("j-") and state == "queued"
    async with channel(admission.port, "root") as ch:
        got = await pb_grpc.JobServiceStub(ch).GetJob(pb.GetJobRequest(job_id=job_id))
    for field, value in sent.spec.ListFields():  # each field equal, one by one (names the field that differs)
        assert getattr(got.spec, field.name) == value, field.name
    assert got.spec == sent.spec


async def test_flags_override_the_files_values_in_every_job_and_stdin_works(admission):
    text = json.dumps([{"tenant": "search", "project": "train", "name": "a", "gpus": 2, "card_model": ["T4"]},
                       {"tenant": "search", "project": "serve", "name": "b", "cpu_milli": 1000}])
    out = await _cli(admission, "submit", "-f", "-", "--project", "batch", "--gpus", "1", "--priority", "low",
                     stdin=text)
    assert out.returncode == 0, out.stderr
    ids = [line.split()[1] for line in out.stdout.splitlines()]
    assert [line.split(":")[0] for line in out.stdout.splitlines()] == ["a", "b"]
    specs = [admission.view.jobs[j].spec for j in ids]
    assert [(s.project, s.gpus_per_worker, s.priority.value) for s in specs] == [("batch", 1, "low")] * 2
    assert specs[0].card_models == ("nvidia-t4-16gb",)  # not overridden: the file's


async def test_an_unknown_key_is_an_error_naming_its_position_and_nothing_is_submitted(admission, tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("- {tenant: search, project: train}\n- {tenant: search, project: train}\n"
                    "- {tenant: search, project: train, gpu_per_worker: 2}\n")
    out = await _cli_here(admission, "submit", "-f", str(path))
    assert out.returncode == 2
    assert "jobs[2].gpu_per_worker: unknown field; did you mean gpus_per_worker?" in out.stderr
    deadline = "- {tenant: search, project: train, start_deadline: tomorrow}\n"
    path.write_text(deadline)
    out = await _cli_here(admission, "submit", "-f", str(path))
    assert out.returncode == 2 and "jobs[0].start_deadline: 'tomorrow' is not an ISO-8601 date-time" in out.stderr
    assert not admission.view.jobs


async def test_a_list_with_one_bad_item_submits_the_others_prints_each_and_exits_1(admission, tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("- {tenant: search, project: train, name: one}\n"
                    "- {tenant: search, project: train, name: two, workers: 0}\n"
                    "- {tenant: search, project: train, name: three}\n")
    out = await _cli_here(admission, "submit", "-f", str(path), "--request-id", "batch-7")
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["one", "three"]
    assert "two: INVALID_ARGUMENT: spec.workers:" in out.stderr
    assert {r.spec.name for r in admission.view.jobs.values()} == {"one", "three"}
    again = await _cli_here(admission, "submit", "-f", str(path), "--request-id", "batch-7")  # same keys: same jobs
    assert [line.split()[1] for line in again.stdout.splitlines()] == [line.split()[1] for line in lines]
    assert all("(duplicate request)" in line for line in again.stdout.splitlines())


async def test_submit_v_prints_the_trace_id_and_how_to_find_its_events(admission):
    out = await _cli(admission, "submit", "--tenant", "search", "--project", "train", "-v")
    assert out.returncode == 0, out.stderr
    trace_line = next(line for line in out.stdout.splitlines() if line.startswith("trace id: "))
    trace_id = trace_line.removeprefix("trace id: ")
    assert len(trace_id) == 32
    assert f"WHERE trace_id = '{trace_id}'" in out.stdout and "fedsched sql" in out.stdout


async def test_dry_run_prints_the_verdict_and_what_if_with_and_without_a_scheduler(admission, bus):
    args = ("submit", "--tenant", "search", "--project", "train", "--card-model", "T4", "--dry-run")
    alone = await _cli(admission, *args)
    assert alone.returncode == 0, alone.stderr
    assert "verdict: accepted" in alone.stdout and "no scheduler answered" in alone.stdout
    refused = await _cli(admission, "submit", "--tenant", "search", "--project", "nope", "--dry-run")
    assert refused.returncode == 1 and "verdict: INVALID_ARGUMENT: spec.project:" in refused.stdout
    await bus.publish(bus.subjects.inventory("cn-north-1", "cn-north-1-c1"),
                      make_event(EventType.INVENTORY_SNAPSHOT, InventorySnapshot(nodes=nodes("n", gpus=8)),
                                 producer="test", occurred_at=time.time(), region="cn-north-1", zone="cn-north-1a",
                                 cluster="cn-north-1-c1"))
    scheduler = SchedulerService(bus, SystemClock(), build_policy(), load_price_catalog(), interval_s=0.01,
                                 stale_after_s=3600)
    task = asyncio.create_task(scheduler.run())
    try:
        assert await until(lambda: "cn-north-1-c1" in scheduler.clusters)
        answered = await _cli(admission, *args)
    finally:
        scheduler.stop()
        await task
    assert answered.returncode == 0, answered.stderr
    assert "verdict: accepted" in answered.stdout and "what-if: placed cn-north-1-c1" in answered.stdout
    assert "cn-north-1-c1" in answered.stdout.split("what-if:", 1)[1] and "fits" in answered.stdout
    assert not admission.view.jobs


async def _submit_many(admission, specs: list[pb.JobSpec]) -> list[str]:
    async with channel(admission.port, "root") as ch:
        stub = pb_grpc.JobServiceStub(ch)
        return [(await stub.SubmitJob(pb.SubmitJobRequest(spec=s))).job_id for s in specs]


async def _cli_here(admission, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process on a worker thread (a child process costs seconds of imports;
    the blocking gRPC calls leave this event loop, which serves them, free)."""
    from typer.testing import CliRunner

    from fedapp.cli import app

    argv = [*args, "--server", f"127.0.0.1:{admission.port}", "--token", TOKENS["root"]]
    result = await asyncio.to_thread(CliRunner().invoke, app, argv, env={"COLUMNS": "250"})
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def _json_ids(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 0, out.stderr
    return [j["job_id"] for j in json.loads(out.stdout)]


async def test_jobs_pages_newest_first_with_tokens_and_json_follows_every_page(admission):
    ids = await _submit_many(admission, [pb.JobSpec(tenant="search", project="train", name=f"n{i}") for i in range(7)])
    newest_first = list(reversed(ids))  # submitted one after the other: later = newer
    seen, token, pages = [], "", 0
    while True:  # the table: 3 pages of at most 3, each footer giving the next token
        out = await _cli_here(admission, "jobs", "--limit", "3", *(["--page-token", token] if token else []))
        assert out.returncode == 0, out.stderr
        rows = [line.split("│")[1].strip() for line in out.stdout.splitlines() if line.startswith("│ j-")]
        seen += rows
        pages += 1
        footer = out.stdout.strip().splitlines()[-1]
        assert footer.startswith(f"{len(rows)} of 7 matching jobs shown")
        if "--page-token" not in footer:
            break
        token = footer.split("--page-token ", 1)[1].strip()
    assert pages == 3 and seen == newest_first
    assert _json_ids(await _cli_here(admission, "jobs", "--limit", "2", "-o", "json")) == newest_first
    assert _json_ids(await _cli_here(admission, "jobs", "--limit", "2", "--oldest-first", "-o", "json")) == ids
    listed = await _cli_here(admission, "jobs", "--limit", "3", "--all")
    assert sum(1 for line in listed.stdout.splitlines() if line.startswith("│ j-")) == 7


async def test_jobs_filters_combine_and_repeated_flags_are_all_kept(admission):
    specs = [pb.JobSpec(tenant="search", project="train", name="train-a", kind=pb.JOB_KIND_TRAINING),
             pb.JobSpec(tenant="search", project="serve", name="serve-a", kind=pb.JOB_KIND_INFERENCE),
             pb.JobSpec(tenant="ads", project="train", name="train-b", kind=pb.JOB_KIND_TRAINING),
             pb.JobSpec(tenant="nlp", project="batch", name="eval-x", kind=pb.JOB_KIND_EVALUATION)]
    a, b, c, d = await _submit_many(admission, specs)
    async with channel(admission.port, "root") as ch:
        await pb_grpc.JobServiceStub(ch).CancelJob(pb.CancelJobRequest(job_id=d))
    assert await until(lambda: admission.view.jobs[d].cancel_requested)
    cases = [
        (("--tenant", "search", "--tenant", "ads"), [c, b, a]),
        (("--tenant", "search,nlp"), [d, b, a]),
        (("--tenant", "search", "--tenant", "ads", "--project", "train"), [c, a]),
        (("--kind", "training", "--kind", "evaluation"), [d, c, a]),
        (("--name", "train-*"), [c, a]),
        (("--name", "*-a", "--kind", "inference"), [b]),
        (("--state", "queued", "--state", "held"), [d, c, b, a]),  # d: cancel requested, the scheduler is absent
        (("--since", "1h"), [d, c, b, a]),
        (("--until", "1h"), []),
        (("--region", "cn-north-1"), []),  # nothing placed yet
    ]
    for args, want in cases:
        assert _json_ids(await _cli_here(admission, "jobs", *args, "-o", "json")) == want, args
    bad = await _cli_here(admission, "jobs", "--state", "sleeping")
    assert bad.returncode == 2 and "'sleeping' is not one of queued, awaiting_approval, placed" in bad.stderr


async def test_a_page_token_used_with_other_filters_is_refused(admission):
    await _submit_many(admission, [pb.JobSpec(tenant="search", project="train") for _ in range(3)])
    first = await _cli_here(admission, "jobs", "--limit", "1", "--tenant", "search")
    token = first.stdout.strip().splitlines()[-1].split("--page-token ", 1)[1].strip()
    same = await _cli_here(admission, "jobs", "--limit", "1", "--tenant", "search", "--page-token", token)
    assert same.returncode == 0, same.stderr
    other = await _cli_here(admission, "jobs", "--limit", "1", "--tenant", "ads", "--page-token", token)
    assert other.returncode == 1 and "INVALID_ARGUMENT: page_token:" in other.stderr


async def test_pages_of_huge_jobs_stay_within_a_mib_and_list_every_job_once(admission):
    """Jobs near the largest spec admission takes (its size limits: 64 annotations of 1 KiB, 64
    allowed regions ...): 40 of them are ~2.6 MiB, so the listing takes several pages, each under
    the byte bound (and far from gRPC's 4 MiB), every job once, newest first."""
    big = dict(annotations={f"k{k}": "x" * 1024 for k in range(64)}, allowed_regions=["cn-north-1"] * 64)
    jobs = [pb.JobSpec(tenant="search", project="train", name=f"s{i}", **big) for i in range(40)]
    assert sum(j.ByteSize() for j in jobs) > 2 * PAGE_BYTES
    ids = await _submit_many(admission, jobs)
    async with channel(admission.port, "root") as ch:
        stub = pb_grpc.JobServiceStub(ch)
        token, pages = "", []
        while True:
            resp = await stub.ListJobs(pb.ListJobsRequest(page_size=1000, page_token=token))
            assert resp.ByteSize() <= PAGE_BYTES + 4096, resp.ByteSize()
            pages.append([j.job_id for j in resp.jobs])
            token = resp.next_page_token
            if not token:
                break
    assert [j for p in pages for j in p] == list(reversed(ids)) and len(pages) >= 3
    out = await _cli_here(admission, "jobs", "-o", "json")  # the CLI follows the same pages
    assert len(_json_ids(out)) == 40


async def test_watch_redraws_and_stops_after_the_asked_refreshes(admission):
    (job_id,) = await _submit_many(admission, [pb.JobSpec(tenant="search", project="train", name="watched")])
    out = await _cli(admission, "jobs", "--watch", "0.2", "--watch-count", "2")
    assert out.returncode == 0, out.stderr
    assert job_id in out.stdout and "refreshed" in out.stdout and "every 0.2 s" in out.stdout
    bare = await _cli(admission, "jobs", "--tenant", "search", "--watch", "--watch-count", "1")  # default period
    assert bare.returncode == 0, bare.stderr
    assert "every 2 s" in bare.stdout



LONG_NAME = "nightly-ranking-model-retrain-cn-north-1"  # 40 characters


async def test_a_pipe_gets_one_line_per_job_with_whole_names_and_columns_is_honoured(admission):
    """Issue 16 follow-up: in a pipe without COLUMNS (rich's default would be 80 columns) every
    job is one line with its whole 40-character name, so `fedsched jobs | grep` sees rows;
    COLUMNS=80 fits the table in 80 columns and cuts the name with an ellipsis, never silently."""
    assert len(LONG_NAME) == 40
    ids = await _submit_many(admission, [pb.JobSpec(tenant="search", project="train", name=LONG_NAME,
                                                    kind=pb.JOB_KIND_TRAINING) for _ in range(3)])
    piped = await _cli(admission, "jobs", columns=None)
    assert piped.returncode == 0, piped.stderr
    for job_id in ids:
        (row,) = [line for line in piped.stdout.splitlines() if job_id in line]  # grep finds the job's one line
        assert LONG_NAME in row and "search/train" in row and "queued" in row, row
    narrow = await _cli(admission, "jobs", columns="80")
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    assert all(any(job_id in line for line in lines) for job_id in ids)  # ids are never cut
    assert LONG_NAME not in narrow.stdout and LONG_NAME[:10] in narrow.stdout and "…" in narrow.stdout


async def test_json_output_spells_enums_as_the_table_and_the_filters_do(admission):
    """`-o json` says `queued`, `training`, `high` (what the STATE column prints and --state
    takes), not JOB_STATE_QUEUED, for jobs, job and submit alike; a job's JSON spec submits again."""
    (job_id,) = await _submit_many(admission, [pb.JobSpec(tenant="search", project="train", name="spelled",
                                                          kind=pb.JOB_KIND_TRAINING, priority=pb.PRIORITY_CLASS_HIGH,
                                                          locality=pb.LOCALITY_PREFER_LOCAL)])
    (listed,) = json.loads((await _cli_here(admission, "jobs", "--state", "queued", "-o", "json")).stdout)
    one = json.loads((await _cli_here(admission, "job", job_id, "-o", "json")).stdout)
    for j in (listed, one):
        assert j["state"] == "queued"
        assert (j["spec"]["kind"], j["spec"]["priority"], j["spec"]["locality"]) == ("training", "high", "prefer_local")
    table = await _cli_here(admission, "jobs")
    (row,) = [line for line in table.stdout.splitlines() if job_id in line]
    assert f" {listed['state']} " in row
    submitted = await _cli_here(admission, "submit", "--tenant", "search", "--project", "train", "--kind",
                                "fine_tune", "-o", "json")
    assert json.loads(submitted.stdout)["state"] == "queued", submitted.stdout
    resubmit = await _cli(admission, "submit", "-f", "-", "-o", "json",
                          stdin=json.dumps(one["spec"]))
    assert resubmit.returncode == 0, resubmit.stderr
    again = json.loads((await _cli_here(admission, "job", json.loads(resubmit.stdout)["job_id"], "-o", "json")).stdout)
    assert (again["spec"]["kind"], again["spec"]["priority"], again["spec"]["locality"]) == ("training", "high",
                                                                                           "prefer_local")


async def test_a_filter_matching_nothing_prints_nothing_and_says_why_on_stderr(admission):
    await _submit_many(admission, [pb.JobSpec(tenant="search", project="train") for _ in range(2)])
    out = await _cli(admission, "jobs", "--state", "held", "--tenant", "ads")  # a known tenant without such jobs
    assert out.returncode == 0 and out.stdout == "", out.stdout
    assert "no jobs match --tenant ads --state held; `fedsched jobs` without filters lists 2" in out.stderr
    as_json = await _cli(admission, "jobs", "--name", "nothing-*", "-o", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == []
    assert "no jobs match --name 'nothing-*'" in as_json.stderr
    unfiltered = await _cli(admission, "jobs", "--tenant", "search")
    assert unfiltered.returncode == 0 and unfiltered.stderr == "" and "2 of 2 matching jobs" in unfiltered.stdout


@pytest.mark.parametrize("args, message", [
    (("clusters", "--region", "cn-nowhere-9"), "regions[0]: no such region 'cn-nowhere-9'; known regions: "),
    (("jobs", "--region", "cn-nowhere-9"), "regions[0]: no such region 'cn-nowhere-9'; known regions: "),
    (("jobs", "--cluster", "cn-north-1-c9"), "clusters[0]: no such cluster 'cn-north-1-c9'; known clusters:"),
    (("jobs", "--tenant", "search,serach"), "tenants[1]: no such tenant 'serach'; known tenants: "),
    (("jobs", "--tenant", "search", "--project", "trian"), "projects[0]: no such project 'trian'; known projects: "),
    (("quota", "--tenant", "serach"), "tenant: no such tenant 'serach'; known tenants: "),
    (("approvals", "--tenant", "serach"), "tenant: no such tenant 'serach'; known tenants: "),
], ids=["clusters-region", "jobs-region", "jobs-cluster", "jobs-tenant", "jobs-project", "quota-tenant",
        "approvals-tenant"])
async def test_a_filter_naming_nothing_that_exists_is_an_error_listing_the_known_names(admission, args, message):
    """Issue 14 follow-up: ``fedsched clusters --region <well-formed but unknown>`` printed an
    empty table and exited 0; so did other list filters naming nothing (for an admin)."""
    result = await _cli_here(admission, *args)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"INVALID_ARGUMENT: {message}" in " ".join(result.stderr.split()), result.stderr
    if "region" in message:
        assert "cn-north-1" in result.stderr  # the known ones are listed


async def test_a_known_name_that_matches_nothing_is_still_an_empty_answer(admission):
    """The other side of the judgement: a valid filter with an empty result is not an error."""
    empty = await _cli_here(admission, "jobs", "--region", "cn-north-1", "-o", "json")
    assert empty.returncode == 0 and _json_ids(empty) == []
    clusters = await _cli_here(admission, "clusters", "--region", "cn-north-1", "-o", "json")
    assert clusters.returncode == 0, clusters.stderr
    # a non-admin naming a tenant they may not read is refused as before (known or not: no leak)
    async with channel(admission.port, "alice") as ch:
        with pytest.raises(Exception) as e:
            await pb_grpc.JobServiceStub(ch).ListJobs(pb.ListJobsRequest(tenants=["no-such-tenant"]))
    assert e.value.code().name == "PERMISSION_DENIED"


async def test_clusters_of_a_known_region_without_reports_says_so_and_exits_0(admission):
    out = await _cli_here(admission, "clusters", "--region", "cn-north-1")
    assert out.returncode == 0 and "no cluster of cn-north-1 has reported yet" in out.stdout, out.stdout


async def test_submit_v_of_a_job_file_prints_the_batchs_trace_id_from_the_metadata(admission, tmp_path):
    """SubmitJobs' trace id reaches the CLI only as ``x-trace-id`` metadata (trailing since issue 15)."""
    path = tmp_path / "jobs.yaml"
    path.write_text("- {tenant: search, project: train, name: one}\n- {tenant: search, project: train, name: two}\n")
    out = await _cli_here(admission, "submit", "-f", str(path), "-v")
    assert out.returncode == 0, out.stderr
    trace_line = next(line for line in out.stdout.splitlines() if line.startswith("trace id: "))
    assert len(trace_line.removeprefix("trace id: ")) == 32
