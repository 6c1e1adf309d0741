"""A start deadline that has passed at submit is refused (as Slurm's ``--deadline``), naming the
field and both times; a later one, or none, is accepted (services/admission/service.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fedsched.errors import ValidationError
from fedsched.jobs import JobSpec
from services.admission.service import check_start_deadline

NOW = datetime(2026, 11, 30, 23, 0, tzinfo=UTC)


def _spec(deadline):
    return JobSpec(tenant="search", project="train", home_region="cn-north-1", start_deadline=deadline)


@pytest.mark.parametrize("deadline", [NOW - timedelta(days=400), NOW - timedelta(seconds=1), NOW],
                         ids=["last-year", "a-second-ago", "now"])
def test_a_deadline_not_after_now_is_refused(deadline):
    with pytest.raises(ValidationError) as e:
        check_start_deadline(_spec(deadline), NOW.timestamp())
    assert e.value.field == "spec.start_deadline"
    assert f"{deadline:%Y-%m-%dT%H:%M:%SZ} is not after now (2026-11-30T23:00:00Z)" in e.value.message


@pytest.mark.parametrize("deadline", [None, NOW + timedelta(seconds=1), NOW + timedelta(days=30)],
                         ids=["none", "a-second-ahead", "next-month"])
def test_a_later_deadline_or_none_is_accepted(deadline):
    check_start_deadline(_spec(deadline), NOW.timestamp())
