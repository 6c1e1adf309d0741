"""A cycle's placement counterfactuals share their home start estimates (core/explain.py
``placement_counterfactual(..., starts)``): same text as computed alone, and the home clusters'
running work is walked once per request shape, not once per placed job."""

from __future__ import annotations

from services.scheduler.core import ClusterState, NodeState, RunningWork, View, build_policy, decide
from services.scheduler.core.explain import placement_counterfactual
from tests.builders import job as queued

T4 = "nvidia-t4-16gb"
NOW = 1.7e9


def _view() -> View:
    busy = NodeState("h1", T4, 16, (0,) * 8, 64000, 262144, 64000, 262144)
    running = tuple(RunningWork(f"r{g}", 1, 0, "search", 50, False, False, NOW - 60, NOW + 600 * (g + 1), T4,
                                ((0, (g,), 1000, 1000, 1024),)) for g in range(8))
    home = ClusterState("cn-north-1-c1", "cn-north-1", "cn-north-1a", (busy,), prices={T4: 6.0}, running=running)
    away = ClusterState("cn-east-1-c1", "cn-east-1", "cn-east-1a",
                        (NodeState("e1", T4, 16, (1000,) * 8, 64000, 262144, 64000, 262144),), prices={T4: 5.4})
    return View((home, away), NOW)


def test_shared_home_starts_give_the_same_counterfactuals():
    view = _view()
    policy = build_policy("federated")
    jobs = [queued(f"j{i}", gpus=1, at=NOW - 10 + i, estimated_duration_s=3600) for i in range(4)]
    placements = decide(view, jobs, policy).placements
    assert len(placements) == 4 and all(p.cross_region for p in placements)
    alone = [placement_counterfactual(view, p, policy) for p in placements]
    starts: dict = {}
    shared = [placement_counterfactual(view, p, policy, starts) for p in placements]
    assert shared == alone and alone[0].startswith("staying in cn-north-1 would start it ~10 min later")
    assert len(starts) == 1  # one home cluster, one request shape: estimated once
