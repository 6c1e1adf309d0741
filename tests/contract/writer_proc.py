"""A separate process running audit + billing, for kill -9 tests.

    python -m tests.contract.writer_proc --nats URL --prefix P --database DB (--chdb DIR | --url URL)
        [--crash-mid-batch] [--expect N] [--dump]

``--crash-mid-batch``: the second ``events`` insert of audit commits only half its rows, and
billing's first ``usage`` insert commits but its spend and ``usage.recorded`` never follow; each
then prints ``MID-BATCH <service>`` and hangs, so the test can SIGKILL the process mid-batch.
Without it: write until the store holds ``--expect`` events and both consumers have no lag, then
print the counts as one JSON line and exit. ``--dump`` adds a second JSON line with every
``events`` and ``usage`` row (times as the store keeps them, UTC text and epoch ms) and the
monthly chargeback (SQL by ``toYYYYMM(ended_at)`` and :meth:`BillingService.spend`), so a test
can compare writers run under different ``TZ`` values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from fedsched.bus import Bus
from fedsched.pricing import load_price_catalog
from fedsched.store import AsyncStore, open_store
from services.audit.service import AuditService
from services.billing.service import BillingService


class CrashingStore(AsyncStore):
    """Commits part of a batch, then never returns (see the module docstring)."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.events_inserts = 0

    async def insert_new(self, table, rows, columns, key):
        if table == "events":
            self.events_inserts += 1
            if self.events_inserts == 2:
                n = await super().insert_new(table, rows[: len(rows) // 2], columns, key)
                print(f"MID-BATCH audit {n}", flush=True)
                await asyncio.Event().wait()
        n = await super().insert_new(table, rows, columns, key)
        if table == "usage":
            print(f"MID-BATCH billing {n}", flush=True)
            await asyncio.Event().wait()
        return n


async def main(a) -> None:
    store = open_store(url=a.url, chdb_path=Path(a.chdb) if a.chdb else None, database=a.database)
    astore = CrashingStore(store) if a.crash_mid_batch else AsyncStore(store)
    bus = await Bus.connect(a.nats, a.prefix, name="writer")
    audit = AuditService(bus, astore, batch=100, linger_s=0.05, ack_wait_s=1.0)
    billing = BillingService(bus, astore, load_price_catalog(), batch=40, linger_s=0.05, ack_wait_s=1.0)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    db = store.database
    while True:
        await asyncio.sleep(0.2)
        if a.crash_mid_batch:
            continue
        n = store.query(f"SELECT count() FROM {db}.events").scalar()
        if n >= a.expect and await audit.lag() == 0 and await billing.lag() == 0:
            break
    audit.stop(), billing.stop()
    await asyncio.gather(*tasks)
    ev = store.query(f"SELECT count(), uniqExact(event_id) FROM {db}.events").rows[0]
    us = store.query(f"SELECT count(), uniqExact(usage_id), sum(cost), countIf(line = 'transfer') "
                     f"FROM {db}.usage").rows[0]
    print(json.dumps({"events": ev[0], "event_ids": ev[1], "usage": us[0], "usage_ids": us[1], "cost": str(us[2]),
                      "transfer_lines": us[3]}), flush=True)
    if a.dump:
        print(json.dumps(await _dump(store, billing), default=str), flush=True)
    await bus.close()


async def _dump(store, billing: BillingService) -> dict:
    db = store.database
    events = store.query(f"SELECT event_id, type, occurred_at, toString(occurred_at), "
                         f"toUnixTimestamp64Milli(occurred_at) FROM {db}.events ORDER BY event_id").rows
    usage = store.query(f"SELECT usage_id, line, started_at, ended_at, toString(started_at), toString(ended_at), "
                        f"toUnixTimestamp64Milli(ended_at) - toUnixTimestamp64Milli(started_at), gpu_seconds, cost "
                        f"FROM {db}.usage ORDER BY usage_id").rows
    months = store.query(f"SELECT tenant, toString(toYYYYMM(ended_at)), sum(cost) FROM {db}.usage "
                         f"GROUP BY 1, 2 ORDER BY 1, 2").rows
    spend = {f"{t}.{m[:4]}-{m[4:]}": str(await billing.spend(t, f"{m[:4]}-{m[4:]}")) for t, m, _ in months}
    return {"events": [[*r[:2], r[2].isoformat(), *r[3:]] for r in events],
            "usage": [[*r[:2], r[2].isoformat(), r[3].isoformat(), *r[4:]] for r in usage],
            "months": months, "spend": spend}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nats", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--database", required=True)
    p.add_argument("--chdb", default="")
    p.add_argument("--url", default="")
    p.add_argument("--crash-mid-batch", action="store_true")
    p.add_argument("--expect", type=int, default=0)
    p.add_argument("--dump", action="store_true")
    asyncio.run(main(p.parse_args()))
    sys.exit(0)
