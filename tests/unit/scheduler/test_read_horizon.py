"""A scheduler whose followers lag judges silence against what they have read, not the wall
(services/scheduler/service.py ``_live_now``). Found by bench/e2e_throughput.py: at 20,000 jobs
a busy scheduler took its own backlog for the clusters' silence, declared healthy clusters lost
and reclaimed placements whose starts it had not read yet (tens of thousands of lost attempts)."""

from __future__ import annotations

from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, SchedulerHarness, delivery, heartbeat, nodes

A = "cn-north-1-c1"


def _lagging(h: SchedulerHarness, behind: int) -> None:
    """The inventory follower hands over an old heartbeat with ``behind`` messages still stored
    after it (JetStream's num_pending): the follower is that far behind the stream."""
    at = h.clock.time() - 60.0  # produced a minute ago; read only now
    d = delivery(heartbeat(A, "cn-north-1", at), h.subjects.heartbeat("cn-north-1", A), 10**6, at)
    d.pending = behind
    h.svc.handle_inventory(d)


async def test_a_lagging_follower_does_not_make_a_live_cluster_stale_nor_reclaim_its_placements():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)),), stale_after_s=10.0,
                         reclaim_after_s=30.0)
    h.submit("j1")
    await h.cycle()
    assert h.shard("j1").state == ShardState.PLACED
    h.silence(A)            # no heartbeat *read* for 90 s: the follower is stuck behind a backlog
    h.advance(90.0)
    _lagging(h, behind=5000)
    await h.cycle()
    assert A not in h.svc._stale and h.shard("j1").state == ShardState.PLACED  # judged at what was read
    _lagging(h, behind=0)   # caught up, and still nothing newer from the cluster: now it is silence
    await h.cycle()
    assert A in h.svc._stale


async def test_a_lagging_follower_does_not_leave_the_queue_pending_as_inventory_stale():
    # the view's heartbeat ages are taken at the same read horizon: a job submitted while the
    # followers lag is placed, not left pending "inventory_stale" (seen at 20,000 jobs under CPU
    # contention: 1,000 jobs pending so, 207 never placed)
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)),), stale_after_s=10.0,
                         reclaim_after_s=30.0)
    h.silence(A)
    h.advance(90.0)
    _lagging(h, behind=5000)
    h.submit("j2")
    await h.cycle()
    assert h.shard("j2").state == ShardState.PLACED
    assert all(c.heartbeat_age_s <= 10.0 for c in h.svc.view(h.svc._live_now(h.clock.time())).clusters)
