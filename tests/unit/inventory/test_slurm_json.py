"""Parsing Slurm's JSON and building sbatch arguments, on samples captured from a real Slurm 22.05.

The samples in ``tests/data/slurm/`` come from ``tests/data/slurm/capture.py`` run against
``deploy/slurm/local-slurm.sh`` on this machine (node ``fsnode1``, GRES ``gpu:a100:4,gpu:t4:2``).
"""

from __future__ import annotations

import json
import shlex
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from fedsched.jobs import AttemptState
from services.inventory.slurm_json import (
    AttemptTag, Gres, comment_labels, NodeHealth, SbatchRequest, expand_hostlist, node_health, outcome, parse_comment,
    jobs_by_tag, parse_gres, parse_job_name, parse_jobcomp_line, parse_jobs, parse_nodes, parse_sbatch_output,
    sbatch_call, split_wait_status, time_limit_minutes, utc_from_epoch,
)

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "slurm"


def load(name: str) -> dict:
    return json.loads((SAMPLES / name).read_text())


def by_job(jobs):
    return {j.tag.job_id: j for j in jobs if j.tag is not None}


# --------------------------------------------------------------------------- GRES and nodes


@pytest.mark.parametrize("spec,expected", [
    ("gpu:a100:4,gpu:t4:2", (Gres("gpu", "a100", 4), Gres("gpu", "t4", 2))),
    ("gpu:a100:4(S:0-1)", (Gres("gpu", "a100", 4),)),
    ("gpu:a100:2(IDX:0,2),gpu:t4:0(IDX:N/A)", (Gres("gpu", "a100", 2), Gres("gpu", "t4", 0))),
    ("gres:gpu:a100:2", (Gres("gpu", "a100", 2),)),
    ("gpu:2", (Gres("gpu", "", 2),)),
    ("gpu:a100_80g:8,mps:100", (Gres("gpu", "a100_80g", 8), Gres("mps", "", 100))),
    ("", ()), (None, ()), ("(null)", ()), ("N/A", ()),
], ids=["two-types", "sockets", "used-idx", "tres-prefix", "untyped", "other-gres", "empty", "none", "null", "na"])
def test_parse_gres(spec, expected):
    assert parse_gres(spec) == expected


def test_parse_gres_rejects_entry_without_count():
    with pytest.raises(ValueError, match="not a GRES entry"):
        parse_gres("gpu:a100")


@pytest.mark.parametrize("state,flags,expected", [
    ("idle", [], NodeHealth.HEALTHY), ("mixed", [], NodeHealth.HEALTHY), ("allocated", [], NodeHealth.HEALTHY),
    ("idle", ["DRAIN"], NodeHealth.DRAINED), ("mixed", ["DRAIN"], NodeHealth.DRAINED),
    ("IDLE+DRAIN", [], NodeHealth.DRAINED), ("idle", ["MAINTENANCE"], NodeHealth.DRAINED),
    ("down", [], NodeHealth.DOWN), ("down", ["DRAIN"], NodeHealth.DOWN),
    ("idle", ["NOT_RESPONDING"], NodeHealth.DOWN), ("unknown", [], NodeHealth.DOWN),
    ("future", [], NodeHealth.DOWN), ("idle", ["POWERED_DOWN"], NodeHealth.DOWN),
], ids=lambda v: str(v))
def test_node_health(state, flags, expected):
    assert node_health(state, flags) is expected


def test_idle_node_from_real_sinfo():
    (node,) = parse_nodes(load("sinfo_idle.json"))
    assert (node.name, node.cpus, node.memory_mib, node.partitions) == ("fsnode1", 16, 65536, ("gpu",))
    assert node.health is NodeHealth.HEALTHY and node.state == "idle"
    gpus = {g.slurm_type: g for g in node.gpus}
    assert gpus["a100"].card_model == "nvidia-a100-40gb" and gpus["a100"].count == 4 and gpus["a100"].used == 0
    assert gpus["t4"].card_model == "nvidia-t4-16gb" and gpus["t4"].count == 2
    assert node.gpu_count == 6 and node.alloc_cpus == 0


def test_busy_node_counts_used_gpus_and_cpus():
    (node,) = parse_nodes(load("sinfo_mixed.json"))
    gpus = {g.slurm_type: g.used for g in node.gpus}
    # running then: cap-ok (2 x a100), cap-gang (2 x t4, 2 tasks), cap-timeout and cap-cancel (no GPU)
    assert gpus == {"a100": 2, "t4": 2}
    assert node.state in ("mixed", "allocated") and node.health is NodeHealth.HEALTHY
    assert node.alloc_cpus >= 5 and node.alloc_memory_mib > 0


def test_drained_node_keeps_reason():
    (node,) = parse_nodes(load("sinfo_drain.json"))
    assert node.health is NodeHealth.DRAINED and "DRAIN" in node.flags
    assert node.reason == "fedsched capture drain"


def test_documents_with_errors_raise():
    with pytest.raises(ValueError, match="Invalid"):
        parse_nodes({"errors": [{"error": "Invalid user"}], "nodes": []})
    with pytest.raises(ValueError, match="no 'jobs'"):
        parse_jobs({"errors": []})


# --------------------------------------------------------------------------- jobs


def test_final_jobs_map_to_attempt_outcomes():
    jobs = by_job(parse_jobs(load("squeue_final.json")))
    table = {  # fedsched job -> (Slurm state, outcome state, reason, exit code)
        "cap-ok": ("COMPLETED", AttemptState.SUCCEEDED, "", 0),
        "cap-exit3": ("FAILED", AttemptState.FAILED, "exit_code", 3),
        "cap-timeout": ("TIMEOUT", AttemptState.FAILED, "timeout", None),
        "cap-gang": ("COMPLETED", AttemptState.SUCCEEDED, "", 0),
        "cap-cancel": ("CANCELLED", AttemptState.LOST, "cancelled_externally", None),
        "cap-pending": ("CANCELLED", AttemptState.LOST, "cancelled_externally", None),
        "cap-toobig": ("FAILED", AttemptState.FAILED, "not_started:BadConstraints", None),
    }
    got = {}
    for name in table:
        o = outcome(jobs[name])
        got[name] = (jobs[name].state, o.state, o.reason, o.exit_code)
    assert got == table
    assert jobs["cap-timeout"].signal == 15  # SIGTERM at the limit
    assert jobs["cap-toobig"].exit_code is None and jobs["cap-toobig"].signal is None  # Slurm says 1


def test_cancel_we_asked_for_is_cancelled_not_lost():
    job = by_job(parse_jobs(load("squeue_final.json")))["cap-cancel"]
    assert outcome(job, stop_requested=True).state is AttemptState.CANCELLED


def test_final_job_times_are_aware_utc_and_ordered():
    jobs = by_job(parse_jobs(load("squeue_final.json")))
    for job in jobs.values():
        for t in (job.submit_time, job.start_time, job.end_time):
            assert t is not None and t.tzinfo is timezone.utc
        assert job.submit_time <= job.start_time <= job.end_time
    assert 2 <= jobs["cap-ok"].elapsed_s <= 10          # "sleep 3"
    assert 60 <= jobs["cap-timeout"].elapsed_s <= 150    # --time=1 (minute), killed at the next check
    assert jobs["cap-timeout"].time_limit_s == 60
    assert jobs["cap-pending"].started is False and jobs["cap-pending"].elapsed_s is None
    assert jobs["cap-ok"].nodes == ("fsnode1",) and jobs["cap-pending"].nodes == ()


def test_running_snapshot_has_pending_and_running_jobs():
    jobs = by_job(parse_jobs(load("squeue_running.json")))
    pending, running = jobs["cap-pending"], jobs["cap-ok"]
    assert pending.state == "PENDING" and outcome(pending).state is AttemptState.PLACED
    assert pending.start_time is None and pending.exit_code is None and pending.reason != "None"
    assert running.state == "RUNNING" and outcome(running).state is AttemptState.RUNNING
    assert running.start_time is not None and running.exit_code is None
    assert running.tag == AttemptTag("cap-ok", 1, 0) and running.comment == "fedsched:cap-ok:1:0"


def test_jobcomp_log_agrees_with_squeue():
    final = by_job(parse_jobs(load("squeue_final.json")))
    lines = [l for l in (SAMPLES / "jobcomp.log").read_text().splitlines() if l.strip()]
    comp = by_job(parse_jobcomp_line(l) for l in lines)
    assert set(comp) == set(final)
    for name, job in final.items():
        c = comp[name]
        assert (c.job_id, c.state, c.tag) == (job.job_id, job.state, job.tag), name
        assert (c.start_time, c.end_time) == (job.start_time, job.end_time), name
        assert outcome(c).state is outcome(job).state, name
    assert comp["cap-exit3"].exit_code == 3 and comp["cap-ok"].exit_code == 0


def test_jobcomp_times_are_read_in_the_given_zone():
    line = ("JobId=9 UserId=root(0) Name=fedsched-j-a1-s0 JobState=COMPLETED TimeLimit=UNLIMITED "
            "StartTime=2026-11-30T13:00:00 EndTime=2026-11-30T13:00:05 NodeList=n[1-2] ExitCode=0:0")
    cet = timezone(timedelta(hours=1))
    job = parse_jobcomp_line(line, tz=cet)
    assert job.start_time == datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    assert job.nodes == ("n1", "n2") and job.time_limit_s is None and job.tag == AttemptTag("j", 1, 0)
    with pytest.raises(ValueError):
        parse_jobcomp_line("garbage")


@pytest.mark.parametrize("raw,expected", [(0, (0, None)), (768, (3, None)), (256, (1, None)), (9, (None, 9)),
                                          (15, (None, 15)), (None, (None, None))])
def test_split_wait_status(raw, expected):
    assert split_wait_status(raw) == expected


def test_epoch_zero_is_unset():
    assert utc_from_epoch(0) is None and utc_from_epoch(None) is None
    assert utc_from_epoch({"set": False, "number": 5}) is None
    assert utc_from_epoch(1796043969) == datetime(2026, 11, 30, 13, 6, 9, tzinfo=timezone.utc)


@pytest.mark.parametrize("text,expected", [
    ("fsnode1", ["fsnode1"]), ("n[1-3]", ["n1", "n2", "n3"]), ("n[01-02,5],gpu7", ["n01", "n02", "n5", "gpu7"]),
    ("a[1-2]-ib", ["a1-ib", "a2-ib"]),
])
def test_expand_hostlist(text, expected):
    assert expand_hostlist(text) == expected


# --------------------------------------------------------------------------- tags and sbatch


def test_tag_round_trips_through_comment_and_name():
    tag = AttemptTag("train-7", 3, 1)
    assert tag.comment == "fedsched:train-7:3:1" and parse_comment(tag.comment) == tag
    assert tag.job_name == "fedsched-train-7-a3-s1" and parse_job_name(tag.job_name) == tag
    assert parse_comment("someone else's job") is None and parse_job_name("wrap") is None
    with pytest.raises(Exception):
        AttemptTag("Bad:Name", 1)


@pytest.mark.parametrize("estimate,ratio,margin,minutes", [
    (5, 0, 0, 1), (60, 0, 0, 1), (61, 0, 0, 2), (600, 0.1, 0, 11), (600, 0.1, 30, 12), (0, 0, 0, 1),
    (3600, 0.5, 60, 91),
])
def test_time_limit_minutes(estimate, ratio, margin, minutes):
    assert time_limit_minutes(estimate, ratio, margin) == minutes


def test_sbatch_call_for_one_task():
    req = SbatchRequest(AttemptTag("j1", 2), ["python", "train.py", "--lr", "0.1 0.2"], output_dir="/var/fs/out",
                        gpu_type="a100", gpus_per_node=2, partition="gpu", estimate_s=600, time_margin_ratio=0.1,
                        env={"B": "x,y", "A": "1"}, memory_mib_per_node=4096, cpus_per_task=4)
    call = sbatch_call(req)
    assert call.argv[0] == "sbatch" and "--parsable" in call.argv and "--no-requeue" in call.argv
    args = dict(a.split("=", 1) for a in call.argv[1:] if "=" in a)
    assert args["--job-name"] == "fedsched-j1-a2-s0" and args["--comment"] == "fedsched:j1:2:0"
    assert args["--gres"] == "gpu:a100:2" and args["--partition"] == "gpu" and args["--time"] == "11"
    assert args["--nodes"] == "1" and args["--ntasks-per-node"] == "1" and args["--cpus-per-task"] == "4"
    assert args["--mem"] == "4096M" and args["--export"] == "PATH,A,B"
    assert args["--output"] == "/var/fs/out/j1/a2-s0.out" == call.output_path
    assert shlex.split(args["--wrap"]) == ["python", "train.py", "--lr", "0.1 0.2"]
    assert call.env == {"A": "1", "B": "x,y"}


def test_sbatch_call_for_a_gang_runs_the_command_in_every_task():
    req = SbatchRequest(AttemptTag("g", 1), "echo $SLURM_PROCID", output_dir="/o", nodes=2, tasks_per_node=4,
                        gpu_type="t4", gpus_per_node=4)
    args = dict(a.split("=", 1) for a in sbatch_call(req).argv[1:] if "=" in a)
    assert args["--nodes"] == "2" and args["--ntasks-per-node"] == "4" and args["--gres"] == "gpu:t4:4"
    assert shlex.split(args["--wrap"]) == ["srun", "--kill-on-bad-exit=1", "--label", "/bin/sh", "-c", "echo $SLURM_PROCID"]
    assert "--time" not in args and "--partition" not in args


@pytest.mark.parametrize("change,match", [
    ({"nodes": 0}, "nodes"), ({"tasks_per_node": 0}, "nodes"), ({"gpus_per_node": -1}, "gpus"),
    ({"env": {"BAD-NAME": "1"}}, "identifiers"), ({"env": {"PATH": "/x"}}, "identifiers"),
    ({"env": {"SLURM_PROCID": "3"}}, "identifiers"), ({"command": "  "}, "empty"),
    ({"gpu_type": "a100;rm"}, "GRES type"), ({"cpus_per_task": 0}, "cpus"),
], ids=lambda v: str(v))
def test_sbatch_call_rejects(change, match):
    base = dict(tag=AttemptTag("j", 1), command=["true"], output_dir="/o")
    with pytest.raises(ValueError, match=match):
        sbatch_call(SbatchRequest(**{**base, **change}))


@pytest.mark.parametrize("text,expected", [("42\n", 42), ("42;cluster\n", 42)])
def test_parse_sbatch_output(text, expected):
    assert parse_sbatch_output(text) == expected


def test_parse_sbatch_output_without_id_raises():
    with pytest.raises(ValueError, match="no job id"):
        parse_sbatch_output("sbatch: error: whatever\n")


def test_jobs_by_tag_keeps_the_newest_job_per_attempt_and_drops_foreign_ones():
    jobs = parse_jobs(load("squeue_final.json"))
    found = jobs_by_tag(jobs)
    assert found[AttemptTag("cap-exit3", 2)].state == "FAILED" and len(found) == len(jobs)
    older = found[AttemptTag("cap-ok", 1)]
    newer = type(older)(**{**{f: getattr(older, f) for f in older.__slots__}, "job_id": older.job_id + 100})
    foreign = type(older)(**{**{f: getattr(older, f) for f in older.__slots__}, "job_id": 999, "tag": None})
    again = jobs_by_tag([newer, older, foreign])
    assert list(again) == [AttemptTag("cap-ok", 1)] and again[AttemptTag("cap-ok", 1)].job_id == older.job_id + 100


def test_comment_labels_ride_after_the_tag_and_the_tag_still_parses():
    tag = AttemptTag("j-1", 2, 0)
    call = sbatch_call(SbatchRequest(tag=tag, command="true", output_dir="/o", labels={"tenant": "search", "project": "p-1"},
                                     nodelist=("n1", "n1")))
    comment = next(a for a in call.argv if a.startswith("--comment=")).split("=", 1)[1]
    assert parse_comment(comment) == tag
    assert comment_labels(comment) == {"project": "p-1", "tenant": "search"}
    assert "--nodelist=n1" in call.argv
    assert comment_labels("someone else's comment") == {}
    with pytest.raises(ValueError):
        sbatch_call(SbatchRequest(tag=tag, command="true", output_dir="/o", labels={"tenant": "a b,c"}))
