"""Failover of running work: retry accounting and resume points of attempts lost with their cluster.

A real :class:`~services.scheduler.service.SchedulerService` on fakes
(:class:`tests.builders.SchedulerHarness`): clusters A and B of one 8-T4 node each (ties go to
A), freshness limit 1 s. Rules under test (``fedsched.tenancy.RetryBudgetDoc``): a loss does not
count against ``spec.retry_limit``; at most ``retries.max_infra_retries`` losses per shard and
``retries.per_month`` retries per tenant, past which the job ends ``retries_exhausted``; a
checkpointable job resumes from its last whole checkpoint interval, others from zero; a rebuilt
scheduler reaches the same book.
"""

from __future__ import annotations

from fedsched.policystore import StoredPolicy
from fedsched.tenancy import Governance
from services.scheduler.states import Outcome, ShardState
from tests.builders import TENANTS, ClusterSpec, Decision, SchedulerHarness, nodes, policy_text

A, B = "cn-north-1-c1", "cn-north-1-c2"
TWO = (ClusterSpec(A, node_list=nodes("a")), ClusterSpec(B, node_list=nodes("b")))

SEARCH = "{name: search, home_region: cn-north-1, projects: [train, serve, batch]}"


def _harness(retries: str = "") -> SchedulerHarness:
    h = SchedulerHarness(TWO, stale_after_s=1.0, reclaim_after_s=20.0)
    _govern(h, retries)
    return h


def _govern(h: SchedulerHarness, retries: str) -> None:
    _set_policy(h.svc, retries)


def _set_policy(svc, retries: str) -> None:
    assert SEARCH in TENANTS
    tenants = TENANTS.replace(SEARCH, SEARCH[:-1] + f", retries: {retries}}}") if retries else TENANTS
    svc.policy_holder.set(StoredPolicy(Governance.parse(policy_text(tenants=tenants)), 1))


def _restart(h: SchedulerHarness, retries: str = "") -> None:
    """A new scheduler holding the same policy rebuilds from the streams."""
    h.restart(lambda svc: _set_policy(svc, retries))


async def _lose(h: SchedulerHarness, cluster: str) -> list[Decision]:
    """``cluster`` falls silent (the other one is alive) until one cycle has moved its work."""
    h.silence(cluster)
    h.advance(1.6)
    out = await h.cycle()
    h.silent.discard(cluster)
    return out


def _ended(h: SchedulerHarness, job_id: str) -> list[str]:
    return [p.event.payload["reason"] for p in h.publisher.published
            if p.event.type == "job.cancelled" and p.event.job_id == job_id]


async def test_a_lost_attempt_does_not_count_against_retry_limit() -> None:
    h = _harness()
    h.submit("j1", gpus=8)  # retry_limit 0: a failure would end it
    assert await h.cycle() == [Decision("job.placed", "j1", 1, A)]
    h.report("j1", "job.started")
    assert [d.type for d in await _lose(h, A)] == ["job.stop", "job.stopped", "job.placed"]
    h.advance(0.6)  # A beats again
    h.report("j1", "job.started")
    assert (h.shard("j1").attempt, h.shard("j1").cluster, h.shard("j1").losses) == (2, B, 1)
    assert (await _lose(h, B))[-1] == Decision("job.placed", "j1", 3, A)
    assert (h.shard("j1").failures, h.shard("j1").losses, h.shard("j1").state) == (0, 2, ShardState.PLACED)


async def test_a_failure_still_counts_against_retry_limit() -> None:
    h = _harness()
    h.submit("j1", gpus=8, retry_limit=1)
    await h.cycle()
    h.report("j1", "job.started")
    h.report("j1", "job.failed", reason="exit 1")
    assert (await h.cycle())[-1] == Decision("job.placed", "j1", 2, B)
    h.report("j1", "job.started")
    h.report("j1", "job.failed", reason="exit 1")
    assert await h.cycle() == []
    assert (h.shard("j1").state, h.shard("j1").outcome) == (ShardState.DONE, Outcome.FAILED)


async def test_losses_past_max_infra_retries_end_the_job_retries_exhausted() -> None:
    h = _harness("{max_infra_retries: 1}")
    h.submit("j1", gpus=8)
    await h.cycle()
    h.report("j1", "job.started")
    assert (await _lose(h, A))[-1] == Decision("job.placed", "j1", 2, B)  # loss 1 of 1: retried
    h.advance(0.6)
    h.report("j1", "job.started")
    out = await _lose(h, B)  # loss 2: over the limit
    assert out == [Decision("job.stop", "j1", 2, B, "cluster_lost"), Decision("job.stopped", "j1", 2, B, "cluster_lost"),
                   Decision("job.cancelled", "j1", 2, "", _ended(h, "j1")[0])]
    assert _ended(h, "j1")[0].startswith("retries_exhausted: attempt 2 lost with cluster " + B)
    assert (h.shard("j1").state, h.shard("j1").outcome) == (ShardState.DONE, Outcome.CANCELLED)
    _restart(h, "{max_infra_retries: 1}")  # the rebuilt book agrees and publishes nothing again
    assert (h.shard("j1").state, h.shard("j1").losses) == (ShardState.DONE, 2)
    assert await h.cycle() == []


async def test_the_tenants_retries_per_month_cap_all_its_jobs() -> None:
    h = _harness("{per_month: 1}")
    h.submit("j1", gpus=4)
    h.submit("j2", gpus=4)
    await h.cycle()
    h.report("j1", "job.started")
    h.report("j2", "job.started")
    out = await _lose(h, A)
    placed = [d for d in out if d.type == "job.placed"]
    assert len(placed) == 1  # one retry this month: the first job moves, the second ends
    ended = {"j1", "j2"} - {placed[0].job_id}
    (other,) = ended
    assert _ended(h, other)[0].startswith("retries_exhausted:") and "used its 1 retries" in _ended(h, other)[0]
    assert sum(h.svc.retries_used.values()) == 1
    _restart(h, "{per_month: 1}")
    assert sum(h.svc.retries_used.values()) == 1 and h.shard(other).state == ShardState.DONE


async def test_a_checkpointable_job_resumes_from_its_last_checkpoint_others_restart() -> None:
    h = _harness()
    interval = h.policy.checkpoint_interval_s
    h.submit("ckpt", gpus=4, checkpointable=True, estimated_duration_s=10 * interval)
    h.submit("plain", gpus=4, estimated_duration_s=10 * interval)
    await h.cycle()
    h.report("ckpt", "job.started")
    h.report("plain", "job.started")
    h.advance(2.5 * interval)
    out = await _lose(h, A)
    resumed = {p.event.job_id: p.event.payload["resume_from_s"] for p in h.publisher.published
               if p.event.type == "job.placed" and p.event.attempt == 2}
    assert resumed == {"ckpt": 2 * interval, "plain": 0.0}
    lost = {p.event.job_id: p.event.payload["progress_s"] for p in h.publisher.published
            if p.event.type == "job.stopped"}
    assert lost == resumed  # the lost attempt's end says where the next one resumes
    assert [d.type for d in out].count("job.placed") == 2
    _restart(h)
    assert (h.shard("ckpt").progress_s, h.shard("plain").progress_s) == (2 * interval, 0.0)


async def test_a_failure_retry_past_the_monthly_cap_ends_the_job_retries_exhausted() -> None:
    h = _harness("{per_month: 0}")
    h.submit("j1", gpus=8, retry_limit=3)
    await h.cycle()
    h.report("j1", "job.started")
    h.report("j1", "job.failed", reason="exit 1")
    out = await h.cycle()
    assert [d.type for d in out] == ["job.cancelled"]
    assert _ended(h, "j1")[0].startswith("retries_exhausted: attempt 1 failed; tenant search has used its 0 retries")
    assert (h.shard("j1").state, h.shard("j1").failures) == (ShardState.DONE, 1)
