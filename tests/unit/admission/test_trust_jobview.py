"""Issue 14 item 1 on admission's job view: a status that contradicts the job's placements (or
its subject) changes nothing and is handed to the service as a refusal."""

from fedsched.bus import Delivery
from fedsched.events import JobPlaced, Subjects, WorkerBinding, business_event_id, make_event
from fedsched.jobs import JobState
from services.admission.jobview import JobView
from tests.builders import spec, status_event, submitted

S = Subjects("t")
T0 = 1.7e9


def _placed(job_id: str, cluster: str = "cn-north-1-c1"):
    return make_event("job.placed", JobPlaced(spec=spec(), card_model="nvidia-t4-16gb",
                                              bindings=(WorkerBinding(worker=0, node="n1"),)),
                      producer="scheduler", occurred_at=T0 + 1, event_id=business_event_id(job_id, 1, 0, "placed"),
                      region="cn-north-1", cluster=cluster, tenant="search", project="train", job_id=job_id, attempt=1)


def _view_with_running_job():
    view, seq = JobView(), iter(range(1, 1000))
    feed = lambda e, subject: view.apply_delivery(Delivery(e, subject, {}, next(seq), 1))  # noqa: E731
    job = spec()
    feed(submitted("j1", job, T0), S.job("submitted", "search", "train"))
    placed = _placed("j1")
    feed(placed, S.placements("cn-north-1", "cn-north-1-c1"))
    feed(status_event("job.started", placed, T0 + 2, started_at=T0 + 2), S.status("cn-north-1", "cn-north-1-c1"))
    return view, feed, placed


def test_forged_success_of_another_clusters_job_is_refused_and_the_job_stays_running():
    view, feed, placed = _view_with_running_job()
    assert view.jobs["j1"].state == JobState.RUNNING
    forged_placement = _placed("j1", cluster="cn-north-1-c2")  # the forger's view of "where it runs"
    forged = status_event("job.finished", forged_placement, T0 + 3, started_at=T0 + 2)
    feed(forged, S.status("cn-north-1", "cn-north-1-c2"))
    # the same claim naming the victim's cluster, sent on the forger's subject
    feed(status_event("job.finished", placed, T0 + 3, started_at=T0 + 2), S.status("cn-north-1", "cn-north-1-c2"))
    assert view.jobs["j1"].state == JobState.RUNNING
    reasons = [r.reason for r in view.rejections]
    assert reasons == ["attempt 1 of j1 was placed on cn-north-1/cn-north-1-c1, not on cn-north-1/cn-north-1-c2",
                       "envelope claims cn-north-1/cn-north-1-c1 but arrived on status subject of "
                       "cn-north-1/cn-north-1-c2"]
    feed(status_event("job.finished", placed, T0 + 4, started_at=T0 + 2), S.status("cn-north-1", "cn-north-1-c1"))
    assert view.jobs["j1"].state == JobState.SUCCEEDED and len(view.rejections) == 2


def test_a_status_of_an_invented_job_is_refused():
    view, feed, _ = _view_with_running_job()
    feed(status_event("job.finished", _placed("invented"), T0 + 3, started_at=T0), S.status("cn-north-1", "cn-north-1-c1"))
    assert "invented" not in view.jobs
    assert [r.reason for r in view.rejections] == ["job 'invented' does not exist"]
