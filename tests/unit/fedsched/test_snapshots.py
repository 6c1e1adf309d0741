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
