"""Audit and billing store the same instants and bill the same months whatever the writer
process's time zone (issue 14, item 5): the writers run in a subprocess per ``TZ`` (chDB allows
one data path per process) over the same events -- across the EU and US daylight-saving changes
and a month end -- and every row and the monthly chargeback must be identical and right."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import UTC, datetime
from decimal import Decimal

from fedsched.bus import Bus
from fedsched.events import JobPlaced, JobStatus, WorkerBinding, business_event_id, make_event
from fedsched.jobs import JobSpec
from tests.conftest import unique

ZONES = ("UTC", "Europe/Berlin", "America/Los_Angeles", "Asia/Kolkata")
REGION, CLUSTER = "cn-east-1", "cn-east-1-c1"
GPU_HOUR = Decimal("5.4")  # nvidia-t4-16gb in cn-east-1: 6.0 x 0.9 per GPU-hour, no time-of-day factor

#: job -> (start, end, month billed); 2 GPUs each.
JOBS = {
    "eu-dst": (datetime(2023, 3, 26, 0, 30, tzinfo=UTC), datetime(2023, 3, 26, 3, 30, tzinfo=UTC), "2023-03"),
    "month-end": (datetime(2023, 3, 31, 23, 30, tzinfo=UTC), datetime(2023, 4, 1, 0, 30, tzinfo=UTC), "2023-04"),
    "us-dst": (datetime(2023, 3, 12, 9, 30, tzinfo=UTC), datetime(2023, 3, 12, 11, 30, tzinfo=UTC), "2023-03"),
    "eu-dst-end": (datetime(2023, 10, 29, 0, 30, tzinfo=UTC), datetime(2023, 10, 29, 2, 30, tzinfo=UTC), "2023-10"),
}


def _wire(event, *, occurred_at: str | None = None, started_at: str | None = None) -> bytes:
    """The event's wire form, with its times written as another producer might (an offset, or
    no zone at all, which means UTC)."""
    body = json.loads(event.to_bytes())
    if occurred_at:
        body["occurred_at"] = occurred_at
    if started_at:
        body["payload"]["started_at"] = started_at
    return json.dumps(body).encode()


async def _publish(bus: Bus) -> int:
    n = 0
    for job, (start, end, _) in JOBS.items():
        routing = dict(region=REGION, zone="cn-east-1a", cluster=CLUSTER, tenant="nlp", project="train", job_id=job,
                       attempt=1)
        spec = JobSpec(tenant="nlp", project="train", home_region=REGION, kind="training", gpus_per_worker=2)
        placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb", cross_region=False,
                                                    bindings=(WorkerBinding(worker=0, node="n1", gpu_indices=(0, 1)),)),
                            producer="scheduler", occurred_at=start.timestamp() - 60,
                            event_id=business_event_id(job, 1, 0, "placed"), **routing)
        status = JobStatus(card_model="nvidia-t4-16gb", gpu_milli=2000, cpu_milli=8000, kind="training",
                           started_at=start)
        started = make_event("job.started", status, producer="agent/x", occurred_at=start.timestamp(),
                             event_id=business_event_id(job, 1, 0, "started"), **routing)
        ended = make_event("job.finished", status, producer="agent/x", occurred_at=end.timestamp(),
                           event_id=business_event_id(job, 1, 0, "ended"), **routing)
        wire = {e.event_id: e.to_bytes() for e in (placed, started, ended)}
        if job == "month-end":  # the end written with a +05:30 offset: the same instant
            wire[ended.event_id] = _wire(ended, occurred_at="2023-04-01T06:00:00+05:30")
        if job == "eu-dst-end":  # a start time without a zone: UTC, not the writer's local time
            wire[ended.event_id] = _wire(ended, started_at="2023-10-29T00:30:00")
        for (subject, event_id) in [(bus.subjects.placements(REGION, CLUSTER), placed.event_id),
                                    (bus.subjects.status(REGION, CLUSTER), started.event_id),
                                    (bus.subjects.status(REGION, CLUSTER), ended.event_id)]:
            await bus.js.publish(subject, wire[event_id], headers={"Nats-Msg-Id": event_id})
            n += 1
    return n


async def _writers_in(tz: str, nats_url: str, prefix: str, chdb, expect: int) -> dict:
    env = dict(os.environ, TZ=tz)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.contract.writer_proc", "--nats", nats_url, "--prefix", prefix,
        "--database", "fedsched", "--chdb", str(chdb), "--expect", str(expect), "--dump",
        stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_rows_and_chargeback_do_not_depend_on_the_writers_time_zone(nats_server, tmp_path):
    buses = {tz: await Bus.connect(nats_server.url, unique("tz"), name="tz-test") for tz in ZONES}
    try:
        for bus in buses.values():
            await bus.ensure_streams()
        expect = len(JOBS) * 3 + len(JOBS)  # placed, started, ended + one usage.recorded per job
        published = [await _publish(bus) for bus in buses.values()]
        assert published == [len(JOBS) * 3] * len(ZONES)
        dumps = dict(zip(ZONES, await asyncio.gather(*(
            _writers_in(tz, nats_server.url, bus.prefix, tmp_path / tz.replace("/", "-"), expect)
            for tz, bus in buses.items()))))
        spend = {}
        for tz, bus in buses.items():
            kv = await bus.key_value("spend")
            spend[tz] = {m: (await kv.get(f"nlp.{m}")).value.decode() for m in ("2023-03", "2023-04", "2023-10")}
    finally:
        for bus in buses.values():
            await bus.close()

    utc = dumps["UTC"]
    for tz in ZONES[1:]:
        assert dumps[tz] == utc, tz
        assert spend[tz] == spend["UTC"], tz
    # ... and right: each interval as long as it was, billed to the month it ended in (UTC)
    usage = {row[0]: row for row in utc["usage"]}
    for job, (start, end, month) in JOBS.items():
        row = usage[business_event_id(job, 1, 0, "ended")]
        assert row[2] == start.replace(tzinfo=None).isoformat() and row[3] == end.replace(tzinfo=None).isoformat(), job
        assert row[6] == (end - start).total_seconds() * 1000, job
        assert row[7] == 2 * (end - start).total_seconds(), job
    hours = {"2023-03": 3 + 2, "2023-04": 1, "2023-10": 2}
    expected = {m: str((2 * h * GPU_HOUR).quantize(Decimal("0.000001"))) for m, h in hours.items()}
    assert utc["spend"] == {f"nlp.{m}": v for m, v in expected.items()}
    assert spend["UTC"] == expected
    assert [m for _, m, _ in utc["months"]] == ["202303", "202304", "202310"]
    occurred = {row[0]: row[3] for row in utc["events"]}
    assert occurred[business_event_id("month-end", 1, 0, "ended")] == "2023-04-01 00:30:00.000"
