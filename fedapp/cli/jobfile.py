"""Job files for ``fedsched submit -f FILE``: YAML or JSON, one job mapping or a list of them.

Keys are the proto's field names of ``JobSpec`` (``fedsched.api.v1``; e.g. ``gpus_per_worker``,
``allowed_regions``, ``datasets``, ``workload``), plus ``request_id`` (the idempotency key of
``SubmitJobRequest``) on each job. The submit flags' spellings are accepted where they differ
(``gpus`` = ``gpus_per_worker``, ``card_model`` = ``card_models``, ``duration`` =
``estimated_duration_seconds``, and ``-`` for ``_``). A list may also be given as ``jobs: [...]``.

Values: enums by their short lower-case name as the CLI prints them (``kind: fine_tune``,
``priority: best_effort``, ``locality: must_local``) or the proto's full name;
``start_deadline`` ISO-8601 (a date-time without a timezone is taken as UTC);
``env``/``secret_env``/``annotations`` map strings to strings (numbers are written as text,
booleans must be quoted). Sizes and counts are plain integers in the proto's units
(``cpu_milli`` milli-cores, ``memory_mib`` MiB, ``size_bytes`` bytes, ``min_gpu_memory_gib`` GiB).

Numbers for ``double`` fields may also be written as text (YAML 1.1 reads ``1e300`` without a
dot as a string): ``duration: 1e300`` is the number 1e300, then range-checked (finite; admission
applies its own limits). A list or mapping with more entries than admission ever accepts
(:data:`MAX_ENTRIES`, e.g. 64 annotations) is refused while the file is being read, before any
entry is built or checked: a 200,000-annotation file fails in milliseconds, not after seconds of
parsing.

Every problem raises :class:`JobFileError` naming the position and key, e.g.
``jobs[2].gpu_per_worker: unknown field; did you mean gpus_per_worker?``.
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import re
from typing import Any

import yaml

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import ValidationError
from fedsched.yamltext import load_yaml
from fedapp.cli.wire import enum_number, enum_words

#: Largest job file read (characters): a batch of 1000 large specs, not a configuration file.
MAX_FILE_CHARS = 16 * 1024 * 1024

#: The submit flags' spellings of JobSpec fields (``fedsched submit --help``).
FLAG_ALIASES = {"gpus": "gpus_per_worker", "card_model": "card_models", "duration": "estimated_duration_seconds",
                "checkpoint": "checkpoint_uri"}

#: Keys of a job mapping that are not JobSpec fields (SubmitJobRequest's).
REQUEST_KEYS = ("request_id",)

#: Most entries admission ever accepts per repeated/map field (proto field names), so a file
#: with more is refused before its entries are built. Sources: ``services.admission.convert.Limits``
#: (card models 32, regions 64, residency tags 32, annotations 64), the policy's ceiling for
#: ``limits.max_datasets`` (``fedsched.tenancy.LimitsDoc``: <= 1024; the default is 64) and the
#: Workload limits of ``jobs.proto`` (command + args <= 256 items, env + secret_env <= 128 names).
MAX_ENTRIES = {"card_models": 32, "allowed_regions": 64, "forbidden_regions": 64, "residency_tags": 32,
               "annotations": 64, "datasets": 1024, "command": 256, "args": 256, "env": 128, "secret_env": 128}

#: A decimal number written as text (no ``nan``/``inf``, no ``_``, no hex).
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class JobFileError(ValueError):
    """A job file that cannot be submitted as written; the message starts with the position."""


def _enum_value(field: FieldDescriptor, value: Any, where: str) -> int:
    """An enum value from the CLI's word (``fine_tune``, as ``-o json`` prints it:
    :mod:`fedapp.cli.wire`) or the proto's full name (``JOB_KIND_FINE_TUNE``)."""
    enum = field.enum_type
    if isinstance(value, str):
        number = enum_number(enum, value)
        full = enum.values_by_name.get(value.strip().upper().replace("-", "_"))
        if number is None and full is not None and not full.name.endswith("_UNSPECIFIED"):
            number = full.number
        if number is not None:
            return number
    raise JobFileError(f"{where}: {value!r} is not one of {', '.join(enum_words(enum))}")


def _timestamp(value: Any, where: str) -> dt.datetime:
    if isinstance(value, dt.datetime):
        t = value
    elif isinstance(value, dt.date):
        t = dt.datetime(value.year, value.month, value.day)
    elif isinstance(value, str):
        try:
            t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError as e:
            raise JobFileError(f"{where}: {value!r} is not an ISO-8601 date-time (e.g. 2026-12-01T08:00:00Z)") from e
    else:
        raise JobFileError(f"{where}: want an ISO-8601 date-time, got {type(value).__name__}")
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)  # no zone: UTC


def _scalar(field: FieldDescriptor, value: Any, where: str) -> Any:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise JobFileError(f"{where}: want text, got {type(value).__name__}")
        return value if isinstance(value, str) else str(value)
    if t == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise JobFileError(f"{where}: want true or false, got {value!r}")
        return value
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobFileError(f"{where}: want a whole number, got {value!r}")
        top = 2**32 - 1 if t == FieldDescriptor.TYPE_UINT32 else 2**64 - 1
        if not 0 <= value <= top:
            raise JobFileError(f"{where}: {value} is out of range 0..{top}")
        return value
    if t == FieldDescriptor.TYPE_DOUBLE:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = value.strip()  # YAML 1.1 reads 1e300 (no dot) as text
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise JobFileError(f"{where}: want a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond any double
            number = math.inf
        if not math.isfinite(number):
            raise JobFileError(f"{where}: {value!r} is out of range (want a finite number)")
        return number
    if t == FieldDescriptor.TYPE_ENUM:
        return _enum_value(field, value, where)
    raise JobFileError(f"{where}: unsupported field type")  # pragma: no cover - the proto has no other


def _field_for(desc: Descriptor, key: Any, where: str, extra: tuple[str, ...] = ()) -> str:
    """The proto field name ``key`` stands for in ``desc`` (aliases, ``-`` for ``_``)."""
    if not isinstance(key, str):
        raise JobFileError(f"{where}: keys are field names, got {key!r}")
    name = key.replace("-", "_")
    name = FLAG_ALIASES.get(name, name) if desc is pb.JobSpec.DESCRIPTOR or desc is pb.Workload.DESCRIPTOR else name
    if name in desc.fields_by_name or name in extra:
        return name
    known = list(desc.fields_by_name) + list(extra)
    guess = difflib.get_close_matches(name, known, n=1) or [k for k in known if k.startswith(name + "_")][:1]
    hint = f"; did you mean {guess[0]}?" if guess else f"; known: {', '.join(sorted(known))}"
    raise JobFileError(f"{where}.{key}: unknown field{hint}")


def fill(msg: Message, doc: Any, where: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Set the fields of ``msg`` from the mapping ``doc``; returns the ``extra`` keys' values.

    Raises:
        JobFileError: not a mapping, an unknown key, a value of the wrong type (position named).
    """
    if not isinstance(doc, dict):
        raise JobFileError(f"{where}: want a mapping of field names to values, got {type(doc).__name__}")
    desc = msg.DESCRIPTOR
    rest: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in doc.items():
        name = _field_for(desc, key, where, extra)
        at = f"{where}.{key}"
        if name in seen:
            raise JobFileError(f"{at}: given twice (also as {seen[name]})")
        seen[name] = str(key)
        if name in extra:
            rest[name] = value
            continue
        if value is None:
            continue  # `key:` with nothing = not given
        field = desc.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if not isinstance(value, dict):
                raise JobFileError(f"{at}: want a mapping of names to text")
            target = getattr(msg, name)
            for k, v in value.items():
                if not isinstance(k, str):
                    raise JobFileError(f"{at}: keys are text, got {k!r}")
                target[k] = _scalar(field.message_type.fields_by_name["value"], v, f"{at}[{k}]")
        elif field.is_repeated:
            items = value if isinstance(value, list) else [value]
            target = getattr(msg, name)
            for i, v in enumerate(items):
                if field.message_type is not None:
                    fill(target.add(), v, f"{at}[{i}]")
                else:
                    target.append(_scalar(field, v, f"{at}[{i}]"))
        elif field.message_type is not None and field.message_type.full_name == "google.protobuf.Timestamp":
            getattr(msg, name).FromDatetime(_timestamp(value, at))
        elif field.message_type is not None:
            fill(getattr(msg, name), value, at)
        else:
            setattr(msg, name, _scalar(field, value, at))
    return rest


def parse_job_file(text: str, source: str = "file") -> tuple[bool, list[pb.SubmitJobRequest]]:
    """The submit requests a job file describes.

    Returns:
        (whether the file holds a list, the requests in file order). Positions in errors are
        ``jobs[i]`` for a list and ``job`` for a single mapping.

    Raises:
        JobFileError: not YAML/JSON, empty, or any job not as described in the module docstring.
    """
    if len(text) <= MAX_FILE_CHARS:  # (a larger one is refused by load_yaml)
        check_entry_counts(text)
    try:
        doc = load_yaml(text, source, max_chars=MAX_FILE_CHARS)
    except ValidationError as e:
        raise JobFileError(e.message) from e
    if isinstance(doc, dict) and "jobs" in doc:  # the wrapper form: jobs: [...] and nothing else
        extra = sorted(str(k) for k in doc if k != "jobs")
        if extra:
            raise JobFileError(f"{source}: a file with 'jobs:' holds only that list (also got {', '.join(extra)}); "
                               f"put every job's fields inside its item")
        if not isinstance(doc["jobs"], list):
            raise JobFileError(f"{source}: jobs: want a list of job mappings, got {type(doc['jobs']).__name__}")
        doc = doc["jobs"]
    if isinstance(doc, list):
        if not doc:
            raise JobFileError(f"{source}: the list of jobs is empty")
        return True, [_request(item, f"jobs[{i}]") for i, item in enumerate(doc)]
    if isinstance(doc, dict):
        return False, [_request(doc, "job")]
    raise JobFileError(f"{source}: want a job mapping or a list of them, got {type(doc).__name__}")


class _Frame:
    """A list or mapping open in :func:`check_entry_counts`."""

    __slots__ = ("is_map", "where", "limit", "entries", "expect_key", "key")

    def __init__(self, is_map: bool, where: str, limit: int | None) -> None:
        self.is_map, self.where, self.limit = is_map, where, limit
        self.entries, self.expect_key, self.key = 0, True, ""


def _field_name(key: str) -> str:
    name = key.replace("-", "_")
    return FLAG_ALIASES.get(name, name)


def check_entry_counts(text: str) -> None:
    """Refuse a job file whose list or mapping under a field of :data:`MAX_ENTRIES` has more
    entries than allowed, reading only the parser's event stream (libyaml's when installed) and
    stopping at the first entry too many: nothing is built and no entry is checked first.
    Positions are named as the rest of the file's errors (``job.annotations``,
    ``jobs[3].workload.env``). Text that is not YAML is left for :func:`parse_job_file` to report.

    Raises:
        JobFileError: ``<position>: at most N entries ...``.
    """
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    frames: list[_Frame] = []
    node_events = (yaml.ScalarEvent, yaml.AliasEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                frames.pop()
                continue
            if not isinstance(event, node_events):
                continue
            parent = frames[-1] if frames else None
            field, where = None, ""
            if parent is None:  # the document: one job, or the list of jobs
                where = "jobs" if isinstance(event, yaml.SequenceStartEvent) else "job"
            elif parent.is_map and parent.expect_key:  # a key
                parent.expect_key = False
                parent.key = str(event.value) if isinstance(event, yaml.ScalarEvent) else "?"
                where = f"{parent.where}.?"
            else:  # a value or a list item: one entry of its parent
                if parent.is_map:
                    parent.expect_key = True
                    field = _field_name(parent.key)
                    where = "jobs" if (len(frames) == 1 and parent.key == "jobs") else f"{parent.where}.{parent.key}"
                else:
                    where = f"{parent.where}[{parent.entries}]"
                parent.entries += 1
                if parent.limit is not None and parent.entries > parent.limit:
                    raise JobFileError(f"{parent.where}: at most {parent.limit} entries (admission's limit); "
                                       "this file has more")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                frames.append(_Frame(isinstance(event, yaml.MappingStartEvent), where, MAX_ENTRIES.get(field or "")))
    except yaml.YAMLError:
        return  # parse_job_file reports it with its position

def _request(doc: Any, where: str) -> pb.SubmitJobRequest:
    spec = pb.JobSpec()
    rest = fill(spec, doc, where, REQUEST_KEYS)
    request = pb.SubmitJobRequest(spec=spec)
    if "request_id" in rest and rest["request_id"] is not None:
        request.request_id = _scalar(pb.SubmitJobRequest.DESCRIPTOR.fields_by_name["request_id"], rest["request_id"],
                                     f"{where}.request_id")
    return request
