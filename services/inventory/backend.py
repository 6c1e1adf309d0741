"""The execution backend interface: how a region agent runs job attempts on its cluster.

One :class:`Backend` protocol, in the shape of a job attempt's lifecycle on a cluster (not of the
trace), that every backend implements: ``trace`` (:class:`services.inventory.agent.TraceBackend`,
a simulated cluster on the business clock), and later Slurm and Kubernetes. The agent owns the
*ledger* (what the scheduler asked for, fencing, reporting on the bus); the backend owns the
*cluster* (what really runs there). The agent never predicts an end: it reports what the
backend's status stream says.

Lifecycle of one attempt on a backend (the unit is one shard of one attempt of one job, named
by :class:`AttemptKey`)::

    launch(spec) -> PENDING -> RUNNING -> SUCCEEDED | FAILED(exit_code, reason) | LOST
                       \\_________ stop(key, reason) (from any state; no further status) ___/

How the real backends map onto it (style anchors: Armada's executor, Kueue MultiKueue's
remote-job adapter):

* Slurm: ``launch`` = ``sbatch --job-name=<AttemptKey.name> --comment=<labels>`` (a heterogeneous
  job / ``srun`` step for a gang), adopting a job of that name found by ``squeue --name``;
  ``stop`` = ``scancel``; the status stream polls ``squeue``/``sacct`` (PENDING, RUNNING,
  COMPLETED -> succeeded, FAILED/TIMEOUT/OUT_OF_MEMORY -> failed with ``ExitCode``,
  NODE_FAIL -> failed ``node_failed``); ``inventory`` = ``sinfo``/``scontrol show node``
  (DRAIN/DOWN -> unhealthy/unschedulable).
* Kubernetes: ``launch`` = create a ``batch/v1`` Job (or an indexed Job for a gang) named
  :attr:`AttemptKey.name` with :meth:`AttemptKey.labels`; ``AlreadyExists`` means adopt;
  ``stop`` = delete with foreground propagation; the status stream is a pod/Job watch
  (``Pending``/``Running``/``Succeeded``/``Failed`` with the container's exit code; a pod on a
  NotReady node -> ``node_failed``); ``inventory`` = nodes' allocatable, conditions, taints and
  ``spec.unschedulable``.

Times are POSIX seconds (float) on the business clock the cluster observed the change at (for
``trace``: the compressed trace clock). Resources: milli-GPU per device, milli-CPU, MiB.

Errors: every method may raise :class:`BackendError`; ``retryable=True`` means try again later
(API server / slurmctld unreachable, throttled), ``False`` means the request itself is wrong (the
agent reports the attempt failed and moves on). An agent never crashes on a BackendError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import AsyncIterator, Protocol, runtime_checkable

from fedsched.events import NodeInventory, WorkerBinding
from fedsched.jobs import JobSpec

__all__ = [
    "LABEL_PREFIX", "AttemptKey", "AttemptSpec", "Phase", "AttemptStatus", "ObservedAttempt", "Backend",
    "BackendError", "AttemptNotFound", "BackendUnavailable", "NodeInventory", "TERMINAL_PHASES",
]

#: Prefix of the labels (Kubernetes labels, Slurm ``--comment`` keys) fedsched puts on what it runs.
LABEL_PREFIX = "fedsched.io/"


@dataclass(frozen=True, slots=True, order=True)
class AttemptKey:
    """Names one shard of one attempt of one job on a cluster: the unit a backend launches.

    Attributes:
        job_id: the job's id (naming kind ``job``: an RFC 1123 label).
        attempt: attempt number, 1-based; a higher number fences every lower one.
        shard: shard index of a split batch job (0 otherwise).
    """

    job_id: str
    attempt: int
    shard: int = 0

    @property
    def name(self) -> str:
        """The workload's name on the cluster, derived only from the key so a relaunch finds
        the same object: ``<job_id>-a<attempt>-s<shard>`` (at most 63 + 16 characters; a
        backend whose names are shorter truncates and relies on :meth:`labels`)."""
        return f"{self.job_id}-a{self.attempt}-s{self.shard}"

    def labels(self) -> dict[str, str]:
        """The labels that mark the workload as fedsched's and name its attempt (what
        :meth:`Backend.list_attempts` selects on)."""
        return {LABEL_PREFIX + "job-id": self.job_id, LABEL_PREFIX + "attempt": str(self.attempt),
                LABEL_PREFIX + "shard": str(self.shard)}

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> "AttemptKey | None":
        """The key named by ``labels`` (None if they are not fedsched's or malformed)."""
        try:
            return cls(labels[LABEL_PREFIX + "job-id"], int(labels[LABEL_PREFIX + "attempt"]),
                       int(labels.get(LABEL_PREFIX + "shard", "0")))
        except (KeyError, ValueError):
            return None

    def __str__(self) -> str:
        return f"{self.job_id}/{self.attempt}/{self.shard}"


@dataclass(frozen=True, slots=True)
class AttemptSpec:
    """Everything a backend needs to launch one attempt (built by the agent from ``job.placed``).

    Attributes:
        key: job id, attempt, shard.
        tenant, project: the job's owner (labels; accounting on the cluster side).
        spec: the job as submitted (resources, annotations, and ``workload`` -- image, command,
            env -- which real backends run and ``trace`` ignores).
        card_model: canonical card model of the bound nodes ("" for CPU-only work).
        bindings: worker -> node (and GPU devices, milli-GPU, milli-CPU, MiB) from the placement,
            one per gang member, ``worker`` 0..workers-1. A backend pins worker i to its node.
        resume_from_s: seconds of work checkpointed by earlier attempts; the attempt resumes
            from the job's checkpoint location and runs only the rest.
        started_at: when the attempt started, if the agent already saw it start (a rebuilt
            ledger after an agent restart); None for a fresh launch. Backends whose cluster
            outlives the agent ignore it.
    """

    key: AttemptKey
    tenant: str
    project: str
    spec: JobSpec
    card_model: str = ""
    bindings: tuple[WorkerBinding, ...] = ()
    resume_from_s: float = 0.0
    started_at: float | None = None

    @property
    def name(self) -> str:
        """:attr:`AttemptKey.name`."""
        return self.key.name

    def labels(self) -> dict[str, str]:
        """:meth:`AttemptKey.labels` plus the owner's tenant and project."""
        return {**self.key.labels(), LABEL_PREFIX + "tenant": self.tenant, LABEL_PREFIX + "project": self.project}


class Phase(StrEnum):
    """What the cluster says about an attempt."""

    PENDING = "pending"      # accepted by the cluster, not running yet (image pull, Slurm queue)
    RUNNING = "running"      # every worker of the gang runs
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"        # a worker exited non-zero, or a node under it failed (the gang is stopped)
    LOST = "lost"            # the cluster no longer knows the attempt (deleted behind fedsched's back)


#: Phases after which a backend emits nothing more for the attempt.
TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.LOST})

#: ``AttemptStatus.reason`` of a gang stopped because a node under one of its workers failed.
NODE_FAILED = "node_failed"


@dataclass(frozen=True, slots=True)
class AttemptStatus:
    """One status change of an attempt, as observed on the cluster.

    Attributes:
        key: which attempt.
        phase: the new phase.
        at: when the cluster observed it (POSIX s, business clock).
        exit_code: the failing worker's exit code for :attr:`Phase.FAILED` (None when no process
            exited: node failure, eviction, lost).
        reason: short machine-readable reason for FAILED/LOST (``exit_code``, ``node_failed``,
            ``oom_killed``, ``trace_outcome``...), "" otherwise.
        message: the circumstances in words ("" if none).
        worker: the gang member the change came from, if one (e.g. the one whose node failed).
        node: the node concerned, if one.
    """

    key: AttemptKey
    phase: Phase
    at: float
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    worker: int | None = None
    node: str | None = None


@dataclass(frozen=True, slots=True)
class ObservedAttempt:
    """An attempt found on the cluster under fedsched's labels (for reconcile).

    Attributes:
        key: which attempt (from its labels).
        phase: its phase now.
        started_at: when it started running (POSIX s), None if not yet.
        nodes: the nodes its workers run on, worker order.
        labels: every label it carries (including :meth:`AttemptKey.labels`).
    """

    key: AttemptKey
    phase: Phase
    started_at: float | None = None
    nodes: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


class BackendError(Exception):
    """A backend call failed.

    Attributes:
        retryable: True if the same call may succeed later (transient: cluster API unreachable,
            throttled); False if it never will (bad request, unknown attempt).
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class AttemptNotFound(BackendError):
    """The cluster does not know the attempt (or the worker) asked for. Not retryable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class NoLogsKept(Exception):
    """The backend keeps no logs at all (the trace backend runs no workload): not a failure of
    the cluster and not a missing attempt. The agent answers ``no_logs`` (admission:
    FAILED_PRECONDITION with this message)."""


class BackendUnavailable(BackendError):
    """The cluster's API did not answer (timeout, connection refused, 5xx). Retryable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


@runtime_checkable
class Backend(Protocol):
    """How an agent runs job attempts on its cluster. Every method is idempotent.

    Attributes:
        kind: backend name (``trace``, ``slurm``, ``kubernetes``).
        durable: whether the cluster keeps running attempts while the agent is down (Slurm,
            Kubernetes: True; ``trace`` simulates the cluster in the agent's process: False, so a
            restarted agent relaunches its ledger's live attempts with their ``started_at``).
    """

    kind: str
    durable: bool

    async def inventory(self) -> list[NodeInventory]:
        """The cluster's nodes now: capacity per node (``gpus`` of ``card_model``, milli-CPU,
        MiB), ``healthy`` (Ready / not DOWN), ``unschedulable`` (cordoned / drained) and
        ``taints``. Free fields are the agent's to fill in (from its ledger).

        Raises:
            BackendError: the cluster could not be read.
        """
        ...

    async def launch(self, attempt: AttemptSpec) -> None:
        """Start ``attempt`` (every worker on its bound node), or adopt it if the cluster already
        runs something named :attr:`AttemptSpec.name` with its labels -- never a second copy.
        Returns once the cluster accepted it; the phases follow on :meth:`events`.

        Raises:
            BackendError: not accepted (``retryable`` says whether to try again).
        """
        ...

    async def stop(self, key: AttemptKey, reason: str) -> None:
        """Stop every worker of ``key`` (a gang is stopped as one unit). Stopping an attempt that
        is unknown or already ended is a no-op. No status follows for a stopped attempt.

        Raises:
            BackendError: the cluster could not be reached (retryable).
        """
        ...

    async def list_attempts(self) -> list[ObservedAttempt]:
        """Every attempt on the cluster under fedsched's labels, ended ones included until the
        backend forgets them (reconcile compares these with the agent's ledger).

        Raises:
            BackendError: the cluster could not be read.
        """
        ...

    def events(self) -> AsyncIterator[AttemptStatus]:
        """Status changes as the cluster observes them, in the order observed, forever (until the
        consumer stops iterating). Each attempt: PENDING, RUNNING, then one terminal phase."""
        ...

    def ready(self) -> list[AttemptStatus]:
        """The status changes observed so far and not yet returned, without waiting (the same
        stream as :meth:`events`; an agent driven step by step drains it)."""
        ...

    def logs(self, key: AttemptKey, worker: int | None = None, follow: bool = False) -> AsyncIterator[str]:
        """The output of ``worker`` of ``key`` (every worker when None, lines prefixed
        ``[worker K] ``), line by line without newlines; with ``follow``, until the attempt ends.

        Raises:
            AttemptNotFound: unknown attempt or worker.
            NoLogsKept: this backend keeps no logs (the trace backend).
            BackendError: the cluster could not be read.
        """
        ...
