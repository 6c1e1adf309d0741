"""Scheduler replicas: the lease decides who publishes, and every order carries its fencing token.

Real :class:`~services.scheduler.service.SchedulerService` instances on fakes
(:class:`tests.builders.SchedulerHarness` with a :class:`~fedsched.lease.Lease` on
:class:`tests.builders.FakeLeaseStore`); the lease's own clock is a separate fake moved by hand.
Rules (``services/scheduler/service.py`` module docstring, issue 14 item 9): only the replica
holding the lease and caught up with the stream cycles; its placements and stop orders carry the
lease's token; a lost lease stops publishing at once; a placement read back with a token below the
highest seen is not folded; a token above ours makes the active replica step down.
"""

from __future__ import annotations

from fedsched.events import JobPlaced, JobStop, make_event, business_event_id
from fedsched.lease import Lease, LeaseRecord
from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, FakeClock, FakeLeaseStore, SchedulerHarness, nodes

A = "cn-north-1-c1"
ONE = (ClusterSpec(A, node_list=nodes("a")),)
TTL = 3.0


def _replica(store: FakeLeaseStore, name: str, lease_clock: FakeClock) -> SchedulerHarness:
    lease = Lease(store.client(name), "scheduler", name, lease_clock, ttl_s=TTL)
    holder: list[SchedulerHarness] = []

    async def stream_end() -> int:  # the events stream's last sequence
        events = holder[0].events
        return events[-1].stream_sequence if events else 0

    h = SchedulerHarness(ONE, lease=lease, stream_end=stream_end)
    holder.append(h)
    return h


async def _activate(h: SchedulerHarness) -> None:
    assert await h.svc.lease.step()
    assert await h.svc.catch_up(timeout_s=1.0)


async def test_a_replica_without_the_lease_decides_nothing() -> None:
    store = FakeLeaseStore()
    other = Lease(store.client("x"), "scheduler", "x", FakeClock(), ttl_s=TTL)
    await other.step()  # someone else holds it
    h = _replica(store, "a", FakeClock())
    h.submit("j1")
    assert await h.svc.lease.step() is False
    assert await h.cycle() == [] and h.publisher.published == []
    assert h.svc.status()["role"] == "standby"


async def test_orders_carry_the_token_of_the_tenure() -> None:
    store = FakeLeaseStore()
    store.sequence = 41  # the bucket has seen writes before: tokens are revisions, not counts
    h = _replica(store, "a", FakeClock())
    await _activate(h)
    h.submit("j1", priority="low", preemptible=True, gpus=8)
    [placed] = await h.cycle()
    assert placed.type == "job.placed"
    event = next(p.event for p in h.publisher.published if p.event.type == "job.placed")
    assert event.payload_as(JobPlaced).fencing_token == h.svc.lease.token == 42
    h.submit("j2", priority="critical", gpus=8)  # preempts j1: a stop order
    out = await h.cycle()
    stop = next(p.event for p in h.publisher.published if p.event.type == "job.stop")
    assert [d.type for d in out].count("job.stop") == 1
    assert stop.payload_as(JobStop).fencing_token == 42


async def test_a_lost_lease_stops_publishing_at_once() -> None:
    store = FakeLeaseStore()
    clock = FakeClock()
    h = _replica(store, "a", clock)
    await _activate(h)
    intruder = store.client("b")
    await intruder.update("scheduler", LeaseRecord("b", TTL), store.records["scheduler"].revision)
    clock.advance(h.svc.lease.renew_every_s)
    await h.svc.lease.step()  # the renewal loses the compare-and-set
    h.submit("j1")
    assert await h.cycle() == [] and h.publisher.published == []
    assert not h.svc.leading


async def test_a_holder_past_its_validity_publishes_nothing_even_before_the_next_renewal() -> None:
    store = FakeLeaseStore()
    clock = FakeClock()
    h = _replica(store, "a", clock)
    await _activate(h)
    store.down.add("a")
    clock.advance(TTL)  # renewals could not be written: validity (TTL - margin) has run out
    await h.svc.lease.step()
    h.submit("j1")
    assert await h.cycle() == []
    batch = await h.svc.publisher.publish_many([("t.placements.x.y", h.events[-1].envelope, None)])
    assert batch == [False]


def _stale_placement(h: SchedulerHarness, job_id: str, token: int):
    spec = h.specs[job_id]
    payload = JobPlaced(spec=spec, card_model="nvidia-t4-16gb", fencing_token=token, bindings=())
    return make_event("job.placed", payload, producer="scheduler", occurred_at=h.clock.time(),
                      event_id=business_event_id(job_id, 1, 0, "placed"), region="cn-north-1", zone="cn-north-1a",
                      cluster=A, tenant=spec.tenant, project=spec.project, job_id=job_id, attempt=1)


async def test_a_placement_with_a_token_below_the_highest_seen_is_not_folded() -> None:
    store = FakeLeaseStore()
    h = _replica(store, "a", FakeClock())
    h.submit("j0")
    h.submit("j1")
    h._event(_stale_placement(h, "j0", 7), h.subjects.placements("cn-north-1", A))  # the new holder's
    h._event(_stale_placement(h, "j1", 5), h.subjects.placements("cn-north-1", A))  # a former holder's, late
    await h.settle()  # a token above all seen waits for a lease read (none here: folded as before)
    assert h.svc.jobs["j0"].shards[0].state == ShardState.PLACED
    assert h.svc.jobs["j1"].shards[0].state == ShardState.QUEUED
    assert h.svc.stale_orders == 1 and h.svc.highest_token == 7


async def test_an_order_with_a_newer_token_makes_the_active_replica_step_down() -> None:
    store = FakeLeaseStore()
    h = _replica(store, "a", FakeClock())
    await _activate(h)
    h.submit("j1")
    intruder = store.client("b")  # another replica took the lease (we have not renewed yet)
    token = await intruder.update("scheduler", LeaseRecord("b", TTL), store.records["scheduler"].revision)
    h._event(_stale_placement(h, "j1", token), h.subjects.placements("cn-north-1", A))
    await h.settle()
    assert not h.svc.leading and h.svc.highest_token == token
    h.submit("j2")
    assert await h.cycle() == []


async def test_an_order_with_a_token_no_tenure_issued_is_ignored_and_the_holder_keeps_leading() -> None:
    """Tryout (issue 15 stop): a placement with fencing token 2^62 published with the scheduler's
    credentials would make the active replica step down and every later takeover refuse to lead
    ("not above the highest fencing token"). A token above the lease's current one was issued by
    no tenure: ignored, not the highest seen; the holder keeps leading and placing."""
    store = FakeLeaseStore()
    h = _replica(store, "a", FakeClock())
    await _activate(h)
    h.submit("j1")
    own = h.svc.lease.token
    h._event(_stale_placement(h, "j1", 2 ** 62), h.subjects.placements("cn-north-1", A))
    await h.settle()
    assert h.svc.leading and h.svc.forged_orders == 1 and h.svc.highest_token <= own
    assert h.svc.jobs["j1"].shards[0].state == ShardState.QUEUED
    placed = await h.cycle()
    assert [d.type for d in placed] == ["job.placed"]
    assert h.svc.jobs["j1"].shards[0].state == ShardState.PLACED


async def test_a_new_tenure_waits_until_the_stream_is_read_to_its_end() -> None:
    store = FakeLeaseStore()
    h = _replica(store, "a", FakeClock())
    assert await h.svc.lease.step()
    h.submit("j1")
    h.svc.applied_seq = 0  # as if the follower had not yet read what the former holder published
    assert await h.svc.catch_up(timeout_s=0.05) is False
    assert not h.svc.leading and await h.cycle() == []
    h.svc.applied_seq = h.events[-1].stream_sequence
    assert await h.svc.catch_up(timeout_s=0.05) is True
    assert [d.type for d in await h.cycle()] == ["job.placed"]


async def test_a_former_holders_order_read_after_the_takeover_is_not_folded_before_any_order_of_ours() -> None:
    """Issue 14: the new active replica has published nothing yet; the former holder's order
    (token below ours) that arrives after the catch-up is ignored: our tenure is the floor."""
    store = FakeLeaseStore()
    store.sequence = 20
    h = _replica(store, "a", FakeClock())
    h.submit("j1")  # no cycle runs: we order nothing
    await _activate(h)
    assert h.svc.highest_token == h.svc.lease.token
    h._event(_stale_placement(h, "j1", h.svc.lease.token - 1), h.subjects.placements("cn-north-1", A))
    assert h.svc.jobs["j1"].shards[0].state != ShardState.PLACED and h.svc.stale_orders == 1
    assert h.svc.leading


async def test_a_token_not_above_the_highest_on_the_bus_refuses_to_lead_and_says_why() -> None:
    """The leases bucket was recreated (revisions restarted below the tokens on the bus): the
    holder does not lead (every order would be refused), and status() says so (review item 12)."""
    store = FakeLeaseStore()
    h = _replica(store, "a", FakeClock())
    h.submit("j1")
    h.svc.highest_token = 500  # orders of the former bucket's holders were read from the stream
    assert await h.svc.lease.step()
    assert await h.svc.catch_up(timeout_s=0.05) is False
    assert not h.svc.leading and await h.cycle() == []
    status = h.svc.status()
    assert status["role"] == "refusing" and "not above the highest fencing token" in status["lease_problem"]
    store.sequence = 600  # the operator wrote the key past the old tokens: the next tenure leads
    await h.svc.lease.release()
    assert await h.svc.lease.step()
    assert await h.svc.catch_up(timeout_s=0.05) is True
    assert h.svc.status()["lease_problem"] == "" and h.svc.status()["role"] == "active"


async def test_a_tenure_resumed_over_our_own_record_leads_at_once_without_reading_the_stream() -> None:
    """A renewal that came too late (a stalled loop) loses the lease; when nobody wrote it since
    our last write, the next step begins a new tenure over our own record: the scheduler leads
    on with the new token at once -- no catch-up read (the stream's end is not even asked) and
    no start-up grace. Any other gain still catches up."""
    store = FakeLeaseStore()
    clock = FakeClock()
    h = _replica(store, "a", clock)
    h.svc.lease.on_change.append(h.svc._on_lease_change)  # as run() wires it
    await _activate(h)
    first = h.svc.lease.token
    clock.advance(TTL)  # no renewal in time: validity ran out
    assert not h.svc.lease.is_active() and not h.svc.leading
    asked = []
    h.svc._stream_end = lambda: asked.append(1)  # would be awaited by a catch-up
    assert await h.svc.lease.step()  # the compare-and-set on our own revision succeeds
    assert h.svc.lease.resumed and h.svc.lease.token > first
    assert h.svc.leading and h.svc.fencing_token == h.svc.lease.token and asked == []
    h.submit("j1")
    [placed] = await h.cycle()
    event = next(p.event for p in h.publisher.published if p.event.type == "job.placed")
    assert event.payload_as(JobPlaced).fencing_token == h.svc.lease.token


async def test_a_tenure_gained_after_another_replica_wrote_the_lease_still_catches_up() -> None:
    store = FakeLeaseStore()
    clock = FakeClock()
    h = _replica(store, "a", clock)
    h.svc.lease.on_change.append(h.svc._on_lease_change)  # as run() wires it
    await _activate(h)
    intruder = store.client("b")
    await intruder.update("scheduler", LeaseRecord("", TTL), store.records["scheduler"].revision)  # released by b
    clock.advance(TTL)
    assert await h.svc.lease.step()  # acquires the released lease: not our own record
    assert not h.svc.lease.resumed and not h.svc.leading  # must catch up first
    assert await h.svc.catch_up(timeout_s=1.0) and h.svc.leading


async def test_a_tenure_that_never_led_resumed_still_catches_up() -> None:
    """Lost while still catching up: the resumed tenure has not read the former holder's
    orders either, so it catches up."""
    store = FakeLeaseStore()
    clock = FakeClock()
    h = _replica(store, "a", clock)
    h.svc.lease.on_change.append(h.svc._on_lease_change)  # as run() wires it
    assert await h.svc.lease.step()  # held, not caught up
    clock.advance(TTL)
    assert not h.svc.lease.is_active()
    assert await h.svc.lease.step() and h.svc.lease.resumed
    assert not h.svc.leading
    assert await h.svc.catch_up(timeout_s=1.0) and h.svc.leading
