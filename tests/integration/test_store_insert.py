"""Store inserts on the real engine (issue 15): the column types are read once per table, not
by a ``DESCRIBE`` before every insert; the rows land exactly, datetimes as the instant they are;
a column added after the types were read makes them be read again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

COLUMNS = ("event_id", "type", "occurred_at", "producer", "subject", "payload")


def _rows(lo: int, n: int) -> list[list]:
    at = datetime(2026, 12, 1, 3, 0, tzinfo=timezone(timedelta(hours=8)))  # converted to UTC, never dropped
    return [[f"{i:032x}", "job.started", at + timedelta(seconds=i), "agent/c1", "t.status.r.c1", "{}"]
            for i in range(lo, lo + n)]


def _count_describes(store) -> list[str]:
    """The ``DESCRIBE`` statements the embedded engine runs from now on (every statement the
    client sends it passes its backend's ``_run``/``_run_with_settings``, clickhouse-connect's
    own ``DESCRIBE`` before an insert included)."""
    backend = getattr(store.client, "_backend", None)
    if backend is None or not hasattr(backend, "_run_with_settings"):
        pytest.skip("counts the statements of the embedded (chDB) engine")
    seen: list[str] = []
    for name in ("_run", "_run_with_settings"):
        original = getattr(backend, name)

        def counted(sql, *args, _original=original, **kwargs):
            text = sql.decode() if isinstance(sql, bytes) else sql
            if text.lstrip().upper().startswith("DESCRIBE"):
                seen.append(text)
            return _original(sql, *args, **kwargs)

        setattr(backend, name, counted)
    return seen


def test_the_column_types_are_read_once_per_table_not_before_every_insert(store) -> None:
    describes = _count_describes(store)
    for batch in range(5):
        assert store.insert_new("events", _rows(batch * 10, 10), COLUMNS, ("event_id", "subject")) == 10
    db = store.database
    assert len(describes) == 1
    assert store.query(f"SELECT count(), uniqExact(event_id) FROM {db}.events").rows == [(50, 50)]
    first = store.query(f"SELECT occurred_at FROM {db}.events WHERE event_id = {{i:String}}", {"i": f"{0:032x}"})
    assert first.scalar().replace(tzinfo=UTC) == datetime(2026, 11, 30, 19, 0, tzinfo=UTC)


def test_an_insert_after_a_schema_change_reads_the_types_again(store) -> None:
    describes = _count_describes(store)
    store.insert("events", _rows(0, 1), COLUMNS)
    db = store.database
    store.client.command(f"ALTER TABLE {db}.events ADD COLUMN extra String DEFAULT ''")
    # a column the types read before do not know: they are read again
    assert store.insert("events", [[*_rows(2, 1)[0], "x"]], (*COLUMNS, "extra")) == 1
    assert len(describes) == 2
    assert store.query(f"SELECT extra FROM {db}.events WHERE event_id = {{i:String}}",
                       {"i": f"{2:032x}"}).scalar() == "x"


class _Clock:
    """A monotonic clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ms_table(store) -> tuple[str, list[list]]:
    """A table with a second-precision ``at`` column, and a row whose ``at`` has milliseconds."""
    db = store.database
    store.client.command(f"CREATE TABLE {db}.ms_probe (id String, at DateTime('UTC')) ENGINE = MergeTree ORDER BY id")
    return "ms_probe", [["a", datetime(2026, 12, 1, 3, 0, 0, 123000, tzinfo=UTC)]]


def test_an_alter_by_another_process_is_seen_once_the_types_have_aged(store) -> None:
    from fedsched.store import Store

    clock = _Clock()
    writer = Store(store.client, store.database, embedded=store.embedded, monotonic=clock)
    table, rows = _ms_table(store)
    writer.insert(table, [["first", rows[0][1]]], ("id", "at"))  # the types are read: DateTime
    # another process (here another Store, whose DDL this writer does not see) widens the column
    store.client.command(f"ALTER TABLE {store.database}.{table} MODIFY COLUMN at DateTime64(3, 'UTC')")
    clock.t += 60.0  # the TTL (Store.COLUMN_TYPES_TTL_S)
    writer.insert(table, rows, ("id", "at"))
    got = store.query(f"SELECT at FROM {store.database}.{table} WHERE id = 'a'").scalar()
    assert got.replace(tzinfo=UTC).microsecond == 123000


def test_migrate_forgets_the_column_types(store) -> None:
    from fedsched.store import Store

    clock = _Clock()  # never moves: only the DDL path can make the types be read again
    writer = Store(store.client, store.database, embedded=store.embedded, monotonic=clock)
    table, rows = _ms_table(store)
    writer.insert(table, [["first", rows[0][1]]], ("id", "at"))
    store.client.command(f"ALTER TABLE {store.database}.{table} MODIFY COLUMN at DateTime64(3, 'UTC')")
    writer.migrate()
    writer.insert(table, rows, ("id", "at"))
    got = store.query(f"SELECT at FROM {store.database}.{table} WHERE id = 'a'").scalar()
    assert got.replace(tzinfo=UTC).microsecond == 123000


def _count_lookups(store) -> list[str]:
    """The key lookups (``SELECT DISTINCT``) ``store`` asks its engine from now on."""
    seen: list[str] = []
    original = store.query

    def counted(sql, *args, **kwargs):
        if "SELECT DISTINCT" in sql:
            seen.append(sql)
        return original(sql, *args, **kwargs)

    store.query = counted
    return seen


def _restarted(store):
    """Another :class:`~fedsched.store.Store` on the same database: what a restarted writer opens
    (nothing in its memory of recent keys)."""
    from fedsched.store import Store

    return Store(store.client, store.database, embedded=store.embedded, cluster=store.cluster)


def test_keys_written_a_moment_ago_are_not_asked_again_and_not_written_twice(store) -> None:
    """A redelivered batch (or one bisected and written again) is answered by the store's memory
    of the keys it just wrote: no lookup, no second row."""
    rows = _rows(0, 20)
    assert store.insert_new("events", rows, COLUMNS, ("event_id", "subject")) == 20
    lookups = _count_lookups(store)
    assert store.insert_new("events", rows[5:] + rows[:5], COLUMNS, ("event_id", "subject")) == 0
    assert lookups == []
    # a batch with a key the memory does not hold asks the engine, and writes only that key
    assert store.insert_new("events", rows[:3] + _rows(20, 1), COLUMNS, ("event_id", "subject")) == 1
    assert len(lookups) == 1
    assert store.query(f"SELECT count(), uniqExact(event_id) FROM {store.database}.events").rows == [(21, 21)]


def test_after_a_restart_the_engine_says_which_keys_are_written(store) -> None:
    """The memory is this process's only: a writer restarted (its memory empty) asks the engine,
    which keeps a redelivered event to one row."""
    assert store.insert_new("events", _rows(0, 10), COLUMNS, ("event_id", "subject")) == 10
    successor = _restarted(store)
    lookups = _count_lookups(successor)
    assert successor.insert_new("events", _rows(0, 10) + _rows(10, 2), COLUMNS, ("event_id", "subject")) == 2
    assert len(lookups) == 1
    assert store.query(f"SELECT count(), uniqExact(event_id) FROM {store.database}.events").rows == [(12, 12)]


def test_a_key_is_remembered_only_once_its_insert_committed(store) -> None:
    """An insert the engine refuses leaves nothing in the memory: the same key, written again
    with a value it can hold, is written (a key remembered before its commit would be lost)."""
    from fedsched.errors import ValidationError

    columns = (*COLUMNS, "attempt")
    bad = [[*_rows(0, 1)[0], 2 ** 32]]  # attempt is a UInt32
    with pytest.raises(ValidationError):
        store.insert_new("events", bad, columns, ("event_id", "subject"))
    assert store.insert_new("events", [[*_rows(0, 1)[0], 1]], columns, ("event_id", "subject")) == 1
    assert store.query(f"SELECT attempt FROM {store.database}.events").rows == [(1,)]


def test_the_memory_of_recent_keys_is_bounded_and_a_forgotten_key_is_asked_of_the_engine(store) -> None:
    from fedsched.store import Store

    small = Store(store.client, store.database, embedded=store.embedded, cluster=store.cluster, recent_keys=3)
    assert small.insert_new("events", _rows(0, 5), COLUMNS, ("event_id", "subject")) == 5
    assert len(small._recent["events"]) == 3
    lookups = _count_lookups(small)
    assert small.insert_new("events", _rows(0, 5), COLUMNS, ("event_id", "subject")) == 0  # the first 2: asked
    assert len(lookups) == 1
    assert small.query(f"SELECT count() FROM {store.database}.events").scalar() == 5


def test_a_key_of_one_column_and_keys_that_need_quoting(store) -> None:
    """``usage``-like single-column keys, and ids with quotes, backslashes and non-ASCII (which
    the lookup's parameter must escape) are looked up exactly."""
    odd = ["it's", "back\\slash", "中文", "plain-1", "a,b"]
    rows = [[f"{i:032x}", "job.started", datetime(2026, 12, 1, tzinfo=UTC), "p", subject, "{}"]
            for i, subject in enumerate(odd)]
    assert store.insert_new("events", rows, COLUMNS, "event_id") == 5
    assert _restarted(store).insert_new("events", rows, COLUMNS, ("event_id", "subject")) == 0
    rows2 = [[oid, "job.started", datetime(2026, 12, 1, tzinfo=UTC), "p", "s", "{}"] for oid in odd]
    assert store.insert_new("events", rows2, COLUMNS, "event_id") == 5
    assert _restarted(store).insert_new("events", rows2, COLUMNS, "event_id") == 0
    assert store.query(f"SELECT count() FROM {store.database}.events").scalar() == 10


def test_a_naive_or_offset_datetime_column_is_written_as_the_utc_instant(store) -> None:
    at = datetime(2026, 12, 1, 3, 0, tzinfo=timezone(timedelta(hours=8)))
    rows = [[f"{1:032x}", "x", at, "p", "s", "{}"], [f"{2:032x}", "x", datetime(2026, 12, 1, 3, 0), "p", "s", "{}"]]
    assert store.insert_new("events", rows, COLUMNS, "event_id") == 2
    got = dict(store.query(f"SELECT event_id, occurred_at FROM {store.database}.events").rows)
    assert got[f"{1:032x}"].replace(tzinfo=UTC) == datetime(2026, 11, 30, 19, 0, tzinfo=UTC)
    assert got[f"{2:032x}"].replace(tzinfo=UTC) == datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
