"""The price catalog: Decimal money, region factors, overrides, time of day, version."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from fedsched.errors import ValidationError
from fedsched.pricing import PriceCatalog, load_price_catalog


def test_bundled_catalog_prices_by_region_and_model():
    c = load_price_catalog()
    assert c.gpu_hour("cn-north-1", "nvidia-t4-16gb") == Decimal("6.000000")
    assert c.gpu_hour("cn-south-1", "nvidia-t4-16gb") == Decimal("4.500000")
    assert c.gpu_hour("cn-east-1", "unlisted-x") == Decimal("9.000000")  # default x 0.9
    assert len(c.version) == 12


def test_overrides_aliases_and_time_of_day():
    text = """
currency: USD
base: {T4: 1.0, "A100 80G": 4.0}
region_factor: {us-east-1: 2.0}
overrides: {"us-east-1/A100 80G": 3.5}
time_of_day: [{start_hour: 0, end_hour: 6, factor: 0.5}]
"""
    c = PriceCatalog.from_yaml(text)
    assert c.gpu_hour("us-east-1", "nvidia-t4-16gb") == Decimal("2.000000")
    assert c.gpu_hour("us-east-1", "nvidia-a100-80gb") == Decimal("3.500000")
    night = datetime(2023, 1, 1, 3, tzinfo=UTC)
    assert c.gpu_hour("us-east-1", "nvidia-t4-16gb", night) == Decimal("1.000000")
    assert c.version != load_price_catalog().version


@pytest.mark.parametrize("text", ["base: {T4: -1}", "region_factor: {Bad_Region: 1}", "time_of_day: [{start_hour: 1}]"])
def test_malformed_catalog_is_a_validation_error(text):
    with pytest.raises(ValidationError):
        PriceCatalog.from_yaml(text)
