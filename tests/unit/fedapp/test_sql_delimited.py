"""``fedsched sql -o csv`` / ``-o tsv``: a header row, then one line per row, quoted by the csv
module (a reader gives back exactly the values), values as text, times in UTC. The query runs
on a real chDB store through the CLI (COLUMNS=20: no console width applies); the value rules
are a table."""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import subprocess
import sys
from decimal import Decimal

import pytest
from typer.testing import CliRunner

from fedapp.cli import app
from fedapp.cli.text import cell_text, delimited

QUERY = ("SELECT * FROM (SELECT toDateTime64('2023-03-01 12:00:00.123', 3, 'UTC') AS at, toDecimal64(1.5, 4) AS cost, "
         "'a,\"b\"\tc\nd' AS name, NULL AS nothing, [1, 2] AS ids, true AS ok, toDate('2023-01-02') AS day, "
         "'2026-11-30T22:55:00+09:00' AS note "
         "UNION ALL SELECT toDateTime64('2023-03-01 13:00:00', 3, 'UTC'), toDecimal64(0, 4), 'plain', NULL, [], "
         "false, toDate('2023-01-03'), '2026-11-30T22:55:00') ORDER BY at")
HEADER = ["at", "cost", "name", "nothing", "ids", "ok", "day", "note"]
# a String that looks like a time is text, kept as it is (only DateTime columns are converted)
ROWS = [["2023-03-01T12:00:00.123000Z", "1.5000", 'a,"b"\tc\nd', "", "[1, 2]", "true", "2023-01-02",
         "2026-11-30T22:55:00+09:00"],
        ["2023-03-01T13:00:00Z", "0.0000", "plain", "", "[]", "false", "2023-01-03", "2026-11-30T22:55:00"]]


@pytest.mark.parametrize("fmt, delimiter", [("csv", ","), ("tsv", "\t")])
def test_sql_writes_a_header_and_rows_a_csv_reader_gives_back(tmp_path, fmt, delimiter):
    # its own process and data dir: `sql` closes the embedded engine it opened (one per process)
    (tmp_path / "clickhouse").mkdir()
    result = subprocess.run([sys.executable, "-m", "fedapp.cli", "sql", "--data-dir", str(tmp_path), "-o", fmt, QUERY],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "20"})
    assert result.returncode == 0, result.stderr
    assert list(csv.reader(io.StringIO(result.stdout), delimiter=delimiter)) == [HEADER, *ROWS]
    assert result.stdout.startswith(delimiter.join(HEADER) + "\n")  # header first; \n line ends
    assert '"a,""b""\tc\nd"' in result.stdout  # quoted, inner quotes doubled, the line break kept inside


@pytest.mark.parametrize("value, type_name, text", [
    (None, "", ""),
    (dt.datetime(2026, 11, 30, 22, 55), "", "2026-11-30T22:55:00Z"),  # the store's naive times are UTC
    (dt.datetime(2026, 12, 1, 7, 55, tzinfo=dt.timezone(dt.timedelta(hours=9))), "", "2026-11-30T22:55:00Z"),
    # as the running system sends a time: ISO text, its column's type says it is one
    ("2026-11-30T22:55:00.123000", "DateTime64(3, 'UTC')", "2026-11-30T22:55:00.123000Z"),
    ("2026-12-01T07:55:00+09:00", "Nullable(DateTime)", "2026-11-30T22:55:00Z"),
    ("2026-11-30T22:55:00+09:00", "String", "2026-11-30T22:55:00+09:00"),  # text that looks like a time
    ("2026-11-30T22:55:00", "", "2026-11-30T22:55:00"),  # type not known: kept as it is
    ("2026-11-30 22:55", "", "2026-11-30 22:55"),
    (dt.date(2026, 11, 30), "", "2026-11-30"),
    (Decimal("12.3400"), "", "12.3400"),
    (True, "", "true"),
    (0.1, "", "0.1"),
    ({"k": [1, None]}, "", '{"k": [1, null]}'),
    (b"\xffab", "", "\ufffdab"),
], ids=["null", "naive-utc", "offset", "iso-time-column", "iso-nullable-time-column", "time-like-string",
        "untyped-string", "other-string", "date", "decimal", "bool", "float", "map", "bytes"])
def test_each_value_as_text(value, type_name, text):
    assert cell_text(value, type_name) == text


def test_the_running_systems_answer_converts_only_its_datetime_columns():
    """Through NATS every value is JSON: the reply's column types say which strings are times."""
    out = io.StringIO()
    delimited(["at", "note"], [["2026-12-01T07:55:00+09:00", "2026-12-01T07:55:00+09:00"]], out,
              types=["DateTime64(3, 'UTC')", "String"])
    assert out.getvalue() == "at,note\n2026-11-30T22:55:00Z,2026-12-01T07:55:00+09:00\n"
    out = io.StringIO()
    delimited(["at"], [["2026-12-01T07:55:00"]], out)  # no types (an older system): as sent
    assert out.getvalue() == "at\n2026-12-01T07:55:00\n"


def test_the_store_reports_each_columns_type(store):
    result = store.reader().query("SELECT toDateTime64('2023-03-01 12:00:00', 3, 'UTC') AS at, 'x' AS s")
    assert result.columns == ("at", "s") and result.types[1] == "String" and result.types[0].startswith("DateTime64")


def test_an_empty_answer_is_the_header_alone():
    out = io.StringIO()
    delimited(["a", "b"], [], out, delimiter="\t")
    assert out.getvalue() == "a\tb\n"


def test_sql_help_names_every_format():
    result = CliRunner().invoke(app, ["sql", "--help"], env={"COLUMNS": "200"})
    assert all(f in result.stdout for f in ("table", "json", "csv", "tsv"))
