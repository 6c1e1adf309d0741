"""Builders for governance tests: a test policy with known tokens, storing it in NATS KV,
channels and stubs that carry a principal's token."""

from __future__ import annotations

import asyncio
import time

import grpc

from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.auth import hash_token
from fedsched.bus import Bus
from fedapp.client import aio_channel
from fedsched.governance import PolicyDoc, parse_policy
from fedsched.policystore import StoredPolicy, read_policy, write_policy

#: principal -> (token, roles as written in the policy)
PRINCIPALS: dict[str, tuple[str, str]] = {
    "root": ("tok-root-0123456789", "[{role: admin}]"),
    "alice": ("tok-alice-0123456789", "[{role: submitter, tenants: [search]}]"),
    "dave": ("tok-dave-0123456789", "[{role: submitter, tenants: [search], projects: [train]}]"),
    "carol": ("tok-carol-0123456789", "[{role: submitter, tenants: [ads, vision, nlp, recsys]}]"),
    "bob": ("tok-bob-0123456789", "[{role: approver, tenants: [search, ads]}]"),
    "agent1": ("tok-agent1-0123456789", "[{role: agent, region: cn-north-1, cluster: cn-north-1-c1}]"),
}
TOKENS = {name: token for name, (token, _) in PRINCIPALS.items()}

TENANTS = """
tenants:
  - {name: search, home_region: cn-north-1, projects: [train, serve, batch]}
  - {name: ads, home_region: cn-north-1, projects: [train, serve, batch], cross_region: approval,
     job_classes: [{name: finance, residency_tags: [finance], cross_region: forbidden}]}
  - {name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}
  - {name: vision, home_region: cn-south-1, projects: [train, serve, batch]}
  - {name: recsys, home_region: cn-east-1, projects: [train, serve, batch], cross_region: forbidden,
     regions: [cn-east-1]}
"""


def principals_yaml(names=None) -> str:
    """The ``principals:`` section for ``names`` (default all of :data:`PRINCIPALS`)."""
    lines = ["principals:"]
    for name in names or PRINCIPALS:
        token, roles = PRINCIPALS[name]
        lines.append(f"  - {{name: {name}, token_sha256: {hash_token(token)}, roles: {roles}}}")
    return "\n".join(lines) + "\n"


def policy_text(extra: str = "", tenants: str = TENANTS) -> str:
    """A test policy: ``tenants`` + every test principal + ``extra`` YAML sections."""
    return tenants + principals_yaml() + extra


def policy_doc(extra: str = "", tenants: str = TENANTS) -> PolicyDoc:
    """:func:`policy_text` parsed."""
    return parse_policy(policy_text(extra, tenants))


async def store_policy(bus: Bus, doc: PolicyDoc, actor: str = "test") -> StoredPolicy:
    """Make ``doc`` the stored policy (replacing any)."""
    current = await read_policy(bus)
    return await write_policy(bus, doc, actor=actor, now=time.time(),
                              expected_revision=current.revision if current else 0)


def channel(port_or_target, who: str | None) -> grpc.aio.Channel:
    """An aio channel to admission carrying ``who``'s token (None = no token)."""
    target = port_or_target if isinstance(port_or_target, str) else f"127.0.0.1:{port_or_target}"
    return aio_channel(target, TOKENS[who] if who else None)


class Stubs:
    """All four stubs over one channel."""

    def __init__(self, ch: grpc.aio.Channel) -> None:
        self.jobs = pb_grpc.JobServiceStub(ch)
        self.tenants = gpb_grpc.TenantServiceStub(ch)
        self.approvals = gpb_grpc.ApprovalServiceStub(ch)
        self.policy = gpb_grpc.PolicyServiceStub(ch)


async def until(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred()`` every 20 ms until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return False
