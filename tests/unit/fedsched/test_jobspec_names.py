"""JobSpec's name fields (region limits, residency tags, card models) keep their rules however
they are validated: a malformed name is refused naming its field, a list of good names is kept
as given, card models come out sorted and distinct."""

from __future__ import annotations

import pytest

from fedsched.errors import InvalidName
from fedsched.jobs import JobSpec

BASE = {"tenant": "search", "project": "train", "home_region": "cn-north-1"}


@pytest.mark.parametrize("field,bad", [("allowed_regions", "cn-north-1"), ("forbidden_regions", "cn-north-1"),
                                       ("residency_tags", "finance")])
def test_a_malformed_name_in_a_list_is_refused_naming_its_field(field, bad):
    with pytest.raises(InvalidName) as e:
        JobSpec(**BASE, **{field: (bad, "Not_A_Name")})
    assert e.value.value == "Not_A_Name" and e.value.field == field


def test_good_names_are_kept_as_given_and_empty_lists_stay_empty():
    spec = JobSpec(**BASE, allowed_regions=["cn-north-1", "cn-east-1"], forbidden_regions=("cn-south-1",),
                   residency_tags=["pii", "cn"])
    assert spec.allowed_regions == ("cn-north-1", "cn-east-1") and spec.forbidden_regions == ("cn-south-1",)
    assert spec.residency_tags == ("pii", "cn")
    empty = JobSpec(**BASE)
    assert (empty.allowed_regions, empty.forbidden_regions, empty.residency_tags, empty.card_models) == ((),) * 4


@pytest.mark.parametrize("given,kept", [((), ()), (("nvidia-t4-16gb",), ("nvidia-t4-16gb",)),
                                        (["nvidia-v100-32gb", "nvidia-t4-16gb", "nvidia-v100-32gb"],
                                         ("nvidia-t4-16gb", "nvidia-v100-32gb"))])
def test_card_models_come_out_sorted_and_distinct(given, kept):
    assert JobSpec(**BASE, card_models=given).card_models == kept
