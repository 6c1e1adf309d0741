"""Log requests between admission and agents (NATS request/reply, no stream).

``fedsched logs JOB`` -> gRPC ``JobService.GetJobLogs`` -> admission publishes a
:class:`LogRequest` on ``<p>.logs.<region>.<cluster>`` (:meth:`fedsched.events.Subjects.logs`)
with a reply inbox -> the cluster's agent answers with one or more :class:`LogReply` messages on
that inbox, the last one with ``eof``. Each reply's ``data`` is at most ``max_chunk_bytes`` of
UTF-8 (whole lines, ``\\n``-terminated, except a single line longer than the bound, which is cut).

Errors travel in the reply: ``code`` ``not_found`` (the agent does not know the attempt or the
worker), ``no_logs`` (the attempt ran there but its backend keeps no logs: the trace backend) or
``unavailable`` (its backend could not be read); admission maps them to gRPC NOT_FOUND /
FAILED_PRECONDITION / UNAVAILABLE, and a request no agent answers within its timeout to UNAVAILABLE.
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from fedsched.errors import UnavailableError

#: Upper bound of one reply's ``data`` (bytes of UTF-8); well below NATS' default 1 MiB payload.
MAX_CHUNK_BYTES = 64 * 1024


class LogRequest(BaseModel):
    """What admission asks an agent for.

    Attributes:
        job_id, attempt, shard: the attempt (attempt >= 1).
        worker: one gang member (0-based) or None for every worker.
        follow: keep sending until the attempt ends.
        max_chunk_bytes: bound of each reply's ``data``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    shard: int = Field(default=0, ge=0)
    worker: int | None = Field(default=None, ge=0)
    follow: bool = False
    max_chunk_bytes: int = Field(default=MAX_CHUNK_BYTES, ge=256, le=MAX_CHUNK_BYTES)


class LogReply(BaseModel):
    """One answer of an agent (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    data: str = ""
    eof: bool = False
    code: Literal["", "not_found", "no_logs", "unavailable"] = ""
    error: str = ""


def chunks(lines: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Join ``lines`` (without newlines) into ``\\n``-terminated chunks of at most ``max_bytes``
    UTF-8 bytes; a line longer than the bound is cut at a character boundary."""
    buf: list[str] = []
    size = 0
    for line in lines:
        raw = (line + "\n").encode()
        if len(raw) > max_bytes:
            raw = raw[:max_bytes - 1].decode(errors="ignore").encode() + b"\n"
        if size + len(raw) > max_bytes and buf:
            yield "".join(buf)
            buf, size = [], 0
        buf.append(raw.decode())
        size += len(raw)
    if buf:
        yield "".join(buf)


async def request_logs(nc, subject: str, request: LogRequest, *, timeout_s: float = 5.0
                       ) -> AsyncIterator[LogReply]:
    """Ask the agent listening on ``subject`` for logs over NATS request/reply; yields its
    replies up to the one with ``eof`` (included).

    Args:
        nc: a connected ``nats.aio.client.Client``.
        subject: :meth:`fedsched.events.Subjects.logs` of the attempt's cluster.
        request: what to ask.
        timeout_s: wall seconds to wait for the first reply, and between replies unless
            ``request.follow`` (a followed attempt may be quiet for long).

    Raises:
        UnavailableError: no agent answered within ``timeout_s``, no agent listens, or its reply
            is unreadable.
    """
    import nats.errors

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, request.model_dump_json().encode(), reply=inbox)
        first = True
        while True:
            wait = timeout_s if first or not request.follow else None
            try:
                msg = await sub.next_msg(timeout=wait)  # None: wait as long as the client does
            except nats.errors.TimeoutError as e:
                raise UnavailableError(f"the agent on {subject} did not answer within {timeout_s:g} s") from e
            first = False
            if not msg.data:  # NATS "no responders" (status 503): replies of agents are never empty
                raise UnavailableError(f"no agent listens on {subject}")
            try:
                reply = LogReply.model_validate_json(msg.data)
            except ValueError as e:
                raise UnavailableError(f"the agent on {subject} answered with an unreadable reply") from e
            yield reply
            if reply.eof:
                return
    finally:
        await sub.unsubscribe()
