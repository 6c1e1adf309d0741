"""Pure translation between Slurm's command-line JSON and fedsched's terms (no I/O).

What Slurm 22.05 (Debian ``slurm-wlm``) offers, checked against a real ``slurmctld`` (see
``deploy/slurm/local-slurm.sh`` and ``tests/data/slurm/``):

* ``sinfo --json`` -> ``{"nodes": [...]}`` (OpenAPI v0.0.38): per node ``cpus``,
  ``real_memory`` (MiB), ``alloc_cpus``, ``alloc_memory`` (MiB), ``gres``
  (``gpu:a100:4,gpu:t4:2``, optionally with ``(S:0-1)``), ``gres_used``
  (``gpu:a100:2(IDX:0-1),...``), ``state`` (lower-case base state: ``idle``, ``mixed``,
  ``allocated``, ``down``, ...) plus ``state_flags`` (``DRAIN``, ``NOT_RESPONDING``, ...),
  ``reason`` and ``partitions``. ``scontrol show node --json`` does not exist before Slurm 23.02
  (``scontrol: unrecognized option '--json'``), so :func:`parse_nodes` reads ``sinfo --json``.
* ``squeue --json`` -> ``{"jobs": [...]}``: every job the controller still holds, finished ones
  included for ``MinJobAge`` seconds (22.05 ignores squeue's filters with ``--json``). Times are
  Unix seconds (0 = not set), ``exit_code`` is the raw wait status (``768`` = exit 3; low 7 bits
  = signal), ``job_state`` is upper-case (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``,
  ``TIMEOUT``, ``CANCELLED``, ``OUT_OF_MEMORY``, ``NODE_FAIL``, ...), ``time_limit`` is minutes
  or null (unlimited).
* ``sacct --json`` needs slurmdbd: without it ``sacct`` answers "Slurm accounting storage is
  disabled" and ``sacct -c --json`` fails with "slurm not configured with slurmdbd". Finished
  jobs older than ``MinJobAge`` are therefore read from the ``jobcomp/filetxt`` log
  (:func:`parse_jobcomp_line`; ``sacct -c`` reads the same file as text). The jobcomp record
  has no comment, so :func:`parse_job_name` recovers the fedsched ids from the job name.

Naming: a Slurm GRES type (``a100``, ``a100_80g``, ``tesla_t4``) is mapped to a canonical card
model with :func:`fedsched.naming.canonical_card_model` (``a100`` -> ``nvidia-a100-40gb``, the
smallest A100 variant, per that function's rule; ``a100_80g`` -> ``nvidia-a100-80gb``).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone, tzinfo
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any, Mapping, Sequence

from fedsched.jobs import AttemptState
from fedsched.naming import canonical_card_model, check_name

# --------------------------------------------------------------------------- GRES


@dataclass(frozen=True, slots=True)
class Gres:
    """One generic-resource entry, e.g. ``gpu:a100:4``.

    Attributes:
        name: GRES name (``gpu``, ``mps``, ``shard``...).
        type: GRES type as Slurm spells it (``a100``), '' when untyped (``gpu:4``).
        count: number of units (GPUs for ``gpu``).
    """

    name: str
    type: str
    count: int


_GRES_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_]+)(?::(?P<type>[^:()]+))?:(?P<count>\d+)[KMGT]?(?:\(.*\))?")


def _split_top(spec: str) -> list[str]:
    """Split on commas outside parentheses (``gpu:a100:2(IDX:0,2),gpu:t4:0``)."""
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_gres(spec: str | None) -> tuple[Gres, ...]:
    """Parse a GRES list as ``sinfo``/``squeue`` print it.

    Accepts ``gpu:a100:4,gpu:t4:2``, socket suffixes ``gpu:a100:4(S:0-1)``, used-counts
    ``gpu:a100:2(IDX:0-1)``, untyped ``gpu:2``, a ``gres:`` prefix (squeue's ``tres_per_node``
    says ``gres:gpu:a100:2``) and the empty values ``''``, ``None`` and ``(null)``/``N/A``.

    Raises:
        ValueError: an entry has no count (a GRES Slurm would not print).
    """
    if not spec or spec in ("(null)", "N/A"):
        return ()
    out = []
    for entry in _split_top(spec):
        if entry.startswith("gres:"):
            entry = entry[len("gres:"):]
        m = _GRES_ENTRY.fullmatch(entry)
        if m is None:
            raise ValueError(f"not a GRES entry: {entry!r} (in {spec!r})")
        out.append(Gres(m["name"], m["type"] or "", int(m["count"])))
    return tuple(out)


# --------------------------------------------------------------------------- nodes


class NodeHealth(StrEnum):
    """What the scheduler needs from a Slurm node state."""

    HEALTHY = "healthy"   # idle, mixed or allocated, no drain/failure flag: may take work
    DRAINED = "drained"   # DRAIN flag (draining or drained): running jobs continue, no new ones
    DOWN = "down"         # down, not responding, failed, powered off or unknown


_DOWN_BASE = {"down", "error", "unknown", "future", "invalid", "fail"}
_DOWN_FLAGS = {"NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN",
               "POWERING_UP", "REBOOT_REQUESTED", "REBOOT_ISSUED", "INVALID_REG"}
_DRAIN_FLAGS = {"DRAIN", "MAINTENANCE"}


def node_health(state: str, flags: Sequence[str] = ()) -> NodeHealth:
    """Map a Slurm node base state and flags to :class:`NodeHealth`.

    Rule: a down-ish base state (``down``, ``error``, ``unknown``, ``future``) or a flag saying
    the node is not usable (``NOT_RESPONDING``, ``FAIL``, power or reboot in progress) ->
    DOWN; otherwise a ``DRAIN``/``MAINTENANCE`` flag -> DRAINED; otherwise (``idle``,
    ``mixed``, ``allocated``, ``completing``) -> HEALTHY. Also accepts scontrol's joined form
    ``IDLE+DRAIN``.
    """
    parts = [p for p in re.split(r"[+\s]", state or "") if p]
    base = (parts[0] if parts else "unknown").lower()
    all_flags = {f.upper() for f in (*parts[1:], *flags)}
    if base in _DOWN_BASE or all_flags & _DOWN_FLAGS:
        return NodeHealth.DOWN
    if base in ("drain", "drained", "draining") or all_flags & _DRAIN_FLAGS:
        return NodeHealth.DRAINED
    return NodeHealth.HEALTHY


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """GPUs of one type on a node.

    Attributes:
        slurm_type: the GRES type as Slurm spells it (what ``--gres=gpu:<type>:N`` needs).
        card_model: canonical fedsched card model (``fedsched.naming``).
        count: GPUs configured.
        used: GPUs allocated to jobs now.
    """

    slurm_type: str
    card_model: str
    count: int
    used: int = 0


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """A node as ``sinfo --json`` reports it.

    Attributes:
        name: Slurm node name.
        cpus: CPUs configured (count).
        memory_mib: configured memory (``RealMemory``), MiB.
        alloc_cpus: CPUs allocated to jobs now.
        alloc_memory_mib: memory allocated to jobs now, MiB.
        gpus: GPU GRES per type.
        state: base state, lower case (``idle``, ``mixed``...).
        flags: state flags, upper case (``DRAIN``...).
        health: :func:`node_health` of state and flags.
        reason: the admin's or Slurm's reason for a drain/down, '' when none.
        partitions: partitions the node belongs to.
    """

    name: str
    cpus: int
    memory_mib: int
    alloc_cpus: int
    alloc_memory_mib: int
    gpus: tuple[NodeGpus, ...]
    state: str
    flags: tuple[str, ...]
    health: NodeHealth
    reason: str
    partitions: tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        """All GPUs configured on the node, every type."""
        return sum(g.count for g in self.gpus)


def _gpu_by_type(entries: Sequence[Gres]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in entries:
        if g.name == "gpu":
            out[g.type] = out.get(g.type, 0) + g.count
    return out


def parse_node(raw: Mapping[str, Any]) -> SlurmNode:
    """One node object of ``sinfo --json`` -> :class:`SlurmNode`.

    An untyped GPU GRES (``gpu:2``) maps to the card model ``canonical_card_model("gpu")``
    (a minted ``unlisted-`` name): Slurm does not say which card it is.

    Raises:
        KeyError / ValueError: the object lacks ``name`` or has an unparseable GRES.
    """
    configured = _gpu_by_type(parse_gres(raw.get("gres")))
    used = _gpu_by_type(parse_gres(raw.get("gres_used")))
    gpus = tuple(
        NodeGpus(slurm_type=t, card_model=canonical_card_model(t or "gpu"), count=n, used=used.get(t, 0))
        for t, n in sorted(configured.items())
    )
    state = str(raw.get("state") or "unknown")
    flags = tuple(str(f).upper() for f in raw.get("state_flags") or ())
    return SlurmNode(
        name=str(raw["name"]),
        cpus=int(raw.get("cpus") or 0),
        memory_mib=int(raw.get("real_memory") or 0),
        alloc_cpus=int(raw.get("alloc_cpus") or 0),
        alloc_memory_mib=int(raw.get("alloc_memory") or 0),
        gpus=gpus,
        state=state.lower(),
        flags=flags,
        health=node_health(state, flags),
        reason=str(raw.get("reason") or ""),
        partitions=tuple(str(p) for p in raw.get("partitions") or ()),
    )


def parse_nodes(doc: Mapping[str, Any]) -> list[SlurmNode]:
    """The ``sinfo --json`` document -> nodes, in Slurm's order.

    Raises:
        ValueError: the document reports errors (``"errors": [...]``) or has no ``nodes``.
    """
    _raise_errors(doc, "sinfo")
    if "nodes" not in doc:
        raise ValueError("sinfo --json output has no 'nodes'")
    return [parse_node(n) for n in doc["nodes"]]


def _raise_errors(doc: Mapping[str, Any], what: str) -> None:
    errors = doc.get("errors") or []
    if errors:
        text = "; ".join(str(e.get("error", e)) if isinstance(e, Mapping) else str(e) for e in errors)
        raise ValueError(f"{what} --json reported errors: {text}")


# --------------------------------------------------------------------------- attempt tags

#: Prefix of the ``--comment`` and job name fedsched gives its Slurm jobs.
TAG_PREFIX = "fedsched"


@dataclass(frozen=True, slots=True, order=True)
class AttemptTag:
    """Which fedsched attempt a Slurm job runs: job id, attempt number, shard index.

    Carried as ``--comment=fedsched:<job>:<attempt>:<shard>`` and in the job name
    ``fedsched-<job>-a<attempt>-s<shard>`` (the jobcomp log keeps names, not comments), so a
    relaunch can find and adopt an existing Slurm job instead of submitting a second one.
    """

    job_id: str
    attempt: int
    shard: int = 0

    def __post_init__(self) -> None:
        check_name("job", self.job_id, "job_id")
        if self.attempt < 0 or self.shard < 0:
            raise ValueError(f"attempt and shard must be >= 0, got {self.attempt}, {self.shard}")

    @property
    def comment(self) -> str:
        """``fedsched:<job>:<attempt>:<shard>``."""
        return f"{TAG_PREFIX}:{self.job_id}:{self.attempt}:{self.shard}"

    @property
    def job_name(self) -> str:
        """``fedsched-<job>-a<attempt>-s<shard>``."""
        return f"{TAG_PREFIX}-{self.job_id}-a{self.attempt}-s{self.shard}"


_COMMENT = re.compile(rf"{TAG_PREFIX}:([a-z0-9-]+):(\d+):(\d+)(?: [a-z]+=[a-z0-9-]*)*")
_COMMENT_LABEL = re.compile(r" ([a-z]+)=([a-z0-9-]*)")
_NAME = re.compile(rf"{TAG_PREFIX}-([a-z0-9-]+)-a(\d+)-s(\d+)")


def parse_comment(comment: str | None) -> AttemptTag | None:
    """``fedsched:<job>:<attempt>:<shard>`` (optionally followed by `` key=value`` labels,
    :func:`comment_labels`) -> tag; None for any other comment."""
    m = _COMMENT.fullmatch((comment or "").strip())
    return _tag(m)


def comment_labels(comment: str | None) -> dict[str, str]:
    """The `` key=value`` labels after the tag of a fedsched comment (``fedsched:j:1:0
    tenant=search project=train`` -> ``{"tenant": "search", "project": "train"}``); {} for a
    comment that is not fedsched's. Keys are lower-case words, values naming-checked names."""
    text = (comment or "").strip()
    if _COMMENT.fullmatch(text) is None:
        return {}
    return dict(_COMMENT_LABEL.findall(text))


def parse_job_name(name: str | None) -> AttemptTag | None:
    """``fedsched-<job>-a<attempt>-s<shard>`` -> tag; None for any other name."""
    m = _NAME.fullmatch((name or "").strip())
    return _tag(m)


def _tag(m: re.Match[str] | None) -> AttemptTag | None:
    if m is None:
        return None
    try:
        return AttemptTag(m[1], int(m[2]), int(m[3]))
    except (ValueError, TypeError):
        return None


# --------------------------------------------------------------------------- jobs

#: Slurm job states that are final (``squeue`` man page, JOB STATE CODES).
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
})
_RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
                             "STAGE_OUT", "RESIZING", "CONFIGURING"})


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """A Slurm job record (from ``squeue --json`` or the jobcomp log).

    Attributes:
        job_id: Slurm job id.
        name: job name.
        comment: ``--comment`` ('' when none or unknown, e.g. from the jobcomp log).
        state: upper-case base job state (``RUNNING``, ``COMPLETED``, ``TIMEOUT``...).
        reason: Slurm's state reason (``None``, ``Resources``, ``NonZeroExitCode``...).
        exit_code: the process exit status 0-255, None while unknown, when killed by a signal or
            when the job never ran (Slurm then reports 1 for a refused job, which is no status).
        signal: the signal that ended the batch script, None if it exited.
        submit_time / start_time / end_time: aware UTC datetimes, None while not set. For a
            running job Slurm's ``end_time`` is the expected end (start + time limit).
        nodes: node names allocated ('' list while pending).
        time_limit_s: time limit in seconds, None when unlimited.
        tag: the fedsched attempt, from the comment or else the name; None for foreign jobs.
    """

    job_id: int
    name: str
    comment: str
    state: str
    reason: str
    exit_code: int | None
    signal: int | None
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    nodes: tuple[str, ...]
    time_limit_s: int | None
    tag: AttemptTag | None = field(default=None)

    @property
    def finished(self) -> bool:
        """True once the state is final (:data:`FINAL_STATES`)."""
        return self.state in FINAL_STATES

    @property
    def started(self) -> bool:
        """True once the job has run: running, or finished with nodes allocated."""
        return self.state in _RUNNING_STATES or (self.finished and bool(self.nodes))

    @property
    def elapsed_s(self) -> float | None:
        """Run time in seconds (end - start) of a finished job that started, else None."""
        if not (self.finished and self.started and self.start_time and self.end_time):
            return None
        return (self.end_time - self.start_time).total_seconds()


def utc_from_epoch(value: Any) -> datetime | None:
    """Slurm's Unix seconds -> aware UTC datetime; 0, None and negatives mean 'not set'."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, Mapping):  # newer OpenAPI: {"set": bool, "infinite": bool, "number": n}
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    seconds = int(value or 0)
    return datetime.fromtimestamp(seconds, tz=timezone.utc) if seconds > 0 else None


def split_wait_status(raw: int | None) -> tuple[int | None, int | None]:
    """Slurm's raw wait status -> (exit code, signal), exactly one of them set.

    ``squeue --json``'s ``exit_code`` is the ``waitpid`` status: exit code in bits 8-15, the
    terminating signal in bits 0-6 (``768`` -> (3, None); ``9`` -> (None, 9)).
    """
    if raw is None:
        return None, None
    raw = int(raw)
    sig = raw & 0x7F
    if sig:
        return None, sig
    return (raw >> 8) & 0xFF, None


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return int(value)


def _nodes(value: Any) -> tuple[str, ...]:
    text = str(value or "").strip()
    if not text or text == "(null)" or text == "None assigned":
        return ()
    return tuple(expand_hostlist(text))


def parse_job(raw: Mapping[str, Any]) -> SlurmJob:
    """One job object of ``squeue --json`` -> :class:`SlurmJob`.

    Raises:
        KeyError / ValueError: the object lacks ``job_id`` or has non-numeric times.
    """
    comment = str(raw.get("comment") or "")
    name = str(raw.get("name") or "")
    state = raw.get("job_state") or "UNKNOWN"
    if isinstance(state, list):  # newer OpenAPI: a list of flags, base state first
        state = state[0] if state else "UNKNOWN"
    state = str(state).split("+")[0].upper()
    pending = state == "PENDING"
    exit_code, sig = split_wait_status(None if pending else _int_or_none(raw.get("exit_code")))
    limit = _int_or_none(raw.get("time_limit"))
    nodes = _nodes(raw.get("nodes"))
    if not nodes:  # never ran: Slurm's exit code (1 for a refused job) is not a process status
        exit_code = sig = None
    return SlurmJob(
        job_id=int(raw["job_id"]),
        name=name,
        comment=comment,
        state=state,
        reason=str(raw.get("state_reason") or "None"),
        exit_code=exit_code if state in FINAL_STATES else None,
        signal=sig if state in FINAL_STATES else None,
        submit_time=utc_from_epoch(raw.get("submit_time")),
        start_time=None if pending else utc_from_epoch(raw.get("start_time")),
        end_time=None if pending else utc_from_epoch(raw.get("end_time")),
        nodes=nodes,
        time_limit_s=None if limit is None else limit * 60,
        tag=parse_comment(comment) or parse_job_name(name),
    )


def parse_jobs(doc: Mapping[str, Any]) -> list[SlurmJob]:
    """The ``squeue --json`` document -> jobs, in Slurm's order.

    Raises:
        ValueError: the document reports errors or has no ``jobs``.
    """
    _raise_errors(doc, "squeue")
    if "jobs" not in doc:
        raise ValueError("squeue --json output has no 'jobs'")
    return [parse_job(j) for j in doc["jobs"]]


def jobs_by_tag(jobs: Sequence[SlurmJob]) -> dict[AttemptTag, SlurmJob]:
    """fedsched's jobs among ``jobs``, one per attempt tag: the newest (highest Slurm job id).

    What a relaunch checks before calling sbatch: a tag already present means the attempt was
    submitted (adopt that Slurm job, do not submit a second one). Foreign jobs are left out.
    """
    out: dict[AttemptTag, SlurmJob] = {}
    for job in jobs:
        if job.tag is not None and (job.tag not in out or job.job_id > out[job.tag].job_id):
            out[job.tag] = job
    return out


_JOBCOMP_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_jobcomp_line(line: str, *, tz: tzinfo = timezone.utc) -> SlurmJob:
    """One line of the ``jobcomp/filetxt`` log -> :class:`SlurmJob`.

    The log is ``Key=value`` pairs separated by spaces, times as ``YYYY-MM-DDTHH:MM:SS`` in
    slurmctld's local time zone (``tz``; UTC on our hosts), ``ExitCode=<code>:<signal>``,
    ``TimeLimit`` as ``UNLIMITED`` or minutes. It has no comment: the attempt tag comes from the
    job name. A job name containing spaces is not recoverable from this format (fedsched's
    names have none).

    Raises:
        ValueError: the line has no ``JobId``.
    """
    fields = dict(_JOBCOMP_FIELD.findall(line))
    if "JobId" not in fields:
        raise ValueError(f"not a jobcomp record: {line[:120]!r}")

    def when(key: str) -> datetime | None:
        text = fields.get(key, "")
        if not text or text in ("Unknown", "None"):
            return None
        return datetime.fromisoformat(text).replace(tzinfo=tz).astimezone(timezone.utc)

    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    signal = int(sig or 0) or None
    limit = fields.get("TimeLimit", "UNLIMITED")
    nodes = _nodes(fields.get("NodeList", ""))
    name = fields.get("Name", "")
    return SlurmJob(
        job_id=int(fields["JobId"]),
        name=name,
        comment="",
        state=fields.get("JobState", "UNKNOWN").split("+")[0].upper(),
        reason="None",
        exit_code=None if signal or not nodes else int(code or 0),
        signal=signal if nodes else None,
        submit_time=when("SubmitTime"),
        start_time=when("StartTime"),
        end_time=when("EndTime"),
        nodes=nodes,
        time_limit_s=None if not limit.isdigit() else int(limit) * 60,
        tag=parse_job_name(name),
    )


_RANGE = re.compile(r"^(?P<prefix>[^\[]*)\[(?P<body>[^\]]+)\](?P<suffix>.*)$")


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist (``n[1-3,5],gpu7``) into names (one bracket group per name).

    Raises:
        ValueError: a range is malformed.
    """
    out: list[str] = []
    for part in _split_top(text.replace("[", "(").replace("]", ")")):
        part = part.replace("(", "[").replace(")", "]")
        m = _RANGE.match(part)
        if m is None:
            out.append(part)
            continue
        for item in m["body"].split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad hostlist range {item!r} in {text!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{m['prefix']}{i:0{width}d}{m['suffix']}")
    return out


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a Slurm job means for its fedsched attempt.

    Attributes:
        state: the attempt state (``placed`` while pending, ``running``, or an ended state).
        reason: a countable reason: '' for success/running, else ``exit_code``, ``timeout``,
            ``out_of_memory``, ``node_fail``, ``boot_fail``, ``deadline``, ``preempted``,
            ``cancelled``, ``cancelled_externally``, ``not_started:<Slurm reason>``.
        exit_code: the workload's exit code when it exited, else None (always None for a
            cancelled job: Slurm reports 0 for a batch script it killed).
    """

    state: AttemptState
    reason: str = ""
    exit_code: int | None = None


#: end states that map to one outcome and reason (the rest of the rule is in :func:`outcome`)
_ENDED_STATES: dict[str, tuple[AttemptState, str]] = {
    "TIMEOUT": (AttemptState.FAILED, "timeout"),
    "OUT_OF_MEMORY": (AttemptState.FAILED, "out_of_memory"),
    "DEADLINE": (AttemptState.FAILED, "deadline"),
    "NODE_FAIL": (AttemptState.LOST, "node_fail"),
    "BOOT_FAIL": (AttemptState.LOST, "boot_fail"),
    "PREEMPTED": (AttemptState.LOST, "preempted"),
}


def outcome(job: SlurmJob, *, stop_requested: bool = False) -> Outcome:
    """Map a Slurm job to its attempt's :class:`Outcome`.

    Rule (job states from the ``squeue`` man page):

    ==================  =========================================================
    PENDING             placed
    RUNNING, ...        running (also COMPLETING, SUSPENDED, CONFIGURING)
    COMPLETED           succeeded (exit code 0)
    FAILED              failed, ``exit_code`` (or ``not_started:<reason>`` when it
                        never ran, e.g. BadConstraints)
    TIMEOUT             failed, ``timeout`` (ran past ``--time``)
    OUT_OF_MEMORY       failed, ``out_of_memory``
    DEADLINE            failed, ``deadline``
    NODE_FAIL           lost, ``node_fail`` (the infrastructure's fault: retry)
    BOOT_FAIL           lost, ``boot_fail``
    PREEMPTED           lost, ``preempted`` (by Slurm's own preemption)
    CANCELLED           cancelled when fedsched asked (``stop_requested``), else
                        lost, ``cancelled_externally`` (someone ran scancel)
    ==================  =========================================================
    """
    s = job.state
    if s == "PENDING" or s in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"):
        return Outcome(AttemptState.PLACED)
    if s in _RUNNING_STATES:
        return Outcome(AttemptState.RUNNING)
    if s == "COMPLETED":
        return Outcome(AttemptState.SUCCEEDED, "", job.exit_code if job.exit_code is not None else 0)
    if s == "FAILED":
        if not job.started:
            return Outcome(AttemptState.FAILED, f"not_started:{job.reason}", job.exit_code)
        return Outcome(AttemptState.FAILED, "exit_code", job.exit_code)
    ended = _ENDED_STATES.get(s)
    if ended is not None:
        return Outcome(ended[0], ended[1], job.exit_code)
    if s == "CANCELLED":
        if stop_requested:
            return Outcome(AttemptState.CANCELLED, "cancelled")
        return Outcome(AttemptState.LOST, "cancelled_externally")
    return Outcome(AttemptState.FAILED, f"slurm_state:{s.lower()}", job.exit_code)


# --------------------------------------------------------------------------- sbatch

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class SbatchRequest:
    """What one attempt (or one shard of it) asks of Slurm.

    Attributes:
        tag: the fedsched attempt (job id, attempt, shard).
        command: argv (joined with shell quoting) or a shell command line.
        gpu_type: the GRES type as the cluster spells it (``a100``; from :class:`NodeGpus`
            ``slurm_type``), None for any GPU type.
        gpus_per_node: GPUs per node (count, not milli-GPU); 0 for none.
        nodes: nodes of a gang (>= 1).
        tasks_per_node: tasks (ranks) per node (>= 1).
        cpus_per_task: CPUs per task, None for Slurm's default (1).
        memory_mib_per_node: memory per node in MiB, None for Slurm's default.
        partition: Slurm partition, None for the cluster's default.
        estimate_s: the job's runtime estimate in seconds, None for no ``--time``.
        time_margin_ratio: extra time as a fraction of the estimate (0.1 = +10%).
        time_margin_s: extra seconds on top of the ratio.
        output_dir: directory for the per-attempt output file (stdout and stderr together).
        env: workload environment, exported to the job by name (values never pass through
            sbatch's comma-separated ``--export`` syntax, so any value is safe).
        workdir: the job's working directory, None for sbatch's (the submitter's cwd).
        nodelist: the nodes the job must run on (``--nodelist``), empty for any.
        labels: extra `` key=value`` pairs appended to the ``--comment`` (keys lower-case
            words, values names: ``tenant``, ``project``), read back by :func:`comment_labels`.
        account / qos: ``--account`` / ``--qos``, None for the user's defaults.
    """

    tag: AttemptTag
    command: Sequence[str] | str
    output_dir: str
    gpu_type: str | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int | None = None
    memory_mib_per_node: int | None = None
    partition: str | None = None
    estimate_s: float | None = None
    time_margin_ratio: float = 0.0
    time_margin_s: float = 0.0
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    nodelist: Sequence[str] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    account: str | None = None
    qos: str | None = None


@dataclass(frozen=True, slots=True)
class SbatchCall:
    """How to run sbatch for a request: ``argv`` (no shell), plus ``env``, the variables to
    add to sbatch's process environment (the workload's; ``--export`` names exactly them plus
    ``PATH``, so nothing else of the caller's environment reaches the job)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    output_path: str


def time_limit_minutes(estimate_s: float, ratio: float = 0.0, margin_s: float = 0.0) -> int:
    """``--time`` in whole minutes: ceil((estimate * (1 + ratio) + margin) / 60), at least 1.

    Slurm's time limits have minute granularity (``--time=0:05`` becomes 1 minute).

    Raises:
        ValueError: a negative estimate, ratio or margin.
    """
    if estimate_s < 0 or ratio < 0 or margin_s < 0:
        raise ValueError(f"estimate, ratio and margin must be >= 0, got {estimate_s}, {ratio}, {margin_s}")
    return max(1, math.ceil((estimate_s * (1.0 + ratio) + margin_s) / 60.0))


def output_path(output_dir: str, tag: AttemptTag) -> str:
    """The per-attempt output file: ``<dir>/<job>/a<attempt>-s<shard>.out``."""
    return str(PurePosixPath(output_dir) / tag.job_id / f"a{tag.attempt}-s{tag.shard}.out")


def sbatch_call(req: SbatchRequest) -> SbatchCall:
    """Build the ``sbatch`` argument list for one attempt (pure; nothing is run).

    The batch script runs the command once on the first node; a gang (``nodes`` x
    ``tasks_per_node`` > 1) wraps it in ``srun --kill-on-bad-exit=1 --label`` (each output line prefixed ``<rank>: ``) so every task runs it
    (a command line in its own ``/bin/sh -c``), each reading its rank from ``SLURM_PROCID``
    and the world size from ``SLURM_NTASKS`` (``SLURM_NODEID`` = node index, ``SLURM_LOCALID``
    = rank on the node). ``--no-requeue``: a node failure ends the attempt (fedsched decides on
    a new one) instead of Slurm rerunning it under the same job id. The caller creates the output file's directory.

    Raises:
        ValueError: counts out of range, an environment name that is not an identifier, or an
            empty command.
    """
    if req.nodes < 1 or req.tasks_per_node < 1 or req.gpus_per_node < 0:
        raise ValueError(f"nodes and tasks_per_node must be >= 1 and gpus >= 0, got "
                         f"{req.nodes}, {req.tasks_per_node}, {req.gpus_per_node}")
    if req.cpus_per_task is not None and req.cpus_per_task < 1:
        raise ValueError(f"cpus_per_task must be >= 1, got {req.cpus_per_task}")
    bad_labels = [k for k, v in req.labels.items()
                  if not re.fullmatch(r"[a-z]+", k) or not re.fullmatch(r"[a-z0-9-]*", v)]
    if bad_labels:
        raise ValueError(f"comment labels must be lower-case words = names: {bad_labels}")
    bad = [k for k in req.env if not _ENV_NAME.fullmatch(k) or k == "PATH" or k.startswith("SLURM_")]
    if bad:
        raise ValueError(f"environment names must be identifiers other than PATH and SLURM_*: {bad}")
    if req.gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", req.gpu_type):
        raise ValueError(f"not a GRES type: {req.gpu_type!r}")
    command = req.command if isinstance(req.command, str) else shlex.join(req.command)
    if not command.strip():
        raise ValueError("empty command")
    if req.nodes * req.tasks_per_node > 1:
        # A command line runs in a shell per task, so $SLURM_PROCID is each task's own.
        inner = shlex.join(["/bin/sh", "-c", command]) if isinstance(req.command, str) else command
        command = f"srun --kill-on-bad-exit=1 --label {inner}"
    out = output_path(req.output_dir, req.tag)
    argv = [
        "sbatch", "--parsable", "--no-requeue",
        f"--job-name={req.tag.job_name}",
        f"--comment={req.tag.comment}" + "".join(f" {k}={v}" for k, v in sorted(req.labels.items())),
        f"--output={out}",
        f"--nodes={req.nodes}",
        f"--ntasks-per-node={req.tasks_per_node}",
    ]
    if req.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={req.cpus_per_task}")
    if req.memory_mib_per_node is not None:
        argv.append(f"--mem={int(req.memory_mib_per_node)}M")
    if req.gpus_per_node:
        kind = f"gpu:{req.gpu_type}" if req.gpu_type else "gpu"
        argv.append(f"--gres={kind}:{req.gpus_per_node}")
    if req.partition:
        argv.append(f"--partition={req.partition}")
    if req.estimate_s is not None:
        argv.append(f"--time={time_limit_minutes(req.estimate_s, req.time_margin_ratio, req.time_margin_s)}")
    if req.workdir:
        argv.append(f"--chdir={req.workdir}")
    if req.nodelist:
        argv.append("--nodelist=" + ",".join(dict.fromkeys(req.nodelist)))
    if req.account:
        argv.append(f"--account={req.account}")
    if req.qos:
        argv.append(f"--qos={req.qos}")
    argv.append("--export=" + ",".join(["PATH", *sorted(req.env)]))
    argv.append(f"--wrap={command}")
    return SbatchCall(argv=tuple(argv), env=dict(req.env), output_path=out)


def parse_sbatch_output(stdout: str) -> int:
    """``sbatch --parsable`` output (``<jobid>`` or ``<jobid>;<cluster>``) -> job id.

    Raises:
        ValueError: no job id in the output.
    """
    text = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    head = text.split(";", 1)[0].strip()
    if not head.isdigit():
        raise ValueError(f"sbatch printed no job id: {stdout[:200]!r}")
    return int(head)
