"""Inter-region bandwidth per region pair (from the topology) in the scheduler's transfer estimate."""

from __future__ import annotations

import pytest

from fedsched.jobs import Dataset
from services.scheduler.core import build_policy, decide
from tests.builders import cluster, job, node, view

GB = 10**9


def _pairs(**gbit: float) -> tuple[tuple[str, str, float], ...]:
    """``north_south=100`` -> both orders of (cn-north-1, cn-south-1) at 100 Gbit/s in bytes/s."""
    out = []
    for key, g in gbit.items():
        a, b = (f"cn-{r}-1" for r in key.split("_"))
        out += [(a, b, g * 1e9 / 8), (b, a, g * 1e9 / 8)]
    return tuple(sorted(out))


def test_transfer_time_uses_the_pair_bandwidth_and_the_default_elsewhere():
    j = job(datasets=(Dataset(name="d", home_region="cn-north-1", size_bytes=125 * GB),
                      Dataset(name="e", home_region="cn-east-1", size_bytes=125 * GB)))
    south = cluster("south", "cn-south-1", (node("s1"),))
    policy = build_policy("federated", region_bandwidth_bps=_pairs(north_south=100))
    (p,) = decide(view(south), [j], policy).placements
    # north->south at 12.5 GB/s: 10 s; east->south unlisted: the default 1.25 GB/s, 100 s
    assert p.transfer_s == pytest.approx(10.0 + 100.0)
    (p,) = decide(view(south), [j], build_policy("federated")).placements
    assert p.transfer_s == pytest.approx(200.0)


@pytest.mark.parametrize("fast, expected", [("east", "east"), ("south", "south")])
def test_the_faster_pair_wins_the_placement(fast, expected):
    j = job(datasets=(Dataset(name="d", home_region="cn-north-1", size_bytes=20_000 * GB),))
    clusters = (cluster("east", "cn-east-1", (node("e1"),)), cluster("south", "cn-south-1", (node("s1"),)))
    slow = "south" if fast == "east" else "east"
    policy = build_policy("federated", region_bandwidth_bps=_pairs(**{f"north_{fast}": 400, f"north_{slow}": 1}))
    (p,) = decide(view(*clusters), [j], policy).placements
    assert p.cluster == expected


def test_an_unset_pair_table_keeps_the_policy_version():
    assert build_policy("federated").version == build_policy("federated", region_bandwidth_bps=()).version
    assert build_policy("federated").version != build_policy("federated",
                                                             region_bandwidth_bps=_pairs(north_south=1)).version
