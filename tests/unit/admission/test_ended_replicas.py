"""Idempotency lookups in the ended-jobs bucket on a replicated stream (stop-12 review).

With ``allow_direct`` any replica answers a direct get, also a follower behind the leader: its
"not found" for a retried request id must not be taken as the bucket's answer. The fake below
stands for the bus interface :class:`~services.admission.ended.EndedJobs` uses -- ``key_value``,
``js.stream_info`` / ``js.get_last_msg`` (the leader's non-direct read) and the core connection's
``new_inbox`` / ``subscribe`` / ``publish`` (the batch direct get) -- with a leader holding every
record and a follower that holds none of them yet.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import nats.js.errors
from services.admission import ended as ended_mod
from services.admission.ended import BUCKET, EndedJobs, encode_record
from services.admission.jobview import JobRecord, ShardRecord
from tests.builders import spec, until

PREFIX = "t1"
KV_PREFIX = f"$KV.{PREFIX}_{BUCKET}."


class _Follower:
    """A replica's direct gets: it has not caught up (every key "not found"), or answers a
    status while ``status`` is set (e.g. 503 during an election)."""

    def __init__(self, bus: "_Bus") -> None:
        self.bus = bus
        self.status: str | None = None
        self.batches = 0
        self._subs: list[tuple[str, object]] = []  # (subject, callback)

    def new_inbox(self) -> str:
        return "_INBOX.x"

    async def subscribe(self, subject: str, cb=None):
        self._subs.append((subject, cb))
        return SimpleNamespace(subject=subject)

    async def publish(self, subject: str, body: bytes, reply: str = "") -> None:
        assert subject == f"$JS.API.DIRECT.GET.KV_{PREFIX}_{BUCKET}"
        self.batches += 1
        keys = json.loads(body)["multi_last"]
        assert all(k.startswith(KV_PREFIX) for k in keys)
        status = self.status or "404"
        answer = SimpleNamespace(subject=reply, headers={"Status": status, "Description": "fake"}, data=b"")
        for pattern, cb in self._subs:  # delivered later, as the connection's reader would
            if pattern.endswith(".*") and reply.startswith(pattern[:-1]) and "." not in reply[len(pattern) - 1:]:
                asyncio.get_running_loop().call_soon(asyncio.ensure_future, cb(answer))


class _Kv:
    async def get(self, key: str):
        raise nats.js.errors.KeyNotFoundError  # the follower's direct get: not caught up


class _Js:
    def __init__(self, bus: "_Bus", replicas: int, allow_direct: bool) -> None:
        self.bus = bus
        self.config = SimpleNamespace(num_replicas=replicas, allow_direct=allow_direct)
        self.leader_gets: list[str] = []

    async def stream_info(self, name: str):
        assert name == f"KV_{PREFIX}_{BUCKET}"
        return SimpleNamespace(config=self.config)

    async def get_last_msg(self, stream: str, subject: str):
        self.leader_gets.append(subject)
        data = self.bus.leader.get(subject[len(KV_PREFIX):])
        if data is None:
            raise nats.js.errors.NotFoundError
        return SimpleNamespace(headers={"KV-Operation": "PUT"} if data else None, data=data)


class _Bus:
    def __init__(self, replicas: int, allow_direct: bool = True) -> None:
        self.prefix = PREFIX
        self.leader: dict[str, bytes] = {}
        self.nc = _Follower(self)
        self.js = _Js(self, replicas, allow_direct)

    async def key_value(self, bucket: str, *, direct: bool = False):
        assert bucket == BUCKET
        return _Kv()


def _record(job_id: str) -> JobRecord:
    return JobRecord(job_id, spec(), 1.0, "root", "r-" + job_id, shards=[ShardRecord(0)])


ARCHIVED = "j-00000000000000000001"
NEW = "j-00000000000000000002"


async def test_a_replicated_buckets_batch_misses_are_confirmed_by_the_leader() -> None:
    bus = _Bus(replicas=3)
    bus.leader[ARCHIVED] = encode_record(_record(ARCHIVED))
    ended = EndedJobs(bus)
    found = await ended.get_many([ARCHIVED, NEW])
    assert list(found) == [ARCHIVED] and found[ARCHIVED].request_id == "r-" + ARCHIVED
    assert bus.nc.batches == 1 and ended.replicas == 3
    assert sorted(bus.js.leader_gets) == [KV_PREFIX + ARCHIVED, KV_PREFIX + NEW] and ended.leader_reads == 2


async def test_a_replicated_buckets_single_get_miss_is_confirmed_by_the_leader() -> None:
    bus = _Bus(replicas=3)
    bus.leader[ARCHIVED] = encode_record(_record(ARCHIVED))
    ended = EndedJobs(bus)
    assert (await ended.get(ARCHIVED)).request_id == "r-" + ARCHIVED
    assert await ended.get(NEW) is None
    assert bus.js.leader_gets == [KV_PREFIX + ARCHIVED, KV_PREFIX + NEW]


async def test_a_single_replica_buckets_direct_answer_stands() -> None:
    bus = _Bus(replicas=1)
    bus.leader[ARCHIVED] = encode_record(_record(ARCHIVED))  # (the fake's direct gets do not see it)
    ended = EndedJobs(bus)
    assert await ended.get_many([ARCHIVED, NEW]) == {}
    assert bus.nc.batches == 1 and ended.lookups == 1 and bus.js.leader_gets == []


async def test_a_bucket_without_direct_gets_sends_no_batch() -> None:
    bus = _Bus(replicas=3, allow_direct=False)
    ended = EndedJobs(bus)
    assert await ended.get_many([NEW]) == {}
    assert bus.nc.batches == 0 and ended.batch_gets is False and bus.js.leader_gets == []


async def test_a_batch_answered_by_a_status_is_tried_again_after_the_backoff(monkeypatch) -> None:
    monkeypatch.setattr(ended_mod, "BATCH_RETRY_S", 0.2)
    bus = _Bus(replicas=3)
    bus.leader[ARCHIVED] = encode_record(_record(ARCHIVED))
    ended = EndedJobs(bus)
    bus.nc.status = "503"  # an election
    assert list(await ended.get_many([ARCHIVED, NEW])) == [ARCHIVED]  # key by key, confirmed by the leader
    assert bus.nc.batches == 1 and ended.batch_gets is not False
    bus.nc.status = None
    assert list(await ended.get_many([ARCHIVED])) == [ARCHIVED]
    assert bus.nc.batches == 1  # within the backoff: key by key

    async def batched() -> bool:
        await ended.get_many([NEW])
        return bus.nc.batches == 2

    assert await until(batched, timeout=5, interval=0.05)
    assert ended.batch_gets is True


async def test_a_timeout_status_does_not_turn_batches_off() -> None:
    bus = _Bus(replicas=1)
    ended = EndedJobs(bus)
    bus.nc.status = "408"
    await ended.get_many([NEW])
    assert ended.batch_gets is not False
