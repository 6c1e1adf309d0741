import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from fedsched.api.v1 import jobs_pb2 as _jobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CrossRegionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CROSS_REGION_MODE_UNSPECIFIED: _ClassVar[CrossRegionMode]
    CROSS_REGION_MODE_FORBIDDEN: _ClassVar[CrossRegionMode]
    CROSS_REGION_MODE_APPROVAL: _ClassVar[CrossRegionMode]
    CROSS_REGION_MODE_ALLOWED: _ClassVar[CrossRegionMode]

class ApprovalState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPROVAL_STATE_UNSPECIFIED: _ClassVar[ApprovalState]
    APPROVAL_STATE_PENDING: _ClassVar[ApprovalState]
    APPROVAL_STATE_APPROVED: _ClassVar[ApprovalState]
    APPROVAL_STATE_REJECTED: _ClassVar[ApprovalState]
    APPROVAL_STATE_EXPIRED: _ClassVar[ApprovalState]

class ApprovalOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPROVAL_ORDER_UNSPECIFIED: _ClassVar[ApprovalOrder]
    APPROVAL_ORDER_OLDEST_FIRST: _ClassVar[ApprovalOrder]
    APPROVAL_ORDER_NEWEST_FIRST: _ClassVar[ApprovalOrder]
CROSS_REGION_MODE_UNSPECIFIED: CrossRegionMode
CROSS_REGION_MODE_FORBIDDEN: CrossRegionMode
CROSS_REGION_MODE_APPROVAL: CrossRegionMode
CROSS_REGION_MODE_ALLOWED: CrossRegionMode
APPROVAL_STATE_UNSPECIFIED: ApprovalState
APPROVAL_STATE_PENDING: ApprovalState
APPROVAL_STATE_APPROVED: ApprovalState
APPROVAL_STATE_REJECTED: ApprovalState
APPROVAL_STATE_EXPIRED: ApprovalState
APPROVAL_ORDER_UNSPECIFIED: ApprovalOrder
APPROVAL_ORDER_OLDEST_FIRST: ApprovalOrder
APPROVAL_ORDER_NEWEST_FIRST: ApprovalOrder

class JobClass(_message.Message):
    __slots__ = ("name", "kinds", "residency_tags", "cross_region")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_TAGS_FIELD_NUMBER: _ClassVar[int]
    CROSS_REGION_FIELD_NUMBER: _ClassVar[int]
    name: str
    kinds: _containers.RepeatedScalarFieldContainer[_jobs_pb2.JobKind]
    residency_tags: _containers.RepeatedScalarFieldContainer[str]
    cross_region: CrossRegionMode
    def __init__(self, name: _Optional[str] = ..., kinds: _Optional[_Iterable[_Union[_jobs_pb2.JobKind, str]]] = ..., residency_tags: _Optional[_Iterable[str]] = ..., cross_region: _Optional[_Union[CrossRegionMode, str]] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("monthly", "currency")
    MONTHLY_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    monthly: str
    currency: str
    def __init__(self, monthly: _Optional[str] = ..., currency: _Optional[str] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "home_region", "projects", "cross_region", "default_locality", "regions", "job_classes", "budget", "month_spend")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOME_REGION_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    CROSS_REGION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LOCALITY_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    JOB_CLASSES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MONTH_SPEND_FIELD_NUMBER: _ClassVar[int]
    name: str
    home_region: str
    projects: _containers.RepeatedScalarFieldContainer[str]
    cross_region: CrossRegionMode
    default_locality: _jobs_pb2.Locality
    regions: _containers.RepeatedScalarFieldContainer[str]
    job_classes: _containers.RepeatedCompositeFieldContainer[JobClass]
    budget: Budget
    month_spend: str
    def __init__(self, name: _Optional[str] = ..., home_region: _Optional[str] = ..., projects: _Optional[_Iterable[str]] = ..., cross_region: _Optional[_Union[CrossRegionMode, str]] = ..., default_locality: _Optional[_Union[_jobs_pb2.Locality, str]] = ..., regions: _Optional[_Iterable[str]] = ..., job_classes: _Optional[_Iterable[_Union[JobClass, _Mapping]]] = ..., budget: _Optional[_Union[Budget, _Mapping]] = ..., month_spend: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants", "policy_version")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    policy_version: str
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ..., policy_version: _Optional[str] = ...) -> None: ...

class PutTenantRequest(_message.Message):
    __slots__ = ("tenant", "expected_version")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    expected_version: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., expected_version: _Optional[str] = ...) -> None: ...

class PutTenantResponse(_message.Message):
    __slots__ = ("tenant", "created", "policy_version", "previous_version", "changes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    created: bool
    policy_version: str
    previous_version: str
    changes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., created: _Optional[bool] = ..., policy_version: _Optional[str] = ..., previous_version: _Optional[str] = ..., changes: _Optional[_Iterable[str]] = ...) -> None: ...

class Quota(_message.Message):
    __slots__ = ("tenant", "card", "region", "guaranteed_gpus", "borrowing_limit_gpus", "cohort", "used_milli")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CARD_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_GPUS_FIELD_NUMBER: _ClassVar[int]
    BORROWING_LIMIT_GPUS_FIELD_NUMBER: _ClassVar[int]
    COHORT_FIELD_NUMBER: _ClassVar[int]
    USED_MILLI_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    card: str
    region: str
    guaranteed_gpus: float
    borrowing_limit_gpus: float
    cohort: str
    used_milli: int
    def __init__(self, tenant: _Optional[str] = ..., card: _Optional[str] = ..., region: _Optional[str] = ..., guaranteed_gpus: _Optional[float] = ..., borrowing_limit_gpus: _Optional[float] = ..., cohort: _Optional[str] = ..., used_milli: _Optional[int] = ...) -> None: ...

class ListQuotasRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListQuotasResponse(_message.Message):
    __slots__ = ("quotas", "policy_version")
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.RepeatedCompositeFieldContainer[Quota]
    policy_version: str
    def __init__(self, quotas: _Optional[_Iterable[_Union[Quota, _Mapping]]] = ..., policy_version: _Optional[str] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("quota", "expected_version")
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    expected_version: str
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ..., expected_version: _Optional[str] = ...) -> None: ...

class SetQuotaResponse(_message.Message):
    __slots__ = ("quota", "created", "policy_version")
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    created: bool
    policy_version: str
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ..., created: _Optional[bool] = ..., policy_version: _Optional[str] = ...) -> None: ...

class DeleteQuotaRequest(_message.Message):
    __slots__ = ("tenant", "card", "region", "expected_version")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CARD_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    card: str
    region: str
    expected_version: str
    def __init__(self, tenant: _Optional[str] = ..., card: _Optional[str] = ..., region: _Optional[str] = ..., expected_version: _Optional[str] = ...) -> None: ...

class DeleteQuotaResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: str
    def __init__(self, policy_version: _Optional[str] = ...) -> None: ...

class RoleGrant(_message.Message):
    __slots__ = ("role", "tenants", "projects", "region", "cluster")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    role: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    projects: _containers.RepeatedScalarFieldContainer[str]
    region: str
    cluster: str
    def __init__(self, role: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., projects: _Optional[_Iterable[str]] = ..., region: _Optional[str] = ..., cluster: _Optional[str] = ...) -> None: ...

class PutPrincipalRequest(_message.Message):
    __slots__ = ("name", "roles", "issue_token", "expected_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    ISSUE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    roles: _containers.RepeatedCompositeFieldContainer[RoleGrant]
    issue_token: bool
    expected_version: str
    def __init__(self, name: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleGrant, _Mapping]]] = ..., issue_token: _Optional[bool] = ..., expected_version: _Optional[str] = ...) -> None: ...

class PutPrincipalResponse(_message.Message):
    __slots__ = ("name", "token", "created", "policy_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    created: bool
    policy_version: str
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ..., created: _Optional[bool] = ..., policy_version: _Optional[str] = ...) -> None: ...

class Approval(_message.Message):
    __slots__ = ("approval_id", "job_id", "tenant", "project", "state", "home_region", "proposed_region", "proposed_cluster", "card_model", "reason", "cost", "home_cost", "currency", "transfer_seconds", "requested_at", "expires_at", "decided_at", "decided_by", "comment", "policy_version", "decision_policy_version")
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOME_REGION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_REGION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    HOME_COST_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DECISION_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    approval_id: str
    job_id: str
    tenant: str
    project: str
    state: ApprovalState
    home_region: str
    proposed_region: str
    proposed_cluster: str
    card_model: str
    reason: str
    cost: str
    home_cost: str
    currency: str
    transfer_seconds: float
    requested_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    decided_at: _timestamp_pb2.Timestamp
    decided_by: str
    comment: str
    policy_version: str
    decision_policy_version: str
    def __init__(self, approval_id: _Optional[str] = ..., job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., project: _Optional[str] = ..., state: _Optional[_Union[ApprovalState, str]] = ..., home_region: _Optional[str] = ..., proposed_region: _Optional[str] = ..., proposed_cluster: _Optional[str] = ..., card_model: _Optional[str] = ..., reason: _Optional[str] = ..., cost: _Optional[str] = ..., home_cost: _Optional[str] = ..., currency: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., requested_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., decided_by: _Optional[str] = ..., comment: _Optional[str] = ..., policy_version: _Optional[str] = ..., decision_policy_version: _Optional[str] = ...) -> None: ...

class ListApprovalsRequest(_message.Message):
    __slots__ = ("tenant", "states", "page_size", "order", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    states: _containers.RepeatedScalarFieldContainer[ApprovalState]
    page_size: int
    order: ApprovalOrder
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., states: _Optional[_Iterable[_Union[ApprovalState, str]]] = ..., page_size: _Optional[int] = ..., order: _Optional[_Union[ApprovalOrder, str]] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListApprovalsResponse(_message.Message):
    __slots__ = ("approvals", "next_page_token", "total")
    APPROVALS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    approvals: _containers.RepeatedCompositeFieldContainer[Approval]
    next_page_token: str
    total: int
    def __init__(self, approvals: _Optional[_Iterable[_Union[Approval, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class DecideApprovalRequest(_message.Message):
    __slots__ = ("approval_id", "comment")
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    approval_id: str
    comment: str
    def __init__(self, approval_id: _Optional[str] = ..., comment: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyDocument(_message.Message):
    __slots__ = ("version", "yaml", "applied_by", "applied_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BY_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_FIELD_NUMBER: _ClassVar[int]
    version: str
    yaml: str
    applied_by: str
    applied_at: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[str] = ..., yaml: _Optional[str] = ..., applied_by: _Optional[str] = ..., applied_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ApplyPolicyRequest(_message.Message):
    __slots__ = ("yaml", "expected_version")
    YAML_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    yaml: str
    expected_version: str
    def __init__(self, yaml: _Optional[str] = ..., expected_version: _Optional[str] = ...) -> None: ...

class ApplyPolicyResponse(_message.Message):
    __slots__ = ("version", "previous_version", "changes", "applied")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    version: str
    previous_version: str
    changes: _containers.RepeatedScalarFieldContainer[str]
    applied: bool
    def __init__(self, version: _Optional[str] = ..., previous_version: _Optional[str] = ..., changes: _Optional[_Iterable[str]] = ..., applied: _Optional[bool] = ...) -> None: ...

class ListPolicyVersionsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListPolicyVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[PolicyDocument]
    def __init__(self, versions: _Optional[_Iterable[_Union[PolicyDocument, _Mapping]]] = ...) -> None: ...
