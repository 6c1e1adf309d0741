"""The versioned price catalog (region x card model, optional time-of-day factors).

Money is :class:`decimal.Decimal` with 6 decimal places; floats appear only in scheduling
scores (preferences, never charges). The formula and file format are documented in
``fedsched/catalog/prices.yaml``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from importlib import resources
from pathlib import Path

import yaml

from fedsched import naming
from fedsched.errors import ValidationError
from fedsched.yamltext import load_yaml

SIX = Decimal("0.000001")


def money(value: Decimal | float | int | str) -> Decimal:
    """``value`` as a Decimal rounded half-even to 6 places (the store's Decimal(18, 6))."""
    return Decimal(str(value)).quantize(SIX, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class TimeOfDay:
    """A UTC hour range [start_hour, end_hour) with a price factor (e.g. 0.6 off-peak)."""

    start_hour: int
    end_hour: int
    factor: Decimal


@dataclass(frozen=True)
class PriceCatalog:
    """GPU-hour prices by region and card model.

    Attributes:
        currency: ISO-ish code of the currency units.
        default_gpu_hour: price of a card model missing from ``base``.
        cpu_core_hour: price of one CPU core-hour (CPU-only work).
        egress_per_gb: price of one GB (1e9 bytes) moved between regions.
        base: canonical card model -> base GPU-hour price.
        region_factor: region -> multiplier (missing = 1).
        overrides: (region, model) -> exact GPU-hour price.
        time_of_day: optional UTC hour-range factors.
        version: content hash (first 12 hex of sha256 of the source text).
    """

    currency: str
    default_gpu_hour: Decimal
    cpu_core_hour: Decimal
    egress_per_gb: Decimal
    base: dict[str, Decimal]
    region_factor: dict[str, Decimal]
    overrides: dict[tuple[str, str], Decimal] = field(default_factory=dict)
    time_of_day: tuple[TimeOfDay, ...] = ()
    version: str = ""

    @classmethod
    def from_yaml(cls, text: str) -> "PriceCatalog":
        """Parse the YAML format (see ``prices.yaml``).

        Raises:
            ValidationError: a malformed entry (field names the entry).
        """
        try:
            data = load_yaml(text, "price_catalog") or {}
            base = {naming.canonical_card_model(k): money(v) for k, v in (data.get("base") or {}).items()}
            regions = {naming.check_name("region", k, "price_catalog.region_factor"): Decimal(str(v))
                       for k, v in (data.get("region_factor") or {}).items()}
            overrides = {}
            for key, v in (data.get("overrides") or {}).items():
                region, _, model = str(key).partition("/")
                overrides[(naming.check_name("region", region, "price_catalog.overrides"),
                           naming.canonical_card_model(model))] = money(v)
            tod = tuple(TimeOfDay(int(e["start_hour"]), int(e["end_hour"]), Decimal(str(e["factor"])))
                        for e in data.get("time_of_day") or [])
            catalog = cls(
                currency=str(data.get("currency", "CNY")),
                default_gpu_hour=money(data.get("default_gpu_hour", 10)),
                cpu_core_hour=money(data.get("cpu_core_hour", 0.25)),
                egress_per_gb=money(data.get("egress_per_gb", 0.5)),
                base=base, region_factor=regions, overrides=overrides, time_of_day=tod,
                version=hashlib.sha256(text.encode()).hexdigest()[:12],
            )
        except ValidationError:
            raise
        except (KeyError, TypeError, ValueError, ArithmeticError, yaml.YAMLError) as e:
            raise ValidationError("price_catalog", f"malformed price catalog: {e}") from e
        if any(p < 0 for p in catalog.base.values()):
            raise ValidationError("price_catalog.base", "prices must be >= 0")
        return catalog

    def gpu_hour(self, region: str, card_model: str, at: datetime | None = None) -> Decimal:
        """Price of one GPU-hour of ``card_model`` in ``region`` (at UTC time ``at``)."""
        price = self.overrides.get((region, card_model))
        if price is None:
            price = self.base.get(card_model, self.default_gpu_hour) * self.region_factor.get(region, Decimal(1))
        return money(price * self._tod(at))

    def cpu_core_hour_in(self, region: str, at: datetime | None = None) -> Decimal:
        """Price of one CPU core-hour in ``region``."""
        return money(self.cpu_core_hour * self.region_factor.get(region, Decimal(1)) * self._tod(at))

    def _tod(self, at: datetime | None) -> Decimal:
        if at is None or not self.time_of_day:
            return Decimal(1)
        for window in self.time_of_day:
            if window.start_hour <= at.hour < window.end_hour:
                return window.factor
        return Decimal(1)


def load_price_catalog(path: Path | None = None) -> PriceCatalog:
    """The catalog at ``path``, or the bundled ``fedsched/catalog/prices.yaml``."""
    if path is not None:
        return PriceCatalog.from_yaml(Path(path).read_text("utf-8"))
    return PriceCatalog.from_yaml(resources.files("fedsched.catalog").joinpath("prices.yaml").read_text("utf-8"))
