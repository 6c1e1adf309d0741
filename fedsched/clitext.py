"""The CLI's consoles: text is printed as given, never parsed as rich markup.

Names, reasons and SQL results come from users and the store; a value such as ``[/x]`` or
``[bold]`` must print as itself (and must not crash rich's markup parser), so both consoles have
markup off and styling is explicit (:func:`styled`).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

console = Console(markup=False)
err = Console(stderr=True, markup=False, soft_wrap=True)  # one line per error, for grep


def styled(*parts: str | tuple[str, str]) -> Text:
    """A line from plain strings and ``(text, style)`` pairs, e.g. ``styled(("error:", "red"), " bad")``."""
    return Text.assemble(*parts)


def error_line(label: str, message: object) -> Text:
    """``label`` in red, then ``message`` as plain text."""
    return styled((label, "red"), f" {message}")
