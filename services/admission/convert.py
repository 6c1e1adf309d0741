"""Wire <-> domain: protobuf messages to :class:`~fedsched.jobs.JobSpec` and back, strictly.

Every problem becomes a :class:`~fedsched.errors.ValidationError` whose ``field`` is the
request path (``spec.workers``, ``spec.card_models[1]``), so the caller learns exactly what to
fix. Limits are configurable (:class:`Limits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError as PydanticValidationError

from fedsched import naming
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import InvalidName, ValidationError
from fedsched.jobs import Dataset, JobKind, JobSpec, JobState, Locality, PriorityClass
from fedsched.workload import Workload

KIND_FROM_PB = {pb.JOB_KIND_UNSPECIFIED: JobKind.BATCH, pb.JOB_KIND_TRAINING: JobKind.TRAINING,
                pb.JOB_KIND_FINE_TUNE: JobKind.FINE_TUNE, pb.JOB_KIND_INFERENCE: JobKind.INFERENCE,
                pb.JOB_KIND_BATCH: JobKind.BATCH, pb.JOB_KIND_EVALUATION: JobKind.EVALUATION,
                pb.JOB_KIND_EXPERIMENT: JobKind.EXPERIMENT}
KIND_TO_PB = {v: k for k, v in KIND_FROM_PB.items() if k != pb.JOB_KIND_UNSPECIFIED}
LOCALITY_FROM_PB = {pb.LOCALITY_MUST_LOCAL: Locality.MUST_LOCAL, pb.LOCALITY_PREFER_LOCAL: Locality.PREFER_LOCAL,
                    pb.LOCALITY_GLOBAL: Locality.GLOBAL}
LOCALITY_TO_PB = {v: k for k, v in LOCALITY_FROM_PB.items()}
PRIORITY_FROM_PB = {pb.PRIORITY_CLASS_UNSPECIFIED: PriorityClass.NORMAL, pb.PRIORITY_CLASS_CRITICAL: PriorityClass.CRITICAL,
                    pb.PRIORITY_CLASS_HIGH: PriorityClass.HIGH, pb.PRIORITY_CLASS_NORMAL: PriorityClass.NORMAL,
                    pb.PRIORITY_CLASS_LOW: PriorityClass.LOW, pb.PRIORITY_CLASS_BEST_EFFORT: PriorityClass.BEST_EFFORT}
PRIORITY_TO_PB = {v: k for k, v in PRIORITY_FROM_PB.items() if k != pb.PRIORITY_CLASS_UNSPECIFIED}
STATE_TO_PB = {JobState.QUEUED: pb.JOB_STATE_QUEUED, JobState.AWAITING_APPROVAL: pb.JOB_STATE_AWAITING_APPROVAL,
               JobState.PLACED: pb.JOB_STATE_PLACED, JobState.RUNNING: pb.JOB_STATE_RUNNING,
               JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED, JobState.FAILED: pb.JOB_STATE_FAILED,
               JobState.CANCELLED: pb.JOB_STATE_CANCELLED, JobState.HELD: pb.JOB_STATE_HELD}
STATE_FROM_PB = {v: k for k, v in STATE_TO_PB.items()}


@dataclass(frozen=True)
class Limits:
    """Admission limits (configurable).

    Attributes:
        max_workers: largest gang.
        max_gpus_per_worker: most whole GPUs one worker may ask for.
        max_cpu_milli / max_memory_mib: per worker.
        max_datasets: datasets per job.
        max_request_id: longest request id (characters).
        max_duration_s: longest runtime estimate (s).
        max_spec_bytes: the whole spec, both as received (protobuf bytes) and as it travels on
            the bus (its JSON encoding in ``job.submitted`` and again in every ``job.placed``):
            128 KiB keeps the largest event (a placement: the spec, up to 1024 worker bindings
            and one verdict per cluster) far below NATS's default ``max_payload`` of 1 MB.
        max_card_models / max_regions / max_residency_tags: entries of ``card_models``, of
            ``allowed_regions`` and of ``forbidden_regions`` (each), of ``residency_tags``.
        max_annotations / max_annotation_key / max_annotation_value: annotation entries, and
            characters of one key / one value.

    Every repeated field and the whole spec have a limit (issue 14 item 6: 250 000
    ``allowed_regions`` were accepted and made events larger than the bus carries); each is
    far above what a real job uses and is checked before anything is looked up, with
    INVALID_ARGUMENT naming the field and the count (``spec.allowed_regions: at most 64
    entries (got 250000)``). The proto comments of ``JobSpec`` and the README list them.

    The workload's caps are not configurable here: they belong to the domain model
    (:class:`fedsched.workload.WorkloadLimits`, checked by whoever builds a spec): image
    reference <= 512 characters, command + args <= 256 items of <= 4096 bytes each, env +
    secret_env <= 128 variables with POSIX names and values <= 32 KiB, the whole workload
    <= 64 KiB.
    """

    max_workers: int = 1024
    max_gpus_per_worker: int = 16
    max_cpu_milli: int = 1_024_000
    max_memory_mib: int = 16 * 1024 * 1024
    max_datasets: int = 64
    max_request_id: int = 128
    max_duration_s: float = 365 * 86400.0
    max_spec_bytes: int = 128 * 1024
    max_card_models: int = 32
    max_regions: int = 64
    max_residency_tags: int = 32
    max_annotations: int = 64
    max_annotation_key: int = 128
    max_annotation_value: int = 1024


#: Longest job name (characters): the naming rule of kind ``job`` (an RFC 1123 label).
MAX_NAME_CHARS = 63


def check_sizes(msg: pb.JobSpec, limits: Limits) -> None:
    """Refuse a spec larger than the documented limits, before any entry is looked at.

    Checks, in order: ``name`` (<= 63 characters), the count of every repeated field
    (``card_models``, ``allowed_regions``, ``forbidden_regions``, ``residency_tags``,
    ``datasets``, ``annotations``: O(1) each, so the field named is the one that is too long),
    the sizes of annotation keys and values (entries already bounded), then the encoded spec
    (``msg.ByteSize()`` <= ``max_spec_bytes``). (The workload has its own
    limits: :class:`~fedsched.workload.Workload`.)

    Raises:
        ValidationError: ``field`` = the path (``spec``, ``spec.name``, ``spec.allowed_regions``,
            ``spec.annotations``), the message the limit and what was sent
            (``at most 64 entries (got 250000)``).
    """
    if len(msg.name) > MAX_NAME_CHARS:
        raise ValidationError("spec.name", f"at most {MAX_NAME_CHARS} characters (got {len(msg.name)})")
    for field, count, most in (("card_models", len(msg.card_models), limits.max_card_models),
                               ("allowed_regions", len(msg.allowed_regions), limits.max_regions),
                               ("forbidden_regions", len(msg.forbidden_regions), limits.max_regions),
                               ("residency_tags", len(msg.residency_tags), limits.max_residency_tags),
                               ("datasets", len(msg.datasets), limits.max_datasets),
                               ("annotations", len(msg.annotations), limits.max_annotations)):
        if count > most:
            raise ValidationError(f"spec.{field}", f"at most {most} entries (got {count})")
    for key, value in msg.annotations.items():
        shown = key if len(key) <= 40 else key[:37] + "..."
        if len(key) > limits.max_annotation_key:
            raise ValidationError("spec.annotations", f"keys of at most {limits.max_annotation_key} characters "
                                                      f"(got {len(key)} for {shown!r})")
        if len(value) > limits.max_annotation_value:
            raise ValidationError(f"spec.annotations[{shown}]", f"at most {limits.max_annotation_value} characters "
                                                                f"(got {len(value)})")
    size = msg.ByteSize()
    if size > limits.max_spec_bytes:
        raise ValidationError("spec", f"at most {limits.max_spec_bytes} bytes encoded (got {size})")


def _finite(value: float, field: str, *, lo: float = 0.0, hi: float | None = None) -> float:
    if not math.isfinite(value):
        raise ValidationError(field, "must be a finite number")
    if value < lo:
        raise ValidationError(field, f"must be >= {lo:g}")
    if hi is not None and value > hi:
        raise ValidationError(field, f"must be <= {hi:g}")
    return value


def _enum(value: int, table: dict, field: str, default=None):
    if value in table:
        return table[value]
    if value == 0 and default is not None:
        return default
    raise ValidationError(field, f"unknown enum value {value}")


@dataclass(frozen=True)
class _Gang:
    """The validated gang shape: ``workers`` x ``gpus_per_worker`` whole GPUs (``gpu_milli`` of one
    card when fractional, 0 for CPU-only), in ``shards`` independent gangs."""

    workers: int
    gpus_per_worker: int
    gpu_milli: int
    shards: int


def spec_from_pb(msg: pb.JobSpec, *, limits: Limits, default_home: str | None,
                 known_models: frozenset[str] | None = None) -> JobSpec:
    """Validate a wire :class:`JobSpec` into the domain model.

    The sections are checked in this order, the first problem raised: sizes and counts
    (:func:`check_sizes`), gang and resources (:func:`_gang`), placement (:func:`_card_models`, :func:`_home_region`), the start deadline,
    the datasets, the enums (kind, priority, locality), price and duration, the workload
    (:func:`_workload`), and last the domain model's own rules (names, cross-field rules).

    Args:
        msg: the request's spec.
        limits: admission limits.
        default_home: the tenant's home region, used when ``home_region`` is empty.
        known_models: canonical card models valid besides the catalog (those agents report).

    Raises:
        ValidationError: the first problem found, ``field`` = ``spec.<path>``; ``spec`` when the
            spec's JSON encoding (what the bus carries) exceeds ``limits.max_spec_bytes``.
    """
    check_sizes(msg, limits)
    gang = _gang(msg, limits)
    models = _card_models(msg, known_models)
    home = _home_region(msg, default_home)
    deadline = _start_deadline(msg)
    datasets = _datasets(msg)
    kind = _enum(msg.kind, KIND_FROM_PB, "spec.kind")
    priority = _enum(msg.priority, PRIORITY_FROM_PB, "spec.priority")
    locality = _enum(msg.locality, LOCALITY_FROM_PB, "spec.locality", default=Locality.GLOBAL)
    price = _finite(msg.max_price_per_gpu_hour, "spec.max_price_per_gpu_hour", hi=1e6)
    duration = _finite(msg.estimated_duration_seconds, "spec.estimated_duration_seconds", hi=limits.max_duration_s)
    workload = _workload(msg)
    try:
        spec = JobSpec(
            tenant=msg.tenant, project=msg.project, name=msg.name, kind=kind, priority=priority,
            workers=gang.workers, gpus_per_worker=gang.gpus_per_worker, gpu_milli=gang.gpu_milli,
            cpu_milli=msg.cpu_milli, memory_mib=msg.memory_mib,
            card_models=models, min_gpu_memory_gib=msg.min_gpu_memory_gib, requires_rdma=msg.requires_rdma,
            home_region=home, locality=locality,
            allowed_regions=tuple(msg.allowed_regions), forbidden_regions=tuple(msg.forbidden_regions),
            residency_tags=tuple(msg.residency_tags), datasets=datasets, start_deadline=deadline,
            max_price_per_gpu_hour=price, preemptible=msg.preemptible, checkpointable=msg.checkpointable,
            estimated_duration_s=duration or None,
            retry_limit=msg.retry_limit, shards=gang.shards, annotations=dict(msg.annotations),
            workload=workload,
        )
    except InvalidName as e:
        raise ValidationError(f"spec.{e.field}", e.reason) from e
    except PydanticValidationError as e:
        raise _from_pydantic(e, "spec") from e
    encoded = len(spec.model_dump_json().encode())  # JSON escapes control characters: up to 6x the wire size
    if encoded > limits.max_spec_bytes:
        raise ValidationError("spec", f"at most {limits.max_spec_bytes} bytes encoded as the bus carries it "
                                      f"(got {encoded})")
    return spec


def _gang(msg: pb.JobSpec, limits: Limits) -> _Gang:
    """The gang and per-worker resources, within ``limits``.

    Unset ``workers`` / ``gpus_per_worker`` / ``shards`` are 1; unset ``gpu_milli`` is a whole
    card (1000) for a GPU worker, 0 for a CPU-only one (``gpus_per_worker`` = 0).

    Raises:
        ValidationError: ``spec.workers``, ``spec.gpus_per_worker``, ``spec.gpu_milli``,
            ``spec.cpu_milli``, ``spec.memory_mib`` or ``spec.shards``.
    """
    workers = msg.workers if msg.HasField("workers") else 1
    gpus = msg.gpus_per_worker if msg.HasField("gpus_per_worker") else 1
    milli = msg.gpu_milli if msg.HasField("gpu_milli") else (1000 if gpus else 0)
    shards = msg.shards if msg.HasField("shards") else 1
    if not 1 <= workers <= limits.max_workers:
        raise ValidationError("spec.workers", f"must be 1..{limits.max_workers}")
    if gpus > limits.max_gpus_per_worker:
        raise ValidationError("spec.gpus_per_worker", f"must be 0..{limits.max_gpus_per_worker}")
    if gpus and not 1 <= milli <= 1000:
        raise ValidationError("spec.gpu_milli", "must be 1..1000 (1000 = a whole card)")
    if not gpus and milli not in (0, 1000):
        raise ValidationError("spec.gpu_milli", "must be 0 for a CPU-only worker (gpus_per_worker = 0)")
    if gpus > 1 and milli != 1000:
        raise ValidationError("spec.gpu_milli", "a fractional share (< 1000) needs gpus_per_worker = 1")
    if msg.cpu_milli > limits.max_cpu_milli:
        raise ValidationError("spec.cpu_milli", f"must be <= {limits.max_cpu_milli}")
    if msg.memory_mib > limits.max_memory_mib:
        raise ValidationError("spec.memory_mib", f"must be <= {limits.max_memory_mib}")
    if not gpus and not msg.cpu_milli:
        raise ValidationError("spec.cpu_milli", "a CPU-only job must ask for CPU (cpu_milli > 0)")
    if not 1 <= shards <= 1024:
        raise ValidationError("spec.shards", "must be 1..1024")
    return _Gang(workers=workers, gpus_per_worker=gpus, gpu_milli=milli if gpus else 0, shards=shards)


def _card_models(msg: pb.JobSpec, known_models: frozenset[str] | None) -> tuple[str, ...]:
    """The canonical card models asked for: catalog names and aliases (an alias or card class
    may name several), or models agents reported (``known_models``) that the catalog lacks.

    Raises:
        ValidationError: ``spec.card_models[i]``, the first name neither knows.
    """
    catalog = naming.default_catalog()
    models: list[str] = []
    for i, raw in enumerate(msg.card_models):
        field = f"spec.card_models[{i}]"
        try:
            models.extend(m.name for m in catalog.resolve(raw, field=field))
        except InvalidName:
            minted = catalog.canonical(raw).name if raw.strip() else ""
            if known_models and minted in known_models:
                models.append(minted)
            elif known_models and raw in known_models:
                models.append(raw)
            else:
                raise
    return tuple(models)


def _home_region(msg: pb.JobSpec, default_home: str | None) -> str:
    """``home_region``, else the tenant's (``default_home``).

    Raises:
        ValidationError: ``spec.home_region`` when neither is set.
    """
    home = msg.home_region or default_home or ""
    if not home:
        raise ValidationError("spec.home_region", "required (the tenant has no default home region)")
    return home


def _start_deadline(msg: pb.JobSpec) -> datetime | None:
    """``start_deadline`` as an aware UTC datetime (None when unset).

    Raises:
        ValidationError: ``spec.start_deadline`` out of the datetime range.
    """
    if not msg.HasField("start_deadline"):
        return None
    try:
        return msg.start_deadline.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError) as e:
        raise ValidationError("spec.start_deadline", f"not a valid timestamp: {e}") from e


def _datasets(msg: pb.JobSpec) -> tuple[Dataset, ...]:
    """The datasets (their count is checked by :func:`check_sizes`).

    Raises:
        ValidationError: ``spec.datasets[i].<field>`` for the first bad dataset.
    """
    datasets = []
    for i, d in enumerate(msg.datasets):
        try:
            datasets.append(Dataset(name=d.name, home_region=d.home_region, size_bytes=d.size_bytes))
        except InvalidName as e:
            raise ValidationError(f"spec.datasets[{i}].{e.field.split('.')[-1]}", e.reason) from e
        except PydanticValidationError as e:
            raise _from_pydantic(e, f"spec.datasets[{i}]") from e
    return tuple(datasets)


def _workload(msg: pb.JobSpec) -> Workload | None:
    """The workload (None when the request has none: a trace job).

    Raises:
        ValidationError: ``spec.workload.<path>`` (``spec.workload.image``, ``spec.workload.args[3]``,
            ``spec.workload.env[RANK]``, ``spec.workload`` for the whole size): the first rule of
            :class:`~fedsched.workload.Workload` broken.
    """
    if not msg.HasField("workload"):
        return None
    w = msg.workload
    try:
        return Workload(image=w.image, command=tuple(w.command), args=tuple(w.args), env=dict(w.env),
                        secret_env=dict(w.secret_env), workdir=w.workdir, checkpoint_uri=w.checkpoint_uri)
    except ValidationError as e:
        raise ValidationError(f"spec.{e.field}", e.reason) from e
    except PydanticValidationError as e:
        raise _from_pydantic(e, "spec.workload") from e


def workload_to_pb(w: Workload) -> pb.Workload:
    """The wire form of a workload (secret references as they were given: names, never values)."""
    return pb.Workload(image=w.image, command=list(w.command), args=list(w.args), env=w.env,
                       secret_env=w.secret_env, workdir=w.workdir, checkpoint_uri=w.checkpoint_uri)


def _from_pydantic(e: PydanticValidationError, prefix: str) -> ValidationError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return ValidationError(f"{prefix}.{loc}" if loc else prefix, msg)


def _ts(epoch_s: float | None) -> Timestamp | None:
    if epoch_s is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(datetime.fromtimestamp(epoch_s, tz=UTC))
    return ts


def spec_to_pb(spec: JobSpec) -> pb.JobSpec:
    """The wire form of a domain spec (canonical names)."""
    msg = pb.JobSpec(
        tenant=spec.tenant, project=spec.project, name=spec.name, kind=KIND_TO_PB[spec.kind],
        priority=PRIORITY_TO_PB[spec.priority], workers=spec.workers, gpus_per_worker=spec.gpus_per_worker,
        gpu_milli=spec.gpu_milli, cpu_milli=spec.cpu_milli, memory_mib=spec.memory_mib,
        card_models=list(spec.card_models), min_gpu_memory_gib=spec.min_gpu_memory_gib,
        requires_rdma=spec.requires_rdma, home_region=spec.home_region, locality=LOCALITY_TO_PB[spec.locality],
        allowed_regions=list(spec.allowed_regions), forbidden_regions=list(spec.forbidden_regions),
        residency_tags=list(spec.residency_tags),
        datasets=[pb.Dataset(name=d.name, home_region=d.home_region, size_bytes=d.size_bytes) for d in spec.datasets],
        max_price_per_gpu_hour=spec.max_price_per_gpu_hour, preemptible=spec.preemptible,
        checkpointable=spec.checkpointable, estimated_duration_seconds=spec.estimated_duration_s or 0.0,
        retry_limit=spec.retry_limit, shards=spec.shards, annotations=spec.annotations,
    )
    if spec.start_deadline is not None:
        msg.start_deadline.FromDatetime(spec.start_deadline)
    if spec.workload is not None:
        msg.workload.CopyFrom(workload_to_pb(spec.workload))
    return msg


# ---------------------------------------------------------------------------- unknown fields

_WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group start", 4: "group end", 5: "32-bit"}


def _expected_wire(fd) -> set[int]:
    """Wire types a field of descriptor ``fd`` may arrive as (packed repeated scalars: 2 too)."""
    t = fd.type
    if t in (fd.TYPE_DOUBLE, fd.TYPE_FIXED64, fd.TYPE_SFIXED64):
        wire = {1}
    elif t in (fd.TYPE_FLOAT, fd.TYPE_FIXED32, fd.TYPE_SFIXED32):
        wire = {5}
    elif t in (fd.TYPE_STRING, fd.TYPE_BYTES, fd.TYPE_MESSAGE):
        return {2}
    elif t == fd.TYPE_GROUP:
        return {3}
    else:  # int32/64, uint32/64, sint32/64, bool, enum
        wire = {0}
    return wire | {2} if fd.is_repeated else wire


def refuse_unknown_fields(msg, path: str = "") -> None:
    """Raise if ``msg`` or any message inside it carries a field this server does not know.

    protobuf keeps a field whose number is not in the schema, *or whose wire type does not match
    the schema's field of that number* (e.g. JobSpec field 12, ``min_gpu_memory_gib``, sent as a
    string), as an unknown field and leaves the known field at its default; accepting such a
    request would silently drop what the caller asked for. The forward-compatibility rule of the
    API (README, "API"): mutating calls refuse unknown fields, read-only calls ignore them.

    Walks every set field recursively (nested messages, repeated messages, message-valued maps)
    with ``google.protobuf.unknown_fields.UnknownFieldSet`` -- only for a message that has one
    (:func:`has_unknown_fields`, in C: ~1.4 us instead of the walk's ~10 us per item of a
    ``SubmitJobs`` call), to name it.

    Args:
        msg: a parsed request message.
        path: the request path of ``msg`` ("" for the request itself; ``spec``, ``datasets[2]``).

    Raises:
        ValidationError: ``field`` = the path and field number (``spec.12``; ``7`` at the top),
            the message naming the message type, the known field of that number if any and the
            wire types received and expected.
    """
    if not has_unknown_fields(msg):
        return
    _refuse_unknown_fields(msg, path)


def has_unknown_fields(msg) -> bool:
    """Whether ``msg`` or any message inside it carries an unknown field (or one of the wrong
    wire type, which protobuf keeps as unknown): the encoded size of a copy shrinks when they
    are discarded from it (``DiscardUnknownFields`` recurses into every set message, repeated
    or map value; each unknown field takes at least its tag's byte). ``msg`` is left as it is."""
    stripped = type(msg)()
    stripped.CopyFrom(msg)
    stripped.DiscardUnknownFields()
    return stripped.ByteSize() != msg.ByteSize()


def _refuse_unknown_fields(msg, path: str) -> None:
    """The walk of :func:`refuse_unknown_fields`: raise for the first unknown field found."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    desc = msg.DESCRIPTOR
    for uf in UnknownFieldSet(msg):
        number = uf.field_number
        field = f"{path}.{number}" if path else str(number)
        got = _WIRE_NAMES.get(uf.wire_type, str(uf.wire_type))
        known = desc.fields_by_number.get(number)
        if known is not None:
            expected = " or ".join(_WIRE_NAMES[w] for w in sorted(_expected_wire(known)))
            raise ValidationError(field, f"field {number} of {desc.full_name} ({known.name}) has the wrong wire type "
                                         f"(got {got}, expected {expected}); the request was not applied")
        raise ValidationError(field, f"field {number} of {desc.full_name} is unknown to this server (wire type "
                                     f"{got}); mutating calls refuse unknown fields -- is the client built from a "
                                     f"newer API version?")
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        sub = f"{path}.{fd.name}" if path else fd.name
        if fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.message_type is not None:
                for key, item in value.items():
                    _refuse_unknown_fields(item, f"{sub}[{key}]")
        elif fd.is_repeated:
            for i, item in enumerate(value):
                _refuse_unknown_fields(item, f"{sub}[{i}]")
        else:
            _refuse_unknown_fields(value, sub)
