"""Naming rules and the card-model catalog."""

import pytest

from fedsched import naming
from fedsched.errors import InvalidName


@pytest.mark.parametrize("raw,canonical", [
    ("NVIDIA-A100-SXM4-80GB", "nvidia-a100-80gb"),
    ("A100 80G", "nvidia-a100-80gb"),
    ("a100-80gb", "nvidia-a100-80gb"),
    ("nvidia-a100-80gb", "nvidia-a100-80gb"),
    ("NVIDIA-A100-SXM4-40GB", "nvidia-a100-40gb"),
    ("V100M16", "nvidia-v100-16gb"),
    ("V100M32", "nvidia-v100-32gb"),
    ("Tesla-V100-SXM2-32GB", "nvidia-v100-32gb"),
    ("P100", "nvidia-p100-16gb"),
    ("Tesla-T4", "nvidia-t4-16gb"),
    ("T4", "nvidia-t4-16gb"),
    ("A10", "nvidia-a10-24gb"),
    ("G2", "alibaba-g2"),
    ("G3", "alibaba-g3"),
    ("H100 NVL", "nvidia-h100-94gb"),
    ("NVIDIA-GeForce-RTX-4090", "nvidia-rtx4090-24gb"),
    ("Ascend910B", "huawei-ascend910b-64gb"),
], ids=lambda x: x)
def test_aliases_land_on_one_canonical_model(raw, canonical):
    assert naming.canonical_card_model(raw) == canonical


def test_unknown_card_gets_a_stable_minted_name_not_a_crash():
    a = naming.default_catalog().canonical("Zeta-9000 48GB")
    b = naming.default_catalog().canonical("ZETA 9000 48G")
    assert a.name == b.name == "unlisted-zeta9000-48gb"
    assert not a.catalogued
    assert naming.is_name("cluster", a.name)


def test_bare_family_with_memory_hint_picks_the_variant():
    assert naming.canonical_card_model("A100", memory_gib=80) == "nvidia-a100-80gb"


def test_resolve_family_means_every_variant():
    names = [m.name for m in naming.default_catalog().resolve("A100")]
    assert names == ["nvidia-a100-40gb", "nvidia-a100-80gb"]


def test_resolve_unknown_model_names_the_field():
    with pytest.raises(InvalidName) as e:
        naming.default_catalog().resolve("XYZ-1", field="spec.card_models[0]")
    assert e.value.field == "spec.card_models[0]"


@pytest.mark.parametrize("kind,value,ok", [
    ("region", "cn-north-1", True),
    ("region", "us-west-2", True),
    ("region", "CN-North-1", False),
    ("region", "cn_north_1", False),
    ("region", "north", False),
    ("region", "cn.north.1", False),
    ("cluster", "cn-north-1-c1", True),
    ("cluster", "-c1", False),
    ("cluster", "c1-", False),
    ("cluster", "a" * 64, False),
    ("tenant", "search", True),
    ("tenant", "9search", False),
    ("tenant", "se arch", False),
    ("tenant", "a" * 33, False),
    ("project", "train", True),
    ("project", "train*", False),
    ("job", "j-0123abcd", True),
    ("job", "job>", False),
    ("zone", "cn-north-1a", True),
    ("node", "openb-node-0001", True),
    ("node", "Node_1", False),
], ids=lambda x: str(x)[:20])
def test_name_rules(kind, value, ok):
    assert naming.is_name(kind, value) is ok
    if not ok:
        with pytest.raises(InvalidName) as e:
            naming.check_name(kind, value)
        assert e.value.kind == kind and e.value.rule


def test_valid_names_are_safe_subject_tokens():
    for kind in ("region", "cluster", "tenant", "project", "job", "zone", "queue", "pool"):
        pattern, _ = naming.RULES[kind]
        for bad in ("a.b", "a*", "a>", "a b"):
            assert pattern.fullmatch(bad) is None


def test_error_suggests_the_canonical_form():
    with pytest.raises(InvalidName, match="did you mean 'cn-north-1'"):
        naming.check_name("region", "CN_North_1")


@pytest.mark.parametrize("value, known, suggested", [
    ("CN_North_1", None, "cn-north-1"),  # case and separators: the canonical form
    ("Café", None, "cafe"),  # an accent folds away
    ("s\u0435arch", None, None),  # a Cyrillic е: 's-arch' would help nobody
    ("s\u0435arch", ["ads", "search"], "search"),  # the closest name that exists
    ("Search", ["ads", "search"], "search"),
    ("s\u0435arch", ["ads", "video"], None),  # nothing close exists: no suggestion
    ("CN_North_1", [], None),  # with the names given, only one of them
    ("--", None, None),
], ids=["separators", "accent", "cyrillic", "cyrillic-known", "case-known", "nothing-close", "none-known", "empty"])
def test_a_suggestion_is_a_canonical_form_or_an_existing_name_or_nothing(value, known, suggested):
    with pytest.raises(InvalidName) as e:
        naming.check_name("tenant", value, known=known)
    message = str(e.value)
    if suggested is None:
        assert "did you mean" not in message
    else:
        assert f"did you mean {suggested!r}?" in message
