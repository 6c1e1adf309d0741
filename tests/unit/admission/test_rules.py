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


# ---- can the job ever run as asked (check_can_ever_run)

from fedsched.errors import ConflictError  # noqa: E402
from fedsched.events import InventorySnapshot, NodeInventory  # noqa: E402
from services.admission.rules import ClusterCapacity, check_can_ever_run  # noqa: E402

A100 = "nvidia-a100-80gb"


def cluster(region="cn-north-1", nodes=((T4, 4, 16),) * 2, interconnect="ethernet", tags=()) -> ClusterCapacity:
    snap = InventorySnapshot(nodes=tuple(NodeInventory(name=f"n{i}", card_model=m, gpus=g, gpu_memory_gib=mem)
                                         for i, (m, g, mem) in enumerate(nodes)),
                             interconnect=interconnect, residency_tags=tuple(tags))
    return ClusterCapacity.from_snapshot(region, snap)


NORTH = {"c1": cluster()}  # 2 nodes x 4 T4 (16 GiB) in cn-north-1
EVER = [
    # (id, spec, clusters, refused with this in the reason (None = accepted))
    ("fits", spec(workers=2, gpus_per_worker=4), NORTH, None),
    ("card model no cluster has (the issue's example)", spec(card_models=(A100,)), NORTH,
     f"no cluster in cn-north-1 has {A100}"),
    ("gang larger than any cluster", spec(workers=3, gpus_per_worker=4), NORTH,
     "gang of 3 workers x 4 GPU is larger than any cluster"),
    ("more GPUs per worker than any node", spec(gpus_per_worker=8), NORTH, "one worker needs 8 GPU on one node"),
    ("each shard is judged alone", spec(shards=8, workers=2, gpus_per_worker=4), NORTH, None),
    ("fractional shares pack onto a card", spec(workers=16, gpu_milli=500), NORTH, None),
    ("too many fractional shares", spec(workers=17, gpu_milli=500), NORTH, "at most 16 workers"),
    ("more GPU memory than the cards have", spec(card_models=(), min_gpu_memory_gib=40), NORTH, "with >= 40 GiB"),
    ("no cluster in the allowed regions", spec(home_region="cn-east-1"), NORTH, "no cluster in the regions"),
    ("residency tag no cluster carries", spec(residency_tags=("finance",)), NORTH, "residency tags finance"),
    ("RDMA where the fabric is ethernet", spec(workers=2, gpus_per_worker=4, requires_rdma=True), NORTH, "RDMA"),
    ("another cluster of the region has it", spec(card_models=(A100,)),
     {**NORTH, "c2": cluster(nodes=((A100, 8, 80),))}, None),
    ("nothing known yet: nothing refused", spec(card_models=(A100,)), {}, None),
    ("CPU-only jobs are not judged here", spec(gpus_per_worker=0, gpu_milli=0, cpu_milli=1000), {"c1": cluster(
        nodes=())}, None),
]


@pytest.mark.parametrize("name,job,clusters,refusal", EVER, ids=[c[0] for c in EVER])
def test_a_job_no_cluster_could_ever_hold_is_refused(name, job, clusters, refusal):
    if refusal is None:
        check_can_ever_run(job, clusters, {"cn-north-1", "cn-east-1"})
        return
    with pytest.raises(ConflictError) as e:
        check_can_ever_run(job, clusters, {"cn-north-1", "cn-east-1"})
    assert refusal in e.value.message and "could never run as asked" in e.value.message
