"""ListJobs: filters, order, opaque page tokens bound to them, and byte-bounded pages.

A page is read from the job view's index of every job sorted by ``(submitted_at, job_id)``
(:attr:`~services.admission.jobview.JobView.by_submitted`, kept sorted as jobs arrive): the
request's time range and the page token's cursor are found by bisection, and the walk stops as
soon as the page is full, so a page costs what it skips (jobs of the range the filters reject)
plus what it returns -- never a sort of every job.

The cursor is the ``(submitted_at, job_id)`` of the last job returned, not an offset: a job
submitted while someone pages (it sorts after every existing job) neither shifts nor repeats
what the next page holds. The token is ``base64url(JSON)`` of the cursor and a digest of the
filters and order it was issued for; a token used with other filters or another order is
refused (INVALID_ARGUMENT ``page_token``).

Every page's ``total`` is the number of jobs matching now, not when the first page was read
(a token carried the first page's total until issue 14's follow-up: jobs submitted or changed
meanwhile were missing from it), and a later page does not count the range again (that made
``fedsched jobs --all`` over 20k jobs 200 pages x 20k checks):

* when the only filter is the time range and the caller reads every job: two bisections, on
  every page;
* else the first page (and a page whose token cannot be refreshed) walks the range once; its
  token carries that total, the view's listing sequence number
  (:attr:`~services.admission.jobview.JobView.listing_seq`) and the view's id, and the next page
  adds what changed since: for each job that entered, left or changed state or cluster since
  (:meth:`~services.admission.jobview.JobView.changes_since`), +1 if it matches now and did
  not before, -1 the other way. A later page's total is therefore exact, and costs the jobs
  changed since the previous page, not the range. It is counted again from the range only when
  the token was issued by another admission replica (another view) or is older than the view's
  change log (``retain_listing_changes`` changes), or is a version 1 or 2 token. A token's total
  is the client's own: a tampered one misleads only its holder (no job is shown that it may
  not read).

Filters combine as the proto says: AND across fields, OR within a repeated field; the old
single ``tenant`` / ``project`` fields are ORed into ``tenants`` / ``projects``.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Iterator

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Principal
from fedsched.errors import PermissionDeniedError, ValidationError
from fedsched.naming import check_known, check_name
from services.admission.convert import KIND_FROM_PB, STATE_TO_PB
from services.admission.jobview import JobRecord, JobView, ListingKey, listing_key

#: Default and largest page size (jobs).
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
#: A page stops before its encoded jobs pass this many bytes (at least one job per page), well
#: under gRPC's default 4 MiB receive limit.
PAGE_BYTES = 1024 * 1024
#: Longest name pattern accepted (characters).
MAX_PATTERN = 256


@dataclass(frozen=True)
class JobFilter:
    """The filters of one ListJobs request, validated (empty set / None = no filter on it).

    Attributes:
        states: wire states (``pb.JOB_STATE_*``).
        kinds: domain kinds (:class:`fedsched.jobs.JobKind`).
        after / before: submit time range, seconds since the Unix epoch, ``after`` inclusive,
            ``before`` exclusive.
        newest_first: the order (by ``submitted_at`` then ``job_id``, descending).
    """

    tenants: frozenset[str]
    projects: frozenset[str]
    states: frozenset[int]
    regions: frozenset[str]
    clusters: frozenset[str]
    kinds: frozenset[str]
    name_pattern: str
    after: float | None
    before: float | None
    newest_first: bool

    @classmethod
    def from_request(cls, request: pb.ListJobsRequest) -> "JobFilter":
        """Validate the request's filters.

        Raises:
            ValidationError: a name breaking the naming rules, an unknown state or kind, a
                pattern too long, a time range before > after reversed (field named).
        """
        tenants = {t for t in (request.tenant, *request.tenants) if t}
        projects = {p for p in (request.project, *request.projects) if p}
        for field, values, kind in (("tenants", tenants, "tenant"), ("projects", projects, "project"),
                                    ("regions", request.regions, "region"), ("clusters", request.clusters, "cluster")):
            for v in values:
                check_name(kind, v, field)
        states = set()
        for i, s in enumerate(request.states):
            if s == pb.JOB_STATE_UNSPECIFIED or s not in pb.JobState.values():
                raise ValidationError(f"states[{i}]", f"unknown state {s}")
            states.add(s)
        kinds = set()
        for i, k in enumerate(request.kinds):
            if k == pb.JOB_KIND_UNSPECIFIED or k not in KIND_FROM_PB:
                raise ValidationError(f"kinds[{i}]", f"unknown kind {k}")
            kinds.add(KIND_FROM_PB[k].value)
        if len(request.name_pattern) > MAX_PATTERN or not request.name_pattern.isprintable():
            raise ValidationError("name_pattern", f"at most {MAX_PATTERN} printable characters")
        after = _seconds(request.submitted_after) if request.HasField("submitted_after") else None
        before = _seconds(request.submitted_before) if request.HasField("submitted_before") else None
        if after is not None and before is not None and before < after:
            raise ValidationError("submitted_before", "is before submitted_after")
        if request.order not in pb.JobOrder.values():
            raise ValidationError("order", f"unknown order {request.order}")
        return cls(frozenset(tenants), frozenset(projects), frozenset(states), frozenset(request.regions),
                   frozenset(request.clusters), frozenset(kinds), request.name_pattern, after, before,
                   request.order != pb.JOB_ORDER_OLDEST_FIRST)

    def digest(self) -> str:
        """16 hex of SHA-256 over the filters and order (what a page token is bound to)."""
        doc = [sorted(self.tenants), sorted(self.projects), sorted(self.states), sorted(self.regions),
               sorted(self.clusters), sorted(self.kinds), self.name_pattern, self.after, self.before,
               self.newest_first]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    def check_access(self, principal: Principal) -> None:
        """Refuse a listing of tenants the caller may not read.

        Raises:
            PermissionDeniedError: a named tenant it may not read (in any named project), or
                no tenant rights at all.
        """
        for t in sorted(self.tenants):
            if not any(principal.can_read(t, p) for p in (sorted(self.projects) or [None])):
                raise PermissionDeniedError(f"{principal.name} may not read jobs of {t}")
        if not self.tenants and principal.readable_tenants() == frozenset():
            raise PermissionDeniedError(f"{principal.name} may not list jobs (no tenant rights)")

    def selects_by_time_only(self) -> bool:
        """No filter but the time range (every job in the range matches)."""
        return not (self.tenants or self.projects or self.states or self.regions or self.clusters or self.kinds
                    or self.name_pattern)

    def matches(self, rec: JobRecord) -> bool:
        """Whether ``rec`` passes every filter (the time range is applied by the walk)."""
        return self.matches_key(rec.spec, listing_key(rec))

    def in_range(self, submitted_at: float) -> bool:
        """``submitted_at`` (seconds) is in ``[after, before)``."""
        return (self.after is None or submitted_at >= self.after) and (self.before is None
                                                                       or submitted_at < self.before)

    def matches_key(self, spec, key: ListingKey) -> bool:
        """Whether a job of ``spec`` whose state and latest attempt are ``key`` passes every
        filter but the time range (:meth:`matches` of a job as it is or was)."""
        if self.tenants and spec.tenant not in self.tenants:
            return False
        if self.projects and spec.project not in self.projects:
            return False
        if self.kinds and spec.kind.value not in self.kinds:
            return False
        if self.name_pattern and not fnmatch.fnmatchcase(spec.name, self.name_pattern):
            return False
        if self.states and STATE_TO_PB.get(key.state) not in self.states:
            return False
        if self.regions and key.region not in self.regions:
            return False
        if self.clusters and key.cluster not in self.clusters:
            return False
        return True


@dataclass(frozen=True)
class FilterNames:
    """The names that exist now, so that a well-formed filter naming none of them is an error
    instead of an empty page (issue 14 follow-up). None = that filter is not checked.

    Attributes:
        tenants: the policy's tenants; checked only for a caller who reads every job (an admin):
            anyone else naming a tenant they may not read is refused by
            :meth:`JobFilter.check_access` already, known or not.
        regions / clusters: the federation's regions and clusters (topology and reports), and
            those where a job still in the view last ran (a decommissioned cluster's jobs).
    """

    tenants: frozenset[str] | None = None
    regions: frozenset[str] | None = None
    clusters: frozenset[str] | None = None
    #: tenant -> its projects (projects are checked like tenants: for a caller who reads every
    #: job, against the named tenants' projects, or every tenant's when none is named)
    projects: dict[str, frozenset[str]] | None = None

    def check(self, request: pb.ListJobsRequest, principal: Principal) -> None:
        """Raise for the first filter value that names nothing that exists.

        Raises:
            ValidationError: ``tenant`` / ``tenants[i]`` / ``project`` / ``projects[i]`` /
                ``regions[i]`` / ``clusters[i]``: ``no such ... 'x'; known ...: a, b``.
        """
        checks = [("region", self.regions, [("regions", list(request.regions))]),
                  ("cluster", self.clusters, [("clusters", list(request.clusters))])]
        if principal.reads_every_job():
            named = {t for t in (request.tenant, *request.tenants) if t}
            projects = (None if self.projects is None else
                        frozenset(p for t, ps in self.projects.items() if not named or t in named for p in ps))
            checks[:0] = [("tenant", self.tenants, [("tenant", [request.tenant] if request.tenant else []),
                                                    ("tenants", list(request.tenants))]),
                          ("project", projects, [("project", [request.project] if request.project else []),
                                                 ("projects", list(request.projects))])]
        for kind, known, fields in checks:
            if known is None:
                continue
            for field, values in fields:
                for i, v in enumerate(values):
                    check_known(kind, v, known, field if field in ("tenant", "project") else f"{field}[{i}]")


def _seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


@dataclass(frozen=True)
class PageToken:
    """Where the next page starts: after ``cursor`` in the order; ``digest`` of the filters it
    was issued for; the total it was issued with, as of listing sequence ``seq`` of view
    ``view`` (the next page refreshes it from the changes since: module docstring).

    Attributes:
        total: jobs matching when the token was issued (None: not carried, count again).
        seq / view: :attr:`JobView.listing_seq` and :attr:`JobView.view_id` of that count.
    """

    cursor: tuple[float, str]
    digest: str
    total: int | None = None
    seq: int = 0
    view: str = ""

    #: version 3 carries the total with its listing sequence and view; tokens of versions 1
    #: (the first page's total, ``n``, without a sequence) and 2 (no total) are still read, and
    #: the next page counts its total again
    VERSION = 3

    def encode(self) -> str:
        """The opaque text form."""
        doc = {"v": self.VERSION, "t": self.cursor[0], "j": self.cursor[1], "f": self.digest}
        if self.total is not None:
            doc |= {"n": self.total, "s": self.seq, "w": self.view}
        return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str, digest: str) -> "PageToken":
        """Parse a token and check it was issued for the filters with ``digest``.

        Raises:
            ValidationError: ``page_token``: not a token of ListJobs, or issued for other
                filters or another order.
        """
        try:
            doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            token = cls((float(doc["t"]), str(doc["j"])), str(doc["f"]))
            if doc.get("v") not in (1, 2, cls.VERSION) or not math.isfinite(token.cursor[0]):
                raise ValueError("bad token")
            if doc["v"] == cls.VERSION and "n" in doc:
                n, seq, view = doc["n"], doc["s"], doc["w"]
                if type(n) is not int or type(seq) is not int or n < 0 or seq < 0 or not isinstance(view, str):
                    raise ValueError("bad token")
                token = cls(token.cursor, token.digest, n, seq, view)
        except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as e:
            raise ValidationError("page_token", "not a token returned by ListJobs") from e
        if token.digest != digest:
            raise ValidationError("page_token", "was issued for other filters or another order; repeat the "
                                                "same filters, or start again without a page token")
        return token


def _range_size(view: JobView, f: JobFilter) -> int:
    """Jobs submitted in the filter's time range (the index holds only jobs the view has)."""
    index = view.by_submitted
    lo = 0 if f.after is None else bisect.bisect_left(index, (f.after,))
    hi = len(index) if f.before is None else bisect.bisect_left(index, (f.before,))
    return max(0, hi - lo)


def _walk(view: JobView, f: JobFilter, cursor: tuple[float, str] | None) -> Iterator[tuple[float, str]]:
    """Index entries in the filter's time range and order, strictly after ``cursor``."""
    index = view.by_submitted
    lo = 0 if f.after is None else bisect.bisect_left(index, (f.after,))
    hi = len(index) if f.before is None else bisect.bisect_left(index, (f.before,))
    if f.newest_first:
        if cursor is not None:
            hi = min(hi, bisect.bisect_left(index, cursor))
        for i in range(hi - 1, lo - 1, -1):
            yield index[i]
    else:
        if cursor is not None:
            lo = max(lo, bisect.bisect_right(index, cursor))
        for i in range(lo, hi):
            yield index[i]


def list_page(view: JobView, request: pb.ListJobsRequest, principal: Principal,
              to_pb: Callable[[JobRecord], pb.Job], *, names: FilterNames | None = None) -> pb.ListJobsResponse:
    """One page of ``request`` for ``principal`` (see the module docstring).

    Args:
        to_pb: the wire form of a job (``job_to_pb``).
        names: what the tenant, region and cluster filters may name (None: not checked).

    Returns:
        Up to ``page_size`` jobs (default 100) and at most :data:`PAGE_BYTES` encoded (at least
        one job), the next page's token ("" on the last page) and the number of jobs matching
        the filters now (without filters other than the time range, for a caller who reads
        every job, by bisection on every page; else by one walk of the range on the first page,
        refreshed on later pages from the jobs changed since the previous one: module
        docstring).

    Raises:
        ValidationError: ``page_size`` over :data:`MAX_PAGE_SIZE`, a bad filter, a filter naming
            a tenant, region or cluster that does not exist (``names``), a bad token or one
            issued for other filters or order.
        PermissionDeniedError: see :meth:`JobFilter.check_access`.
    """
    size = request.page_size or DEFAULT_PAGE_SIZE
    if size > MAX_PAGE_SIZE:
        raise ValidationError("page_size", f"must be <= {MAX_PAGE_SIZE}")
    f = JobFilter.from_request(request)
    f.check_access(principal)
    if names is not None:
        names.check(request, principal)
    digest = f.digest()
    token = PageToken.decode(request.page_token, digest) if request.page_token else None

    def visible(rec: JobRecord | None) -> bool:
        return rec is not None and f.matches(rec) and principal.can_read(rec.spec.tenant, rec.spec.project)

    def counted(spec, submitted_at: float, key: ListingKey | None) -> int:
        return int(key is not None and f.in_range(submitted_at) and f.matches_key(spec, key)
                   and principal.can_read(spec.tenant, spec.project))

    jobs = view.jobs
    total: int | None = None
    if f.selects_by_time_only() and principal.reads_every_job():
        total = _range_size(view, f)  # two bisections: the caller reads every job, no other filter
    elif token is not None and token.total is not None and token.view == view.view_id:
        changes = view.changes_since(token.seq)  # the previous page's total plus what changed since
        if changes is not None:
            total = token.total + sum(counted(c.spec, c.submitted_at, c.after)
                                      - counted(c.spec, c.submitted_at, c.before) for c in changes)
    if total is None:  # the first page, or a token that cannot be refreshed: one walk of the range
        total = sum(1 for _, j in _walk(view, f, None) if visible(jobs.get(j)))
    counted_at = view.listing_seq
    out = pb.ListJobsResponse(total=total)
    used = 0
    last: tuple[float, str] | None = None
    walk = _walk(view, f, token.cursor if token else None)
    for key in walk:
        rec = jobs.get(key[1])
        if not visible(rec):
            continue
        msg = to_pb(rec)
        cost = msg.ByteSize() + 8  # field tag and length prefix of a repeated message
        if len(out.jobs) >= size or (out.jobs and used + cost > PAGE_BYTES):
            out.next_page_token = PageToken(last, digest, total, counted_at, view.view_id).encode()
            return out
        out.jobs.append(msg)
        used += cost
        last = key
    return out
