"""The ClickHouse store: one module, one DDL, one set of SQL for chDB and a server.

clickhouse-connect drives both: ``get_client(interface="chdb", path=DIR)`` runs ClickHouse
in this process (the embedded default), an ``http(s)://`` URL talks to a server. The schema is
applied by versioned migrations (``fedsched/schema/migrations/NNNN_name.sql``) recorded in
``schema_migrations``; re-applying is a no-op and a database newer than this binary is a clear
error.

Idempotent writing (the brief: non-replicated MergeTree does not deduplicate, Replacing
engines only at merge time) has three layers, so one event never becomes two rows across
redelivery, restarts and replays:

1. :meth:`Store.insert_new` looks up which keys of a batch are already in the table and inserts
   only the others. With one writer per table (the audit and billing consumers each own theirs)
   that alone is exact. The keys a store itself wrote lately are remembered (bounded), so a
   batch written again a moment ago (redelivered, bisected) is not looked up; every other key is
   asked of the engine, which remains the authority (across restarts and other writers).
2. Each insert carries ``insert_deduplication_token`` = a hash of the table and the keys it
   writes, and every table keeps a deduplication window (migration 0002 sets
   ``non_replicated_deduplication_window``; Replicated tables have one by default). A retry of
   an insert that did commit -- the client timed out after the server committed, or a crash
   between commit and acknowledgement raced a redelivery -- is dropped by the engine.
3. The Replacing engines collapse anything a second, concurrent writer could still produce, at
   merge time (``FINAL`` gives exact counts then).

Writers acknowledge a message only after its rows are committed, so nothing is lost either.

chDB allows one data path per process; :func:`open_store` keeps one client per path. All calls
are synchronous; async services use :class:`AsyncStore`, which runs them on one worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlparse, parse_qs, unquote

from fedsched.bounded import RecentSet
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


#: Time column of each table whose rows may expire (high-volume tables; usage is kept).
TTL_COLUMNS = {"events": "occurred_at", "decisions": "decided_at", "inventory": "at"}

#: Cluster variant: the Distributed table's sharding key per table. All rows of one key land on
#: one shard, so that shard's Replacing engine and deduplication window see every copy of it.
SHARDING_KEYS = {"events": "cityHash64(event_id)", "usage": "cityHash64(usage_id)",
                 "decisions": "cityHash64(event_id)", "inventory": "cityHash64(event_id)"}

#: Cluster variant: suffix of the Replicated table under each Distributed table.
LOCAL_SUFFIX = "_local"


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_identifier(field: str, value: str) -> str:
    """``value`` if it is a plain ClickHouse identifier (letters, digits, ``_``; <= 63 chars).

    Raises:
        ValidationError: anything else (field ``field``).
    """
    if not _IDENTIFIER.fullmatch(value or ""):
        raise ValidationError(field, f"{value!r} must be an identifier: a letter or _, then letters, digits or _ "
                                     f"(at most 63)")
    return value


def render_sql(sql: str, database: str, *, cluster: str | None = None,
               ttl_days: dict[str, int] | None = None) -> list[str]:
    """Render a migration into executable statements.

    Single node, a table is what the migration says. On a cluster, every ``CREATE TABLE X``
    becomes two tables (the usual ClickHouse layout), so queries name ``X`` either way:

    * ``X_local`` -- ``Replicated*MergeTree`` with the standard ``{shard}``/``{replica}`` macros,
      ``ON CLUSTER``, holding the data;
    * ``X`` -- ``ENGINE = Distributed(cluster, db, X_local, SHARDING_KEYS[X])``, ``ON CLUSTER``,
      which queries and inserts go through.

    ``ALTER TABLE X`` goes to ``X_local``, and also to ``X`` when it changes columns (a
    Distributed table must have the columns it reads); settings of non-replicated tables
    (``non_replicated_*``) are left out; other statements get ``ON CLUSTER``.

    Args:
        sql: migration text with ``{db}``, ``{engine:...}`` and ``{ttl:table}`` placeholders.
        database: validated database identifier.
        cluster: None for a single node; a ClickHouse cluster name for the replicated variant.
        ttl_days: table -> days to keep (tables of :data:`TTL_COLUMNS`); absent = keep forever.

    Returns:
        One statement per element, comments removed.

    Raises:
        ValidationError: ``database`` or ``cluster`` is not a plain identifier (they are pasted
            into DDL, where parameters cannot go).
    """
    check_identifier("clickhouse_database", database)
    if cluster:
        check_identifier("clickhouse_cluster", cluster)
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
        return f"TTL {ttl_expression(table, days)}"

    text = re.sub(r"--[^\n]*", "", sql)
    text = re.sub(r"\{engine:([A-Za-z]+(?:\([^)]*\))?)\}", engine, text)
    text = re.sub(r"\{ttl:([a-z_]+)\}", ttl, text)
    text = text.replace("{db}", database)
    statements = [s.strip() for s in text.split(";") if s.strip()]
    if cluster is None:
        return statements
    return [out for s in statements for out in _on_cluster(s, database, cluster)]


def ttl_expression(table: str, days: int) -> str:
    """The TTL expression keeping ``table``'s rows ``days`` days (by its :data:`TTL_COLUMNS` time)."""
    return f"toDateTime({TTL_COLUMNS[table]}) + INTERVAL {int(days)} DAY"


def _on_cluster(statement: str, database: str, cluster: str) -> list[str]:
    db = re.escape(database)
    m = re.match(rf"CREATE TABLE IF NOT EXISTS {db}\.([a-z_]+)\s", statement)
    if m:
        table = m.group(1)
        local = f"{database}.{table}{LOCAL_SUFFIX}"
        key = SHARDING_KEYS.get(table, "rand()")
        return [f"CREATE TABLE IF NOT EXISTS {local} ON CLUSTER {cluster}\n{statement[m.end():]}",
                f"CREATE TABLE IF NOT EXISTS {database}.{table} ON CLUSTER {cluster} AS {local}\n"
                f"ENGINE = Distributed({cluster}, {database}, {table}{LOCAL_SUFFIX}, {key})"]
    m = re.match(rf"ALTER TABLE {db}\.([a-z_]+)\s", statement)
    if m:
        table, rest = m.group(1), statement[m.end():]
        if re.fullmatch(r"MODIFY SETTING non_replicated_\w+\s*=\s*\S+", rest.strip()):
            return []  # Replicated tables deduplicate inserts by their own (replicated_*) window
        out = [f"ALTER TABLE {database}.{table}{LOCAL_SUFFIX} ON CLUSTER {cluster}\n{rest}"]
        if re.search(r"\b(ADD|DROP|MODIFY|RENAME|COMMENT)\s+COLUMN\b", rest):
            out.append(f"ALTER TABLE {database}.{table} ON CLUSTER {cluster}\n{rest}")
        return out
    m = re.match(rf"(CREATE (?:OR REPLACE )?(?:MATERIALIZED )?VIEW (?:IF NOT EXISTS )?{db}\.[a-z_]+)\s", statement)
    if m:
        return [f"{m.group(1)} ON CLUSTER {cluster}\n{statement[m.end():]}"]
    raise SchemaError(f"cannot render for a cluster: {statement[:80]!r}")


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Rows of a query: ``columns`` (names), ``rows`` (tuples) and ``types`` (each column's
    ClickHouse type name, e.g. ``DateTime64(3, 'UTC')``; empty when not known)."""

    columns: tuple[str, ...]
    rows: list[tuple]
    types: tuple[str, ...] = ()

    def dicts(self) -> list[dict[str, Any]]:
        """Rows as dicts keyed by column name."""
        return [dict(zip(self.columns, row)) for row in self.rows]

    def scalar(self) -> Any:
        """The first column of the first row (None if empty)."""
        return self.rows[0][0] if self.rows else None


_chdb_clients: dict[str, Any] = {}
_chdb_lock = threading.Lock()


def _chdb_client(path: Path, *, fresh: bool = False):
    """The process's chDB client on ``path`` (``fresh``: a new handle on it, replacing the cached one)."""
    import clickhouse_connect

    key = str(path.resolve())
    with _chdb_lock:
        client = None if fresh else _chdb_clients.get(key)
        if client is None:
            others = [p for p in _chdb_clients if p != key]
            if others:
                raise UnavailableError(f"chDB is already open on {others[0]} in this process; one data path per process")
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


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How to reach a ClickHouse server over HTTP(S).

    Attributes:
        user / password: credentials; the URL's own ``user:password@`` wins when present.
        ca_cert: CA bundle to verify the server's certificate (TLS: an ``https://`` URL).
        verify: verify the server's certificate (``?verify=false`` in the URL also turns it off).
        connect_timeout_s / send_receive_timeout_s: HTTP timeouts (seconds).
    """

    user: str = ""
    password: str = ""
    ca_cert: str = ""
    verify: bool = True
    connect_timeout_s: float = 10.0
    send_receive_timeout_s: float = 60.0


def http_client_args(url: str, options: ServerOptions | None = None) -> dict[str, Any]:
    """The clickhouse-connect ``get_client`` arguments for a server ``url`` (pure).

    ``http://`` or ``https://`` (TLS); credentials from the URL, else from ``options``; the
    certificate is verified unless ``options.verify`` is off or the URL says ``?verify=false``.

    Raises:
        ValidationError: another scheme.
    """
    o = options or ServerOptions()
    u = urlparse(url)
    if u.scheme not in ("http", "https"):
        raise ValidationError("clickhouse_url", f"scheme must be http or https, got {u.scheme!r}")
    q = parse_qs(u.query)
    args: dict[str, Any] = dict(
        host=u.hostname or "localhost", port=u.port or (8443 if u.scheme == "https" else 8123),
        username=unquote(u.username) if u.username else (o.user or "default"),
        password=unquote(u.password) if u.password else o.password,
        secure=u.scheme == "https", verify=o.verify and q.get("verify", ["true"])[0] != "false",
        connect_timeout=o.connect_timeout_s, send_receive_timeout=o.send_receive_timeout_s,
    )
    if o.ca_cert:
        args["ca_cert"] = o.ca_cert
    return args


def _http_client(url: str, database: str, options: ServerOptions | None = None):
    import clickhouse_connect

    args = http_client_args(url, options)
    try:
        return clickhouse_connect.get_client(**args)
    except Exception as e:  # noqa: BLE001
        raise UnavailableError(f"cannot reach ClickHouse at {args['host']}:{args['port']}: {e}") from e


def _chdb_reader(path: Path):
    """A new chDB handle on ``path`` that is not the process's cached writer handle.

    Settings given to a chDB query stick to its session, so read-only queries run on a handle of
    their own (see :meth:`Store.reader`) and can never turn the writer read-only.
    """
    import clickhouse_connect

    try:
        return clickhouse_connect.get_client(interface="chdb", path=str(path.resolve()))
    except Exception as e:  # noqa: BLE001
        raise UnavailableError(f"cannot open a read handle on the embedded ClickHouse at {path}: {e}") from e


ClientFactory = Callable[[], Any]

#: Keys per table that :meth:`Store.insert_new` remembers having written or found (the newest):
#: ~15 s of an audit writing 3,000 events/s -- past a redelivery after the ack wait, a batch
#: bisected or handed back, a refusal recorded by several consumers -- in ~15 MB for ``events``.
RECENT_KEYS = 50_000

#: Rows an ad-hoc query returns at most (``fedsched sql``); more are cut, and the caller is told.
MAX_QUERY_ROWS = 10_000

@dataclass(frozen=True, slots=True)
class ReadLimits:
    """What one ad-hoc query on a :meth:`Store.reader` handle may use.

    The engine enforces all of it: the handle's session gets these settings once, ``readonly=1``
    last (after it nothing may change a setting, neither a ``SET`` nor a query's ``SETTINGS``
    clause), and every query carries them again (a server sees them on each HTTP request).

    Attributes:
        max_execution_s: seconds after which ClickHouse stops the query (``max_execution_time``).
        max_memory_bytes: bytes one query may allocate (``max_memory_usage``); past it the query
            fails with MEMORY_LIMIT_EXCEEDED. Per query, so the writers' inserts in the same
            engine are not counted against it and keep running.
        max_result_rows / max_result_bytes: the result stops (``break``) past these, so a
            huge answer cannot fill memory on the way out.
    """

    max_execution_s: int = 55
    max_memory_bytes: int = 1024 ** 3
    max_result_rows: int = MAX_QUERY_ROWS + 1
    max_result_bytes: int = 256 * 1024 * 1024

    def settings(self) -> dict[str, int | str]:
        """The ClickHouse settings, in the order to apply them (``readonly`` last).

        ``session_timezone=UTC`` makes time functions independent of the server's zone (see
        :func:`_utc_session`); ``allow_introspection_functions=0`` refuses the functions that read the server binary's
        symbols; ``readonly=1`` refuses writes, DDL, settings changes and every table function
        that reaches outside the database (``file``, ``url``, ``s3``, ``executable``, ``remote``...).
        """
        return {"session_timezone": "UTC", "max_execution_time": self.max_execution_s,
                "max_memory_usage": self.max_memory_bytes,
                "max_result_rows": self.max_result_rows, "max_result_bytes": self.max_result_bytes,
                "result_overflow_mode": "break", "allow_introspection_functions": 0, "readonly": 1}


#: The settings of every query on a default :meth:`Store.reader` handle (see :class:`ReadLimits`).
READ_ONLY_SETTINGS = ReadLimits().settings()

#: Table functions an ad-hoc query may use: they make rows from their arguments or read this
#: database's own tables. Every other one (``file``, ``url``, ``s3``, ``executable``, ``remote``,
#: ``mysql``, ``python``...) reaches the host's files, programs or network.
READ_TABLE_FUNCTIONS = ("numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateSeries", "values",
                        "null", "view", "generateRandom", "merge", "primes")
_READ_TABLE_FUNCTIONS_LOWER = frozenset(n.lower() for n in READ_TABLE_FUNCTIONS)

#: Functions an ad-hoc query may not call, with why. ``readonly`` does not stop them: ``file``
#: (the scalar function) reads any file of the host in the embedded engine (clickhouse-local
#: does not confine it to ``user_files_path``).
DENIED_FUNCTIONS = {"file": "reads a file of the host", "catboostEvaluate": "loads a model file of the host",
                    "showCertificate": "reads the server's certificate", "generateSerialID": "writes to Keeper",
                    "getClientHTTPHeader": "reads the HTTP request"}

#: ``system.functions`` categories an ad-hoc query may not call: the AI functions send data to
#: a network service; the introspection ones read the binary's symbols or write the server log.
DENIED_FUNCTION_CATEGORIES = {"AI": "sends data to a network AI provider",
                              "Introspection": "reads the server's binary or writes its log"}

#: The statements an ad-hoc query may be (``parseQueryToJSON`` type names).
READ_STATEMENTS = frozenset({"SelectWithUnionQuery", "SelectIntersectExceptQuery", "ShowTablesQuery"})


@dataclass(frozen=True, slots=True)
class FunctionCatalog:
    """Which function names an ad-hoc query may not use, from the engine's own ``system.functions``
    (so aliases and case-insensitive spellings of a denied function are denied too).

    Attributes:
        denied: lower-cased spelling -> why it is refused.
    """

    denied: dict[str, str]

    @classmethod
    def from_rows(cls, functions: Iterable[tuple[str, str, str, str]]) -> "FunctionCatalog":
        """Build from ``system.functions`` rows ``(name, alias_to, origin, categories)``."""
        rows = list(functions)
        reason: dict[str, str] = {}
        for name, alias_to, origin, categories in rows:
            if origin != "System":
                reason[name] = f"is user-defined ({origin})"
            elif name in DENIED_FUNCTIONS:
                reason[name] = DENIED_FUNCTIONS[name]
            elif categories in DENIED_FUNCTION_CATEGORIES:
                reason[name] = DENIED_FUNCTION_CATEGORIES[categories]
        denied = {n.lower(): why for n, why in reason.items()}
        denied |= {k.lower(): v for k, v in DENIED_FUNCTIONS.items()}  # also where the engine lacks them
        for name, alias_to, _origin, _categories in rows:
            if alias_to and alias_to in reason:
                denied[name.lower()] = reason[alias_to]
        return cls(denied)


def check_read_query(ast: dict, catalog: FunctionCatalog) -> None:
    """Refuse an ad-hoc query that is not a plain read of the database (pure).

    Args:
        ast: the query as ClickHouse's parser sees it (``parseQueryToJSON``): nested dicts with
            ``type``; functions are ``{"type": "Function", "name": ...}`` (a table function sits
            under the key ``table_function``), ``APPLY f`` is ``{"func_name": "f"}``.
        catalog: the denied names (:class:`FunctionCatalog`).

    Raises:
        ValidationError: (field ``sql``) a statement other than SELECT / SHOW TABLES / EXPLAIN
            of a SELECT; ``INTO OUTFILE``; a denied function (``file``, AI, introspection,
            user-defined); a table function outside :data:`READ_TABLE_FUNCTIONS`.
    """
    kind = ast.get("type", "")
    if kind == "ExplainQuery":
        kind = (ast.get("query") or {}).get("type", "")
    if kind not in READ_STATEMENTS:
        raise ValidationError("sql", f"ad-hoc SQL is read-only: only SELECT, SHOW TABLES and EXPLAIN (of a SELECT) may "
                                     f"run, not {kind.removesuffix('Query') or 'this statement'}")

    def walk(node: Any, key: str) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, key)
            return
        if not isinstance(node, dict):
            return
        if node.get("out_file") is not None:
            raise ValidationError("sql", "ad-hoc SQL is read-only: INTO OUTFILE would write a file of the host")
        name = node.get("name") if node.get("type") == "Function" else node.get("func_name")
        if isinstance(name, str) and name:
            low = name.lower()
            if key == "table_function" and low not in _READ_TABLE_FUNCTIONS_LOWER:
                raise ValidationError("sql", f"ad-hoc SQL is read-only: the table function {name}() reaches outside "
                                                 f"the database (allowed: {', '.join(READ_TABLE_FUNCTIONS)})")
            if low in catalog.denied:
                raise ValidationError("sql", f"ad-hoc SQL is read-only: the function {name}() {catalog.denied[low]}")
        for k, v in node.items():
            walk(v, k)

    walk(ast, "")


class Store:
    """Synchronous access to the federation's ClickHouse database.

    Args:
        client: a clickhouse-connect client (chDB or HTTP).
        database: database name (validated identifier).
        embedded: True for chDB.
        cluster: the ClickHouse cluster of the replicated deployment (None: single node). Tables
            are then Distributed over Replicated ones (:func:`render_sql`); inserts wait until
            the shards have them (``distributed_foreground_insert``), so a lookup right after an
            insert sees it.
        reopen: makes a new client. After the engine became unavailable (a closed chDB handle,
            a lost server), the next call first opens a new client with it; None = keep the
            client (HTTP clients reconnect by themselves).
        read_client: makes a client of its own for :meth:`reader` (None: no reader).
        limits: set on a reader (see :meth:`reader`): every query is checked and runs read-only
            within these limits. ``read_only=True`` without limits means the default ones.
        monotonic: the clock (seconds, monotonic) that ages the insert column-type cache
            (:data:`COLUMN_TYPES_TTL_S`); tests inject a fake one.
        recent_keys: keys per table :meth:`insert_new` remembers having written or found (the
            newest; >= 1), so that writing them again asks the engine nothing.
    """

    #: seconds a table's column types read by ``DESCRIBE`` are trusted before being read again,
    #: so an ``ALTER`` made by another process (``DateTime`` -> ``DateTime64(3)``, a Decimal's
    #: scale) is seen within this time instead of values being silently truncated to the old type
    COLUMN_TYPES_TTL_S = 60.0

    def __init__(self, client: Any, database: str, *, embedded: bool, cluster: str | None = None,
                 reopen: ClientFactory | None = None, read_client: ClientFactory | None = None,
                 read_only: bool = False, location: str = "", limits: ReadLimits | None = None,
                 monotonic: Callable[[], float] = time.monotonic, recent_keys: int = RECENT_KEYS) -> None:
        self.client = _utc_session(client) if limits is None and not read_only else client
        self.database = database
        self.location = location
        self.embedded = embedded
        self.cluster = cluster or None
        self.limits = limits or (ReadLimits() if read_only else None)
        self.read_only = self.limits is not None
        self._catalog: FunctionCatalog | None = None
        self._reopen = reopen
        self._read_client = read_client
        self._broken = False
        self._lock = threading.RLock()
        self._monotonic = monotonic
        #: table -> (when read, column name -> ClickHouse type name) (see :meth:`_types_of`)
        self._column_types: dict[str, tuple[float, dict[str, str]]] = {}
        self.recent_keys = recent_keys
        #: table -> keys this store wrote or found in it lately, the newest :attr:`recent_keys`
        #: (a key value, or a tuple for a key of several columns; see :meth:`insert_new`)
        self._recent: dict[str, RecentSet] = {}

    # ------------------------------------------------------------------ schema

    def migrate(self, *, ttl_days: dict[str, int] | None = None) -> list[int]:
        """Apply the bundled migrations not yet applied; return the versions applied now.

        Args:
            ttl_days: table -> days to keep (see :meth:`apply_ttl`); applied on every start, so
                changing the setting changes the tables.

        Raises:
            SchemaError: the database has a migration this binary does not know, or a known
                migration's recorded checksum differs (someone edited an applied migration).
        """
        migrations = load_migrations()
        cluster = self.cluster
        on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
        engine = "ReplacingMergeTree"
        if cluster:  # one migration record for every replica of every shard
            engine = (f"ReplicatedReplacingMergeTree('/clickhouse/tables/{self.database}/schema_migrations', "
                      "'{replica}')")
        with self._lock:
            self._command(f"CREATE DATABASE IF NOT EXISTS {self.database}{on_cluster}")
            self._command(
                f"CREATE TABLE IF NOT EXISTS {self.database}.schema_migrations{on_cluster} "
                "(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
                f"ENGINE = {engine} ORDER BY version")
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
                self._call(lambda c: c.insert(f"{self.database}.schema_migrations", [[m.version, m.name, m.checksum]],
                                              column_names=["version", "name", "checksum"]))
                done.append(m.version)
            if ttl_days is not None:
                self.apply_ttl(ttl_days)
            return done

    def schema_version(self) -> int:
        """Highest applied migration version (0 if none)."""
        return int(self.query(f"SELECT max(version) FROM {self.database}.schema_migrations").scalar() or 0)

    def apply_ttl(self, ttl_days: dict[str, int]) -> list[str]:
        """Make the tables of :data:`TTL_COLUMNS` keep rows ``ttl_days[table]`` days (absent or 0:
        forever); returns the tables changed.

        Raises:
            ValidationError: a table without a time column to expire by.
        """
        unknown = sorted(set(ttl_days) - set(TTL_COLUMNS))
        if unknown:
            raise ValidationError("clickhouse_ttl_days", f"no TTL for {', '.join(unknown)}; only {', '.join(TTL_COLUMNS)}")
        on_cluster = f" ON CLUSTER {self.cluster}" if self.cluster else ""
        changed = []
        for table in TTL_COLUMNS:
            target = table + (LOCAL_SUFFIX if self.cluster else "")
            full = str(self.query("SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = {t:String}",
                                  {"db": self.database, "t": target}).scalar() or "")
            now = re.search(r"\bTTL\b.*?toIntervalDay\((\d+)\)", full)
            days = int(ttl_days.get(table) or 0)
            if days and (now is None or int(now.group(1)) != days):
                self._command(f"ALTER TABLE {self.database}.{target}{on_cluster} MODIFY TTL {ttl_expression(table, days)}")
                changed.append(table)
            elif not days and now is not None:
                self._command(f"ALTER TABLE {self.database}.{target}{on_cluster} REMOVE TTL")
                changed.append(table)
        return changed

    # ------------------------------------------------------------------ I/O

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(client)`` under the lock, translating the engine's errors (see :func:`_translate`)."""
        with self._lock:
            if self._broken and self._reopen is not None:
                try:
                    client = self._reopen()
                    self.client = client if self.read_only else _utc_session(client)
                except FedError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise UnavailableError(f"ClickHouse unavailable: cannot reopen the client: {e}") from e
                self._broken = False
                log.info("store %s: client reopened", self.database)
            try:
                return fn(self.client)
            except Exception as e:  # noqa: BLE001
                err = _translate(e, read_only=self.read_only, limits=self.limits)
                if isinstance(err, UnavailableError):
                    self._broken = True
                raise err from e

    def _command(self, sql: str) -> None:
        """Run a statement (DDL here: migrations, TTL changes); forgets the cached column types,
        since the statement may change a table's columns."""
        try:
            self._call(lambda c: c.command(sql))
        finally:
            self._column_types.clear()

    def reader(self, limits: ReadLimits | None = None) -> "Store":
        """A read-only :class:`Store` on a client of its own, for ad-hoc (untrusted) SQL.

        Every query on it is first parsed by ClickHouse (``parseQueryToJSON``) and refused unless
        it is one read statement without ``INTO OUTFILE``, denied functions (``file`` reads host
        files, AI functions the network...) or outside table functions (:func:`check_read_query`);
        the engine's own formatting of that parse is what runs. The client's session is set to
        ``limits`` (default :class:`ReadLimits`: 55 s, 1 GiB per query, bounded results) with
        ``readonly=1`` last, so writes, DDL, settings changes and table functions reaching outside
        are refused by the engine too. It has its own lock, so a long query never holds up the
        writers, and its settings never leak into the writers' session.

        Raises:
            UnavailableError: a second handle cannot be opened.
        """
        if self._read_client is None:
            raise UnavailableError("this store cannot open a separate read handle")
        limits = limits or ReadLimits()
        factory = self._read_client

        def locked_down():
            client = factory()
            try:
                for key, value in limits.settings().items():  # readonly=1 last
                    client.set_client_setting(key, value)
            except Exception as e:  # noqa: BLE001
                client.close()
                raise UnavailableError(f"cannot make a read-only handle: {e}") from e
            return client

        return Store(locked_down(), self.database, embedded=self.embedded, cluster=self.cluster,
                     reopen=locked_down, limits=limits, location=self.location)

    @property
    def identity(self) -> str:
        """Which database this is, as a short stable id: the same for every process writing to
        the same server database or chDB directory (12 hex of a SHA-256)."""
        return hashlib.sha256(f"{self.location}|{self.database}".encode()).hexdigest()[:12]

    def query(self, sql: str, parameters: dict[str, Any] | None = None, *, settings: dict | None = None) -> QueryResult:
        """Run a SELECT with ``{name:Type}`` parameters.

        On a reader (:meth:`reader`) the query is checked first and the engine's canonical text
        of it runs, with the reader's limits.

        Raises:
            UnavailableError: the engine/server cannot be reached.
            ValidationError: the SQL is invalid, or not a plain read on a read-only store, or ran
                past a reader's time or memory limit (field ``sql``; the message says which).
        """
        if self.limits is not None:  # the caller's settings first, ours after (readonly=1 last: nothing may change it)
            sql = self._checked(sql)
            ours = self.limits.settings()
            settings = {k: v for k, v in (settings or {}).items() if k not in ours} | ours
        result = self._call(lambda c: c.query(sql, parameters=parameters or {}, settings=settings))
        return QueryResult(tuple(result.column_names), list(result.result_rows),
                           tuple(t.name for t in getattr(result, "column_types", ()) or ()))

    def _checked(self, sql: str) -> str:
        """The engine's canonical text of ``sql`` once :func:`check_read_query` accepts its parse.

        Raises:
            ValidationError: a syntax error, several statements, a statement the parser cannot
                show as JSON (DESCRIBE, EXISTS...), or what :func:`check_read_query` refuses.
        """
        with self._lock:
            if self._catalog is None:
                rows = self._call(lambda c: c.query(
                    "SELECT name, alias_to, origin, toString(categories) FROM system.functions")).result_rows
                self._catalog = FunctionCatalog.from_rows(rows)
            try:
                parsed, canonical = self._call(lambda c: c.query(
                    "SELECT parseQueryToJSON({q:String}), formatQuery({q:String})",
                    parameters={"q": sql})).result_rows[0]
            except ValidationError as e:
                if "not supported by parseQueryToJSON" in e.reason:  # statements it cannot show are no plain reads
                    m = re.search(r"AST node of type '([A-Za-z]+?)(?:Query)?(?:_[^']*)?' does not support JSON",
                                  e.reason)
                    what = m.group(1) if m else (sql.split() or ["this statement"])[0][:20].upper()
                    raise ValidationError("sql", f"ad-hoc SQL is read-only: only SELECT, SHOW TABLES and EXPLAIN (of a "
                                                 f"SELECT) may run, not {what} (read system.tables or "
                                                 f"system.columns instead)") from e
                if "parseQueryToJSON" in e.reason and "UNKNOWN_FUNCTION" in e.reason:
                    raise ValidationError("sql", "this ClickHouse cannot check ad-hoc SQL (it lacks parseQueryToJSON); "
                                                 "ad-hoc SQL is refused") from e
                raise
        check_read_query(json.loads(parsed), self._catalog)
        return canonical

    def insert(self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str], *,
               dedup_token: str = "") -> int:
        """Insert ``rows`` (in ``columns`` order) into ``database.table``; returns the row count.

        Datetimes are written as the instant they are: aware ones are converted to UTC, naive
        ones are taken to be UTC (never the process's local zone, which is what the client
        library would assume; see :func:`_utc_column`).

        Args:
            rows: the rows, each a sequence in ``columns`` order.
            dedup_token: ``insert_deduplication_token``: the engine drops a later insert with the
                same token into the same table (within its deduplication window).

        Raises:
            UnavailableError: the engine/server cannot be reached; nothing was committed, or
                the commit is not known (a retry with the same token is safe).
            ValidationError: the engine (or the client, for a value its column type cannot hold)
                refused the rows; nothing was committed.
        """
        if not rows:
            return 0
        return self._insert_columns(table, [list(c) for c in zip(*rows)], columns, dedup_token)

    def _insert_columns(self, table: str, data: list[list], columns: Sequence[str], dedup_token: str) -> int:
        """:meth:`insert` of rows given column by column (``data[i]``: the values of ``columns[i]``,
        every list the same length, at least one row). The lists of datetime columns may be
        replaced by converted copies.

        Column-oriented, only the datetime columns are looked at (:func:`_utc_column`), not every
        value of every row, and the client does not pivot the rows itself (issue 15).
        """
        settings: dict[str, Any] = {}
        if dedup_token:
            settings["insert_deduplication_token"] = dedup_token
        if self.cluster:
            settings["distributed_foreground_insert"] = 1
        types = self._types_of(table, columns)
        for i, type_name in enumerate(types):
            if "DateTime" in type_name:
                data[i] = _utc_column(data[i])
        try:
            self._call(lambda c: c.insert(table, data, column_names=list(columns), database=self.database,
                                          settings=settings, column_type_names=types, column_oriented=True))
        except FedError:
            self._column_types.pop(table, None)  # the schema may have changed: read it again next time
            raise
        return len(data[0])

    def _types_of(self, table: str, columns: Sequence[str]) -> list[str]:
        """The ClickHouse type names of ``columns`` of ``table``, from a ``DESCRIBE TABLE`` kept
        :data:`COLUMN_TYPES_TTL_S` seconds (dropped sooner when an insert fails or this store runs
        a statement, e.g. :meth:`migrate`; the TTL is how another process's ``ALTER`` is seen). Given to the client's insert,
        they spare it the ``DESCRIBE`` it otherwise makes before every insert -- on chDB with
        the insert's settings applied by ``SET``, read back and restored: ~5 engine calls and
        ~3 ms CPU per insert (issue 15).

        Raises:
            UnavailableError / ValidationError: see :meth:`_call`.
        """
        now = self._monotonic()
        read_at, known = self._column_types.get(table, (0.0, None))
        if known is None or now - read_at >= self.COLUMN_TYPES_TTL_S or any(c not in known for c in columns):
            check_identifier("table", table)
            described = self._call(lambda c: c.query(f"DESCRIBE TABLE {self.database}.{table}"))
            known = {str(row[0]): str(row[1]) for row in described.result_rows}
            self._column_types[table] = (now, known)
        try:
            return [known[c] for c in columns]
        except KeyError as e:
            raise ValidationError("sql", f"{self.database}.{table} has no column {e.args[0]!r}") from None

    def existing_keys(self, table: str, key: Sequence[str], ids: Iterable[str]) -> set[tuple]:
        """Key tuples (columns ``key``) already in ``table`` among rows whose ``key[0]`` is in ``ids``.

        Raises:
            UnavailableError / ValidationError: see :meth:`query`.
        """
        ids = list(ids)
        if not ids:
            return set()
        cols = ", ".join(key)
        # in the embedded engine a lookup of a batch's keys runs on one thread: the query's own
        # thread pool costs more CPU (~4 ms of ~13 ms per 2,000 keys, issue 15) than it saves
        found = self.query(f"SELECT DISTINCT {cols} FROM {self.database}.{table} WHERE {key[0]} IN {{ids:Array(String)}}",
                           {"ids": string_array(ids)}, settings={"max_threads": 1} if self.embedded else None)
        return {tuple(row) for row in found.rows}

    def insert_new(self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str],
                   key: str | Sequence[str]) -> int:
        """Insert only the rows whose key is not yet in the table (nor repeated within ``rows``).

        Which keys are in the table is asked of the engine (:meth:`existing_keys`), except for
        the keys this store itself wrote or found there lately (:attr:`recent_keys` per table,
        the newest kept): a redelivered or bisected batch written a moment ago costs no lookup.
        The engine stays the authority for every key the memory does not hold -- whatever another
        process, or this one before a restart, wrote -- so the memory only saves lookups; it
        never lets a key in twice. A key is remembered only once its insert committed.

        The insert carries a deduplication token derived from the table and the keys written
        (see the module docstring), so repeating this call after an unknown outcome is safe.

        Args:
            table: table name in the store's database.
            rows: rows in ``columns`` order.
            columns: column names.
            key: the idempotency key: one column (e.g. ``event_id``) or several (e.g.
                ``("event_id", "card_model")`` when one event makes several rows); the first
                column is looked up.

        Returns:
            How many rows were inserted. Exact with one writer per table.

        Raises:
            UnavailableError / ValidationError: see :meth:`insert` (nothing is remembered then).
        """
        key = (key,) if isinstance(key, str) else tuple(key)
        columns = list(columns)
        idx = [columns.index(k) for k in key]
        if not rows:
            return 0
        data = [list(c) for c in zip(*rows)]
        # a key is its value (one column) or the tuple of its values (several)
        keys = data[idx[0]] if len(idx) == 1 else list(zip(*(data[i] for i in idx)))
        with self._lock:
            known = self._recent.get(table)
            if known is None:
                known = self._recent[table] = RecentSet(self.recent_keys)
            asked = {k for k in keys if k not in known}
            present: set = set()
            if asked:
                found = self.existing_keys(table, key, asked if len(idx) == 1 else {k[0] for k in asked})
                present = {k[0] for k in found} if len(idx) == 1 else found
            fresh: list[int] = []
            seen = set()
            for i, k in enumerate(keys):
                if k in seen or k in present or k in known:
                    continue
                seen.add(k)
                fresh.append(i)
            written = 0
            if fresh:
                if len(fresh) < len(keys):
                    data = [[col[i] for i in fresh] for col in data]
                token = dedup_token(table, ((k,) for k in seen) if len(idx) == 1 else seen)
                written = self._insert_columns(table, data, columns, token)
            for k in seen:
                known.add(k)
            for k in present:
                known.add(k)
            return written

    def ping(self) -> bool:
        """True if a trivial query succeeds."""
        try:
            self.query("SELECT 1")
            return True
        except FedError:
            return False

    def close(self) -> None:
        """Close the client (a chDB handle is released; other handles on the path stay open)."""
        with self._lock:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self._broken = True


def _utc_session(client: Any) -> Any:
    """``client`` with ``session_timezone = 'UTC'``: the embedded engine's server zone is the
    process's ``TZ``, and a server's is its own; with this, ``toDateTime('...')``, ``toStartOfDay``
    on zone-less values and typed parameters without a zone mean UTC in every process."""
    try:
        client.set_client_setting("session_timezone", "UTC")
    except Exception as e:  # noqa: BLE001 - translate
        raise _translate(e) from e
    return client


def _utc_rows(rows: Sequence[Sequence[Any]]) -> Sequence[Sequence[Any]]:
    """``rows`` with every datetime aware UTC (:func:`~fedsched.clock.as_utc`).

    clickhouse-connect turns a naive datetime into an instant with the process's local zone
    (``datetime.timestamp()``), so under ``TZ=Europe/Berlin`` a naive 00:30 UTC would be stored
    as 22:30 the day before; an aware value is stored exactly.
    """
    from fedsched.clock import as_utc

    return [[as_utc(v) if isinstance(v, datetime) else v for v in row] for row in rows]


def _utc_column(values: list) -> list:
    """A datetime column's ``values`` with every datetime aware UTC (:func:`~fedsched.clock.as_utc`,
    see :func:`_utc_rows`); ``values`` itself when each already is (the common case: one pass, no copy)."""
    from fedsched.clock import as_utc

    for v in values:
        if type(v) is not datetime or v.tzinfo is not UTC:
            return [as_utc(v) if isinstance(v, datetime) else v for v in values]
    return values


class _Literal:
    """A query parameter already in ClickHouse's text form (see :func:`string_array`)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


#: characters a string may hold to be written between quotes in a ClickHouse literal as it is
_UNQUOTED_SAFE = re.compile(r"[^0-9A-Za-z_.:/@+=-]")


def _literal_passes() -> bool:
    """Whether the client binds a :class:`_Literal` as its text (it binds an object of a type it
    does not know by ``str``): checked once, so another client version falls back to lists."""
    try:
        from clickhouse_connect.driver.binding import format_bind_value

        return format_bind_value(_Literal("['a', 'b']")) == "['a', 'b']" == format_bind_value(["a", "b"])
    except Exception:  # noqa: BLE001 - any doubt: no shortcut
        return False


_LITERALS_PASS: list[bool] = []


def string_array(values: list[str]) -> Any:
    """``values`` as the parameter of an ``Array(String)`` placeholder.

    The client formats a list parameter value by value (~3 us per 32-character id: ~6 ms for
    the 2,000 ids of an audit batch, issue 15); when every value consists only of letters, digits
    and ``_.:/@+=-`` (event ids are hex) there is nothing to escape, and the literal the client
    would write, ``['a', 'b']``, is made by one ``join`` instead. Any other value: the list itself
    (the client escapes it).
    """
    if not _LITERALS_PASS:
        _LITERALS_PASS.append(_literal_passes())
    if not _LITERALS_PASS[0] or not all(type(v) is str for v in values) or _UNQUOTED_SAFE.search("".join(values)):
        return values
    return _Literal("['" + "', '".join(values) + "']")


def dedup_token(table: str, keys: Iterable[tuple]) -> str:
    """The insert deduplication token of writing ``keys`` into ``table``: sha256 of both (hex)."""
    text = table + "\n" + "\n".join(sorted("\x1f".join(str(p) for p in k) for k in keys))
    return hashlib.sha256(text.encode()).hexdigest()


#: ClickHouse error codes that mean "not reachable / try later" rather than "this query is
#: wrong": NETWORK_ERROR, SOCKET_TIMEOUT, TOO_MANY_SIMULTANEOUS_QUERIES, NO_FREE_CONNECTION,
#: ALL_CONNECTION_TRIES_FAILED, TABLE_IS_READ_ONLY (a replica without its keeper), KEEPER_EXCEPTION,
#: MEMORY_LIMIT_EXCEEDED, TOO_MANY_PARTS, TIMEOUT_EXCEEDED (writers back off and retry on these).
_UNAVAILABLE_CODES = {210, 209, 202, 203, 279, 242, 999, 241, 252, 159}


def _translate(e: Exception, *, read_only: bool = False, limits: ReadLimits | None = None) -> FedError:
    """The engine's exception as a typed error: an answer from ClickHouse with an error code is
    about the query (:class:`ValidationError`, field ``sql``), unless the code says the server
    is unreachable or busy; no code and words like "connection"/"closed" mean unavailable. On a
    read-only (ad-hoc query) store, running past the time limit is the query's fault."""
    text = str(e)
    low = text.lower()
    m = re.search(r"Code: (\d+)\.", text)
    code = int(m.group(1)) if m else None
    limits = limits or ReadLimits()
    if code == 159 and read_only:
        return ValidationError("sql", f"the query ran past its time limit (max_execution_time, "
                                      f"{limits.max_execution_s} s)")
    if code == 241 and read_only:
        return ValidationError("sql", f"the query needed more memory than an ad-hoc query may use (max_memory_usage, "
                                      f"{limits.max_memory_bytes / 2 ** 30:g} GiB): "
                                      f"{text.strip().splitlines()[0][:300]}")
    if code is not None and code not in _UNAVAILABLE_CODES:
        return ValidationError("sql", text.strip().splitlines()[0][:1000])
    if m or any(s in low for s in ("connection", "timed out", "timeout", "refused", "unreachable", "closed",
                                   "failed to create connection", "network")):
        return UnavailableError(f"ClickHouse unavailable: {text[:500]}")
    return ValidationError("sql", text.strip().splitlines()[0][:1000] if text.strip() else repr(e))


def open_store(*, data_dir: Path | None = None, url: str = "", database: str = "fedsched",
               migrate: bool = True, chdb_path: Path | None = None, server: ServerOptions | None = None,
               cluster: str | None = None, ttl_days: dict[str, int] | None = None) -> Store:
    """Open the store: chDB on ``chdb_path`` (default ``data_dir/clickhouse``) when ``url`` is
    empty, else the server (``server``: credentials, TLS; ``cluster``: the replicated variant).

    Raises:
        UnavailableError: the engine cannot be opened / the server cannot be reached.
        SchemaError: the database schema is newer than this binary.
        ValidationError: a cluster with the embedded engine, or a bad URL.
    """
    if url:
        where = urlparse(url)
        store = Store(_http_client(url, database, server), database, embedded=False, cluster=cluster,
                      reopen=lambda: _http_client(url, database, server),
                      read_client=lambda: _http_client(url, database, server),
                      location=f"{where.hostname}:{where.port}")
    else:
        if cluster:
            raise ValidationError("clickhouse_cluster", "the embedded engine is one node; a cluster needs a server URL")
        if chdb_path is None and data_dir is None:
            raise ValidationError("data_dir", "the embedded store needs a data directory")
        path = Path(chdb_path) if chdb_path else Path(data_dir) / "clickhouse"
        store = Store(_chdb_client(path), database, embedded=True, reopen=lambda: _chdb_client(path, fresh=True),
                      read_client=lambda: _chdb_reader(path), location=f"chdb:{socket.gethostname()}:{path.resolve()}")
    if migrate:
        store.migrate(ttl_days=ttl_days)
    return store


def open_store_from(settings: Any, *, migrate: bool = True) -> Store:
    """:func:`open_store` with everything taken from :class:`~fedsched.settings.Settings`."""
    server = ServerOptions(user=settings.clickhouse_user,
                           password=settings.clickhouse_password.get_secret_value(),
                           ca_cert=str(settings.clickhouse_ca_cert or ""), verify=settings.clickhouse_verify)
    return open_store(data_dir=Path(settings.data_dir), url=settings.clickhouse_url,
                      database=settings.clickhouse_database, chdb_path=settings.clickhouse_path, server=server,
                      cluster=settings.clickhouse_cluster or None, ttl_days=dict(settings.clickhouse_ttl_days),
                      migrate=migrate)


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
