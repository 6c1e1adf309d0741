"""ListJobs over admission's job view (services/admission/listing.py): newest first by default,
pages that never repeat or miss a job (also while jobs arrive), filters ORed within a field and
ANDed across fields, tokens bound to their filters, pages bounded in bytes, and a page that
walks only as far as it needs."""

from __future__ import annotations

import base64
import json

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import PermissionDeniedError, ValidationError
from fedsched.events import JobPlaced, JobSubmitted, WorkerBinding, make_event
from fedsched.jobs import JobKind, JobSpec
from fedsched.tenancy import Governance
from services.admission import listing
from services.admission.jobview import JobView
from services.admission.service import job_to_pb, status_for
from tests.builders import TOKENS, policy_doc

T0 = 1_700_000_000.0
GOV = Governance.of(policy_doc())
ROOT, ALICE = GOV.authenticate(TOKENS["root"]), GOV.authenticate(TOKENS["alice"])


def _submit(view: JobView, job_id: str, at: float, *, tenant="search", project="train", name="", kind="batch",
            **kw) -> None:
    spec = JobSpec(tenant=tenant, project=project, name=name, kind=JobKind(kind), home_region="cn-north-1",
                   gpus_per_worker=1, **kw)
    view.apply(make_event("job.submitted", JobSubmitted(spec=spec, submitted_by="alice"), producer="test",
                          occurred_at=at, tenant=tenant, project=project, job_id=job_id, actor="alice"))


def _place(view: JobView, job_id: str, at: float, region: str, cluster: str) -> None:
    rec = view.jobs[job_id]
    view.apply(make_event("job.placed", JobPlaced(spec=rec.spec, bindings=(WorkerBinding(worker=0, node="n0"),)),
                          producer="test", occurred_at=at, tenant=rec.spec.tenant, project=rec.spec.project,
                          job_id=job_id, attempt=1, region=region, cluster=cluster))


def _ids(resp: pb.ListJobsResponse) -> list[str]:
    return [j.job_id for j in resp.jobs]


def _page(view: JobView, who=ROOT, **kw) -> pb.ListJobsResponse:
    return listing.list_page(view, pb.ListJobsRequest(**kw), who, job_to_pb)


def _all_pages(view: JobView, **kw) -> list[list[str]]:
    pages, token = [], ""
    while True:
        resp = _page(view, **kw, page_token=token)
        pages.append(_ids(resp))
        token = resp.next_page_token
        if not token:
            return pages


def test_three_pages_newest_first_no_job_twice_none_missing():
    view = JobView()
    ids = [f"j-{i:02d}" for i in range(25)]
    for i, j in enumerate(reversed(ids)):  # submitted in reverse id order: the order is by time
        _submit(view, j, T0 + i)
    pages = _all_pages(view, page_size=10)
    assert [len(p) for p in pages] == [10, 10, 5]
    flat = [j for p in pages for j in p]
    assert flat == ids  # newest (latest submit) first, each once
    oldest = [j for p in _all_pages(view, page_size=10, order=pb.JOB_ORDER_OLDEST_FIRST) for j in p]
    assert oldest == list(reversed(ids))
    assert _page(view, page_size=10).total == 25


def test_ties_in_submit_time_are_ordered_by_job_id_and_never_split_wrongly():
    view = JobView()
    for j in ("j-c", "j-a", "j-b", "j-d"):
        _submit(view, j, T0)  # the same second
    assert [j for p in _all_pages(view, page_size=1) for j in p] == ["j-d", "j-c", "j-b", "j-a"]


def test_jobs_arriving_while_paging_neither_shift_nor_repeat_the_next_page():
    view = JobView()
    for i in range(6):
        _submit(view, f"j-old-{i}", T0 + i)
    first = _page(view, page_size=3)
    assert _ids(first) == ["j-old-5", "j-old-4", "j-old-3"]
    for i in range(4):  # newer jobs arrive between the pages (an offset would shift by 4)
        _submit(view, f"j-new-{i}", T0 + 100 + i)
    second = _page(view, page_size=3, page_token=first.next_page_token)
    assert _ids(second) == ["j-old-2", "j-old-1", "j-old-0"] and not second.next_page_token


def test_filters_or_within_a_field_and_across_fields():
    view = JobView()
    _submit(view, "j-1", T0 + 1, tenant="search", project="train", name="train-a", kind="training")
    _submit(view, "j-2", T0 + 2, tenant="search", project="serve", name="serve-a", kind="inference")
    _submit(view, "j-3", T0 + 3, tenant="ads", project="train", name="train-b", kind="training")
    _submit(view, "j-4", T0 + 4, tenant="nlp", project="batch", name="eval-x", kind="evaluation")
    _submit(view, "j-5", T0 + 5, tenant="ads", project="batch", name="train-c", kind="batch")
    _place(view, "j-1", T0 + 10, "cn-north-1", "cn-north-1-c1")
    _place(view, "j-3", T0 + 11, "cn-east-1", "cn-east-1-c1")
    _place(view, "j-4", T0 + 12, "cn-east-1", "cn-east-1-c2")
    cases = [
        (dict(tenants=["search", "ads"]), ["j-5", "j-3", "j-2", "j-1"]),
        (dict(tenant="nlp", tenants=["ads"]), ["j-5", "j-4", "j-3"]),  # the old field is ORed in
        (dict(tenants=["search", "ads"], projects=["train"]), ["j-3", "j-1"]),
        (dict(states=[pb.JOB_STATE_PLACED]), ["j-4", "j-3", "j-1"]),
        (dict(states=[pb.JOB_STATE_PLACED, pb.JOB_STATE_QUEUED], tenants=["ads"]), ["j-5", "j-3"]),
        (dict(regions=["cn-east-1"]), ["j-4", "j-3"]),
        (dict(regions=["cn-east-1"], clusters=["cn-east-1-c1", "cn-north-1-c1"]), ["j-3"]),
        (dict(kinds=[pb.JOB_KIND_TRAINING, pb.JOB_KIND_EVALUATION]), ["j-4", "j-3", "j-1"]),
        (dict(name_pattern="train-*"), ["j-5", "j-3", "j-1"]),
        (dict(name_pattern="train-*", kinds=[pb.JOB_KIND_BATCH]), ["j-5"]),
        (dict(submitted_after=Timestamp(seconds=int(T0) + 2), submitted_before=Timestamp(seconds=int(T0) + 4)),
         ["j-3", "j-2"]),  # after inclusive, before exclusive
        (dict(states=[pb.JOB_STATE_HELD]), []),
    ]
    for kw, want in cases:
        resp = _page(view, **kw)
        assert (_ids(resp), resp.total) == (want, len(want)), kw


def test_a_token_is_bound_to_its_filters_and_order():
    view = JobView()
    for i in range(4):
        _submit(view, f"j-{i}", T0 + i)
    token = _page(view, page_size=2, tenants=["search"]).next_page_token
    assert _ids(_page(view, page_size=2, tenants=["search"], page_token=token)) == ["j-1", "j-0"]
    for other in (dict(tenants=["ads"]), dict(), dict(tenants=["search"], order=pb.JOB_ORDER_OLDEST_FIRST),
                  dict(tenants=["search"], states=[pb.JOB_STATE_QUEUED])):
        with pytest.raises(ValidationError) as e:
            _page(view, page_size=2, page_token=token, **other)
        assert e.value.field == "page_token", other
    with pytest.raises(ValidationError) as e:
        _page(view, page_token="garbage")
    assert e.value.field == "page_token"


def test_every_page_reports_the_total_matching_now_not_the_first_pages():
    """Issue 14 follow-up: the token carried the first page's total, so a later page reported a
    stale one after jobs arrived or changed state."""
    view = JobView()
    for i in range(6):
        _submit(view, f"j-{i}", T0 + i)
    first = _page(view, page_size=2, states=[pb.JOB_STATE_QUEUED])
    assert first.total == 6
    for i in range(6, 9):  # three more queued jobs, and two of the first ones placed
        _submit(view, f"j-{i}", T0 + i)
    _place(view, "j-0", T0 + 20, "cn-north-1", "cn-north-1-c1")
    _place(view, "j-5", T0 + 21, "cn-north-1", "cn-north-1-c1")
    second = _page(view, page_size=2, states=[pb.JOB_STATE_QUEUED], page_token=first.next_page_token)
    assert second.total == 6 + 3 - 2
    assert _ids(second) == ["j-3", "j-2"]  # the cursor still holds: after j-4, queued ones only
    unfiltered = _page(view, page_size=2, page_token=_page(view, page_size=2).next_page_token)
    assert unfiltered.total == 9  # by bisection, also current


def test_a_token_from_another_filter_is_invalid_argument_naming_page_token_and_old_tokens_still_page():
    view = JobView()
    for i in range(5):
        _submit(view, f"j-{i}", T0 + i, tenant="search" if i % 2 else "ads")
    token = _page(view, page_size=1, tenants=["ads"]).next_page_token
    with pytest.raises(ValidationError) as e:
        _page(view, page_size=1, tenants=["search"], page_token=token)
    assert e.value.field == "page_token" and str(e.value).startswith("page_token: was issued for other filters")
    assert status_for(e.value).name == "INVALID_ARGUMENT"
    # a token issued before this change (version 1, with the first page's total) still pages;
    # its total is ignored
    doc = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    old = dict(doc, v=1, n=999)
    old_token = base64.urlsafe_b64encode(json.dumps(old).encode()).decode().rstrip("=")
    resp = _page(view, page_size=1, tenants=["ads"], page_token=old_token)
    assert resp.total == 3 and _ids(resp) == ["j-2"]


def test_filters_naming_nothing_that_exists_are_refused_and_known_ones_that_match_nothing_are_empty():
    view = JobView()
    _submit(view, "j-1", T0)
    names = listing.FilterNames(tenants=frozenset({"search", "ads"}), regions=frozenset({"cn-north-1"}),
                                clusters=frozenset({"cn-north-1-c1"}),
                                projects={"search": frozenset({"train"}), "ads": frozenset({"serve"})})

    def page(who=ROOT, **kw):
        return listing.list_page(view, pb.ListJobsRequest(**kw), who, job_to_pb, names=names)

    for kw, field, said in [
        (dict(regions=["cn-north-1", "cn-nowhere-9"]), "regions[1]", "no such region 'cn-nowhere-9'; known regions: "
                                                                     "cn-north-1"),
        (dict(clusters=["cn-north-1-c9"]), "clusters[0]", "no such cluster 'cn-north-1-c9'"),
        (dict(tenant="serach"), "tenant", "no such tenant 'serach'; known tenants: ads, search"),
        (dict(tenants=["search", "serach"]), "tenants[1]", "no such tenant 'serach'"),
        (dict(project="trian"), "project", "no such project 'trian'; known projects: serve, train"),
        (dict(tenants=["search"], projects=["serve"]), "projects[0]", "no such project 'serve'; known projects: "
                                                                      "train"),  # a project of another tenant
    ]:
        with pytest.raises(ValidationError) as e:
            page(**kw)
        assert (e.value.field, e.value.reason) == (field, said) or (e.value.field == field and said in e.value.reason)
    assert _ids(page(regions=["cn-north-1"])) == []  # known, nothing placed there: empty, not an error
    assert _ids(page(tenants=["ads"])) == []
    assert _ids(page(projects=["serve"])) == []
    with pytest.raises(PermissionDeniedError):  # a non-admin: refused as for any tenant they may not read
        page(who=ALICE, tenants=["serach"])


def test_a_page_stops_at_about_one_mib_and_every_job_still_comes_once():
    view = JobView()
    annotations = {f"k{i}": "x" * 1024 for i in range(64)}  # ~66 KB per job, the most JobSpec allows
    for i in range(40):
        _submit(view, f"j-{i:02d}", T0 + i, annotations=annotations)
    pages = []
    token = ""
    while True:
        resp = _page(view, page_size=1000, page_token=token)
        assert resp.ByteSize() <= listing.PAGE_BYTES + 1024
        pages.append(_ids(resp))
        token = resp.next_page_token
        if not token:
            break
    assert len(pages) == 3 and all(len(p) < 40 for p in pages)
    assert sorted(j for p in pages for j in p) == sorted(view.jobs)


def test_readers_see_only_their_tenants_and_cannot_ask_for_others():
    view = JobView()
    _submit(view, "j-s", T0, tenant="search")
    _submit(view, "j-a", T0 + 1, tenant="ads")
    assert _ids(_page(view, who=ALICE)) == ["j-s"]
    with pytest.raises(PermissionDeniedError):
        _page(view, who=ALICE, tenants=["search", "ads"])


def test_a_page_walks_only_what_it_needs(monkeypatch):
    """Per-request cost: a later page bisects to its cursor; it does not visit the jobs before it."""
    view = JobView()
    for i in range(2000):
        _submit(view, f"j-{i:04d}", T0 + i)
    first = _page(view, page_size=10)
    visited = []
    matches = listing.JobFilter.matches
    monkeypatch.setattr(listing.JobFilter, "matches", lambda self, rec: visited.append(rec.job_id) or matches(self, rec))
    _page(view, page_size=10, page_token=first.next_page_token)
    assert len(visited) == 11  # ten jobs and the one that tells there is a next page
    visited.clear()
    assert _page(view, page_size=10).total == 2000 and len(visited) == 11  # the total by bisection
    visited.clear()
    assert _page(view, page_size=10, tenants=["search"]).total == 2000 and len(visited) == 2000 + 11  # one walk


def test_total_counts_only_the_jobs_a_project_restricted_submitter_of_every_tenant_sees():
    """A submitter of tenants ``*`` limited to project ``train`` reads every tenant but only that
    project: ``total`` is the number of jobs it is shown, not every job in the time range."""
    from fedsched.auth import Grant, Principal
    who = Principal("carol", (Grant(role="submitter", tenants=frozenset({"*"}), projects=frozenset({"train"})),))
    view = JobView()
    _submit(view, "j-1", T0, tenant="search", project="train")
    _submit(view, "j-2", T0 + 1, tenant="search", project="serve")
    _submit(view, "j-3", T0 + 2, tenant="ads", project="train")
    resp = _page(view, who=who)
    assert sorted(_ids(resp)) == ["j-1", "j-3"]
    assert resp.total == 2
    assert _page(view).total == 3  # the admin's shortcut still counts all


def test_a_later_page_refreshes_its_total_from_what_changed_not_by_counting_the_range(monkeypatch):
    """``fedsched jobs --all`` over 20k jobs re-counted the whole range on each of its 200 pages.
    Now the first page counts the range once; each later page visits at most its page (and the
    one job telling there is a next) plus the jobs that changed since the previous page, and
    its total is still exact (equal to a fresh count)."""
    view = JobView()
    for i in range(2000):
        _submit(view, f"j-{i:04d}", T0 + i)
    visited = []
    matches_key = listing.JobFilter.matches_key
    monkeypatch.setattr(listing.JobFilter, "matches_key",
                        lambda self, spec, key: visited.append(1) or matches_key(self, spec, key))
    query = dict(page_size=10, tenants=["search"], states=[pb.JOB_STATE_QUEUED])
    first = _page(view, **query)
    assert first.total == 2000 and len(visited) == 2000 + 11  # the first page counts the range
    token, changed = first.next_page_token, 0
    for step in range(5):
        for i in range(step * 3):  # jobs submitted, placed (no longer queued) meanwhile
            _submit(view, f"k-{step}-{i}", T0 + 5000 + step * 10 + i)
            _place(view, f"j-{1000 + step * 10 + i:04d}", T0 + 6000, "cn-north-1", "cn-north-1-c1")
        changed = 2 * step * 3
        visited.clear()
        resp = _page(view, **query, page_token=token)
        assert len(visited) <= 11 + 2 * changed  # before and after of each change, not 2000
        visited.clear()
        assert resp.total == _page(view, **query).total  # exact: what a fresh count says now
        token = resp.next_page_token
    assert resp.total == 2000  # as many submitted as placed


def test_a_token_of_another_view_or_older_than_the_change_log_counts_the_range_again():
    view = JobView(retain_listing_changes=5)
    for i in range(20):
        _submit(view, f"j-{i:02d}", T0 + i)
    token = _page(view, page_size=2, tenants=["search"]).next_page_token
    for i in range(3):
        _place(view, f"j-{i:02d}", T0 + 100, "cn-north-1", "cn-north-1-c1")
    assert _page(view, page_size=2, tenants=["search"], page_token=token).total == 20  # refreshed
    for i in range(20, 30):  # more changes than the log keeps
        _submit(view, f"j-{i:02d}", T0 + i)
    assert _page(view, page_size=2, tenants=["search"], page_token=token).total == 30
    other = JobView()  # another replica's view: same jobs, its own sequence
    for i in range(30):
        _submit(other, f"j-{i:02d}", T0 + i)
    _submit(other, "j-99", T0 + 99)
    assert _page(other, page_size=2, tenants=["search"], page_token=token).total == 31
