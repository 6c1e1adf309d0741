"""Replay the bundled openb gpuspec33 trace under each scheduling policy and compare.

Every policy gets the same workload through the whole running system (embedded NATS, chDB,
agents, admission, scheduler) and every figure is computed by SQL from that run's ClickHouse
database:

* wait p50/p95/mean: submit -> first start (business clock), started jobs;
* p95 ready: submit -> first start + that placement's estimated data transfer (when the job
  can compute: starting abroad at once still waits for the data);
* finished: jobs that finished or failed as the trace says (vs. still pending at the end);
* GPU utilisation over the arrival window; total cost (usage rows, Decimal);
* cross-region jobs; data transfer time (sum of estimated transfer seconds of started
  placements) and egress cost (bytes moved x the catalog's egress price);
* constraint violations -- must be 0 for every policy: a job started on a card model it did not
  allow, a must-stay-local job started abroad, a job with residency tags on a cluster without
  them, a cluster whose GPUs were ever over-allocated.

The trace as recorded keeps under 70 of 6212 GPUs busy, so ``--load`` compresses arrivals
(runtimes unchanged) to create contention; without it every policy waits ~0.

    python bench/compare_policies.py [--load 200] [--limit N] [--policies federated,local-only,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from decimal import Decimal
from importlib import resources
from pathlib import Path

from fedsched.pricing import load_price_catalog
from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedsched.settings import Settings
from fedsched.store import open_store
from services.inventory.trace import CLUSTERS
from services.scheduler.core import POLICY_NAMES


def data(name: str) -> Path:
    return Path(str(resources.files("fedsched.data").joinpath("alibaba-gpu-2023", name)))


def violations(store) -> dict[str, int]:
    """Constraint violations of one run, from its event log."""
    db = store.database
    started = store.query(f"""
        SELECT s.job_id, JSONExtract(s.payload, 'spec', 'card_models', 'Array(String)'),
               JSONExtractString(s.payload, 'spec', 'locality'), JSONExtractString(s.payload, 'spec', 'home_region'),
               JSONExtract(s.payload, 'spec', 'residency_tags', 'Array(String)'),
               JSONExtractString(r.payload, 'card_model'), r.region, r.cluster
        FROM {db}.events AS s INNER JOIN {db}.events AS r ON s.job_id = r.job_id
        WHERE s.type = 'job.submitted' AND r.type = 'job.started'""").rows
    tags = {c.name: set(c.residency_tags) for c in CLUSTERS}
    out = {"card_model": 0, "must_local": 0, "residency": 0}
    for _, models, locality, home, residency, used, region, cluster in started:
        out["card_model"] += bool(models) and used not in models
        out["must_local"] += locality == "must_local" and region != home
        out["residency"] += not set(residency) <= tags.get(cluster, set())
    return out


def ready_waits(store) -> dict[str, float]:
    """Submit -> first start plus that placement's estimated data transfer (s, business clock):
    when the job can actually compute. A policy that starts jobs abroad at once still makes them
    wait for their data; one that waits for home does not."""
    db = store.database
    p50, p95, mean = store.query(f"""
        SELECT quantileExact(0.5)(r), quantileExact(0.95)(r), avg(r) FROM (
            SELECT dateDiff('millisecond', sub.at, st.at) / 1000.0 + JSONExtractFloat(pl.payload, 'transfer_s') AS r
            FROM (SELECT job_id, min(occurred_at) AS at, argMin(attempt, occurred_at) AS attempt
                  FROM {db}.events WHERE type = 'job.started' GROUP BY job_id) AS st
            INNER JOIN (SELECT job_id, min(occurred_at) AS at FROM {db}.events WHERE type = 'job.submitted'
                        GROUP BY job_id) AS sub ON sub.job_id = st.job_id
            INNER JOIN (SELECT job_id, attempt, any(payload) AS payload FROM {db}.events WHERE type = 'job.placed'
                        GROUP BY job_id, attempt) AS pl ON pl.job_id = st.job_id AND pl.attempt = st.attempt)
        """).rows[0]
    return {"p50": float(p50 or 0), "p95": float(p95 or 0), "mean": float(mean or 0)}


def transfer(store) -> tuple[float, Decimal]:
    """(estimated transfer seconds, egress cost) of placements that started."""
    db = store.database
    seconds, gb = store.query(f"""
        SELECT sum(JSONExtractFloat(p.payload, 'transfer_s')), sum(JSONExtractUInt(p.payload, 'transfer_bytes')) / 1e9
        FROM {db}.events AS p INNER JOIN {db}.events AS s ON p.job_id = s.job_id AND p.attempt = s.attempt
        WHERE p.type = 'job.placed' AND s.type = 'job.started'""").rows[0]
    egress = load_price_catalog().egress_per_gb * Decimal(str(gb or 0))
    return float(seconds or 0), egress.quantize(Decimal("0.01"))


async def run(policy: str, args, chdb_path: Path, workdir: Path) -> dict:
    database = "bench_" + policy.replace("-", "_")
    settings = Settings(data_dir=workdir / policy, clickhouse_path=chdb_path, clickhouse_database=database,
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    options = ReplayOptions(nodes_csv=data("openb_node_list_gpu_node.csv"), pods_csv=data("openb_pod_list_gpuspec33.csv"),
                            settings=settings, limit=args.limit, speed=args.speed, policy=policy, load=args.load,
                            timeout_s=args.timeout)
    report = await ReplayDriver(options).run()
    store = open_store(chdb_path=chdb_path, database=database, migrate=False)
    report["violations"] = violations(store)
    report["violations"]["over_allocated_clusters"] = len(report["capacity_check"]["over_allocated"])
    report["transfer_s"], report["egress_cost"] = transfer(store)
    report["ready_seconds"] = ready_waits(store)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--load", type=float, default=200.0, help="arrival compression (1 = the trace as recorded)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, default=None, help="also write all reports here")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fedsched-bench-"))
    chdb_path = workdir / "clickhouse"
    reports = {}
    for policy in args.policies.split(","):
        t0 = time.monotonic()
        reports[policy] = asyncio.run(run(policy, args, chdb_path, workdir))
        print(f"{policy}: done in {time.monotonic() - t0:.0f} s", flush=True)
    cols = ("policy", "p50 s", "p95 s", "mean s", "p95 ready s", "finished", "GPU util", "cost", "x-region",
            "transfer s", "egress", "violations")
    rows = []
    for policy, r in reports.items():
        w = r["wait_seconds"]
        rows.append((policy, f"{w['p50']:.0f}", f"{w['p95']:.0f}", f"{w['mean']:.0f}", f"{r['ready_seconds']['p95']:.0f}",
                     str(r["jobs"]["finished"] + r["jobs"]["failed"]), f"{r['gpu_utilization_arrivals']:.1%}",
                     f"{Decimal(r['cost_total']):,.0f}", str(r["cross_region_jobs"]), f"{r['transfer_s']:,.0f}",
                     f"{r['egress_cost']:,.0f}", str(sum(r["violations"].values()))))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"\nload {args.load:g}, {next(iter(reports.values()))['jobs']['submitted']} jobs")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2, default=str))


if __name__ == "__main__":
    main()
