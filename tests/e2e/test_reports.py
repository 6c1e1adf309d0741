"""Report accuracy after a replay: every figure of every saved report equals an independent
computation in Python from the raw ``events`` table (and the price catalog); chargeback ==
usage == start/stop events x prices; every name is canonical; the HTML page renders with data in
every chart; the Grafana panels run the same SQL with the same results; ``fedsched report`` works.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from fedsched import naming
from fedsched.bus import Bus
from fedsched.events import JobPlaced, WorkerBinding, business_event_id, make_event
from fedsched.jobs import Dataset, JobSpec
from fedsched.lease import read_tenure
from fedsched.pricing import load_price_catalog, money
from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedapp.reports import REPORTS, data_window, run_reports
from fedapp.reports.grafana import dashboard, grafana_macros
from fedapp.reports.html import html_page
from fedsched.settings import Settings
from fedsched.store import AsyncStore, open_store
from services.audit.service import EVENT_COLUMNS, AuditService
from services.billing.service import BillingService
from tests.builders import DATA, unique

pytestmark = pytest.mark.e2e

MS = timedelta(milliseconds=1)
ENDS = ("job.finished", "job.failed", "job.stopped")


@pytest.fixture(scope="module")
async def replayed(nats_server, chdb_path, tmp_path_factory):
    """200 pods of the trace at 400x arrival compression; then, so that every report has data
    whatever the scheduler decides, one more placement that moves data between regions
    (published on the bus and ingested by a restarted audit and billing), and one approval row
    (what audit will write once admission publishes ``approval.*`` events)."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("reports"), nats_url=nats_server.url,
                        subject_prefix=unique("r"), clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    await ReplayDriver(ReplayOptions(nodes_csv=DATA / "openb_node_list_gpu_node.csv",
                                     pods_csv=DATA / "openb_pod_list_gpuspec33.csv", settings=settings, limit=200,
                                     load=400, timeout_s=300)).run()
    store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)
    job, at = store.query(f"SELECT job_id, min(occurred_at) FROM {store.database}.events "
                          f"WHERE type = 'job.placed' GROUP BY job_id ORDER BY 2 LIMIT 1").rows[0]
    await _one_more_transfer(nats_server.url, settings.subject_prefix, store, at.replace(tzinfo=UTC))
    row = dict.fromkeys(EVENT_COLUMNS, "")
    row.update(event_id="a" * 32, type="approval.approved", schema_version=1, occurred_at=at, producer="admission",
               actor="alice", region="cn-east-1", cluster="cn-east-1-c1", tenant="nlp", project="train", job_id=job,
               attempt=1, policy_version="p-1", payload=json.dumps({"reason": "home region full"}))
    store.insert("events", [[row[c] for c in EVENT_COLUMNS]], EVENT_COLUMNS)
    query = lambda sql, params: store.query(sql, params)  # noqa: E731
    window = data_window(query, store.database)
    results = {r.query.name: r for r in run_reports(query, store.database, window)}
    return store, window, results, Raw(store)


async def _one_more_transfer(nats_url: str, prefix: str, store, at: datetime) -> None:
    bus = await Bus.connect(nats_url, prefix, name="extra")
    # stamped with the lease's current fencing token, as the active scheduler stamps its orders
    # (with the replay's last token it is judged a former holder's late order: audit stores a
    # stand-in and billing prices nothing, and the wait below used to run out after 15 s)
    tenure = await read_tenure(bus)
    spec = JobSpec(tenant="nlp", project="train", home_region="cn-south-1", kind="training",
                   datasets=(Dataset(name="nlp/corpus", home_region="cn-south-1", size_bytes=7_500_000_000),))
    placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb", cross_region=True,
                                                bindings=(WorkerBinding(worker=0, node="n1", gpu_indices=(0,)),),
                                                transfer_bytes=7_500_000_000, transfer_s=60.0,
                                                fencing_token=tenure.token if tenure is not None else 0),
                        producer="scheduler", occurred_at=at.timestamp() + 1, region="cn-east-1", zone="cn-east-1a",
                        cluster="cn-east-1-c1", tenant="nlp", project="train", job_id="j-extra-transfer", attempt=1)
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), placed)
    astore = AsyncStore(store)
    audit = AuditService(bus, astore, linger_s=0.02)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    recorded = business_event_id(placed.event_id, "usage")
    for _ in range(300):
        await asyncio.sleep(0.05)
        if store.query(f"SELECT count() FROM {store.database}.events WHERE event_id = {{e:String}}",
                       {"e": recorded}).scalar() and await audit.lag() == 0 and await billing.lag() == 0:
            break
    else:
        raise AssertionError("the extra transfer was not audited and billed within 15 s")
    audit.stop(), billing.stop()
    await asyncio.gather(*tasks)
    await bus.close()


class Raw:
    """The raw audit log, parsed once, and the independent computations over it."""

    def __init__(self, store) -> None:
        rows = store.query(f"SELECT event_id, type, occurred_at, region, cluster, tenant, project, job_id, attempt, "
                           f"actor, policy_version, payload FROM {store.database}.events").rows
        self.events = [dict(zip(("event_id", "type", "at", "region", "cluster", "tenant", "project", "job_id",
                                 "attempt", "actor", "policy_version"), r[:11]), payload=json.loads(r[11]))
                       for r in rows]
        self.by_type = defaultdict(list)
        for e in self.events:
            self.by_type[e["type"]].append(e)

    def submitted(self, start, end) -> dict[str, dict]:
        first = {}
        for e in self.by_type["job.submitted"]:
            if e["job_id"] not in first or e["at"] < first[e["job_id"]]["at"]:
                first[e["job_id"]] = e
        return {j: e for j, e in first.items() if start <= e["at"] < end}

    def first_starts(self) -> dict[str, dict]:
        first = {}
        for e in self.by_type["job.started"]:
            if e["job_id"] not in first or e["at"] < first[e["job_id"]]["at"]:
                first[e["job_id"]] = e
        return first

    def attempts(self, end) -> list[dict]:
        """Started attempts: (job, attempt, shard) with card, milli-GPUs, start and end (or ``end``)."""
        out: dict[tuple, dict] = {}
        for e in self.events:
            if e["type"] not in ("job.started", *ENDS) or e["at"] >= end:
                continue
            key = (e["job_id"], e["attempt"], e["payload"].get("shard", 0))
            a = out.setdefault(key, {"cluster": e["cluster"], "start": None, "end": None})
            if e["type"] == "job.started":
                a["start"] = e["at"] if a["start"] is None else min(a["start"], e["at"])
                a["card"] = e["payload"]["card_model"]
                a["milli"] = e["payload"]["gpu_milli"]
            else:
                a["end"] = e["at"] if a["end"] is None else min(a["end"], e["at"])
        return [dict(a, end=a["end"] or end) for a in out.values() if a["start"] is not None]

    def capacity(self) -> dict[tuple[str, str], int]:
        """(cluster, card model) -> GPUs in the cluster's latest inventory snapshot."""
        latest: dict[str, dict] = {}
        for e in self.by_type["inventory.snapshot"]:
            if e["cluster"] not in latest or e["at"] >= latest[e["cluster"]]["at"]:
                latest[e["cluster"]] = e
        out: dict[tuple[str, str], int] = defaultdict(int)
        for cluster, e in latest.items():
            for n in e["payload"]["nodes"]:
                out[(cluster, n["card_model"])] += n["gpus"]
        return out


def quantile(values: list[float], level: float) -> float:
    """ClickHouse's quantileExact: the element at index floor(level * n) of the sorted values."""
    s = sorted(values)
    return s[min(int(level * len(s)), len(s) - 1)]


def approx(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dim", ["region", "kind", "tenant"])
async def test_submit_to_start_quantiles_match_the_raw_events(replayed, dim):
    _, window, results, raw = replayed
    starts = raw.first_starts()
    waits = defaultdict(list)
    for job, sub in raw.submitted(window.start, window.end).items():
        if job in starts:
            key = {"region": starts[job]["region"], "kind": sub["payload"]["spec"]["kind"], "tenant": sub["tenant"]}[dim]
            waits[key].append(((starts[job]["at"] - sub["at"]) // MS) / 1000.0)
    got = {r[dim]: r for r in results[f"wait_by_{dim}"].dicts()}
    assert set(got) == set(waits) and waits
    for key, ws in waits.items():
        r = got[key]
        assert (r["jobs"], r["p50_s"], r["p95_s"], r["max_s"]) == (len(ws), quantile(ws, 0.5), quantile(ws, 0.95),
                                                                   max(ws)), key
        assert approx(r["mean_s"], sum(ws) / len(ws))


async def test_cross_region_ratio_and_success_match_the_raw_events(replayed):
    _, window, results, raw = replayed
    crossed = defaultdict(bool)
    for e in raw.by_type["job.started"]:
        crossed[e["job_id"]] |= bool(e["payload"]["cross_region"])
    last = {}
    for e in raw.by_type["job.finished"] + raw.by_type["job.failed"]:
        if e["job_id"] not in last or (e["at"], e["attempt"]) > (last[e["job_id"]]["at"], last[e["job_id"]]["attempt"]):
            last[e["job_id"]] = e
    expect = defaultdict(lambda: defaultdict(int))
    for job, s in raw.first_starts().items():
        if not window.start <= s["at"] < window.end:
            continue
        c = expect[s["region"]]
        c["jobs_started"] += 1
        side = "cross_region" if crossed[job] else "local"
        c["cross_region_jobs"] += crossed[job]
        if job in last:
            c[f"{side}_ended"] += 1
            c[f"{side}_succeeded"] += last[job]["type"] == "job.finished"
    got = {r["region"]: r for r in results["cross_region"].dicts()}
    assert set(got) == set(expect)
    for region, c in expect.items():
        r = got[region]
        for k in ("jobs_started", "cross_region_jobs", "cross_region_ended", "cross_region_succeeded", "local_ended",
                  "local_succeeded"):
            assert r[k] == c[k], (region, k)
        assert approx(r["cross_region_ratio"], c["cross_region_jobs"] / c["jobs_started"])
        for side in ("cross_region", "local"):
            rate = c[f"{side}_succeeded"] / c[f"{side}_ended"] if c[f"{side}_ended"] else None
            assert approx(r[f"{side}_success_rate"], rate), (region, side)


async def test_transfer_overhead_and_egress_cost_match_placements_times_the_catalog(replayed):
    store, window, results, raw = replayed
    catalog = load_price_catalog()
    moved = [e for e in raw.by_type["job.placed"] if e["payload"]["transfer_bytes"] > 0]
    assert moved, "the replay should move some data between regions"
    expect = defaultdict(lambda: {"placements": 0, "bytes": 0, "transfer_s": 0.0, "cost": Decimal(0)})
    for e in moved:
        c = expect[(e["payload"]["spec"]["home_region"], e["region"])]
        c["placements"] += 1
        c["bytes"] += e["payload"]["transfer_bytes"]
        c["transfer_s"] += e["payload"]["transfer_s"]
        c["cost"] += money(Decimal(e["payload"]["transfer_bytes"]) / Decimal(10**9) * catalog.egress_per_gb)
    got = {(r["home_region"], r["region"]): r for r in results["transfer_overhead"].dicts()}
    assert set(got) == set(expect)
    for route, c in expect.items():
        r = got[route]
        assert (r["placements"], r["egress_cost"]) == (c["placements"], c["cost"])
        assert approx(r["gb"], c["bytes"] / 1e9) and approx(r["transfer_hours"], c["transfer_s"] / 3600)
    usage = store.query(f"SELECT count(), sum(cost), sum(transfer_bytes) FROM {store.database}.usage "
                        f"WHERE line = 'transfer'").rows[0]
    assert usage == (len(moved), sum(c["cost"] for c in expect.values()), sum(c["bytes"] for c in expect.values()))


async def test_failure_rate_by_cluster_matches_the_raw_events(replayed):
    _, window, results, raw = replayed
    expect = defaultdict(lambda: defaultdict(int))
    for e in raw.events:
        if e["type"] in ("job.finished", "job.failed", "job.stopped", "job.rejected") and \
                window.start <= e["at"] < window.end:
            expect[e["cluster"]][e["type"].split(".")[1]] += 1
    got = {r["cluster"]: r for r in results["failure_by_cluster"].dicts()}
    assert set(got) == set(expect)
    for cluster, c in expect.items():
        r = got[cluster]
        ended = sum(c.values())
        assert (r["attempts_ended"], r["finished"], r["failed"], r["stopped"], r["rejected"]) == (
            ended, c["finished"], c["failed"], c["stopped"], c["rejected"])
        assert approx(r["failure_rate"], (c["failed"] + c["rejected"]) / ended)


def _buckets(window):
    step = timedelta(seconds=window.bucket_s)
    n = -(-((window.end - window.start) // MS) // (window.bucket_s * 1000))
    return [(window.start + k * step, min(window.start + (k + 1) * step, window.end)) for k in range(n)]


async def test_gpu_utilisation_series_matches_the_raw_events(replayed):
    _, window, results, raw = replayed
    gpus = defaultdict(int)
    for (cluster, _), n in raw.capacity().items():
        gpus[cluster] += n
    attempts = raw.attempts(window.end)
    got = {(r["time"], r["cluster"]): r["utilisation"] for r in results["gpu_utilisation"].dicts()}
    buckets = _buckets(window)
    assert len(got) == len(buckets) * len(gpus)
    busy = 0
    for cluster, total in gpus.items():
        for a, b in buckets:
            used = sum(x["milli"] / 1000 * max(0, (min(x["end"], b) - max(x["start"], a)) // MS)
                       for x in attempts if x["cluster"] == cluster) / 1000.0
            expect = used / (total * ((b - a) // MS) / 1000.0)
            value = got[(a, cluster)]
            assert approx(value or 0.0, expect), (cluster, a)
            busy += expect > 0
    assert busy > 0


async def test_queue_length_series_matches_the_raw_events(replayed):
    _, window, results, raw = replayed
    kinds = {e["job_id"]: e["payload"]["spec"]["kind"] for e in raw.by_type["job.submitted"]}
    per_job = defaultdict(list)
    for e in raw.events:
        if e["type"] in ("job.submitted", "job.started", "job.finished", "job.failed", "job.stopped", "job.rejected",
                         "job.cancelled") and e["at"] < window.end:
            per_job[e["job_id"]].append(e)
    deltas = defaultdict(list)  # kind -> (t, d)
    for job, evs in per_job.items():
        evs.sort(key=lambda e: (e["at"], e["event_id"]))
        last_start = max((e["at"] for e in evs if e["type"] == "job.started"), default=None)
        waiting = 0
        for e in evs:
            t, typ = e["at"], e["type"]
            if typ in ("job.started", "job.finished", "job.cancelled"):
                now = 0
            elif typ == "job.stopped" and e["payload"].get("reason") == "cancelled":
                now = 0
            elif typ == "job.failed" and last_start is not None and t >= last_start:
                now = 0
            else:
                now = 1
            if now != waiting and job in kinds:
                deltas[kinds[job]].append((t, now - waiting))
            waiting = now
    buckets = _buckets(window)
    expect = {}
    for kind in set(kinds.values()):
        marks = sorted(deltas[kind] + [(a, 0) for a, _ in buckets])
        level, k = 0, -1
        for t, d in marks:
            level += d
            if not window.start <= t < window.end:
                continue
            k = ((t - window.start) // MS) // (window.bucket_s * 1000)
            key = (buckets[k][0], kind)
            expect[key] = max(expect.get(key, level), level)
    got = {(r["time"], r["kind"]): r["waiting"] for r in results["queue_length"].dicts()}
    assert got == expect
    assert max(got.values()) > 0


async def test_capacity_hints_match_the_raw_events(replayed):
    _, window, results, raw = replayed
    gpus = defaultdict(int)
    for (_, model), n in raw.capacity().items():
        gpus[model] += n
    span = ((window.end - window.start) // MS) / 1000.0
    used = defaultdict(float)
    for x in raw.attempts(window.end):
        used[x["card"]] += x["milli"] / 1000 * max(0, (min(x["end"], window.end) - max(x["start"], window.start)) // MS)
    starts = raw.first_starts()
    waits = defaultdict(list)
    for job, sub in raw.submitted(window.start, window.end).items():
        if job in starts:
            waits[starts[job]["payload"]["card_model"]].append(((starts[job]["at"] - sub["at"]) // MS) / 1000.0)
    got = {r["card_model"]: r for r in results["capacity_hints"].dicts()}
    assert set(got) == {m for m, n in gpus.items() if n > 0}
    for model, r in got.items():
        util = used[model] / 1000.0 / (gpus[model] * span)
        assert r["gpus"] == gpus[model] and approx(r["utilisation"], util), model
        ws = waits.get(model, [])
        assert r["jobs_started"] == len(ws)
        p95 = quantile(ws, 0.95) if ws else 0.0
        assert r["p95_wait_s"] == p95
        hint = "expand" if p95 >= 600 and util >= 0.8 else "wait-bound" if p95 >= 600 else "busy" if util >= 0.8 else ""
        assert r["hint"] == hint


async def test_chargeback_equals_usage_equals_start_stop_events_times_catalog_prices(replayed):
    store, window, results, raw = replayed
    catalog = load_price_catalog()
    expect: dict[tuple, Decimal] = defaultdict(Decimal)
    for e in raw.events:
        p = e["payload"]
        if e["type"] in ENDS and p.get("started_at"):
            start = datetime.fromisoformat(p["started_at"]).replace(tzinfo=None)
            start = start.replace(microsecond=start.microsecond // 1000 * 1000)
            ms = max(0, (e["at"] - start) // MS)
            if p["gpu_milli"]:
                cost = Decimal(p["gpu_milli"]) / 1000 * Decimal(ms) / 3_600_000 * catalog.gpu_hour(
                    e["region"], p["card_model"], start)
            else:
                cost = Decimal(p["cpu_milli"]) / 1000 * Decimal(ms) / 3_600_000 * catalog.cpu_core_hour_in(e["region"])
            key = (e["at"].strftime("%Y-%m"), e["tenant"], e["project"], e["region"], p["card_model"])
        elif e["type"] == "job.placed" and p["transfer_bytes"] > 0:
            cost = Decimal(p["transfer_bytes"]) / Decimal(10**9) * catalog.egress_per_gb
            key = (e["at"].strftime("%Y-%m"), e["tenant"], e["project"], e["region"], p["card_model"])
        else:
            continue
        expect[key] += money(cost)
    rows = results["chargeback"].dicts()
    got = {(r["month"], r["tenant"], r["project"], r["region"], r["card_model"]): r["cost"] for r in rows}
    assert got == dict(expect)
    total = sum(expect.values())
    usage_total = store.query(f"SELECT sum(cost) FROM {store.database}.usage").scalar()
    summary = results["summary"].dicts()[0]
    assert sum(r["cost"] for r in rows) == usage_total == total == summary["total_cost"]
    assert all(isinstance(r["cost"], Decimal) for r in rows)
    for month in {r["month"] for r in rows}:
        assert approx(sum(r["share_of_month"] for r in rows if r["month"] == month), 1.0)


async def test_summary_matches_the_raw_events(replayed):
    _, window, results, raw = replayed
    s = results["summary"].dicts()[0]
    in_window = [e for e in raw.events if window.start <= e["at"] < window.end]
    assert s["audit_events"] == len(in_window) == len(raw.events)
    assert s["jobs_submitted"] == len({e["job_id"] for e in raw.by_type["job.submitted"]})
    assert s["jobs_started"] == len({e["job_id"] for e in raw.by_type["job.started"]})
    starts, subs = raw.first_starts(), raw.submitted(window.start, window.end)
    ws = [((starts[j]["at"] - s_["at"]) // MS) / 1000.0 for j, s_ in subs.items() if j in starts]
    assert (s["wait_p50_s"], s["wait_p95_s"]) == (quantile(ws, 0.5), quantile(ws, 0.95))


async def test_approvals_lists_who_approved_what(replayed):
    _, _, results, raw = replayed
    (row,) = results["approvals"].dicts()
    (event,) = [e for e in raw.events if e["type"].startswith("approval.")]
    assert (row["actor"], row["decision"], row["job_id"], row["policy_version"], row["reason"]) == (
        "alice", "approved", event["job_id"], "p-1", "home region full")


# --------------------------------------------------------------------------- names

_NAME_COLUMNS = {"region": "region", "home_region": "region", "zone": "zone", "cluster": "cluster",
                 "tenant": "tenant", "project": "project", "job_id": "job"}


def _canonical(column: str, value: str) -> bool:
    if column == "card_model":
        return value == naming.canonical_card_model(value)
    return naming.is_name(_NAME_COLUMNS[column], value)


async def test_every_name_in_every_table_and_report_is_canonical(replayed):
    store, _, results, _ = replayed
    checked = 0
    for table, columns in {"events": ("region", "zone", "cluster", "tenant", "project", "job_id"),
                           "usage": ("region", "zone", "cluster", "tenant", "project", "job_id", "card_model"),
                           "decisions": ("region", "cluster", "tenant", "project", "job_id"),
                           "inventory": ("region", "zone", "cluster", "card_model")}.items():
        for column in columns:
            values = store.query(f"SELECT DISTINCT {column} FROM {store.database}.{table} WHERE {column} != ''").rows
            assert values, (table, column)
            bad = [v for (v,) in values if not _canonical(column, v)]
            assert not bad, (table, column, bad[:5])
            checked += len(values)
    for r in results.values():
        for column in set(r.columns) & (set(_NAME_COLUMNS) | {"card_model"}):
            bad = [d[column] for d in r.dicts() if d[column] and not _canonical(column, d[column])]
            assert not bad, (r.query.name, column, bad[:5])
    assert checked > 50


# --------------------------------------------------------------------------- HTML, Grafana, CLI


class _Charts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.charts: list[dict] = []
        self.shapes = 0
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "figure" and "chart" in (a.get("class") or ""):
            self.charts.append({"name": a["data-chart"], "kind": a["data-kind"], "points": int(a["data-points"]),
                                "shapes": 0})
        elif tag in ("rect", "polyline") and "data-series" in a and self.charts:
            self.charts[-1]["shapes"] += 1


async def test_the_html_report_renders_with_data_in_every_chart(replayed, tmp_path):
    _, window, results, _ = replayed
    page = html_page(results.values(), window, source="test")
    parser = _Charts()
    parser.feed(page)
    parser.close()
    assert {"html", "svg", "table", "section"} <= parser.tags
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    names = {c["name"] for c in parser.charts}
    assert names == {q.name for q in REPORTS if q.shape != "table"}
    kinds = {c["kind"] for c in parser.charts}
    assert kinds == {"bar", "line"}
    for c in parser.charts:
        assert c["points"] > 0 and c["shapes"] > 0, c


async def test_grafana_panels_run_the_same_sql_with_the_same_results(replayed):
    store, window, results, _ = replayed
    epoch = datetime(1970, 1, 1)
    from_ms, to_ms = (window.start - epoch) // MS, (window.end - epoch) // MS
    panels = dashboard()["panels"]
    assert len(panels) == len(REPORTS)
    for panel, q in zip(panels, REPORTS):
        sql = grafana_macros(panel["targets"][0]["rawSql"], database=store.database, from_ms=from_ms, to_ms=to_ms,
                             interval_s=window.bucket_s)
        got, want = store.query(sql).rows, results[q.name].rows
        assert len(got) == len(want), q.name
        for a, b in zip(got, want):  # floats may differ in the last bit (parallel summation order)
            assert all(approx(x, y) if isinstance(x, float) else x == y for x, y in zip(a, b)), (q.name, a, b)


async def test_fedsched_report_prints_tables_and_writes_html_and_json(replayed, chdb_path, tmp_path):
    from fedapp.cli import app

    store, _, results, _ = replayed
    page = tmp_path / "report.html"
    base = ["report", "--data-dir", str(chdb_path.parent), "--database", store.database]
    out = CliRunner().invoke(app, [*base, "--html", str(page)])
    assert out.exit_code == 0, out.output
    assert "Monthly chargeback" in out.output and "Queue length over time" in out.output
    assert page.read_text().startswith("<!doctype html>")
    js = CliRunner().invoke(app, [*base, "-o", "json", "--only", "chargeback", "--from", "2023-01-01"])
    assert js.exit_code == 0, js.output
    body = json.loads(js.output)
    assert len(body["reports"]["chargeback"]["rows"]) == len(results["chargeback"].rows)
