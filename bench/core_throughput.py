"""Placement decisions per second of the pure scheduling core (no bus, no store).

Scenario: N clusters (8, 64, 256) spread over regions, each built from a slice of the openb
node list (so card mixes are real), half of their cards already busy; a queue of J pending jobs
(1k, 5k, 10k) made from the openb gpuspec33 pods by the replay's overlay rule. One
``decide(view, queue, federated)`` call is one scheduling cycle; decisions/s = J / cycle time.

    python bench/core_throughput.py [--repeat 3] [--clusters 8,64,256] [--jobs 1000,5000,10000]

Targets (issue 4): >= 10,000 decisions/s at 64 clusters with 10,000 pending jobs, and that
cycle under 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources
from pathlib import Path

from fedsched.replay.workload import overlay
from services.inventory.trace import load_nodes, load_pods
from services.scheduler.core import ClusterState, NodeState, QueuedJob, View, build_policy, decide
from fedsched.pricing import load_price_catalog

REGIONS = ("cn-north-1", "cn-east-1", "cn-south-1", "cn-west-1", "us-east-1", "eu-west-1", "ap-south-1", "us-west-2")


def data(name: str) -> Path:
    return Path(str(resources.files("fedsched.data").joinpath("alibaba-gpu-2023", name)))


def build_view(n_clusters: int, nodes_per_cluster: int = 40) -> View:
    nodes = load_nodes(data("openb_node_list_gpu_node.csv"))
    prices = load_price_catalog()
    clusters = []
    for c in range(n_clusters):
        region = REGIONS[c % len(REGIONS)]
        picked = [nodes[(c * 97 + k * 31) % len(nodes)] for k in range(nodes_per_cluster)]
        states = []
        for k, n in enumerate(picked):
            busy = (k * 7 + c) % 2  # every other card busy on half the nodes
            free = tuple(0 if (busy and g % 2 == 0) else 1000 for g in range(n.gpus))
            states.append(NodeState(f"c{c}-n{k}", n.card_model, n.gpu_memory_gib, free, n.cpu_milli // 2,
                                    n.memory_mib // 2, n.cpu_milli, n.memory_mib))
        models = {s.card_model for s in states}
        clusters.append(ClusterState(f"c{c:03d}", region if region.count("-") else region, f"{region}a", tuple(states),
                                     prices={m: float(prices.gpu_hour(region, m)) for m in models}))
    return View(tuple(clusters), 1.7e9)


def build_queue(n_jobs: int, regions: tuple[str, ...]) -> list[QueuedJob]:
    pods = load_pods(data("openb_pod_list_gpuspec33.csv"))
    queue = []
    for i in range(n_jobs):
        pod = pods[i % len(pods)]
        spec = overlay(pod)
        if spec.home_region not in regions:
            spec = spec.model_copy(update={"home_region": regions[i % len(regions)]})
        queue.append(QueuedJob(f"j{i}", 1, spec, 1.7e9 - (n_jobs - i)))
    return queue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="8,64,256")
    ap.add_argument("--jobs", default="1000,5000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    policy = build_policy("federated")
    print(f"{'clusters':>8} {'pending':>8} {'placed':>7} {'cycle s (median)':>17} {'decisions/s':>12}")
    for n_clusters in (int(x) for x in args.clusters.split(",")):
        view = build_view(n_clusters)
        regions = tuple(dict.fromkeys(c.region for c in view.clusters))
        for n_jobs in (int(x) for x in args.jobs.split(",")):
            queue = build_queue(n_jobs, regions)
            times, placed = [], 0
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                d = decide(view, queue, policy)
                times.append(time.perf_counter() - t0)
                placed = len(d.placements)
            t = statistics.median(times)
            print(f"{n_clusters:>8} {n_jobs:>8} {placed:>7} {t:>17.3f} {n_jobs / t:>12,.0f}", flush=True)


if __name__ == "__main__":
    main()
