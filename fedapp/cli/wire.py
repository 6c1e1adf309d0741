"""The CLI's one spelling of the API's enums, in tables, filters and JSON output alike.

An enum value is written as its proto name without the enum's prefix, in lower case:
``JOB_STATE_AWAITING_APPROVAL`` -> ``awaiting_approval``, ``PRIORITY_CLASS_BEST_EFFORT`` ->
``best_effort``. The prefix is the name of the enum's zero value without ``UNSPECIFIED`` (every
enum of ``fedsched.api.v1`` starts with ``<PREFIX>_UNSPECIFIED = 0``). ``--output json`` goes
through :func:`message_dict`, so what a script reads is what ``--state`` and the table say.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message


def enum_prefix(enum: EnumDescriptor) -> str:
    """The prefix every value name of ``enum`` carries, e.g. ``JOB_STATE_`` (from its zero
    value ``JOB_STATE_UNSPECIFIED``; empty for an enum without such a value)."""
    zero = enum.values_by_number.get(0)
    if zero is not None and zero.name.endswith("UNSPECIFIED"):
        return zero.name.removesuffix("UNSPECIFIED")
    return ""


def enum_word(enum: EnumDescriptor, number: int) -> str:
    """The CLI's word for value ``number`` of ``enum`` (``queued``); an unknown number (a newer
    server) as its decimal string."""
    value = enum.values_by_number.get(number)
    if value is None:
        return str(number)
    return value.name.removeprefix(enum_prefix(enum)).lower()


def enum_number(enum: EnumDescriptor, word: str) -> int | None:
    """The value of ``enum`` the CLI's ``word`` names (case and ``-``/``_`` ignored, e.g.
    ``awaiting-approval``), or None when none does (the zero value, UNSPECIFIED, included)."""
    name = enum_prefix(enum) + word.strip().upper().replace("-", "_")
    value = enum.values_by_name.get(name)
    return None if value is None or (value.number == 0 and name.endswith("UNSPECIFIED")) else value.number


def enum_words(enum: EnumDescriptor) -> list[str]:
    """Every word of ``enum`` but its zero UNSPECIFIED value, in declaration order."""
    return [enum_word(enum, v.number) for v in enum.values if not (v.number == 0 and v.name.endswith("UNSPECIFIED"))]


def message_dict(message: Message, **options: Any) -> dict:
    """``message`` as a JSON-ready dict for ``--output json``: proto field names, and every enum
    value (fields, repeated fields, map values, nested messages) as :func:`enum_word`.

    Args:
        message: any protobuf message.
        **options: passed to ``MessageToDict`` (e.g. ``always_print_fields_with_no_presence``).
    """
    return _words(message.DESCRIPTOR, MessageToDict(message, preserving_proto_field_name=True, **options))


def _words(descriptor, value: dict) -> dict:
    """``value`` (``MessageToDict`` of a ``descriptor`` message) with enum names as words."""
    if descriptor.full_name.startswith("google.protobuf."):  # well-known types have their own JSON form
        return value
    out = {}
    for key, item in value.items():
        field = descriptor.fields_by_name.get(key)
        out[key] = item if field is None else _field(field, item)
    return out


def _field(field: FieldDescriptor, item: Any) -> Any:
    message_type = field.message_type
    if message_type is not None and message_type.GetOptions().map_entry:
        value_field = message_type.fields_by_name["value"]
        return {k: _scalar(value_field, v) for k, v in item.items()}
    if isinstance(item, list):
        return [_scalar(field, v) for v in item]
    return _scalar(field, item)


def _scalar(field: FieldDescriptor, item: Any) -> Any:
    if field.enum_type is not None and isinstance(item, str):
        number = field.enum_type.values_by_name.get(item)
        return enum_word(field.enum_type, number.number) if number is not None else item
    if field.message_type is not None and isinstance(item, dict):
        return _words(field.message_type, item)
    return item
