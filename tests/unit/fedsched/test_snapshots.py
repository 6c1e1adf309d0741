"""Restart checkpoints in the NATS object store (fedsched/snapshots.py): a snapshot larger
than the server's max payload round-trips; a missing, corrupt or incompatible one loads as None
(the service reads the whole stream)."""

from __future__ import annotations

import os

import pytest

from fedsched import snapshots
from fedsched.snapshots import SnapshotError, SnapshotStore


def test_encode_decode_and_refusals():
    data = snapshots.encode("scheduler", 3, 42, {"jobs": [1, 2]})
    snap = snapshots.decode(data, "scheduler", 3)
    assert (snap.applied_seq, snap.state) == (42, {"jobs": [1, 2]})
    for bad, service, version in ((data[:-5], "scheduler", 3), (b"x", "scheduler", 3), (data, "admission", 3),
                                  (data, "scheduler", 4)):
        with pytest.raises(SnapshotError):
            snapshots.decode(bad, service, version)



def test_a_snapshot_reads_as_the_json_module_wrote_and_read_it():
    """Encoded with orjson: the JSON text is what ``json.dumps`` (compact) wrote, integer keys
    included (as strings), so checkpoints written before the switch read the same; non-ASCII
    text and bytes that are not UTF-8 (corrupt) are handled."""
    import json
    import zlib
    from datetime import UTC, datetime

    at = datetime(2026, 12, 2, 5, 30, tzinfo=UTC)
    state = {"jobs": [{"id": "j-1", "at": 1764653400.25, "n": 2 ** 63, "none": None, "ok": True, "x": [1.5, -0.0]}],
             "counts": {3: 4, "queued": 1}, "name": "Zürich ✓"}
    data = snapshots.encode("admission", 2, 7, state, at=at)
    doc = {"format": snapshots.FORMAT, "service": "admission", "version": 2, "applied_seq": 7,
           "written_at": at.isoformat(), "state": state}
    assert json.loads(zlib.decompress(data)) == json.loads(json.dumps(doc, separators=(",", ":")))
    ascii_state = {k: v for k, v in state.items() if k != "name"}
    assert zlib.decompress(snapshots.encode("admission", 2, 7, ascii_state, at=at)) == json.dumps(
        {**doc, "state": ascii_state}, separators=(",", ":")).encode()
    old = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)  # written by the json module
    assert snapshots.decode(old, "admission", 2).state == snapshots.decode(data, "admission", 2).state == {
        **state, "counts": {"3": 4, "queued": 1}}
    with pytest.raises(SnapshotError, match="corrupt"):
        snapshots.decode(zlib.compress(b'{"format": "\xff"}'), "admission", 2)
    with pytest.raises(TypeError):
        snapshots.encode("admission", 2, 7, {"n": 2 ** 64})  # beyond 64 bits: refused, never rounded

async def test_a_snapshot_bigger_than_max_payload_round_trips_through_the_object_store(bus):
    store = SnapshotStore(bus, "scheduler")
    assert await store.load(1) is None  # no bucket yet
    blob = os.urandom(3 * 1024 * 1024).hex()  # incompressible: ~6 MB of JSON
    await store.write(snapshots.encode("scheduler", 1, 7, {"blob": blob}))
    again = SnapshotStore(bus, "scheduler")
    snap = await again.load(1)
    assert snap is not None and snap.applied_seq == 7 and snap.state["blob"] == blob
    await store.write(snapshots.encode("scheduler", 1, 9, {"small": True}))  # replaces it
    assert (await again.load(1)).applied_seq == 9
    assert await again.load(2) is None  # incompatible version: warned, not used
    await store.write(b"garbage")
    assert await again.load(1) is None


async def test_each_service_reads_and_writes_its_own_snapshots_only_under_the_deployment_users(tmp_path):
    from fedapp import natsauth
    from fedsched.bus import Bus
    from fedsched.natsd import EmbeddedNats
    from services.admission.ended import EndedJobs

    users = natsauth.federation_users("fed", [])
    passwords = {u.user: f"pw-{u.user}" for u in users}
    server = EmbeddedNats(tmp_path / "nats", accounts=natsauth.embedded_authorization(users, passwords),
                          passwords=passwords)
    server.start()
    try:
        setup = await Bus.connect(server.client_url_for(natsauth.SETUP_USER), "fed", name="setup",
                                inbox_prefix=natsauth.inbox_prefix(natsauth.SETUP_USER))
        await setup.ensure_streams()
        sched = await Bus.connect(server.client_url_for("scheduler"), "fed", name="scheduler",
                                  inbox_prefix=natsauth.inbox_prefix("scheduler"))
        adm = await Bus.connect(server.client_url_for("admission"), "fed", name="admission",
                                inbox_prefix=natsauth.inbox_prefix("admission"))
        try:
            store = SnapshotStore(sched, "scheduler")
            await store.write(snapshots.encode("scheduler", 1, 5, {"blob": os.urandom(300_000).hex()}))
            await store.write(snapshots.encode("scheduler", 1, 6, {"jobs": []}))  # replace: purges old chunks
            assert (await SnapshotStore(sched, "scheduler").load(1)).applied_seq == 6
            mine = SnapshotStore(adm, "admission")
            await mine.write(snapshots.encode("admission", 1, 3, {}))
            assert (await mine.load(1)).applied_seq == 3
            spy = SnapshotStore(adm, "scheduler")  # admission may not read the scheduler's bucket
            assert await spy.read() is None
            ended = EndedJobs(adm)  # and admission's ended-jobs bucket works under its user
            assert await ended.get("j-00000000000000000000") is None
            assert ended.replicas == 1  # its stream config was readable under the admission user
        finally:
            for b in (sched, adm, setup):
                await b.close()
    finally:
        server.stop()


async def test_a_forked_capture_delivers_the_childs_bytes_and_reports_its_failure():
    big = os.urandom(3 * 1024 * 1024)  # more than a pipe holds: read while the child writes
    assert await snapshots.ForkedCapture(lambda: big).result() == big
    assert await snapshots.ForkedCapture(lambda: b"x", in_child=False).result() == b"x"

    def fails() -> bytes:
        raise RuntimeError("boom")

    with pytest.raises(SnapshotError):
        await snapshots.ForkedCapture(fails).result()
    with pytest.raises(SnapshotError):  # a child that does not deliver in time is killed
        await snapshots.ForkedCapture(lambda: __import__("time").sleep(30) or b"", timeout_s=0.2).result()


async def test_a_forked_capture_builds_at_a_lower_cpu_priority_than_its_service():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    child = int(await snapshots.ForkedCapture(lambda: str(os.getpriority(os.PRIO_PROCESS, 0)).encode()).result())
    assert child == min(19, mine + snapshots.CHILD_NICE) > mine or mine == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the service's own is untouched
    same = snapshots.ForkedCapture(lambda: str(os.getpriority(os.PRIO_PROCESS, 0)).encode(), nice=0)
    assert int(await same.result()) == mine


@pytest.mark.parametrize(("kw", "due"), [
    (dict(applied_seq=10, written_seq=10, now=999, written_at=0), False),       # nothing new since the last one
    (dict(applied_seq=11, written_seq=10, now=5, written_at=0), False),         # neither a period nor enough events
    (dict(applied_seq=11, written_seq=10, now=60, written_at=0), True),         # a period passed
    (dict(applied_seq=110, written_seq=10, now=5, written_at=0), True),         # enough events
    (dict(applied_seq=110, written_seq=10, now=5, written_at=0, retry_at=30), False),  # failed a moment ago
    (dict(applied_seq=110, written_seq=10, now=30, written_at=0, retry_at=30), True),  # retry time reached
    (dict(applied_seq=11, written_seq=10, now=5, written_at=0, retry_at=30, force=True), True),
    (dict(applied_seq=10, written_seq=10, now=5, written_at=0, force=True), False),   # forced, but nothing new
])
def test_when_a_checkpoint_is_due(kw, due):
    assert snapshots.checkpoint_due(every_s=60, every_events=100, **kw) is due
