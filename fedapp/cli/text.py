"""The CLI's consoles: text is printed as given, never parsed as rich markup.

Names, reasons and SQL results come from users and the store; a value such as ``[/x]``,
``[bold]`` or ``:x:`` must print as itself (and must not crash rich's markup parser), so both
consoles have markup and emoji codes off and styling is explicit (:func:`styled`).
"""

from __future__ import annotations

from enum import Enum

from rich.console import Console
from rich.text import Text

# text is printed as given: no markup, no :emoji: codes, no highlighting, no wrapping of long
# lines (YAML, tokens, SQL results must survive `> file`; tables still fit the terminal)
console = Console(markup=False, emoji=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)


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
