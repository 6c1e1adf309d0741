"""Tenants and projects as a plain directory (compatibility view of the governance policy).

The tenants live in the versioned governance policy (:mod:`fedsched.governance`; the bundled
default is ``fedsched/catalog/policy.yaml``). This module keeps the small read-only directory
API for code that only needs names, home regions, projects and modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fedsched.governance import Governance, bundled_policy_text

CrossRegionMode = Literal["forbidden", "approval", "allowed"]


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant.

    Attributes:
        name: canonical tenant name.
        home_region: where its data and people are.
        projects: its projects (canonical names).
        cross_region: ``forbidden``, ``approval`` or ``allowed``.
    """

    name: str
    home_region: str
    projects: frozenset[str]
    cross_region: CrossRegionMode = "allowed"


class TenantDirectory:
    """Known tenants by name."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self._tenants = {t.name: t for t in tenants}

    @classmethod
    def from_governance(cls, gov: Governance) -> "TenantDirectory":
        """The tenants of a governance policy."""
        return cls([Tenant(t.name, t.home_region, frozenset(t.projects), t.cross_region) for t in gov.doc.tenants])

    @classmethod
    def from_yaml(cls, text: str) -> "TenantDirectory":
        """The tenants of a policy document's YAML text.

        Raises:
            ValidationError: the document does not validate (the field names the entry).
        """
        return cls.from_governance(Governance.parse(text))

    def get(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self._tenants.get(name)

    def __iter__(self):
        return iter(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)


def load_tenants(path: Path | None = None) -> TenantDirectory:
    """Tenants of the policy document at ``path``, or of the bundled default policy."""
    text = Path(path).read_text("utf-8") if path is not None else bundled_policy_text()
    return TenantDirectory.from_yaml(text)
