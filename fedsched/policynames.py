"""Names of the scheduling policies and of their scorers.

The scheduler's core (``services/scheduler/core/policy.py``) implements them; the policy
document (:mod:`fedsched.tenancy`, ``scheduling.weights``) and the CLI only need the names,
so the names live here, below both (a unit test checks they match the core's tables).
"""

from __future__ import annotations

#: The named scheduling policies (``build_policy(name)``), the default first.
POLICY_NAMES: tuple[str, ...] = ("federated", "local-only", "least-loaded", "cheapest", "random")

#: Scorer names a policy document may weight (``scheduling.weights``); the scorers are in
#: ``services/scheduler/core/scorers.py``.
SCORER_NAMES: frozenset[str] = frozenset({"home", "start", "cost", "fragmentation", "packing", "headroom",
                                          "random"})
