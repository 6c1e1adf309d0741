"""The trace backend accepts a job's workload and ignores it (issue 10 item 1)."""

from fedsched.jobs import JobSpec
from fedsched.workload import Workload
from services.inventory.agent import TraceBackend
from services.inventory.trace import load_nodes
from tests.builders import FakeClock


def test_the_trace_backend_plans_a_job_with_a_workload_exactly_as_without(trace_nodes):
    backend = TraceBackend(load_nodes(trace_nodes)[:2], clock=FakeClock(1000.0))
    plain = JobSpec(tenant="search", project="train", home_region="cn-east-1", estimated_duration_s=300,
                    annotations={"trace.runtime_s": "120"})
    with_workload = plain.model_copy(update={"workload": Workload(
        image="ghcr.io/acme/trainer:1.4", command=("python", "train.py"), env={"EPOCHS": "3"},
        secret_env={"HF_TOKEN": "hf-credentials/token"}, checkpoint_uri="s3://ckpt/run-1")})
    for attempt, resume in ((1, 0.0), (2, 60.0)):
        got = backend.plan(with_workload, 1000.0, attempt=attempt, resume_from_s=resume)
        assert got == backend.plan(plain, 1000.0, attempt=attempt, resume_from_s=resume)
        assert got[0] == 1000.0 + 120 - resume
