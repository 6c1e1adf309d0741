"""The ClickHouse store: one module, one DDL, one set of SQL for chDB and a server.

clickhouse-connect drives both: ``get_client(interface="chdb", path=DIR)`` runs ClickHouse
in this process (the embedded default), an ``http(s)://`` URL talks to a server. The schema is
applied by versioned migrations (``fedsched/schema/migrations/NNNN_name.sql``) recorded in
``schema_migrations``; re-applying is a no-op and a database newer than this binary is a clear
error.

Idempotent writing (the brief: non-replicated MergeTree does not deduplicate, Replacing
engines only at merge time): :meth:`Store.insert_new` looks up which keys of a batch are
already in the table and inserts only the others. With one writer per table (the audit and
billing consumers each own theirs) that is exact across redelivery, restarts and replays; the
Replacing engines are the second line for anything else.

chDB allows one data path per process; :func:`open_store` keeps one client per path. All calls
are synchronous; async services use :class:`AsyncStore`, which runs them on one worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlparse, parse_qs, unquote

from fedsched.errors import FedError, UnavailableError, ValidationError

log = logging.getLogger(__name__)


class SchemaError(FedError):
    """The database schema cannot be used by this binary (e.g. it is newer)."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step: ``version`` (from the file name), ``name``, ``sql`` with placeholders."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """sha256 of the SQL text (hex, first 16 chars)."""
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


def load_migrations() -> list[Migration]:
    """The bundled migrations, ordered by version."""
    out = []
    for entry in resources.files("fedsched.schema.migrations").iterdir():
        m = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", entry.name)
        if m:
            out.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    return sorted(out, key=lambda m: m.version)


_TTL_COLUMNS = {"events": "occurred_at", "decisions": "decided_at", "inventory": "at"}


def render_sql(sql: str, database: str, *, cluster: str | None = None,
               ttl_days: dict[str, int] | None = None) -> list[str]:
    """Render a migration into executable statements.

    Args:
        sql: migration text with ``{db}``, ``{engine:...}`` and ``{ttl:table}`` placeholders.
        database: validated database identifier.
        cluster: None for a single node; a ClickHouse cluster name for the replicated variant
            (``ON CLUSTER``, ``Replicated*MergeTree`` with the standard ``{shard}``/``{replica}``
            macros).
        ttl_days: table -> days to keep (high-volume tables); absent = keep forever.

    Returns:
        One statement per element, comments removed.
    """
    ttl_days = ttl_days or {}

    def engine(m: re.Match[str]) -> str:
        spec = m.group(1)
        if cluster is None:
            return spec
        name, _, args = spec.partition("(")
        args = args.rstrip(")")
        zk = "'/clickhouse/tables/{shard}/" + database + "/{uuid}', '{replica}'"
        return f"Replicated{name}({zk}{', ' + args if args else ''})"

    def ttl(m: re.Match[str]) -> str:
        table = m.group(1)
        days = ttl_days.get(table)
        if not days:
            return ""
        return f"TTL toDateTime({_TTL_COLUMNS[table]}) + INTERVAL {int(days)} DAY"

    text = re.sub(r"--[^\n]*", "", sql)
    text = re.sub(r"\{engine:([A-Za-z]+(?:\([^)]*\))?)\}", engine, text)
    text = re.sub(r"\{ttl:([a-z_]+)\}", ttl, text)
    text = text.replace("{db}", database)
    statements = [s.strip() for s in text.split(";") if s.strip()]
    if cluster is not None:
        statements = [re.sub(r"^(CREATE TABLE IF NOT EXISTS \S+)", rf"\1 ON CLUSTER {cluster}", s)
                      for s in statements]
    return statements


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Rows of a query: ``columns`` (names) and ``rows`` (tuples)."""

    columns: tuple[str, ...]
    rows: list[tuple]

    def dicts(self) -> list[dict[str, Any]]:
        """Rows as dicts keyed by column name."""
        return [dict(zip(self.columns, row)) for row in self.rows]

    def scalar(self) -> Any:
        """The first column of the first row (None if empty)."""
        return self.rows[0][0] if self.rows else None


_chdb_clients: dict[str, Any] = {}
_chdb_lock = threading.Lock()


def _chdb_client(path: Path):
    import clickhouse_connect

    key = str(path.resolve())
    with _chdb_lock:
        client = _chdb_clients.get(key)
        if client is None:
            if _chdb_clients:
                other = next(iter(_chdb_clients))
                raise UnavailableError(f"chDB is already open on {other} in this process; one data path per process")
            path.mkdir(parents=True, exist_ok=True)
            try:
                client = clickhouse_connect.get_client(interface="chdb", path=key)
            except Exception as e:  # noqa: BLE001 - translate the engine's error
                raise UnavailableError(
                    f"cannot open the embedded ClickHouse at {key} ({str(e).strip()[:200]}). Is a fedsched process "
                    f"using this data dir? Query the running system with `fedsched sql --nats-url nats://...` "
                    f"(the URL `fedsched up` printed), or stop it first.") from e
            _chdb_clients[key] = client
        return client


def _http_client(url: str, database: str):
    import clickhouse_connect

    u = urlparse(url)
    if u.scheme not in ("http", "https"):
        raise ValidationError("clickhouse_url", f"scheme must be http or https, got {u.scheme!r}")
    q = parse_qs(u.query)
    try:
        return clickhouse_connect.get_client(
            host=u.hostname or "localhost", port=u.port or (8443 if u.scheme == "https" else 8123),
            username=unquote(u.username or "default"), password=unquote(u.password or ""),
            secure=u.scheme == "https", verify=q.get("verify", ["true"])[0] != "false",
            connect_timeout=10, send_receive_timeout=60,
        )
    except Exception as e:  # noqa: BLE001
        raise UnavailableError(f"cannot reach ClickHouse at {u.hostname}:{u.port}: {e}") from e


class Store:
    """Synchronous access to the federation's ClickHouse database.

    Args:
        client: a clickhouse-connect client (chDB or HTTP).
        database: database name (validated identifier).
        embedded: True for chDB.
    """

    def __init__(self, client: Any, database: str, *, embedded: bool) -> None:
        self.client = client
        self.database = database
        self.embedded = embedded
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ schema

    def migrate(self, *, cluster: str | None = None, ttl_days: dict[str, int] | None = None) -> list[int]:
        """Apply the bundled migrations not yet applied; return the versions applied now.

        Raises:
            SchemaError: the database has a migration this binary does not know, or a known
                migration's recorded checksum differs (someone edited an applied migration).
        """
        migrations = load_migrations()
        on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
        with self._lock:
            self._command(f"CREATE DATABASE IF NOT EXISTS {self.database}{on_cluster}")
            self._command(
                f"CREATE TABLE IF NOT EXISTS {self.database}.schema_migrations{on_cluster} "
                "(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
                "ENGINE = ReplacingMergeTree ORDER BY version")
            applied = {int(v): c for v, c in self.query(
                f"SELECT version, argMax(checksum, applied_at) FROM {self.database}.schema_migrations GROUP BY version").rows}
            known = {m.version: m for m in migrations}
            newer = sorted(v for v in applied if v not in known)
            if newer:
                raise SchemaError(
                    f"database {self.database} has schema version {newer[-1]}, newer than this fedsched "
                    f"(knows up to {max(known, default=0)}); upgrade fedsched or use another database")
            done = []
            for m in migrations:
                if m.version in applied:
                    if applied[m.version] != m.checksum:
                        raise SchemaError(f"migration {m.version:04d}_{m.name} changed after it was applied "
                                          f"(checksum {applied[m.version]} != {m.checksum}); add a new migration instead")
                    continue
                for statement in render_sql(m.sql, self.database, cluster=cluster, ttl_days=ttl_days):
                    self._command(statement)
                self.client.insert(f"{self.database}.schema_migrations", [[m.version, m.name, m.checksum]],
                                   column_names=["version", "name", "checksum"])
                done.append(m.version)
            return done

    def schema_version(self) -> int:
        """Highest applied migration version (0 if none)."""
        return int(self.query(f"SELECT max(version) FROM {self.database}.schema_migrations").scalar() or 0)

    # ------------------------------------------------------------------ I/O

    def _command(self, sql: str) -> None:
        try:
            self.client.command(sql)
        except Exception as e:  # noqa: BLE001
            raise _translate(e) from e

    def query(self, sql: str, parameters: dict[str, Any] | None = None, *, settings: dict | None = None) -> QueryResult:
        """Run a SELECT with ``{name:Type}`` parameters.

        Raises:
            UnavailableError: the engine/server cannot be reached.
            ValidationError: the SQL is invalid (field ``sql``; the message is ClickHouse's).
        """
        with self._lock:
            try:
                result = self.client.query(sql, parameters=parameters or {}, settings=settings or {})
            except Exception as e:  # noqa: BLE001
                raise _translate(e) from e
        return QueryResult(tuple(result.column_names), list(result.result_rows))

    def insert(self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str]) -> int:
        """Insert ``rows`` (in ``columns`` order) into ``database.table``; returns the row count.

        Raises:
            UnavailableError: the engine/server cannot be reached; nothing was committed.
        """
        if not rows:
            return 0
        with self._lock:
            try:
                self.client.insert(table, rows, column_names=list(columns), database=self.database)
            except Exception as e:  # noqa: BLE001
                raise _translate(e) from e
        return len(rows)

    def existing_keys(self, table: str, key: Sequence[str], ids: Iterable[str]) -> set[tuple]:
        """Key tuples (columns ``key``) already in ``table`` among rows whose ``key[0]`` is in ``ids``."""
        ids = list(ids)
        if not ids:
            return set()
        cols = ", ".join(key)
        found = self.query(f"SELECT DISTINCT {cols} FROM {self.database}.{table} WHERE {key[0]} IN {{ids:Array(String)}}",
                           {"ids": ids})
        return {tuple(row) for row in found.rows}

    def insert_new(self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str],
                   key: str | Sequence[str]) -> int:
        """Insert only the rows whose key is not yet in the table (nor repeated within ``rows``).

        Args:
            table: table name in the store's database.
            rows: rows in ``columns`` order.
            columns: column names.
            key: the idempotency key: one column (e.g. ``event_id``) or several (e.g.
                ``("event_id", "card_model")`` when one event makes several rows); the first
                column is looked up.

        Returns:
            How many rows were inserted. Exact with one writer per table.
        """
        key = (key,) if isinstance(key, str) else tuple(key)
        idx = [list(columns).index(k) for k in key]
        with self._lock:
            present = self.existing_keys(table, key, {row[idx[0]] for row in rows})
            fresh, seen = [], set()
            for row in rows:
                k = tuple(row[i] for i in idx)
                if k in present or k in seen:
                    continue
                seen.add(k)
                fresh.append(row)
            return self.insert(table, fresh, columns)

    def ping(self) -> bool:
        """True if a trivial query succeeds."""
        try:
            self.query("SELECT 1")
            return True
        except FedError:
            return False


def _translate(e: Exception) -> FedError:
    text = str(e)
    low = text.lower()
    if any(s in low for s in ("connection", "timed out", "timeout", "refused", "unreachable", "closed",
                              "failed to create connection", "network")):
        return UnavailableError(f"ClickHouse unavailable: {text[:500]}")
    return ValidationError("sql", text.strip().splitlines()[0][:1000] if text.strip() else repr(e))


def open_store(*, data_dir: Path | None = None, url: str = "", database: str = "fedsched",
               migrate: bool = True, chdb_path: Path | None = None) -> Store:
    """Open the store: chDB on ``chdb_path`` (default ``data_dir/clickhouse``) when ``url`` is
    empty, else the server.

    Raises:
        UnavailableError: the engine cannot be opened / the server cannot be reached.
        SchemaError: the database schema is newer than this binary.
    """
    if url:
        store = Store(_http_client(url, database), database, embedded=False)
    else:
        if chdb_path is None and data_dir is None:
            raise ValidationError("data_dir", "the embedded store needs a data directory")
        store = Store(_chdb_client(Path(chdb_path) if chdb_path else Path(data_dir) / "clickhouse"), database,
                      embedded=True)
    if migrate:
        store.migrate()
    return store


class AsyncStore:
    """Runs a :class:`Store`'s calls on one worker thread, so the event loop never blocks.

    Args:
        store: the synchronous store.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        """See :meth:`Store.query`."""
        return await self._run(self.store.query, sql, parameters)

    async def insert_new(self, table: str, rows, columns, key: str) -> int:
        """See :meth:`Store.insert_new`."""
        return await self._run(self.store.insert_new, table, rows, columns, key)

    async def insert(self, table: str, rows, columns) -> int:
        """See :meth:`Store.insert`."""
        return await self._run(self.store.insert, table, rows, columns)

    def close(self) -> None:
        """Stop the worker thread (pending calls finish first)."""
        self._pool.shutdown(wait=True)
