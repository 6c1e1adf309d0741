"""Admission's pure rules: a job's worst-case cost counts every shard, worker and retry."""

from decimal import Decimal

import pytest

from fedsched.jobs import JobKind, JobSpec
from fedsched.pricing import load_price_catalog
from services.admission.rules import worst_case_cost

PRICES = load_price_catalog()
T4 = "nvidia-t4-16gb"
UNIT = PRICES.gpu_hour("cn-north-1", T4)


def spec(**kw) -> JobSpec:
    base = dict(tenant="vision", project="serve", kind=JobKind.BATCH, gpus_per_worker=1, card_models=(T4,),
                home_region="cn-north-1", locality="must_local", estimated_duration_s=3600.0)
    return JobSpec(**{**base, **kw})


CASES = [
    # (id, spec, GPU-hours per attempt)
    ("one worker, one GPU", spec(), 1),
    ("a gang of 2 workers x 2 GPUs", spec(workers=2, gpus_per_worker=2), 4),
    ("4 shards of one GPU: held at four, not one", spec(shards=4), 4),
    ("2 shards x 2 GPUs (the ListQuotas example)", spec(shards=2, gpus_per_worker=2), 4),
    ("3 shards x 2 workers x 2 GPUs, 1 retry", spec(shards=3, workers=2, gpus_per_worker=2, retry_limit=1), 24),
]


@pytest.mark.parametrize("name,job,gpu_hours", CASES, ids=[c[0] for c in CASES])
def test_worst_case_cost_counts_every_shard_worker_and_retry(name, job, gpu_hours):
    cost, how = worst_case_cost(job, PRICES, {T4}, {"cn-north-1"})
    assert cost == (Decimal(gpu_hours) * UNIT).quantize(cost)
    if job.shards > 1:
        assert f"{job.shards} shards" in how


def test_cpu_only_worst_case_counts_every_shard():
    one = worst_case_cost(spec(gpus_per_worker=0, gpu_milli=0, cpu_milli=2000), PRICES, set(), {"cn-north-1"})[0]
    four = worst_case_cost(spec(gpus_per_worker=0, gpu_milli=0, cpu_milli=2000, shards=4), PRICES, set(),
                           {"cn-north-1"})[0]
    assert one > 0 and four == 4 * one
