"""Refused messages' dead letters (review item 6): a dead letter the bus refuses for good
(``PublishResult.REFUSED``: larger than the server's max_payload) is not retried forever, so
it no longer blocks checkpoints; one not acknowledged for now is kept; the refused message
embedded in a dead letter is capped at ``max_payload // 8`` like ``Bus.dead_letter``'s."""

from __future__ import annotations

from types import SimpleNamespace

from fedsched.events import DeadLetter, Subjects
from fedsched.trust import Rejection
from services.admission.service import AdmissionService
from tests.builders import ClusterSpec, FakeClock, FakePublisher, SchedulerHarness, delivery, spec, submitted

T0 = 1_700_000_000.0


def _refused(svc, n: int = 1) -> None:
    for i in range(n):
        env = submitted(f"j-{i}", spec(), T0)
        svc._reject("scheduler-events", delivery(env, "t.jobs.submitted.search.train", 100 + i, T0), "test")


async def test_the_scheduler_drops_a_rejection_the_bus_refuses_for_good():
    h = SchedulerHarness([ClusterSpec("c1")])
    svc = h.svc
    h.publisher.too_large = lambda subject, event: subject == h.subjects.deadletter("scheduler-events")
    _refused(svc, 3)
    await svc._publish_rejections()
    assert svc.rejections == [] and len(h.publisher.dead_lettered) == 6


async def test_the_scheduler_keeps_a_rejection_not_acknowledged_for_now():
    h = SchedulerHarness([ClusterSpec("c1")])
    svc = h.svc
    h.publisher.refuse = lambda subject, event: True  # an outage
    _refused(svc, 2)
    await svc._publish_rejections()
    assert len(svc.rejections) == 2
    h.publisher.refuse = None
    await svc._publish_rejections()
    assert svc.rejections == []


async def test_the_scheduler_caps_the_embedded_message_at_an_eighth_of_max_payload():
    h = SchedulerHarness([ClusterSpec("c1")])
    h.publisher.max_payload = 2048
    _refused(h.svc)
    await h.svc._publish_rejections()
    dead = [p.event.payload_as(DeadLetter) for p in h.publisher.published if p.event.type == "bus.dead_letter"]
    assert len(dead) == 1 and len(dead[0].data) == 256


async def test_admission_drops_a_rejection_the_bus_refuses_and_caps_the_rest():
    bus = FakePublisher(too_large=lambda subject, event: "j-0" in event.payload.get("data", ""))
    bus.subjects, bus.max_payload = Subjects("t"), 2048
    view = SimpleNamespace(rejections=[])
    fake = SimpleNamespace(bus=bus, view=view, clock=FakeClock())
    for i in range(2):
        env = submitted(f"j-{i}", spec(), T0)
        view.rejections.append(Rejection("admission-jobs", "t.jobs.submitted.search.train", env, "test", 10 + i))
    await AdmissionService._publish_rejections(fake)
    assert view.rejections == []  # j-0's dead letter refused for good: not kept; j-1's stored
    dead = [p.event.payload_as(DeadLetter) for p in bus.published if p.event.type == "bus.dead_letter"]
    assert [len(d.data) for d in dead] == [256]
