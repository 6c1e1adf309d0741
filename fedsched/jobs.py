"""The job profile: what a job asks for, in canonical names and explicit units.

This is the domain model every service shares (admission builds it from the gRPC request,
the scheduler reads it, agents launch it). It is validated strictly: names through
:mod:`fedsched.naming`, resources within limits, card models canonical.

Units: GPU counts are whole cards; ``gpu_milli`` is the share of one card per GPU
(1..1000, 1000 = whole card, fractional shares only with one GPU per worker); CPU in milli-cores;
memory in MiB; data sizes in bytes; durations in seconds; prices in currency units per GPU-hour.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedsched import naming
from fedsched.clock import UtcDatetime
from fedsched.workload import Workload


class JobKind(StrEnum):
    """What a job is for; queues and defaults depend on it."""

    TRAINING = "training"
    FINE_TUNE = "fine_tune"
    INFERENCE = "inference"
    BATCH = "batch"
    EVALUATION = "evaluation"
    EXPERIMENT = "experiment"


#: Kinds whose workers talk to each other all the time (gang, one cluster and one zone).
COMMUNICATION_HEAVY = frozenset({JobKind.TRAINING, JobKind.FINE_TUNE})


class Locality(StrEnum):
    """Where a job may run relative to its home region (the brief's three classes)."""

    MUST_LOCAL = "must_local"        # data, security or latency keep it at home
    PREFER_LOCAL = "prefer_local"    # home first, may backfill cross-region
    GLOBAL = "global"                # anywhere the rules allow


class PriorityClass(StrEnum):
    """Priority classes, highest first; :data:`PRIORITY_VALUE` orders them."""

    CRITICAL = "critical"
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"
    BEST_EFFORT = "best_effort"


PRIORITY_VALUE: dict[PriorityClass, int] = {
    PriorityClass.CRITICAL: 1000,
    PriorityClass.HIGH: 100,
    PriorityClass.NORMAL: 50,
    PriorityClass.LOW: 10,
    PriorityClass.BEST_EFFORT: 0,
}


class JobState(StrEnum):
    """Lifecycle states as admission reports them."""

    QUEUED = "queued"                  # accepted, waiting for a placement
    AWAITING_APPROVAL = "awaiting_approval"
    HELD = "held"                      # queued but held (HoldJobs): not considered until released
    PLACED = "placed"                  # placement published, agent not yet started it
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class AttemptState(StrEnum):
    """States of one attempt (one placement of a job or shard on a cluster), str-valued as
    attempt records, the API's ``Attempt.outcome`` and the CLI have always carried them.

    Open: ``placed``, ``running``, ``stopping``. Ended: the rest. The transitions admission's job
    view follows are in ``services/admission/jobview.py``; an agent's trace outcome is
    ``succeeded`` or ``failed``.
    """

    PLACED = "placed"        # the scheduler published the placement
    RUNNING = "running"      # its agent started it
    STOPPING = "stopping"    # a stop order is out (preemption, cancellation), the agent has not confirmed
    SUCCEEDED = "succeeded"  # ended well (``job.finished``)
    FAILED = "failed"        # ended in failure (``job.failed``)
    REJECTED = "rejected"    # its agent refused the placement (``job.rejected``)
    RECLAIMED = "reclaimed"  # placed, never started in time: the scheduler took the placement back
    PREEMPTED = "preempted"  # stopped for a higher-priority job
    CANCELLED = "cancelled"  # stopped because its job was cancelled
    LOST = "lost"            # its cluster went silent (``job.stopped`` cluster_lost)
    STOPPED = "stopped"      # stopped for another reason


class StopReason(StrEnum):
    """Why the scheduler stops an attempt (``JobStop.reason``; also ``JobStatus.reason`` of the
    ``job.stopped`` an agent reports for it, or the scheduler publishes for an attempt on a lost
    cluster). Shared by the scheduler (producer) and the job view and agents (consumers)."""

    CANCELLED = "cancelled"
    PREEMPTED = "preempted"        # for a higher-priority job
    RECLAIMED = "reclaimed"        # placed, never started within ``reclaim_after_s``
    CLUSTER_LOST = "cluster_lost"  # its cluster went silent for longer than ``stale_after_s``


class Dataset(BaseModel):
    """A dataset a job reads.

    Attributes:
        name: dataset name (naming kind ``dataset``).
        home_region: region where the data lives.
        size_bytes: bytes to move if the job runs elsewhere.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    home_region: str
    size_bytes: int = Field(ge=0, le=10**16)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return naming.check_name("dataset", v, "datasets.name")

    @field_validator("home_region")
    @classmethod
    def _region(cls, v: str) -> str:
        return naming.check_name("region", v, "datasets.home_region")


Milli = Annotated[int, Field(ge=0, le=10**9)]


def _names(kind: str, values: tuple[str, ...], field: str) -> tuple[str, ...]:
    """``values`` if each is a canonical name of ``kind`` (:func:`fedsched.naming.check_name`).

    Raises:
        InvalidName: the first that is not, naming ``field``.
    """
    for value in values:
        naming.check_name(kind, value, field)
    return values


class JobSpec(BaseModel):
    """Everything a job asks for (immutable).

    Attributes:
        tenant, project: owners (naming kinds ``tenant``, ``project``).
        name: the submitter's label for the job (naming kind ``job``), optional.
        kind: :class:`JobKind`.
        priority: :class:`PriorityClass`.
        workers: gang size; all workers start together in one cluster.
        gpus_per_worker: whole GPUs per worker (0 = CPU-only worker).
        gpu_milli: share of each GPU, 1..1000; < 1000 only with ``gpus_per_worker == 1``.
        cpu_milli: CPU per worker in milli-cores.
        memory_mib: host memory per worker in MiB.
        card_models: allowed canonical card models; empty = any.
        min_gpu_memory_gib: minimum on-card memory (GiB); 0 = no minimum.
        requires_rdma: needs an RDMA/InfiniBand fabric between nodes.
        home_region: the region the job belongs to (its data or its submitter); cross-region
            means running anywhere else.
        locality: :class:`Locality`.
        allowed_regions / forbidden_regions: explicit region limits (empty allowed = any).
        residency_tags: compliance tags; a cluster must carry every one of them.
        datasets: inputs, with where they live and their size.
        start_deadline: latest acceptable start (UTC), optional.
        max_price_per_gpu_hour: price ceiling (currency units per GPU-hour), 0 = none.
        preemptible / checkpointable: may be evicted / can resume from a checkpoint.
        estimated_duration_s: the submitter's runtime estimate (s); the scheduler's only
            knowledge of duration.
        retry_limit: failed attempts to retry (0 = none).
        shards: for splittable batch jobs, how many independent shards (1 = not split).
        annotations: opaque key/values for backends (the trace agent reads its runtime here);
            the scheduler never reads them.
        workload: what each worker runs (:class:`~fedsched.workload.Workload`: image, argv, env,
            secret references by name, workdir, checkpoint location); None for trace jobs. The
            scheduler never reads it; real backends run it, the trace backend ignores it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    project: str
    name: str = ""
    kind: JobKind = JobKind.BATCH
    priority: PriorityClass = PriorityClass.NORMAL
    workers: int = Field(default=1, ge=1, le=4096)
    gpus_per_worker: int = Field(default=1, ge=0, le=64)
    gpu_milli: int = Field(default=1000, ge=0, le=1000)
    cpu_milli: Milli = 0
    memory_mib: Milli = 0
    card_models: tuple[str, ...] = ()
    min_gpu_memory_gib: int = Field(default=0, ge=0, le=4096)
    requires_rdma: bool = False
    home_region: str
    locality: Locality = Locality.GLOBAL
    allowed_regions: tuple[str, ...] = ()
    forbidden_regions: tuple[str, ...] = ()
    residency_tags: tuple[str, ...] = ()
    datasets: tuple[Dataset, ...] = ()
    start_deadline: UtcDatetime | None = None
    max_price_per_gpu_hour: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False)
    preemptible: bool = False
    checkpointable: bool = False
    estimated_duration_s: float | None = Field(default=None, ge=0, le=10 * 365 * 86400, allow_inf_nan=False)
    retry_limit: int = Field(default=0, ge=0, le=100)
    shards: int = Field(default=1, ge=1, le=1024)
    annotations: dict[str, str] = Field(default_factory=dict)
    workload: Workload | None = None

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str) -> str:
        return naming.check_name("tenant", v)

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        return naming.check_name("project", v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return naming.check_name("job", v, "name") if v else v

    @field_validator("home_region")
    @classmethod
    def _home(cls, v: str) -> str:
        return naming.check_name("region", v, "home_region")

    # (one validator per field, without pydantic's ValidationInfo, and nothing made for an empty
    # tuple: every service validates a JobSpec per job message it reads -- issue 15)
    @field_validator("allowed_regions")
    @classmethod
    def _allowed(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _names("region", v, "allowed_regions")

    @field_validator("forbidden_regions")
    @classmethod
    def _forbidden(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _names("region", v, "forbidden_regions")

    @field_validator("residency_tags")
    @classmethod
    def _tags(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _names("residency_tag", v, "residency_tags")

    @field_validator("card_models")
    @classmethod
    def _cards(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return v if len(v) < 2 else tuple(sorted(set(v)))  # (0 or 1: already sorted and distinct)

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64 or any(len(k) > 128 or len(val) > 1024 for k, val in v.items()):
            raise ValueError("at most 64 annotations, keys <= 128 and values <= 1024 characters")
        return v

    @model_validator(mode="after")
    def _coherent(self) -> "JobSpec":
        if self.gpus_per_worker == 0 and self.gpu_milli not in (0, 1000):
            raise ValueError("gpu_milli must be 0 for a CPU-only worker (gpus_per_worker = 0)")
        if self.gpus_per_worker > 1 and self.gpu_milli != 1000:
            raise ValueError("gpu_milli < 1000 (a fractional GPU) needs gpus_per_worker = 1")
        if self.gpus_per_worker >= 1 and self.gpu_milli == 0:
            raise ValueError("gpu_milli must be 1..1000 when the worker has a GPU")
        if set(self.allowed_regions) & set(self.forbidden_regions):
            raise ValueError("a region is both allowed and forbidden")
        if self.shards > 1 and self.kind != JobKind.BATCH:
            raise ValueError("only batch jobs can be split into shards")
        return self

    # ---- derived quantities (units in the names)

    @property
    def gpu_milli_per_worker(self) -> int:
        """GPU demand of one worker in milli-GPUs (2 whole GPUs = 2000)."""
        if self.gpus_per_worker == 0:
            return 0
        return self.gpus_per_worker * 1000 if self.gpus_per_worker > 1 else self.gpu_milli

    @property
    def total_gpu_milli(self) -> int:
        """GPU demand of the whole gang in milli-GPUs."""
        return self.gpu_milli_per_worker * self.workers

    @property
    def communication_heavy(self) -> bool:
        """Gang jobs of training kinds: keep all workers in one zone."""
        return self.kind in COMMUNICATION_HEAVY and self.workers > 1

    @property
    def priority_value(self) -> int:
        """Numeric priority (higher first), from :data:`PRIORITY_VALUE`."""
        return PRIORITY_VALUE[self.priority]
