"""Placement decisions per second of the pure scheduling core (no bus, no store).

Scenarios: N clusters (8, 64, 256) spread over 8 regions, each built from a slice of the openb
node list (so card mixes are real); a queue of J pending jobs (1k, 5k, 10k) made from the
openb gpuspec33 pods by the replay's overlay rule. One ``decide(view, queue, federated)`` call
is one scheduling cycle; decisions/s = J / cycle time (a decision is a placement or a pending
verdict with every cluster's reason).

* ``filling``: half of the cards busy, so thousands of jobs are placed in the one cycle (the
  worst case: every placement fits and scores clusters);
* ``steady``: the federation nearly full (every card busy except one in 20);
* ``full``: every card busy but a few shares, the usual state of a busy pool -- a handful of
  placements, thousands of jobs that must be told why they wait.

    python bench/core_throughput.py [--repeat 3] [--clusters 8,64,256] [--jobs 1000,5000,10000] [--nodes 40]

Karmada scale (issue 15, item 5): 100 clusters x 5,000 nodes (500k nodes), 10k pending:

    PYTHONPATH=. python bench/core_throughput.py --clusters 100 --nodes 5000 --jobs 10000 --repeat 1 \
        --scenarios full,steady,filling --digest

Clusters are handed to ``decide`` prepared (:meth:`ClusterState.prepared`: node index and
capacity classes), as the scheduler service keeps them from one cycle to the next (rebuilt only
for nodes whose allocation changed); building them is not part of the cycle time. On a shared
machine wall time varies with load: compare the ``cpu s`` column (``per cpu-s`` = decisions per
CPU-second, the rate issue 15's figures use).

The process runs with the scheduler service's garbage-collector thresholds
(:func:`services.scheduler.core.collector.raise_gc_thresholds`, set after the view is built);
``--gc default`` keeps CPython's (700, 10, 10), under which collections are about a quarter of
a cycle at 500k nodes.

``--digest`` adds a column: a hash of every placement (cluster, card model, bindings, score,
explanation, cost) and every pending job (reason, reservation), each with every cluster's verdict
(code, detail, score terms) in order -- a change meant to be a pure speed-up must leave it as it
was.

Targets (issue 4): >= 10,000 decisions/s at 64 clusters with 10,000 pending jobs, and that
cycle under 1 s; issue 15: the same at 100 x 5,000 nodes in the busy (``full``) and steady states.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time
from importlib import resources
from pathlib import Path

from fedapp.replay.workload import overlay
from services.inventory.trace import load_nodes, load_pods
from services.scheduler.core import ClusterState, NodeState, QueuedJob, View, build_policy, decide
from services.scheduler.core.collector import CYCLE_THRESHOLDS, raise_gc_thresholds
from fedsched.pricing import load_price_catalog

REGIONS = ("cn-north-1", "cn-east-1", "cn-south-1", "cn-west-1", "us-east-1", "eu-west-1", "ap-south-1", "us-west-2")


def data(name: str) -> Path:
    return Path(str(resources.files("fedsched.data").joinpath("alibaba-gpu-2023", name)))


def build_view(n_clusters: int, nodes_per_cluster: int = 40, scenario: str = "filling") -> View:
    nodes = load_nodes(data("openb_node_list_gpu_node.csv"))
    prices = load_price_catalog()
    clusters = []
    for c in range(n_clusters):
        region = REGIONS[c % len(REGIONS)]
        picked = [nodes[(c * 97 + k * 31) % len(nodes)] for k in range(nodes_per_cluster)]
        states = []
        for k, n in enumerate(picked):
            if scenario == "filling":
                busy = (k * 7 + c) % 2  # every other card busy on half the nodes
                free = tuple(0 if (busy and g % 2 == 0) else 1000 for g in range(n.gpus))
            elif scenario == "steady":  # one card in 20 idle
                free = tuple(1000 if (k * 8 + g + c) % 20 == 0 else 0 for g in range(n.gpus))
            else:  # full: every card busy, a few with a fractional share left
                free = tuple(300 if (k * 8 + g + c) % 50 == 0 else 0 for g in range(n.gpus))
            states.append(NodeState(f"c{c}-n{k}", n.card_model, n.gpu_memory_gib, free, n.cpu_milli // 2,
                                    n.memory_mib // 2, n.cpu_milli, n.memory_mib))
        models = {s.card_model for s in states}
        clusters.append(ClusterState(f"c{c:03d}", region if region.count("-") else region, f"{region}a", tuple(states),
                                     prices={m: float(prices.gpu_hour(region, m)) for m in models}).prepared())
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


def digest(d) -> str:
    """A short hash of every decision of ``d`` with every cluster's verdict, in order."""
    h = hashlib.sha256()
    for p in d.placements:
        h.update(repr((p.job.key, p.cluster, p.card_model, p.bindings, p.score, p.explanation, p.est_cost,
                       p.transfer_s, [(e.cluster, e.region, e.verdict.reason, e.verdict.detail, e.scores, e.total)
                                      for e in p.evaluations])).encode())
    for p in d.pending:
        h.update(repr((p.job.key, p.reason, p.fits_empty, p.queue, p.reservation,
                       [(e.cluster, e.region, e.verdict.reason, e.verdict.detail, e.scores, e.total)
                        for e in p.evaluations])).encode())
    h.update(repr(d.reservations).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="8,64,256")
    ap.add_argument("--nodes", type=int, default=40, help="nodes per cluster (5000 = the Karmada-scale view)")
    ap.add_argument("--jobs", default="1000,5000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenarios", default="full,steady,filling")
    ap.add_argument("--digest", action="store_true", help="print a hash of every decision and verdict")
    ap.add_argument("--gc", choices=("service", "default"), default="service",
                    help=f"collector thresholds: the scheduler service's {CYCLE_THRESHOLDS} or CPython's default")
    args = ap.parse_args()
    policy = build_policy("federated")
    print(f"gc thresholds: {gc.get_threshold() if args.gc == 'default' else CYCLE_THRESHOLDS}")
    print(f"{'scenario':>8} {'clusters':>8} {'pending':>8} {'placed':>7} {'cycle s (median)':>17} {'cpu s':>10} "
          f"{'decisions/s':>12} {'per cpu-s':>10}" + (f" {'digest':>16}" if args.digest else ""))
    for scenario, n_clusters in ((sc, int(x)) for sc in args.scenarios.split(",") for x in args.clusters.split(",")):
        t_build = time.perf_counter()
        view = build_view(n_clusters, args.nodes, scenario=scenario)
        t_build = time.perf_counter() - t_build
        if args.gc == "service":
            raise_gc_thresholds()  # as the scheduler service does at start-up
        regions = tuple(dict.fromkeys(c.region for c in view.clusters))
        for n_jobs in (int(x) for x in args.jobs.split(",")):
            queue = build_queue(n_jobs, regions)
            times, cpu, placed, d = [], [], 0, None
            for _ in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                d = decide(view, queue, policy)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                placed = len(d.placements)
            t, c = statistics.median(times), statistics.median(cpu)
            print(f"{scenario:>8} {n_clusters:>8} {n_jobs:>8} {placed:>7} {t:>17.3f} {c:>10.3f} {n_jobs / t:>12,.0f} "
                  f"{n_jobs / c:>10,.0f}" + (f" {digest(d):>16}" if args.digest else ""), flush=True)


if __name__ == "__main__":
    main()
