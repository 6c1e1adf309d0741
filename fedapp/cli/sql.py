"""``fedsched sql``: run a read-only query against the store, wherever it is.

* ``--clickhouse-url``: the server, directly.
* ``--nats-url``: ask the running system (the process holding the embedded store answers on
  ``<p>.svc.store.query``).
* otherwise, while a running system holds the embedded store in ``--data-dir`` (chDB opens a
  data path in one process only): ask that system, found through the data dir
  (:func:`~fedapp.client.running_store`: its NATS, with the data dir's operator credentials and
  admin token), with the same read-only handle and limits;
* else: open the embedded store in ``--data-dir``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fedapp.client import resolve_token, running_store, with_local_credentials
from fedsched.errors import AuthError, PermissionDeniedError, UnavailableError, ValidationError
from fedsched.store import MAX_QUERY_ROWS, open_store


def redact(url: str) -> str:
    """:func:`fedsched.bus.redact`, imported on use: ``fedsched.bus`` loads nats.py and aiohttp
    (~0.3 s of every CLI start), which most commands never need."""
    from fedsched.bus import redact as _redact

    return _redact(url)


def _check(query: str) -> str:
    q = query.strip().rstrip(";")
    if not q:
        raise ValidationError("query", "empty")
    return q


def run_sql(query: str, *, data_dir: Path, nats_url: str = "", clickhouse_url: str = "",
            prefix: str = "fed", inbox_prefix: str = "", token: str | None = None,
            ) -> tuple[list[str], list[list], int, list[str]]:
    """Columns, rows (at most :data:`~fedsched.store.MAX_QUERY_ROWS`), the full row count and the
    columns' ClickHouse type names (empty: not known, e.g. an older running system) of a
    read-only query (on a handle of its own, :meth:`~fedsched.store.Store.reader`: ClickHouse's
    parser checks it is one read statement without functions or table functions that reach the
    host's files, programs or network; the engine refuses writes, DDL and settings changes and
    stops it after 55 s or 1 GiB). Through ``nats_url``, or while a running system holds the
    embedded store of ``data_dir`` (:func:`running_system`), that system answers on the same
    read-only handle, for an admin's ``token`` only.

    Raises:
        AuthError / PermissionDeniedError: (through NATS) no token, an unknown one, or not an admin's.
        ValidationError: empty query, or ClickHouse rejected it (the message says why).
        UnavailableError: the store or the running system cannot be reached, or did not answer in time.
    """
    q = _check(query)
    if nats_url:
        return asyncio.run(_ask(q, nats_url, prefix, inbox_prefix, token))
    running = None if clickhouse_url else running_system(data_dir, token)
    if running is not None:
        url, prefix, token = running
        return asyncio.run(_ask(q, url, prefix, inbox_prefix, token))
    if not clickhouse_url and not (Path(data_dir) / "clickhouse").exists():
        raise UnavailableError(f"no embedded store in {data_dir}/clickhouse; run `fedsched up --data-dir {data_dir}` "
                               f"or pass --clickhouse-url")
    store = open_store(data_dir=Path(data_dir), url=clickhouse_url, migrate=False)
    try:
        result = store.reader().query(q)
    finally:
        store.close()
    return (list(result.columns), [list(r) for r in result.rows[:MAX_QUERY_ROWS]], len(result.rows),
            list(result.types))


def running_system(data_dir: Path, token: str | None) -> tuple[str, str, str | None] | None:
    """How to ask the running system that holds ``data_dir``'s embedded store, or None when no
    running process holds it: its NATS URL with the data dir's operator credentials, its subject
    prefix, and the token to send (``token``, else ``FEDSCHED_TOKEN``, else the data dir's
    ``admin.token``)."""
    endpoint = running_store(data_dir)
    if endpoint is None:
        return None
    return (with_local_credentials(endpoint.nats_url, data_dir), endpoint.subject_prefix,
            resolve_token(token, data_dir))


async def ask_store(nats_url: str, prefix: str, sql: str, parameters: dict | None = None, *,
                    inbox_prefix: str = "", timeout_s: float = 65.0, token: str | None = None) -> dict:
    """Ask the running system (the process holding the store) a read-only query over NATS, as
    the holder of ``token`` (default: :func:`~fedapp.client.resolve_token`; must be an admin's).

    Returns:
        The reply body: ``columns``, ``types`` (ClickHouse type names; absent from an older
        system) and ``rows`` (JSON values: a time is its ISO-8601 text).

    Raises:
        UnavailableError: NATS unreachable, or no fedsched answers on ``<prefix>.svc.store.query``.
        ValidationError: ClickHouse refused the query (its message).
        AuthError / PermissionDeniedError: no token, an unknown one, or not an admin's.
    """
    import nats
    import nats.errors

    extra = {"inbox_prefix": inbox_prefix.encode()} if inbox_prefix else {}

    failures: list[Exception] = []

    async def quiet(e: Exception) -> None:  # the failure is raised below, once, for people
        failures.append(e)

    try:
        # nats.py reads max_reconnect_attempts=0 as "retry forever" (every 2 s) on the first
        # connection: 1 = try each server twice, 0.1 s apart, then NoServersError -- a refused
        # port fails in ~0.1 s instead of after the 10 s bound; a silent one still stops at 10 s.
        nc = await asyncio.wait_for(
            nats.connect(with_local_credentials(nats_url), connect_timeout=5, allow_reconnect=False,
                         max_reconnect_attempts=1, reconnect_time_wait=0.1,
                         error_cb=quiet, **extra),
            timeout=10)
    except Exception as e:  # noqa: BLE001 - a bad URL, refused, or silent
        cause = failures[-1] if isinstance(e, nats.errors.NoServersError) and failures else e
        raise UnavailableError(f"cannot connect to NATS at {redact(nats_url)}: "
                               f"{str(cause) or type(cause).__name__}") from e
    try:
        reply = await nc.request(f"{prefix}.svc.store.query",
                                 json.dumps({"sql": sql, "parameters": parameters or {},
                                             "token": resolve_token(token) or ""}).encode(), timeout=timeout_s)
    except nats.errors.NoRespondersError as e:
        raise UnavailableError("no running fedsched answers store queries on this NATS") from e
    except nats.errors.TimeoutError as e:
        raise UnavailableError(f"the running fedsched did not answer within {timeout_s:g} s (queries stop after "
                               f"55 s; is the system overloaded?)") from e
    finally:
        await nc.close()
    body = json.loads(reply.data)
    if "error" in body:
        code = body.get("code", "invalid")
        if code == "unauthenticated":
            raise AuthError(body["error"])
        if code == "permission_denied":
            raise PermissionDeniedError(body["error"])
        if code == "unavailable":
            raise UnavailableError(body["error"])
        raise ValidationError("query", body["error"])
    return body


async def _ask(query: str, nats_url: str, prefix: str, inbox_prefix: str,
               token: str | None) -> tuple[list[str], list[list], int, list[str]]:
    body = await ask_store(nats_url, prefix, query, inbox_prefix=inbox_prefix, timeout_s=65, token=token)
    return (body["columns"], body["rows"], int(body.get("total_rows", len(body["rows"]))),
            list(body.get("types") or ()))
