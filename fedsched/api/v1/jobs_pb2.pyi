import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_KIND_UNSPECIFIED: _ClassVar[JobKind]
    JOB_KIND_TRAINING: _ClassVar[JobKind]
    JOB_KIND_FINE_TUNE: _ClassVar[JobKind]
    JOB_KIND_INFERENCE: _ClassVar[JobKind]
    JOB_KIND_BATCH: _ClassVar[JobKind]
    JOB_KIND_EVALUATION: _ClassVar[JobKind]
    JOB_KIND_EXPERIMENT: _ClassVar[JobKind]

class Locality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCALITY_UNSPECIFIED: _ClassVar[Locality]
    LOCALITY_MUST_LOCAL: _ClassVar[Locality]
    LOCALITY_PREFER_LOCAL: _ClassVar[Locality]
    LOCALITY_GLOBAL: _ClassVar[Locality]

class PriorityClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_CLASS_UNSPECIFIED: _ClassVar[PriorityClass]
    PRIORITY_CLASS_CRITICAL: _ClassVar[PriorityClass]
    PRIORITY_CLASS_HIGH: _ClassVar[PriorityClass]
    PRIORITY_CLASS_NORMAL: _ClassVar[PriorityClass]
    PRIORITY_CLASS_LOW: _ClassVar[PriorityClass]
    PRIORITY_CLASS_BEST_EFFORT: _ClassVar[PriorityClass]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_AWAITING_APPROVAL: _ClassVar[JobState]
    JOB_STATE_PLACED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_HELD: _ClassVar[JobState]

class JobOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_ORDER_UNSPECIFIED: _ClassVar[JobOrder]
    JOB_ORDER_NEWEST_FIRST: _ClassVar[JobOrder]
    JOB_ORDER_OLDEST_FIRST: _ClassVar[JobOrder]
JOB_KIND_UNSPECIFIED: JobKind
JOB_KIND_TRAINING: JobKind
JOB_KIND_FINE_TUNE: JobKind
JOB_KIND_INFERENCE: JobKind
JOB_KIND_BATCH: JobKind
JOB_KIND_EVALUATION: JobKind
JOB_KIND_EXPERIMENT: JobKind
LOCALITY_UNSPECIFIED: Locality
LOCALITY_MUST_LOCAL: Locality
LOCALITY_PREFER_LOCAL: Locality
LOCALITY_GLOBAL: Locality
PRIORITY_CLASS_UNSPECIFIED: PriorityClass
PRIORITY_CLASS_CRITICAL: PriorityClass
PRIORITY_CLASS_HIGH: PriorityClass
PRIORITY_CLASS_NORMAL: PriorityClass
PRIORITY_CLASS_LOW: PriorityClass
PRIORITY_CLASS_BEST_EFFORT: PriorityClass
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_AWAITING_APPROVAL: JobState
JOB_STATE_PLACED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_HELD: JobState
JOB_ORDER_UNSPECIFIED: JobOrder
JOB_ORDER_NEWEST_FIRST: JobOrder
JOB_ORDER_OLDEST_FIRST: JobOrder

class Dataset(_message.Message):
    __slots__ = ("name", "home_region", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOME_REGION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    home_region: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., home_region: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Workload(_message.Message):
    __slots__ = ("image", "command", "args", "env", "secret_env", "workdir", "checkpoint_uri")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SecretEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SECRET_ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    image: str
    command: _containers.RepeatedScalarFieldContainer[str]
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    secret_env: _containers.ScalarMap[str, str]
    workdir: str
    checkpoint_uri: str
    def __init__(self, image: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., secret_env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., checkpoint_uri: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("tenant", "project", "name", "kind", "priority", "workers", "gpus_per_worker", "gpu_milli", "cpu_milli", "memory_mib", "card_models", "min_gpu_memory_gib", "requires_rdma", "home_region", "locality", "allowed_regions", "forbidden_regions", "residency_tags", "datasets", "start_deadline", "max_price_per_gpu_hour", "preemptible", "checkpointable", "estimated_duration_seconds", "retry_limit", "shards", "annotations", "workload")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    GPU_MILLI_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLI_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CARD_MODELS_FIELD_NUMBER: _ClassVar[int]
    MIN_GPU_MEMORY_GIB_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_RDMA_FIELD_NUMBER: _ClassVar[int]
    HOME_REGION_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_REGIONS_FIELD_NUMBER: _ClassVar[int]
    FORBIDDEN_REGIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_TAGS_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    START_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTABLE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    project: str
    name: str
    kind: JobKind
    priority: PriorityClass
    workers: int
    gpus_per_worker: int
    gpu_milli: int
    cpu_milli: int
    memory_mib: int
    card_models: _containers.RepeatedScalarFieldContainer[str]
    min_gpu_memory_gib: int
    requires_rdma: bool
    home_region: str
    locality: Locality
    allowed_regions: _containers.RepeatedScalarFieldContainer[str]
    forbidden_regions: _containers.RepeatedScalarFieldContainer[str]
    residency_tags: _containers.RepeatedScalarFieldContainer[str]
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    start_deadline: _timestamp_pb2.Timestamp
    max_price_per_gpu_hour: float
    preemptible: bool
    checkpointable: bool
    estimated_duration_seconds: float
    retry_limit: int
    shards: int
    annotations: _containers.ScalarMap[str, str]
    workload: Workload
    def __init__(self, tenant: _Optional[str] = ..., project: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., workers: _Optional[int] = ..., gpus_per_worker: _Optional[int] = ..., gpu_milli: _Optional[int] = ..., cpu_milli: _Optional[int] = ..., memory_mib: _Optional[int] = ..., card_models: _Optional[_Iterable[str]] = ..., min_gpu_memory_gib: _Optional[int] = ..., requires_rdma: _Optional[bool] = ..., home_region: _Optional[str] = ..., locality: _Optional[_Union[Locality, str]] = ..., allowed_regions: _Optional[_Iterable[str]] = ..., forbidden_regions: _Optional[_Iterable[str]] = ..., residency_tags: _Optional[_Iterable[str]] = ..., datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., start_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., max_price_per_gpu_hour: _Optional[float] = ..., preemptible: _Optional[bool] = ..., checkpointable: _Optional[bool] = ..., estimated_duration_seconds: _Optional[float] = ..., retry_limit: _Optional[int] = ..., shards: _Optional[int] = ..., annotations: _Optional[_Mapping[str, str]] = ..., workload: _Optional[_Union[Workload, _Mapping]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt", "region", "cluster", "card_model", "placed_at", "started_at", "ended_at", "outcome", "reason", "cross_region", "shard")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    PLACED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CROSS_REGION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    region: str
    cluster: str
    card_model: str
    placed_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    outcome: str
    reason: str
    cross_region: bool
    shard: int
    def __init__(self, attempt: _Optional[int] = ..., region: _Optional[str] = ..., cluster: _Optional[str] = ..., card_model: _Optional[str] = ..., placed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., cross_region: _Optional[bool] = ..., shard: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "reason", "submitted_at", "started_at", "ended_at", "region", "cluster", "attempts", "submitted_by", "policy_version", "unplaceable")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNPLACEABLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    reason: str
    submitted_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    region: str
    cluster: str
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    submitted_by: str
    policy_version: str
    unplaceable: bool
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., submitted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., region: _Optional[str] = ..., cluster: _Optional[str] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., submitted_by: _Optional[str] = ..., policy_version: _Optional[str] = ..., unplaceable: _Optional[bool] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "request_id", "dry_run")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    request_id: str
    dry_run: bool
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id", "state", "duplicate", "verdict", "what_if", "trace_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    WHAT_IF_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    duplicate: bool
    verdict: str
    what_if: ExplainJobResponse
    trace_id: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., duplicate: _Optional[bool] = ..., verdict: _Optional[str] = ..., what_if: _Optional[_Union[ExplainJobResponse, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class SubmitJobsRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SubmitJobRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[SubmitJobRequest, _Mapping]]] = ...) -> None: ...

class SubmitJobsResult(_message.Message):
    __slots__ = ("response", "code", "message")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    response: SubmitJobResponse
    code: int
    message: str
    def __init__(self, response: _Optional[_Union[SubmitJobResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SubmitJobsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SubmitJobsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SubmitJobsResult, _Mapping]]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("tenant", "project", "states", "page_size", "page_token", "tenants", "projects", "regions", "clusters", "kinds", "name_pattern", "submitted_after", "submitted_before", "order")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    NAME_PATTERN_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AFTER_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    project: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    page_size: int
    page_token: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    projects: _containers.RepeatedScalarFieldContainer[str]
    regions: _containers.RepeatedScalarFieldContainer[str]
    clusters: _containers.RepeatedScalarFieldContainer[str]
    kinds: _containers.RepeatedScalarFieldContainer[JobKind]
    name_pattern: str
    submitted_after: _timestamp_pb2.Timestamp
    submitted_before: _timestamp_pb2.Timestamp
    order: JobOrder
    def __init__(self, tenant: _Optional[str] = ..., project: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., projects: _Optional[_Iterable[str]] = ..., regions: _Optional[_Iterable[str]] = ..., clusters: _Optional[_Iterable[str]] = ..., kinds: _Optional[_Iterable[_Union[JobKind, str]]] = ..., name_pattern: _Optional[str] = ..., submitted_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., submitted_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., order: _Optional[_Union[JobOrder, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token", "total")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    total: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class JobSelector(_message.Message):
    __slots__ = ("job_ids", "tenants", "projects", "states", "name_pattern")
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    NAME_PATTERN_FIELD_NUMBER: _ClassVar[int]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    projects: _containers.RepeatedScalarFieldContainer[str]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    name_pattern: str
    def __init__(self, job_ids: _Optional[_Iterable[str]] = ..., tenants: _Optional[_Iterable[str]] = ..., projects: _Optional[_Iterable[str]] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ..., name_pattern: _Optional[str] = ...) -> None: ...

class BulkJobsRequest(_message.Message):
    __slots__ = ("selector", "reason", "dry_run")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    selector: JobSelector
    reason: str
    dry_run: bool
    def __init__(self, selector: _Optional[_Union[JobSelector, _Mapping]] = ..., reason: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class BulkJobResult(_message.Message):
    __slots__ = ("job_id", "code", "message", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    code: int
    message: str
    state: JobState
    def __init__(self, job_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class BulkJobsResponse(_message.Message):
    __slots__ = ("matched", "succeeded", "results")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    matched: int
    succeeded: int
    results: _containers.RepeatedCompositeFieldContainer[BulkJobResult]
    def __init__(self, matched: _Optional[int] = ..., succeeded: _Optional[int] = ..., results: _Optional[_Iterable[_Union[BulkJobResult, _Mapping]]] = ...) -> None: ...

class SetJobPriorityRequest(_message.Message):
    __slots__ = ("job_id", "priority", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    priority: PriorityClass
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ClusterVerdict(_message.Message):
    __slots__ = ("cluster", "region", "passed", "reason", "detail", "scores", "total")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    region: str
    passed: bool
    reason: str
    detail: str
    scores: _containers.ScalarMap[str, float]
    total: float
    def __init__(self, cluster: _Optional[str] = ..., region: _Optional[str] = ..., passed: _Optional[bool] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., scores: _Optional[_Mapping[str, float]] = ..., total: _Optional[float] = ...) -> None: ...

class ShardDecision(_message.Message):
    __slots__ = ("shard", "outcome", "summary", "cluster", "region", "queue", "clusters", "counterfactual", "policy_version", "decided_at", "fits_empty", "reserved_cluster", "approval_id", "approval_expires_at")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    FITS_EMPTY_FIELD_NUMBER: _ClassVar[int]
    RESERVED_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    shard: int
    outcome: str
    summary: str
    cluster: str
    region: str
    queue: str
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterVerdict]
    counterfactual: str
    policy_version: str
    decided_at: _timestamp_pb2.Timestamp
    fits_empty: bool
    reserved_cluster: str
    approval_id: str
    approval_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, shard: _Optional[int] = ..., outcome: _Optional[str] = ..., summary: _Optional[str] = ..., cluster: _Optional[str] = ..., region: _Optional[str] = ..., queue: _Optional[str] = ..., clusters: _Optional[_Iterable[_Union[ClusterVerdict, _Mapping]]] = ..., counterfactual: _Optional[str] = ..., policy_version: _Optional[str] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., fits_empty: _Optional[bool] = ..., reserved_cluster: _Optional[str] = ..., approval_id: _Optional[str] = ..., approval_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ExplainJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ExplainJobResponse(_message.Message):
    __slots__ = ("job_id", "state", "decisions")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    decisions: _containers.RepeatedCompositeFieldContainer[ShardDecision]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., decisions: _Optional[_Iterable[_Union[ShardDecision, _Mapping]]] = ...) -> None: ...

class CardCapacity(_message.Message):
    __slots__ = ("card_model", "gpus_total", "gpus_allocated", "gpus_free")
    CARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPUS_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    card_model: str
    gpus_total: int
    gpus_allocated: int
    gpus_free: int
    def __init__(self, card_model: _Optional[str] = ..., gpus_total: _Optional[int] = ..., gpus_allocated: _Optional[int] = ..., gpus_free: _Optional[int] = ...) -> None: ...

class ClusterSummary(_message.Message):
    __slots__ = ("region", "zone", "cluster", "backend", "healthy", "heartbeat_age_seconds", "cards", "nodes", "nodes_schedulable", "running_jobs")
    REGION_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_SCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    region: str
    zone: str
    cluster: str
    backend: str
    healthy: bool
    heartbeat_age_seconds: float
    cards: _containers.RepeatedCompositeFieldContainer[CardCapacity]
    nodes: int
    nodes_schedulable: int
    running_jobs: int
    def __init__(self, region: _Optional[str] = ..., zone: _Optional[str] = ..., cluster: _Optional[str] = ..., backend: _Optional[str] = ..., healthy: _Optional[bool] = ..., heartbeat_age_seconds: _Optional[float] = ..., cards: _Optional[_Iterable[_Union[CardCapacity, _Mapping]]] = ..., nodes: _Optional[int] = ..., nodes_schedulable: _Optional[int] = ..., running_jobs: _Optional[int] = ...) -> None: ...

class QueueSummary(_message.Message):
    __slots__ = ("region", "kind", "queued", "oldest_wait_seconds")
    REGION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    region: str
    kind: str
    queued: int
    oldest_wait_seconds: float
    def __init__(self, region: _Optional[str] = ..., kind: _Optional[str] = ..., queued: _Optional[int] = ..., oldest_wait_seconds: _Optional[float] = ...) -> None: ...

class ListClustersRequest(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, regions: _Optional[_Iterable[str]] = ...) -> None: ...

class ListClustersResponse(_message.Message):
    __slots__ = ("clusters", "queues")
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterSummary]
    queues: _containers.RepeatedCompositeFieldContainer[QueueSummary]
    def __init__(self, clusters: _Optional[_Iterable[_Union[ClusterSummary, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueSummary, _Mapping]]] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("name", "state", "version", "detail", "consumer_lag", "last_seen_age_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    version: str
    detail: str
    consumer_lag: int
    last_seen_age_seconds: float
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[str] = ..., detail: _Optional[str] = ..., consumer_lag: _Optional[int] = ..., last_seen_age_seconds: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "services")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    version: str
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    def __init__(self, version: _Optional[str] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ...) -> None: ...

class GetJobLogsRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "worker", "follow", "shard")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    worker: int
    follow: bool
    shard: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., worker: _Optional[int] = ..., follow: _Optional[bool] = ..., shard: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("attempt", "cluster", "data")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    cluster: str
    data: str
    def __init__(self, attempt: _Optional[int] = ..., cluster: _Optional[str] = ..., data: _Optional[str] = ...) -> None: ...
