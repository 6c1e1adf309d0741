"""The console's ClickHouse reads (fedapp.web.reads) on a real chDB database: usage per tenant
bucketed over the window (cut to the chart span), exact money, only the tenants asked for; a
job's events newest-last with the total counted; its cost lines."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from fedapp.web.reads import Reads

T0 = datetime(2026, 3, 1, 12, 0, 0)
USAGE_COLUMNS = ("usage_id", "line", "job_id", "attempt", "shard", "tenant", "project", "region", "cluster",
                 "card_model", "kind", "outcome", "started_at", "ended_at", "gpu_milli", "gpu_seconds", "unit_price",
                 "cost", "currency")


def _line(n: int, tenant: str, ended: datetime, gpu_seconds: float, cost: str, job: str = "j-x") -> tuple:
    return (f"u-{n}", "compute", job, 1, 0, tenant, "train", "cn-east-1", "c1", "nvidia-t4-16gb", "batch", "finished",
            ended - timedelta(seconds=gpu_seconds), ended, 1000, gpu_seconds, Decimal("1"), Decimal(cost), "CNY")


async def test_usage_is_bucketed_per_tenant_over_the_window_with_exact_money(store):
    store.insert_new("usage", [
        _line(1, "search", T0, 3600, "1.10"),
        _line(2, "search", T0 + timedelta(minutes=30), 1800, "0.55"),
        _line(3, "nlp", T0 + timedelta(minutes=59), 7200, "2.000001"),
        _line(4, "ads", T0 + timedelta(minutes=10), 3600, "9"),          # not asked for
        _line(5, "search", T0 - timedelta(days=30), 3600, "100"),         # before the chart span
    ], USAGE_COLUMNS, "usage_id")
    reads = Reads(store.query, store.database)
    usage = await reads.usage_by_tenant(["search", "nlp"], start=T0, end=T0 + timedelta(hours=1), points=6)
    assert set(usage.gpu_hours) == {"search", "nlp"} and usage.currency == "CNY"
    assert usage.times == [T0 + timedelta(minutes=10 * i) for i in range(6)] and usage.bucket_s == 600
    assert usage.gpu_hours["search"][0] == 1.0 and usage.gpu_hours["search"][3] == 0.5
    assert usage.cost["nlp"][-1] == Decimal("2.000001") and sum(usage.cost["nlp"][:-1]) == 0
    assert usage.totals == {"search": (1.5, Decimal("1.65")), "nlp": (2.0, Decimal("2.000001"))}
    recent = await reads.usage_by_tenant(["search", "nlp"])  # default: the 7 days before the newest line
    assert recent.totals == usage.totals and recent.times[0] == T0 + timedelta(minutes=59, milliseconds=1) - \
        timedelta(days=7)
    wide = await reads.usage_by_tenant(["search"], span=timedelta(days=60))
    assert wide.totals["search"][1] == Decimal("101.65")  # the older line is inside a longer span
    assert (await reads.usage_by_tenant([])).times == []


async def test_a_jobs_events_are_the_newest_in_time_order_and_its_cost_lines_listed(store):
    columns = ("event_id", "type", "schema_version", "occurred_at", "producer", "actor", "region", "cluster", "tenant",
               "project", "job_id", "attempt", "policy_version", "trace_id", "subject", "payload")
    store.insert_new("events", [
        (f"e-{i}", f"job.t{i}", 1, T0 + timedelta(seconds=i), "scheduler", "scheduler", "cn-east-1", "c1", "search",
         "train", "j-1" if i != 3 else "j-2", 1, "v", "", "s", '{"reason": "r%d", "spec": {"big": 1}}' % i)
        for i in range(6)], columns, "event_id")
    store.insert_new("usage", [_line(9, "search", T0, 60, "0.01", job="j-1")], USAGE_COLUMNS, "usage_id")
    reads = Reads(store.query, store.database)
    events, total = await reads.job_events("j-1", limit=3)
    assert total == 5 and [e.type for e in events] == ["job.t2", "job.t4", "job.t5"]
    assert events[-1].summary == "reason=r5" and events[-1].at == T0 + timedelta(seconds=5)
    # a status refused by a consumer (fedsched.trust) shows as refused, never as the job's own event
    store.insert_new("events", [
        ("e-forged", "job.finished", 1, T0 + timedelta(seconds=9), "agent", "agent", "cn-east-1", "c9", "search",
         "train", "j-1", 1, "v", "", "fed.status.cn-east-1.c9", "{}"),
        ("e-sec", "security.rejected_message", 1, T0 + timedelta(seconds=9), "billing", "billing", "cn-east-1", "c9",
         "", "", "", 0, "", "", "fed.deadletter.billing",
         '{"event_id": "e-forged", "subject": "fed.status.cn-east-1.c9", "job_id": "j-1"}')], columns, "event_id")
    events, total = await reads.job_events("j-1", limit=3)
    assert total == 6 and events[-1].type.startswith("REFUSED job.finished")
    assert [e.type for e in events[:2]] == ["job.t4", "job.t5"]
    cost = await reads.job_cost("j-1")
    assert [(c.line, c.attempt, c.cost, c.currency) for c in cost] == [("compute", 1, Decimal("0.01"), "CNY")]
    assert await reads.job_cost("j-none") == []
