"""The scheduler's states of a shard and its attempts, and the reasons it stops an attempt
(:class:`StopReason`, defined in :mod:`fedsched.jobs` because admission's job view reads it too).

str-valued enums: the values are what logs, the status endpoint and events have always carried.
"""

from __future__ import annotations

from enum import StrEnum

from fedsched.jobs import StopReason  # noqa: F401 - re-exported: the scheduler's stop reasons are shared


class ShardState(StrEnum):
    """Where a shard is in the scheduler's book (str-valued: logs and status JSON unchanged)."""

    QUEUED = "queued"      # waiting for a placement
    HELD = "held"          # held by a caller (``job.held``): not in the queue until ``job.released``
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


#: States in which a shard holds resources on a cluster (an attempt is placed or running).
ACTIVE = (ShardState.PLACED, ShardState.RUNNING)
