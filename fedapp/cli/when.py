"""Time options of the CLI (``report --from/--to``, and any new one): one parser for all.

Every time option takes what ``jobs --since`` takes (:func:`fedapp.cli.jobs.parse_when`, called,
not copied): an ISO-8601 time (``2026-11-30``, ``2026-11-30T22:55:00Z``, ``...+09:00``; no zone =
UTC) or an age before now (``90m``, ``2h``, ``1.5d``). This module adds, around that parser:

* the *end* of a window may be in the future (``--to`` tomorrow); its start may not;
* a date alone as the *end* of a window means the end of that day (``--from 2026-11-30 --to
  2026-11-30`` is that one day, [00:00, 24:00) UTC);
* one typed error, :class:`TimeOptionError`, for every refusal, including values out of the
  datetime range (``99999999d``, ``1e20s``, ``infm``: an ``OverflowError`` inside the parser)
  and times before 1970 (protobuf Timestamps and the audit log start there).

Errors::

    ValueError
    └── fedapp.cli.jobs.WhenError      flag, text, reason
        └── TimeOptionError
"""

from __future__ import annotations

import datetime as dt

import typer

from fedapp.cli.jobs import _EPOCH as EPOCH, _ISO_DATE as _DATE_ONLY, WhenError, parse_when  # the one parser
from fedapp.cli.text import err, error_line

#: What every time option accepts, as refusals say it.
FORMS = ("an ISO-8601 time (2026-11-30, 2026-11-30T22:55:00Z, 2026-11-30T22:55:00+09:00; no zone = UTC) "
         "or an age before now (30m, 2h, 1.5d)")


class TimeOptionError(WhenError):
    """A time option's value that is not one of :data:`FORMS` or is out of range (the message
    names :data:`FORMS`; ``flag``, ``text`` and ``reason`` as in :class:`WhenError`)."""

    forms = FORMS


def parse_time(text: str, flag: str, now: dt.datetime | None = None, *, end_of_day: bool = False,
               future: bool = False) -> dt.datetime:
    """``text`` as a timezone-aware UTC datetime, by the parser of ``jobs --since``.

    Args:
        text: the option's value.
        flag: the option's name (for the error).
        now: the present moment ages count back from (default: the wall clock, UTC).
        end_of_day: a date alone (``2026-11-30``) means the end of that day (the next midnight
            UTC), for the exclusive end of a window.
        future: a time after ``now`` is accepted (the end of a window, ``--to``); without it a
            future time is refused (a window's start, ``--from``).

    Raises:
        TimeOptionError: not a time or age the parser accepts (its own refusal's text as the
            reason), an age reaching beyond the datetime range, or a time before 1970.
        typer.Exit: (code 2, message printed) from the parser itself, for a value it refuses
            while it still reports refusals that way.
    """
    now = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    try:
        when = parse_when(text, flag, now, future=future)
    except OverflowError:
        raise TimeOptionError(flag, text, "is out of range (an age that reaches back beyond year 1)") from None
    except ValueError as e:  # the parser's typed refusal (a ValueError subclass)
        raise TimeOptionError(flag, text, getattr(e, "reason", str(e))) from None
    when = when.astimezone(dt.UTC)
    if when < EPOCH:
        raise TimeOptionError(flag, text, "is before 1970")
    if end_of_day and _DATE_ONLY.fullmatch(text.strip()):
        when += dt.timedelta(days=1)
    return when


def time_option(text: str | None, flag: str, now: dt.datetime | None = None, *,
                end_of_day: bool = False, future: bool = False) -> dt.datetime | None:
    """:func:`parse_time` for a command: None for an unset option; a refusal is printed as
    ``<flag> <message>`` on stderr and exits 2."""
    if text is None or text == "":
        return None
    try:
        return parse_time(text, flag, now, end_of_day=end_of_day, future=future)
    except TimeOptionError as e:
        err.print(error_line(e.flag, str(e)))
        raise typer.Exit(2) from None
