"""Reading configuration YAML (policy, price catalog, card catalog) defensively.

``yaml.safe_load`` never runs code, but it still expands aliases: a few hundred bytes of nested
``&a [*b, *b, ...]`` anchors (the "billion laughs") make a structure of billions of nodes and
freeze whoever walks it. Configuration has no use for anchors, so they are refused, and the text
size is capped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fedsched.errors import ValidationError

#: Largest configuration text accepted (characters).
MAX_YAML_CHARS = 1_000_000


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (``*name``)."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed here",
                                              event.start_mark)
        return super().compose_node(parent, index)


def load_yaml(text: str, field: str, *, max_chars: int = MAX_YAML_CHARS) -> Any:
    """Parse one YAML (or JSON) document without aliases.

    Args:
        text: the document.
        field: names the input in errors (e.g. ``policy``, ``price_catalog``).
        max_chars: size limit (characters).

    Raises:
        ValidationError: larger than ``max_chars``, not valid YAML, or uses aliases.
    """
    if len(text) > max_chars:
        raise ValidationError(field, f"larger than {max_chars} characters")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValidationError(field, f"not valid YAML: {e}") from e


def read_text(path: Path, field: str) -> str:
    """The UTF-8 text of a configuration file (a policy, a price catalog).

    Raises:
        ValidationError: unreadable or not UTF-8 (field ``field``).
    """
    try:
        return Path(path).read_text("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(field, f"{path} is not UTF-8 text (byte {e.start}); expected YAML") from e
    except OSError as e:
        raise ValidationError(field, f"cannot read {path}: {e.strerror or e}") from e
