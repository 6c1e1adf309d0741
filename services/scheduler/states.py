"""The scheduler's states of a shard and its attempts, and the reasons it stops an attempt.

str-valued enums: the values are what logs, the status endpoint and events have always carried.
"""

from __future__ import annotations

from enum import StrEnum


class ShardState(StrEnum):
    """Where a shard is in the scheduler's book (str-valued: logs and status JSON unchanged)."""

    QUEUED = "queued"      # waiting for a placement
    PLACED = "placed"      # placement published, its agent has not reported a start
    RUNNING = "running"    # its agent reported ``job.started`` for the current attempt
    STOPPING = "stopping"  # preempted: stop order sent, resources already given up, awaiting ``job.stopped``
    DONE = "done"          # ended for good (see :class:`Outcome`)


class Outcome(StrEnum):
    """How a done shard ended ("" while it is not done)."""

    NONE = ""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StopReason(StrEnum):
    """Why the scheduler stops an attempt (``JobStop.reason``; also ``JobStatus.reason`` of the
    ``job.stopped`` it publishes for an attempt on a lost cluster)."""

    CANCELLED = "cancelled"
    PREEMPTED = "preempted"        # for a higher-priority job
    RECLAIMED = "reclaimed"        # placed, never started within ``reclaim_after_s``
    CLUSTER_LOST = "cluster_lost"  # its cluster went silent for longer than ``stale_after_s``


#: States in which a shard holds resources on a cluster (an attempt is placed or running).
ACTIVE = (ShardState.PLACED, ShardState.RUNNING)
