"""The workload section of a job spec and each gang member's environment (fedsched/workload.py)."""

import pytest

from fedsched.errors import ValidationError
from fedsched.jobs import JobKind, JobSpec
from fedsched.workload import RESERVED_ENV, Workload, WorkloadLimits, worker_env

IMAGE = "ghcr.io/acme/trainer:1.4"


def spec(workers: int = 4, **workload) -> JobSpec:
    return JobSpec(tenant="search", project="train", home_region="cn-east-1", kind=JobKind.TRAINING,
                   workers=workers, workload=Workload(image=IMAGE, **workload))


def test_each_member_of_a_4_worker_gang_gets_its_rank_the_world_size_and_the_rendezvous():
    s = spec(env={"EPOCHS": "3"}, checkpoint_uri="s3://ckpt/run1")
    envs = [worker_env(s, job_id="j-1", attempt=2, rank=r, master_addr="10.0.0.7", master_port=29500)
            for r in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    for e in envs:
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_RANK"] == "0" and e["LOCAL_WORLD_SIZE"] == "1"
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.7", "29500")
        assert (e["FEDSCHED_JOB_ID"], e["FEDSCHED_ATTEMPT"], e["FEDSCHED_SHARD"]) == ("j-1", "2", "0")
        assert e["FEDSCHED_CHECKPOINT_URI"] == "s3://ckpt/run1"
        assert e["EPOCHS"] == "3"
        assert all(isinstance(v, str) for v in e.values())
    # the members differ only in their rank
    assert [{k: v for k, v in e.items() if k not in ("RANK", "GROUP_RANK")} for e in envs].count(
        {k: v for k, v in envs[0].items() if k not in ("RANK", "GROUP_RANK")}) == 4


def test_no_checkpoint_variable_without_a_checkpoint_and_a_trace_job_gets_only_the_rank_and_fedsched_variables():
    assert "FEDSCHED_CHECKPOINT_URI" not in worker_env(spec(), job_id="j", attempt=1, rank=0, master_addr="h",
                                                       master_port=1)
    trace = JobSpec(tenant="search", project="train", home_region="cn-east-1", workers=2)
    env = worker_env(trace, job_id="j", attempt=1, rank=1, master_addr="h", master_port=1)
    assert set(env) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "FEDSCHED_JOB_ID", "FEDSCHED_ATTEMPT", "FEDSCHED_SHARD"}


def test_the_shard_of_a_split_batch_job_is_in_its_environment():
    s = JobSpec(tenant="search", project="train", home_region="cn-east-1", shards=3,
                workload=Workload(image="busybox"))
    assert worker_env(s, job_id="j", attempt=1, rank=0, shard=2, master_addr="h", master_port=1)["FEDSCHED_SHARD"] == "2"


@pytest.mark.parametrize("kw", [
    {"rank": 4}, {"rank": -1}, {"world_size": 3}, {"attempt": 0}, {"shard": 1}, {"master_addr": ""},
    {"master_port": 0}, {"master_port": 65536},
])
def test_worker_env_refuses_arguments_out_of_range(kw):
    args = dict(job_id="j", attempt=1, rank=0, master_addr="h", master_port=29500) | kw
    with pytest.raises(ValueError):
        worker_env(spec(), **args)


def test_every_fedsched_variable_and_rank_variable_is_reserved_for_env_and_secret_env():
    produced = set(worker_env(spec(checkpoint_uri="s3://b/c"), job_id="j", attempt=1, rank=0, master_addr="h",
                              master_port=1))
    for name in produced:
        assert name in RESERVED_ENV or name.startswith("FEDSCHED_")
        for section in ("env", "secret_env"):
            value = "1" if section == "env" else "s/k"
            with pytest.raises(ValidationError) as e:
                Workload(image=IMAGE, **{section: {name: value}})
            assert e.value.field == f"workload.{section}[{name}]"
    for native in ("SLURM_PROCID", "SLURM_NTASKS", "JOB_COMPLETION_INDEX", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        with pytest.raises(ValidationError):
            Workload(image=IMAGE, env={native: "0"})


@pytest.mark.parametrize("image", [
    "busybox", "ubuntu:22.04", "ghcr.io/acme/trainer:1.4", "localhost:5000/a/b_c__d-e.f:tag-1",
    "nvcr.io/nvidia/pytorch:24.05-py3",
    "docker.io/library/python@sha256:" + "a" * 64, "reg.example.com/x/y:v1@sha256:" + "0f" * 32,
])
def test_oci_references_are_accepted(image):
    assert Workload(image=image).image == image


@pytest.mark.parametrize("image", [
    "", "Ubuntu", "ubuntu:", "ubuntu; rm -rf /", "ubuntu:latest latest", "-ubuntu", "ubuntu:" + "t" * 129,
    "a/" * 200 + "b", "python@sha256:abc", "x" * (WorkloadLimits.max_image_chars + 1), "ubuntu:\u00e9t\u00e9",
])
def test_malformed_image_references_are_refused_naming_the_image(image):
    with pytest.raises(ValidationError) as e:
        Workload(image=image)
    assert e.value.field == "workload.image"


@pytest.mark.parametrize("kw,field", [
    ({"command": ("x",) * 200, "args": ("y",) * 57}, "workload.args"),
    ({"command": ("python", "é" * 2049)}, "workload.command[1]"),  # 4098 bytes, 2049 characters
    ({"args": ("a", "b", "c\x00")}, "workload.args[2]"),
    ({"env": {f"V{i}": "" for i in range(100)}, "secret_env": {f"S{i}": "s/k" for i in range(29)}}, "workload.env"),
    ({"env": {"1X": "v"}}, "workload.env"),
    ({"env": {"A-B": "v"}}, "workload.env"),
    ({"env": {"": "v"}}, "workload.env"),
    ({"env": {"BIG": "v" * (32 * 1024 + 1)}}, "workload.env[BIG]"),
    ({"env": {"FEDSCHED_ANYTHING": "v"}}, "workload.env[FEDSCHED_ANYTHING]"),
    ({"secret_env": {"TOKEN": "hunter2"}}, "workload.secret_env[TOKEN]"),
    ({"secret_env": {"TOKEN": "Creds/key"}}, "workload.secret_env[TOKEN]"),
    ({"secret_env": {"TOKEN": "creds/key with space"}}, "workload.secret_env[TOKEN]"),
    ({"secret_env": {"TOKEN": "creds/"}}, "workload.secret_env[TOKEN]"),
    ({"env": {"TOKEN": "x"}, "secret_env": {"TOKEN": "creds/key"}}, "workload.secret_env[TOKEN]"),
    ({"workdir": "relative/dir"}, "workload.workdir"),
    ({"checkpoint_uri": "/ckpt"}, "workload.checkpoint_uri"),
    ({"checkpoint_uri": "s3://b/has space"}, "workload.checkpoint_uri"),
    ({"env": {f"V{i}": "v" * 30000 for i in range(3)}}, "workload"),
])
def test_bad_workloads_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValidationError) as e:
        Workload(image=IMAGE, **kw)
    assert e.value.field == field, e.value


def test_the_limits_are_inclusive():
    w = Workload(image=IMAGE, command=("x" * 4096,), args=("y",) * 255,
                 env={f"V{i}": "" for i in range(64)}, secret_env={f"S{i}": "s/k" for i in range(64)})
    assert len(w.argv) == 256 and len(w.env) + len(w.secret_env) == 128
    Workload(image=IMAGE, env={"BIG": "v" * (32 * 1024)})


def test_a_spec_with_a_workload_round_trips_through_json_as_events_carry_it():
    s = spec(command=("python", "train.py"), args=("--lr", "0.1"), env={"A": "1"}, secret_env={"T": "hf/token"},
             workdir="/work", checkpoint_uri="s3://ckpt/run1")
    again = JobSpec.model_validate_json(s.model_dump_json())
    assert again == s and again.workload.argv == ("python", "train.py", "--lr", "0.1")
