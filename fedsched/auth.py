"""Identities and roles: bearer tokens, principals, and what each role may do.

Every gRPC call carries ``authorization: Bearer <token>`` in its metadata. Tokens are random
(:func:`new_token`, 256 bits) and stored only as their SHA-256 (:func:`hash_token`) in the
versioned policy (:mod:`fedsched.tenancy`); a token is never logged, never put in an event
and never returned except once, when it is issued. Because tokens are high-entropy random
strings, one SHA-256 is enough (no password stretching needed); lookup is by hash.

Roles (one principal may hold several grants):

=========  =====================================================================================
role       rights
=========  =====================================================================================
submitter  submit jobs for its tenants (and, if listed, only those projects); read, watch and
           cancel those jobs; read its tenants and their quotas
approver   read its tenants' jobs, tenants and quotas; list, approve and reject their
           cross-region approval requests
agent      read jobs placed on its own cluster (agents otherwise talk NATS, confined by subject)
admin      everything, including tenants, quotas, principals and the policy
=========  =====================================================================================

A tenant list may hold ``*`` (every tenant). The predicates here are pure; the admission
service turns a ``False`` into :class:`~fedsched.errors.PermissionDeniedError`.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from fedsched.errors import AuthError

Role = Literal["submitter", "approver", "admin", "agent"]
ROLES: tuple[str, ...] = ("submitter", "approver", "admin", "agent")

TOKEN_PREFIX = "fst_"
METADATA_KEY = "authorization"
ANY = "*"
TOKEN_FILE = "admin.token"  #: the embedded system's bootstrap admin token, in its data dir


def new_token() -> str:
    """A fresh bearer token: ``fst_`` + 43 URL-safe characters (32 random bytes)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """SHA-256 of a token, 64 lower-case hex characters (what the policy stores)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    """Constant-time comparison of two token hashes."""
    return hmac.compare_digest(a.encode(), b.encode())


def bearer_token(metadata: Iterable[tuple[str, object]] | None) -> str:
    """The token of an ``authorization: Bearer <token>`` metadata entry.

    Raises:
        AuthError: no such entry, or not a bearer token (the message never echoes the value).
    """
    for key, value in metadata or ():
        if key.lower() != METADATA_KEY:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("the authorization metadata must be 'Bearer <token>'")
        return token.strip()
    raise AuthError("missing credentials: send metadata 'authorization: Bearer <token>' "
                    "(fedsched CLI: --token or FEDSCHED_TOKEN)")


@dataclass(frozen=True, slots=True)
class Grant:
    """One role of a principal.

    Attributes:
        role: ``submitter``, ``approver``, ``admin`` or ``agent``.
        tenants: tenants it applies to (``*`` = all); submitter and approver only.
        projects: for a submitter, the projects it may use (empty = all of its tenants').
        region, cluster: for an agent, its own cluster.
    """

    role: str
    tenants: frozenset[str] = frozenset()
    projects: frozenset[str] = frozenset()
    region: str = ""
    cluster: str = ""

    def covers(self, tenant: str) -> bool:
        """The grant's tenant list includes ``tenant``."""
        return ANY in self.tenants or tenant in self.tenants


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: a name and its grants."""

    name: str
    grants: tuple[Grant, ...]

    def _grants(self, role: str):
        return (g for g in self.grants if g.role == role)

    @property
    def is_admin(self) -> bool:
        """Holds the admin role."""
        return any(True for _ in self._grants("admin"))

    @property
    def roles(self) -> tuple[str, ...]:
        """Its role names (sorted, unique)."""
        return tuple(sorted({g.role for g in self.grants}))

    def can_submit(self, tenant: str, project: str) -> bool:
        """May submit jobs for ``tenant``/``project``."""
        return self.is_admin or any(g.covers(tenant) and (not g.projects or project in g.projects)
                                    for g in self._grants("submitter"))

    def can_read(self, tenant: str, project: str | None = None) -> bool:
        """May read jobs, tenant settings and quotas of ``tenant`` (and ``project``, if given)."""
        if self.is_admin or any(g.covers(tenant) for g in self._grants("approver")):
            return True
        return any(g.covers(tenant) and (project is None or not g.projects or project in g.projects)
                   for g in self._grants("submitter"))

    def can_cancel(self, tenant: str, project: str) -> bool:
        """May cancel jobs of ``tenant``/``project`` (submitters of it, admins)."""
        return self.can_submit(tenant, project)

    def can_approve(self, tenant: str) -> bool:
        """May decide cross-region approval requests of ``tenant``."""
        return self.is_admin or any(g.covers(tenant) for g in self._grants("approver"))

    def agent_of(self, cluster: str) -> bool:
        """Is the agent of ``cluster``."""
        return bool(cluster) and any(g.cluster == cluster for g in self._grants("agent"))

    def reads_every_job(self) -> bool:
        """May read every job of every tenant and project: an admin, an approver of every tenant,
        or a submitter of every tenant without a project restriction. (``readable_tenants() is
        None`` is not enough: a submitter of ``*`` limited to some projects reads all tenants but
        not all projects.)"""
        if self.is_admin or any(ANY in g.tenants for g in self._grants("approver")):
            return True
        return any(ANY in g.tenants and not g.projects for g in self._grants("submitter"))

    def readable_tenants(self) -> frozenset[str] | None:
        """Tenants whose jobs it may list (None = all tenants; a submitter's project restriction
        may still hide some of their jobs: see :meth:`reads_every_job`)."""
        if self.is_admin:
            return None
        out: set[str] = set()
        for g in self.grants:
            if g.role in ("submitter", "approver"):
                if ANY in g.tenants:
                    return None
                out |= g.tenants
        return frozenset(out)


#: The principal of the call being served (set by the admission interceptor).
CURRENT: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("fedsched_principal", default=None)


def current() -> Principal:
    """The authenticated caller of the current gRPC call.

    Raises:
        AuthError: called outside an authenticated call (a wiring bug, reported safely).
    """
    principal = CURRENT.get()
    if principal is None:
        raise AuthError("not authenticated")
    return principal


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` with mode 0600 (replacing any old file atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_token_file(path: Path) -> str | None:
    """The token in ``path``, or None if there is no such file."""
    try:
        text = Path(path).read_text("utf-8").strip()
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
        return None
    return text or None
