"""The policy and scorer names in fedsched (what the policy document and the CLI check) are
the ones the scheduling core implements."""

from __future__ import annotations

from fedsched.tenancy import known_scorers
from fedsched.policynames import POLICY_NAMES, SCORER_NAMES
from services.scheduler.core import build_policy
from services.scheduler.core.policy import _TABLE, SCORERS


def test_policy_names_are_the_cores_policies() -> None:
    assert POLICY_NAMES[0] == "federated"
    assert set(POLICY_NAMES) == set(_TABLE)
    assert all(build_policy(name).name == name for name in POLICY_NAMES)


def test_scorer_names_are_the_cores_scorers_and_the_policies_weights() -> None:
    assert SCORER_NAMES == set(SCORERS) == {cls.name for cls in SCORERS.values()}
    assert known_scorers() == frozenset(sc.name for name in POLICY_NAMES for sc, _ in build_policy(name).weights)
