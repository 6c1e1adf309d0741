"""What-if requests between admission and the scheduler (core NATS request/reply, no stream).

``fedsched submit --dry-run`` -> gRPC ``SubmitJob`` with ``dry_run`` -> admission validates and
governs the spec as a submit would, then publishes a :class:`WhatIfRequest` on
``<p>.svc.scheduler.whatif`` (:func:`subject`) with a reply inbox -> the scheduler runs its pure
core's ``decide`` for that one job (one queued entry per shard) against its current view,
commits nothing, and answers with one :class:`WhatIfReply`: per shard, the decision in the
shape ``ExplainJob`` returns (outcome, summary, every cluster's verdict and score terms).

No answer within the timeout (no scheduler running, or a busy one) is not an error for the
dry run: :func:`request_what_if` returns None and the dry run's ``what_if`` stays unset.
"""

from __future__ import annotations

import logging
from typing import Any

import nats.errors
from pydantic import BaseModel, ConfigDict, Field

from fedsched.jobs import JobSpec

log = logging.getLogger(__name__)

#: The job id a what-if decision is made for (never a real job: real ids are ``j-`` + 20 hex).
WHAT_IF_JOB_ID = "what-if"


def subject(prefix: str) -> str:
    """The scheduler's what-if endpoint for the federation whose subjects start with ``prefix``."""
    return f"{prefix}.svc.scheduler.whatif"


class WhatIfRequest(BaseModel):
    """What admission asks: the admitted spec (canonical, governed) and when it would be
    submitted (business seconds since the Unix epoch: the age the queue order sees)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: JobSpec
    submitted_at: float


class ShardWhatIf(BaseModel):
    """The scheduler's decision about one shard, as ``ExplainJob``'s ``ShardDecision``.

    Attributes:
        outcome: ``placed`` (it would be placed now) or ``pending``.
        summary: why there / why it would wait.
        evaluations: one dict per cluster considered: ``cluster``, ``region``, ``passed``,
            ``reason``, ``detail``, ``scores`` (terms 0..1), ``total`` (None unless it fits).
        decided_at: business time of the decision (seconds since the Unix epoch).
        needs_approval: the placement is cross-region and the tenant's mode is ``approval``.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    shard: int = Field(ge=0)
    outcome: str
    summary: str = ""
    cluster: str = ""
    region: str = ""
    queue: str = ""
    counterfactual: str = ""
    policy_version: str = ""
    fits_empty: bool = True
    reserved_cluster: str = ""
    decided_at: float = 0.0
    evaluations: tuple[dict[str, Any], ...] = ()
    needs_approval: bool = False  #: placed abroad for a tenant whose mode is ``approval``: a submit would wait for an approver


class WhatIfReply(BaseModel):
    """The scheduler's answer: the decisions, or ``error`` (the request was not a job spec)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    decisions: tuple[ShardWhatIf, ...] = ()
    error: str = ""


async def request_what_if(nc, prefix: str, request: WhatIfRequest, *, timeout_s: float = 1.0) -> WhatIfReply | None:
    """Ask the scheduler; None when none answers within ``timeout_s`` seconds or the answer is
    not a :class:`WhatIfReply` (logged), or the request fails on the bus (any
    :class:`nats.errors.Error`, e.g. the connection closed or draining: logged), so a dry run
    never fails for want of a scheduler."""
    try:
        msg = await nc.request(subject(prefix), request.model_dump_json().encode(), timeout=timeout_s)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
        return None
    except nats.errors.Error as e:
        log.warning("what-if: the request failed on the bus: %r", e)
        return None
    try:
        return WhatIfReply.model_validate_json(msg.data)
    except ValueError as e:
        log.warning("what-if: the scheduler's answer is not a WhatIfReply: %s", e)
        return None
