"""Typed errors shared by every service.

Each error carries data (the field, the rule, the value) so the edge that reports it -- the gRPC
interceptor, the CLI, a dead-letter record -- can say exactly what is wrong without parsing
strings. Foreign exceptions (nats, clickhouse-connect, grpc) are translated at the edge into
these kinds and re-raised with ``from``.

Hierarchy::

    FedError
    ├── ValidationError          bad input; gRPC INVALID_ARGUMENT, names `field`
    │   └── InvalidName          a name breaking the naming rules (`kind`, `rule`)
    ├── NotFoundError            unknown job / tenant / ...; gRPC NOT_FOUND
    ├── ConflictError            state does not allow the operation; gRPC FAILED_PRECONDITION
    │   ├── AlreadyExistsError   the key is taken by another object (a reused request id); ALREADY_EXISTS
    │   └── SequenceConflictError  a compare-and-set publish lost: the subject moved on since (retry after reading it)
    ├── QuotaExceededError       quota or budget can never allow it; gRPC RESOURCE_EXHAUSTED
    ├── AuthError                missing/unknown credentials; gRPC UNAUTHENTICATED
    │   └── PermissionDeniedError  known principal acting outside its rights; PERMISSION_DENIED
    ├── UnavailableError         a dependency (bus, store) is down; gRPC UNAVAILABLE
    ├── PayloadTooLargeError     a message larger than the bus server's max_payload (never sent)
    ├── DecodeError              an undecodable bus message (goes to the dead-letter subject)
    └── EventTypeError           an event built with an unknown type or the wrong payload model
                                 (a producer's programming error; never a wire problem)
"""

from __future__ import annotations


class FedError(Exception):
    """Base of every error this project raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationError(FedError):
    """Input that breaks a rule.

    Args:
        field: dotted path of the offending field in the request (``spec.workers``).
        message: what is wrong and, where possible, what would be right.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class InvalidName(ValidationError):
    """A name that is not in canonical form.

    Args:
        kind: the naming kind (``region``, ``tenant``, ``card_model`` ...).
        value: the rejected value (truncated to 80 characters in the message).
        rule: the rule the value breaks, in words.
        field: request field; defaults to the kind.
    """

    def __init__(self, kind: str, value: str, rule: str, field: str | None = None) -> None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        super().__init__(field or kind, f"{kind} {shown!r} is not valid: {rule}")
        self.kind = kind
        self.value = value
        self.rule = rule


class NotFoundError(FedError):
    """An object that does not exist (``kind`` and ``key`` say which)."""

    def __init__(self, kind: str, key: str) -> None:
        super().__init__(f"{kind} {key!r} not found")
        self.kind = kind
        self.key = key


class ConflictError(FedError):
    """The object's state does not allow the operation (e.g. cancelling a finished job)."""


class AlreadyExistsError(ConflictError):
    """The key of a create request is taken by a different object (e.g. a submitter's
    ``request_id`` reused for another job spec)."""


class SequenceConflictError(ConflictError):
    """A publish conditioned on the last sequence of a subject filter
    (``Nats-Expected-Last-Subject-Sequence``) was refused: another writer published there since.

    Args:
        subject: the subject filter of the condition.
        expected: the last sequence the writer had read.
    """

    def __init__(self, subject: str, expected: int) -> None:
        super().__init__(f"{subject} has moved past sequence {expected}")
        self.subject = subject
        self.expected = expected


class QuotaExceededError(FedError):
    """A quota or budget that can never admit the request; ``limit`` names which one."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit}: {message}")
        self.limit = limit


class AuthError(FedError):
    """Missing or unknown credentials."""


class PermissionDeniedError(AuthError):
    """A known principal acting outside its roles."""


class UnavailableError(FedError):
    """A dependency (NATS, ClickHouse) cannot be reached; retrying later may succeed."""


class PayloadTooLargeError(FedError):
    """A message larger than the connected NATS server carries (its INFO ``max_payload``): it
    was not sent, since the server would close the connection on it. Retrying cannot help.

    Args:
        subject: where it was to go.
        event_id / event_type: the event it carried.
        size: its encoded size in bytes (headers + body).
        max_payload: the server's limit in bytes.
    """

    def __init__(self, subject: str, event_id: str, event_type: str, size: int, max_payload: int) -> None:
        super().__init__(f"{event_type} {event_id} to {subject} is {size} bytes (headers + body), above the bus "
                         f"server's max_payload of {max_payload} bytes; not sent")
        self.subject = subject
        self.event_id = event_id
        self.event_type = event_type
        self.size = size
        self.max_payload = max_payload


class DecodeError(FedError):
    """A bus message that cannot be decoded or validated; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventTypeError(FedError):
    """An event built with an unknown type, or with a payload that is not its type's model.

    Args:
        event_type: the type given to :func:`~fedsched.events.make_event`.
        message: what is wrong.
        expected / got: payload model names, when the payload is the wrong one ("" otherwise).
    """

    def __init__(self, event_type: str, message: str, *, expected: str = "", got: str = "") -> None:
        super().__init__(f"{event_type}: {message}")
        self.event_type = event_type
        self.expected = expected
        self.got = got
