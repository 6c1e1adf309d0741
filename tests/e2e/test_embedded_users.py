"""Issue 14 item 2 end to end: `fedsched up`'s embedded NATS has one user per service and per
agent with the deployment's permissions (fedapp/natsauth.py), every component connects as its own
user, and a replay runs through it without a single permission violation."""

import json
import stat
import time
from urllib.parse import urlparse

import pytest

from fedapp import natsauth
from fedapp.client import aio_channel, with_local_credentials
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedapp.runtime import System, SystemOptions
from fedsched.events import Envelope, JobStatus, make_event, random_event_id
from fedsched.settings import Settings
from fedsched.store import open_store
from services.inventory.trace import TraceNode
from tests.builders import DATA, unique, until

pytestmark = pytest.mark.e2e


async def test_every_component_connects_as_its_own_user(tmp_path, chdb_path):
    settings = Settings(data_dir=tmp_path, clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2)
    nodes = [TraceNode("a-0", 64000, 262144, 2, "nvidia-t4-16gb", 16)]
    system = System(SystemOptions(settings=settings, split={"cn-north-1-c1": nodes}))
    await system.start()
    try:
        users = {b.nc.connected_url.username for b in system.buses}
        assert users == {"ops", "audit", "billing", "agent-cn-north-1-c1", "scheduler", "admission"}
        inboxes = {b.nc.connected_url.username: b.nc._inbox_prefix.decode() for b in system.buses}
        assert inboxes["agent-cn-north-1-c1"] == "_INBOX_agent-cn-north-1-c1" and inboxes["ops"] == "_INBOX"
        stored = json.loads((tmp_path / natsauth.USERS_FILE).read_text())
        assert stat.S_IMODE((tmp_path / natsauth.USERS_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "nats" / "nats-server.conf").stat().st_mode) == 0o600
        assert {"ops", "admission", "scheduler", "audit", "billing", "agent-cn-north-1-c1"} <= stored.keys()
        # agents' message ids are keyed with their own secret; the services' are the event ids
        keyed = {b.nc.connected_url.username for b in system.buses if b.msg_id_key}
        assert keyed == {"agent-cn-north-1-c1"}
        # the CLI reaches the bus as the operator
        assert urlparse(with_local_credentials(system.nats_url, tmp_path)).username == "ops"
        # admission asks the scheduler over the bus under its own user: a dry run's what-if and
        # the status of every service are answered (no permission violation on svc.scheduler.*)
        async with aio_channel(system.grpc_target, system.admin_token) as ch:
            spec = pb.JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)
            dry = await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=spec, dry_run=True))
            assert dry.verdict == "accepted" and dry.what_if.decisions, dry
            status = await pb_grpc.SystemServiceStub(ch).GetStatus(pb.GetStatusRequest())
            states = {s.name: s.state for s in status.services}
            assert states["scheduler"] == "ok", status
            # a batch asks the ended-jobs bucket about its request ids in one batch direct get,
            # which admission's user may make (issue 15: no fallback to one get per key)
            lookups = system.admission.ended.lookups
            batch = await pb_grpc.JobServiceStub(ch).SubmitJobs(pb.SubmitJobsRequest(
                items=[pb.SubmitJobRequest(spec=spec, request_id=f"users-{i}") for i in range(3)]))
            assert [r.code for r in batch.results] == [0, 0, 0], batch
            assert system.admission.ended.lookups - lookups == 1 and system.admission.ended.batch_gets is not False
        log = (tmp_path / "nats" / "nats-server.log").read_text()
        assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]
    finally:
        await system.stop()


async def test_a_replay_runs_under_the_per_user_permissions_without_a_violation(tmp_path_factory, chdb_path):
    data_dir = tmp_path_factory.mktemp("embedded")
    settings = Settings(data_dir=data_dir, clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    driver = ReplayDriver(ReplayOptions(nodes_csv=DATA / "openb_node_list_gpu_node.csv",
                                        pods_csv=DATA / "openb_pod_list_gpuspec33.csv", settings=settings, limit=40,
                                        timeout_s=240))
    report = await driver.run()
    jobs = report["jobs"]
    assert jobs["submitted"] == 40 and jobs["pending"] == 0
    assert jobs["finished"] + jobs["failed"] + jobs["rejected"] + jobs["cancelled"] == 40
    log = (data_dir / "nats" / "nats-server.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]
    stored = json.loads((data_dir / natsauth.USERS_FILE).read_text())
    assert sum(1 for u in stored if u.startswith("agent-")) == 6
    store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)  # the process's one chDB: not closed
    db = store.database
    billed = store.query(f"SELECT count() FROM {db}.usage WHERE line = 'compute'").scalar()
    assert billed == jobs["finished"] + jobs["failed"]
    assert store.query(f"SELECT count() FROM {db}.events WHERE type = 'security.rejected_message'").scalar() == 0


async def test_a_data_dir_from_the_shared_password_days_resumes_with_its_streams(tmp_path, chdb_path):
    """Before per-user permissions the embedded server had one user (``fedsched``) in its global
    account; the per-user server keeps its users there, so the old streams are still seen."""
    from fedsched.bus import Bus
    from fedsched.natsd import EmbeddedNats
    from tests.builders import spec, submitted

    old = EmbeddedNats(tmp_path / "nats", password="old-shared")
    old.start()
    try:
        bus = await Bus.connect(old.client_url, "fed", name="old")
        await bus.ensure_streams()
        job = spec()
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("j-old", job, 1.7e9))
        await bus.close()
    finally:
        old.stop()
    settings = Settings(data_dir=tmp_path, clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", nats_port=old.port)
    system = System(SystemOptions(settings=settings, services=("scheduler",)))
    await system.start()
    try:
        assert await system.stream_last_seq("EVENTS") >= 1
        assert "j-old" in system.scheduler.jobs or await _until_known(system, "j-old")
    finally:
        await system.stop()


async def _until_known(system, job_id: str) -> bool:
    from tests.builders import until
    return await until(lambda: job_id in system.scheduler.jobs, timeout=10, interval=0.05)


async def test_one_forged_status_is_one_security_event_whoever_refuses_it(tmp_path, chdb_path):
    """Issue 14: every consumer of a status subject (scheduler, admission, billing, audit) refuses
    a forged status; the services each publish their own dead letter and a security record; the
    audit log holds one dead letter per service and one ``security.rejected_message`` for the
    message (before: one per refusing consumer, 4 here)."""
    settings = Settings(data_dir=tmp_path, clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2)
    cluster = "cn-north-1-c1"
    nodes = [TraceNode("a-0", 64000, 262144, 2, "nvidia-t4-16gb", 16)]
    system = System(SystemOptions(settings=settings, split={cluster: nodes}))
    await system.start()
    try:
        agent = next(b for b in system.buses if b.nc.connected_url.username == "agent-" + cluster)
        # the agent of c1, on its own status subject (all its NATS user may publish on), speaks for c9
        forged = make_event("job.finished", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000, kind="training"),
                            producer="agent/cn-north-1-c9", occurred_at=time.time(), event_id=random_event_id(),
                            region="cn-north-1", zone="cn-north-1a", cluster="cn-north-1-c9", tenant="search",
                            project="train", job_id="j-forged", attempt=1)
        subject = agent.subjects.status("cn-north-1", cluster)
        ack = await agent.js.publish(subject, forged.to_bytes(), headers={"Nats-Msg-Id": forged.event_id})
        db = settings.clickhouse_database
        about = (f"JSONExtractString(payload, 'subject') = '{subject}' "
                 f"AND JSONExtractUInt(payload, 'stream_sequence') = {int(ack.seq)}")
        dlq = system.control.stream_name("DLQ")

        async def refused_by_all() -> bool:
            # scheduler, admission and billing each published a dead letter and a security record
            refusers = {m async for m in _dlq_senders(system.control, dlq)}
            if not all(any(r.startswith(s) for r in refusers) for s in ("scheduler", "admission", "billing")):
                return False
            await system.drain_writers(timeout_s=30)
            dead = system.read_query(f"SELECT count() FROM {db}.events WHERE type = 'bus.dead_letter' AND {about}")
            return dead.rows[0][0] == len(refusers)
        assert await until(refused_by_all, timeout=60, interval=0.2)
        # each service's security record of the message has the same id (JetStream drops the
        # repeats inside its duplicate window; audit keys on it beyond that), and audit's own too
        assert await _dlq_count(system.control, dlq, "security.rejected_message") >= 1
        rows = system.read_query(f"SELECT producer, cluster, actor FROM {db}.events "
                                 f"WHERE type = 'security.rejected_message' AND {about}").rows
        assert len(rows) == 1, rows
        assert rows[0][:2] == ("agent/cn-north-1/" + cluster, cluster)
        assert system.read_query(f"SELECT count() FROM {db}.events "
                                 f"WHERE type = 'security.rejected_message'").rows[0][0] == 1
        assert system.read_query(f"SELECT count() FROM {db}.events WHERE job_id = 'j-forged'").rows[0][0] == 0
    finally:
        await system.stop()


async def _dlq_messages(bus, stream: str):
    """Every message of the dead-letter stream, decoded."""
    last = (await bus.js.stream_info(stream)).state.last_seq
    for seq in range(1, int(last) + 1):
        try:
            raw = await bus.js.get_msg(stream, seq=seq)
        except Exception:  # noqa: BLE001 - a deleted message
            continue
        yield raw.subject, Envelope.from_bytes(raw.data)


async def _dlq_senders(bus, stream: str):
    async for subject, _ in _dlq_messages(bus, stream):
        yield subject.rsplit(".", 1)[-1]


async def _dlq_count(bus, stream: str, type_: str) -> int:
    return sum([1 async for _, e in _dlq_messages(bus, stream) if e.type == type_])
