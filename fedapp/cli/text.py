"""The CLI's consoles: text is printed as given, never parsed as rich markup.

Names, reasons and SQL results come from users and the store; a value such as ``[/x]``,
``[bold]`` or ``:x:`` must print as itself (and must not crash rich's markup parser), so both
consoles have markup and emoji codes off and styling is explicit (:func:`styled`).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re

from enum import Enum

from rich.console import Console, ConsoleDimensions
from rich.text import Text

#: Width of tables written to a pipe or a file when ``COLUMNS`` is not set: wide enough that a
#: job's row stays one line (``fedsched jobs | grep x`` sees whole rows), while a cell longer
#: still ends in an ellipsis.
PIPE_WIDTH = 512


class CliConsole(Console):
    """A rich console whose width is, in this order: ``COLUMNS`` when set (to a number); the
    terminal's width when it writes to a terminal; else :data:`PIPE_WIDTH` columns.

    rich's own default for a pipe is 80 columns, or the width of whichever of stdin/stderr is a
    terminal: ``fedsched jobs | grep`` then saw rows wrapped over several lines.
    """

    @property
    def size(self) -> ConsoleDimensions:
        """The console's (columns, lines), as the class docstring says."""
        size = Console.size.fget(self)
        columns = self._environ.get("COLUMNS", "")
        if self._width is None and not columns.isdigit() and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    def print(self, *objects, **kwargs) -> None:
        """``Console.print``; tables and other renderables (not strings or :class:`Text`) are laid
        out within the width (the console's ``soft_wrap`` lets lines of text run on, but would
        let a table run past the width too)."""
        if "soft_wrap" not in kwargs and any(not isinstance(o, (str, Text)) for o in objects):
            kwargs["soft_wrap"] = False
        super().print(*objects, **kwargs)


# text is printed as given: no markup, no :emoji: codes, no highlighting, no wrapping of long
# lines (YAML, tokens, SQL results must survive `> file`; tables fit the terminal, or
# PIPE_WIDTH in a pipe)
console = CliConsole(markup=False, emoji=False, highlight=False, soft_wrap=True)
err = CliConsole(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)


def styled(*parts: str | tuple[str, str]) -> Text:
    """A line from plain strings and ``(text, style)`` pairs, e.g. ``styled(("error:", "red"), " bad")``."""
    return Text.assemble(*parts)


def error_line(label: str, message: object) -> Text:
    """``label`` in red, then ``message`` as plain text."""
    return styled((label, "red"), f" {message}")


class Output(str, Enum):
    """``--output``: ``table`` (for people) or ``json`` (for scripts); anything else is a usage error."""

    table = "table"
    json = "json"


class SqlOutput(str, Enum):
    """``fedsched sql --output``: ``table`` (for people), ``json`` (for scripts), ``csv`` or
    ``tsv`` (for spreadsheets and shell tools: :func:`delimited`)."""

    table = "table"
    json = "json"
    csv = "csv"
    tsv = "tsv"


#: A ClickHouse type name of a time column (``DateTime``, ``DateTime64(3, 'UTC')``, also inside
#: ``Nullable(...)`` / ``LowCardinality(...)``): the running system sends its values as ISO text.
_TIME_TYPE = re.compile(r"^(?:(?:Nullable|LowCardinality)\()*DateTime(?:64)?\b")


def cell_text(value, type_name: str = "") -> str:
    """One result value as CSV/TSV text: NULL empty; a time as ISO-8601 UTC ending in ``Z``
    (``2026-11-30T22:55:00.123000Z``; the store's naive times are UTC) -- a datetime, or the ISO
    text the running system sends for a value whose column ``type_name`` is a ClickHouse
    ``DateTime``/``DateTime64`` (a string of any other or unknown type is kept as it is, even
    one that looks like a time); a date ``2026-11-30``; Decimals exactly as stored; booleans
    ``true``/``false``; arrays, tuples and maps as JSON; bytes as UTF-8 (bad bytes replaced);
    anything else its ``str``."""
    if value is None:
        return ""
    if isinstance(value, str) and type_name and _TIME_TYPE.match(type_name):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return value
    if isinstance(value, dt.datetime):
        utc = value.astimezone(dt.UTC).replace(tzinfo=None) if value.tzinfo else value
        return utc.isoformat() + "Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return strict_json(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    return str(value)


def delimited(columns, rows, out, *, delimiter: str = ",", types=()) -> None:
    """Write a query result to the text stream ``out`` as CSV (``delimiter=","``) or TSV
    (``"\\t"``): a header row of column names, then one line per row of :func:`cell_text`
    values (``types``: the columns' ClickHouse type names, when known), quoted by the :mod:`csv`
    module where needed (a value holding the delimiter, a quote or a line break is enclosed in
    double quotes, its quotes doubled); lines end in ``\\n``."""
    writer = csv.writer(out, delimiter=delimiter, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    writer.writerow(columns)
    names = list(types) if len(types) == len(columns) else [""] * len(columns)
    for row in rows:
        writer.writerow([cell_text(v, t) for v, t in zip(row, names)])


def _finite(value):
    """``value`` with every NaN or infinite float replaced by None, recursively (lists, tuples,
    dicts)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(value, *, indent: int | None = None) -> str:
    """JSON that strict parsers accept: NaN and infinities (e.g. the average of no rows) become
    ``null``, anything else JSON has no type for (datetimes, Decimals) its ``str``."""
    return json.dumps(_finite(value), indent=indent, default=str, allow_nan=False)


def clip(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters, ending in an ellipsis when cut (never cut silently)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7f, 0xa0))}


def printable(text: str) -> Text:
    """``text`` as it may reach a terminal: control characters (C0, DEL, C1 -- e.g. an escape
    sequence in a job's reason that would set the window title or clear the screen of whoever
    lists the job) shown as ``\\xNN``, and never read as rich markup (a ``[red]`` in a reason
    stays those characters). Returns a :class:`rich.text.Text` (its ``plain`` is the string)."""
    return Text(text.translate(_CONTROL))


def safe(text: str) -> str:
    """``text`` for a rich markup string (``console.print(f"... {safe(x)}")``, a table cell):
    control characters escaped as in :func:`printable` and markup characters escaped."""
    from rich.markup import escape

    return escape(text.translate(_CONTROL))


def money(amount: object, currency: str = "") -> str:
    """An amount of money for people, to the cent (``"12.35 CNY"``): the exact stored value (a
    decimal string, Decimal, int or float) rounded half-to-even to 2 places; "-" for an empty
    amount, the text itself for one that is not a number. Only tables use it: JSON output keeps
    the exact value."""
    from decimal import Decimal, InvalidOperation

    if amount is None or amount == "":
        return "-"
    try:
        value = Decimal(str(amount)).quantize(Decimal("0.01"))
    except (InvalidOperation, ValueError):
        return str(amount)
    return f"{value} {currency}".rstrip()
