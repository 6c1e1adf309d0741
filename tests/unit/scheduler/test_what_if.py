"""The scheduler's what-if (a dry-run submit's decision, services/scheduler/service.py
``SchedulerService.what_if``): the core's decision for one spec on the current view, with every
cluster's verdict -- and no change at all to the scheduler's state."""

from __future__ import annotations

import copy

from fedsched.whatif import WhatIfReply, WhatIfRequest
from tests.builders import ClusterSpec, SchedulerHarness, nodes, spec


def _state(h: SchedulerHarness) -> tuple:
    """Everything a what-if could change: the queue, the shards' states and pending reasons, the
    view (free cards per node, running work), the counts, the cycle count, what was published."""
    svc = h.svc
    view = svc.view()
    return (sorted((j.job_id, j.shard, j.attempt) for j in svc.queue()),
            {k: (s.state, s.pending_reason, s.unplaceable, s.attempt) for k, (_, s) in {**svc.queued, **svc.active}.items()},
            [(c.name, [n.gpu_free for n in c.nodes], [r.job_id for r in c.running]) for c in view.clusters],
            dict(svc.counts), svc.cycles, len(h.publisher.published), sorted(svc.jobs),
            copy.deepcopy({k: v.alloc for k, v in svc.clusters.items()}))


async def test_what_if_answers_with_every_clusters_verdict_and_changes_nothing():
    h = SchedulerHarness([ClusterSpec("c1", node_list=nodes("a", gpus=4)),
                          ClusterSpec("c2", "cn-east-1", node_list=nodes("b", gpus=8))])
    h.submit("j-running", gpus=4)
    await h.cycle()  # j-running takes c1's 4 cards (or c2's)
    h.submit("j-waiting", gpus=8)  # queued, not yet decided
    before = _state(h)

    fits = h.svc.what_if(WhatIfRequest(spec=spec(gpus=2), submitted_at=h.clock.time()))
    never = h.svc.what_if(WhatIfRequest(spec=spec(gpus=64), submitted_at=h.clock.time()))

    assert _state(h) == before  # queue, shard states, view, allocations, publishes: unchanged
    assert [d.outcome for d in fits.decisions] == ["placed"] and fits.decisions[0].cluster in ("c1", "c2")
    assert {e["cluster"] for e in fits.decisions[0].evaluations} == {"c1", "c2"}
    assert any(e["passed"] and e["total"] is not None for e in fits.decisions[0].evaluations)
    assert [d.outcome for d in never.decisions] == ["pending"] and never.decisions[0].fits_empty is False
    assert all(not e["passed"] and e["reason"] for e in never.decisions[0].evaluations)
    # and the next real cycle decides exactly as it would have without the what-ifs
    assert [d.job_id for d in await h.cycle()] == ["j-waiting"]


async def test_a_split_job_gets_one_decision_per_shard_and_the_reply_survives_the_wire():
    h = SchedulerHarness([ClusterSpec("c1", node_list=nodes("a", count=2, gpus=8))])
    reply = h.svc.what_if(WhatIfRequest(spec=spec(gpus=1, shards=3), submitted_at=h.clock.time()))
    assert [d.shard for d in reply.decisions] == [0, 1, 2]
    assert WhatIfReply.model_validate_json(reply.model_dump_json()) == reply


async def test_no_cluster_yet_is_pending_with_a_reason():
    h = SchedulerHarness([])
    reply = h.svc.what_if(WhatIfRequest(spec=spec(), submitted_at=h.clock.time()))
    assert [(d.outcome, d.summary) for d in reply.decisions] == [("pending", "no cluster reported yet")]


async def test_a_placement_abroad_for_a_tenant_that_needs_approval_is_marked():
    """ads' policy: cross-region runs need an approver; its home region has no cluster here."""
    from fedsched.policystore import StoredPolicy
    from fedsched.tenancy import Governance
    from tests.builders import policy_text

    h = SchedulerHarness([ClusterSpec("east", "cn-east-1", node_list=nodes("e", gpus=8))])
    h.svc.policy_holder.set(StoredPolicy(Governance.parse(policy_text()), 1))
    before = _state(h)
    ads = h.svc.what_if(WhatIfRequest(spec=spec(tenant="ads"), submitted_at=h.clock.time()))
    search = h.svc.what_if(WhatIfRequest(spec=spec(tenant="search"), submitted_at=h.clock.time()))
    assert [(d.outcome, d.needs_approval) for d in ads.decisions] == [("placed", True)]
    assert "approval" in ads.decisions[0].summary
    assert [(d.outcome, d.needs_approval) for d in search.decisions] == [("placed", False)]  # search: allowed
    assert _state(h) == before and not h.svc.governor.state  # no approval request was made


class _Msg:
    """A request message as the scheduler's handler gets it (records the answer)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.answers: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


async def test_only_the_leading_replica_answers_what_if():
    """Review item 11: a standby (lease held by another replica) leaves a what-if to the leader;
    a leader answers."""
    from fedsched.lease import Lease
    from tests.builders import FakeClock, FakeLeaseStore

    store = FakeLeaseStore()
    other = Lease(store.client("x"), "scheduler", "x", FakeClock(), ttl_s=3.0)
    assert await other.step()  # another replica leads
    standby = SchedulerHarness([ClusterSpec("c1", node_list=nodes("a", gpus=4))],
                               lease=Lease(store.client("a"), "scheduler", "a", FakeClock(), ttl_s=3.0),
                               stream_end=_zero)
    request = WhatIfRequest(spec=spec(gpus=2), submitted_at=standby.clock.time()).model_dump_json().encode()
    msg = _Msg(request)
    await standby.svc._on_what_if_request(msg)
    assert msg.answers == []
    leader = SchedulerHarness([ClusterSpec("c1", node_list=nodes("a", gpus=4))])  # no lease: it leads
    msg = _Msg(request)
    await leader.svc._on_what_if_request(msg)
    assert len(msg.answers) == 1 and WhatIfReply.model_validate_json(msg.answers[0]).decisions


async def _zero() -> int:
    return 0
