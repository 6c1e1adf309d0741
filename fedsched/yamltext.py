"""Reading configuration YAML (policy, price catalog, card catalog) defensively.

``yaml.safe_load`` never runs code, but it still expands aliases: a few hundred bytes of nested
``&a [*b, *b, ...]`` anchors (the "billion laughs") make a structure of billions of nodes and
freeze whoever walks it. Configuration has no use for anchors, so they are refused, and the text
size is capped. A key given twice in one mapping is an error (YAML 1.2 says keys are unique;
PyYAML would silently keep the last one, so ``tenant: a`` ... ``tenant: b`` would submit to b), and
so is nesting deeper than :data:`MAX_DEPTH` (a deeply nested document would otherwise exhaust
the parser's recursion).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fedsched.errors import ValidationError

#: Largest configuration text accepted (characters).
MAX_YAML_CHARS = 1_000_000
#: Deepest nesting of mappings and sequences accepted (levels).
MAX_DEPTH = 64


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (``*name``)."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed here",
                                              event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"key {key!r} is given twice (first {seen[key]})", key_node.start_mark)
                    seen[key] = f"line {key_node.start_mark.line + 1}"
                except TypeError:
                    pass  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep=deep)


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


def read_bounded(stream, max_chars: int) -> str | None:
    """At most ``max_chars`` characters of the text ``stream`` (a file opened in text mode, or
    stdin), or None when it holds more: the read stops there, so ``/dev/zero`` or ``yes |``
    cannot fill the memory before the size check. Raises what the stream's ``read`` raises."""
    text = stream.read(max_chars + 1)
    return None if len(text) > max_chars else text


def read_text(path: Path, field: str, *, max_chars: int = MAX_YAML_CHARS) -> str:
    """The UTF-8 text of a configuration file (a policy, a price catalog, a topology), read at
    most ``max_chars`` characters far.

    Raises:
        ValidationError: unreadable, not UTF-8 or larger than ``max_chars`` (field ``field``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = read_bounded(f, max_chars)
    except UnicodeDecodeError as e:
        raise ValidationError(field, f"{path} is not UTF-8 text (byte {e.start}); expected YAML") from e
    except OSError as e:
        raise ValidationError(field, f"cannot read {path}: {e.strerror or e}") from e
    if text is None:
        raise ValidationError(field, f"{path} is larger than {max_chars} characters")
    return text
