"""A placement the bus refuses for good (larger than its server's max_payload; issue 14 item 6)
ends its job with ``placement_too_large`` instead of being decided again each cycle, and never
holds up the other jobs of the batch; a refused pending reason is not re-sent every cycle.
Driven through :class:`tests.builders.SchedulerHarness` (fake publisher, fake clock)."""

from __future__ import annotations

from tests.builders import T4, ClusterSpec, SchedulerHarness, nodes

A = "cn-north-1-c1"


def _harness(too_large) -> SchedulerHarness:
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a")),))
    h.publisher.too_large = too_large
    return h


async def test_a_refused_placement_ends_its_job_and_the_others_are_placed_in_the_same_cycle():
    h = _harness(lambda subject, e: e.type == "job.placed" and e.job_id == "big")
    h.submit("big", card_models=(T4,))
    for i in range(3):
        h.submit(f"ok{i}", card_models=(T4,))
    first = await h.cycle()
    assert sorted(d.job_id for d in first if d.type == "job.placed") == ["ok0", "ok1", "ok2"]
    second = await h.cycle()
    ended = [d for d in second if d.job_id == "big"]
    assert [d.type for d in ended] == ["job.cancelled"]
    cancelled = next(p.event for p in h.publisher.published if p.event.type == "job.cancelled")
    assert cancelled.payload["reason"].startswith("placement_too_large: the placement of shard 0")
    assert h.svc.jobs["big"].done
    for _ in range(3):  # never decided (nor refused) again
        h.advance(1.0)
        assert not [d for d in await h.cycle() if d.job_id == "big"]
    assert len(h.publisher.dead_lettered) == 1


async def test_a_refused_pending_reason_is_taken_as_sent():
    h = _harness(lambda subject, e: e.type == "job.pending")
    h.submit("never", card_models=("nvidia-a100-80gb",))  # no A100 anywhere: pending every cycle
    await h.cycle()
    for _ in range(3):
        h.advance(1.0)
        await h.cycle()
    assert len(h.publisher.dead_lettered) == 1
    assert h.shard("never").pending_reason and not h.svc.jobs["never"].cancel_requested
