"""Tenants and projects: who may submit, where they live, how far their jobs may roam.

Loaded from YAML (``fedsched/catalog/tenants.yaml`` by default); names are validated by
:mod:`fedsched.naming`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml

from fedsched import naming
from fedsched.errors import ValidationError

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
    def from_yaml(cls, text: str) -> "TenantDirectory":
        """Parse the YAML format of ``tenants.yaml``.

        Raises:
            ValidationError: a bad name or mode (the field names the entry).
        """
        data = yaml.safe_load(text) or {}
        tenants = []
        for i, entry in enumerate(data.get("tenants") or []):
            field = f"tenants[{i}]"
            mode = entry.get("cross_region", "allowed")
            if mode not in ("forbidden", "approval", "allowed"):
                raise ValidationError(f"{field}.cross_region", f"must be forbidden, approval or allowed, got {mode!r}")
            tenants.append(Tenant(
                name=naming.check_name("tenant", str(entry.get("name", "")), f"{field}.name"),
                home_region=naming.check_name("region", str(entry.get("home_region", "")), f"{field}.home_region"),
                projects=frozenset(naming.check_name("project", str(p), f"{field}.projects")
                                   for p in entry.get("projects") or []),
                cross_region=mode,
            ))
        return cls(tenants)

    def get(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self._tenants.get(name)

    def __iter__(self):
        return iter(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)


def load_tenants(path: Path | None = None) -> TenantDirectory:
    """Tenants from ``path`` or the bundled default."""
    if path is not None:
        return TenantDirectory.from_yaml(Path(path).read_text("utf-8"))
    return TenantDirectory.from_yaml(resources.files("fedsched.catalog").joinpath("tenants.yaml").read_text("utf-8"))
