"""Issue 14 items 1 and 2 on a real nats-server carrying the deployment's accounts file
(``deploy/nats/accounts.conf``, one user per agent): an agent may publish only on its own
subjects (a permission violation otherwise, and nothing stored), and what it may publish on its
own subject about another cluster's job is refused by billing and changes no bill."""

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from fedsched.bus import Bus
from fedsched.events import Envelope, JobStatus, business_event_id, make_event
from fedsched.natsd import EmbeddedNats
from fedsched.pricing import load_price_catalog
from fedsched.store import AsyncStore
from services.billing.service import BillingService
from tests.builders import placement_of, until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "accounts.conf"
R = "cn-north-1"
C1, C2 = "cn-north-1-c1", "cn-north-1-c2"
START = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def deployed_server(tmp_path):
    """A nats-server with JetStream and the deployment's accounts (dev passwords ``dev-<user>``)."""
    server = EmbeddedNats(tmp_path / "nats", accounts=DEPLOY.read_text(),
                          passwords={u: f"dev-{u}" for u in ("ops", "admission", "scheduler", "billing",
                                                             f"agent-{C1}", f"agent-{C2}")})
    server.start()
    yield server
    server.stop()


async def _set_up(server: EmbeddedNats) -> None:
    """Make the streams as ``fedsched up`` does: with the setup user's credentials (ops may not)."""
    from fedapp.natsauth import SETUP_USER

    setup = await _connect(server, SETUP_USER)
    await setup.ensure_streams()
    await setup.close()


async def _connect(server: EmbeddedNats, user: str, errors: list[Exception] | None = None) -> Bus:
    inbox = "" if user == "ops" else f"_INBOX_{user}"
    bus = await Bus.connect(server.client_url_for(user), "fed", name=user, inbox_prefix=inbox)

    async def on_error(e: Exception) -> None:
        if errors is not None:
            errors.append(e)
    bus.nc._error_cb = on_error
    return bus


def _finished(job: str, cluster: str, at: float) -> object:
    return make_event("job.finished", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=8000, kind="training",
                                                started_at=datetime.fromtimestamp(START, UTC)),
                      producer=f"agent/{cluster}", occurred_at=at, event_id=business_event_id(job, 1, 0, "ended"),
                      region=R, zone=R + "a", cluster=cluster, tenant="search", project="train", job_id=job, attempt=1)


async def test_an_agent_cannot_publish_or_read_for_another_cluster(deployed_server):
    await _set_up(deployed_server)
    ops = await _connect(deployed_server, "ops")
    errors: list[Exception] = []
    agent = await _connect(deployed_server, f"agent-{C2}", errors)
    try:
        # its own status subject: stored
        own = _finished("j-own", C2, START + 60)
        await agent.publish(agent.subjects.status(R, C2), own)
        # another cluster's status subject: a permission violation, nothing stored
        forged = _finished("j-victim", C1, START + 60)
        await agent.nc.publish(agent.subjects.status(R, C1), forged.to_bytes())
        # nor may it read another cluster's placements
        await agent.nc.subscribe(agent.subjects.placements(R, C1))
        await agent.nc.flush()

        def violations():
            return [str(e).lower() for e in errors if "permissions violation" in str(e).lower()]
        assert await until(lambda: len(violations()) == 2, timeout=10, interval=0.05)
        assert any(f'publish to "fed.status.{R}.{C1}"' in v for v in violations())
        assert any(f'subscription to "fed.placements.{R}.{C1}"' in v for v in violations())
        # the server logs each one, naming the user (what the embedded replay test counts)
        log = (deployed_server.store_dir / "nats-server.log").read_text()
        assert f'"FED/user:agent-{C2}" - Publish Violation - Subject "fed.status.{R}.{C1}"' in log
        info = await ops.js.stream_info(ops.stream_name("EVENTS"), subjects_filter="fed.status.>")
        assert info.state.subjects == {f"fed.status.{R}.{C2}": 1}
        # JetStream API: its durable only with its own filter
        from nats.js import api
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await agent.js.add_consumer(ops.stream_name("EVENTS"), api.ConsumerConfig(
                name=f"agent-{C2}", durable_name=f"agent-{C2}", filter_subject=f"fed.placements.{R}.{C1}",
                ack_policy=api.AckPolicy.EXPLICIT), timeout=1)
        # ... but it may read the scheduler lease's tenure (fencing late orders), and only read it
        from fedsched.lease import nats_lease, read_tenure
        scheduler = await _connect(deployed_server, "scheduler")  # the lease's only writer
        lease = await nats_lease(scheduler, "scheduler", "sched-a", ttl_s=1.5)
        assert await lease.step()
        await scheduler.close()
        tenure = await read_tenure(agent)
        assert tenure is not None and tenure.token == lease.token
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await agent.js.add_consumer(f"KV_{ops.prefix}_leases", api.ConsumerConfig(
                name="peek", ack_policy=api.AckPolicy.EXPLICIT), timeout=1)
    finally:
        await agent.close()
        await ops.close()


async def test_a_forged_end_on_the_agents_own_subject_bills_nothing(deployed_server, chdb_path):
    """The half NATS cannot stop: c2's agent reports c1's job finished on its own subject."""
    from fedsched.store import open_store
    from tests.builders import unique

    store = open_store(chdb_path=chdb_path, database=unique("db"))
    await _set_up(deployed_server)
    ops = await _connect(deployed_server, "ops")
    billing_bus = await _connect(deployed_server, "billing")
    agent1, agent2 = await _connect(deployed_server, f"agent-{C1}"), await _connect(deployed_server, f"agent-{C2}")
    billing = BillingService(billing_bus, AsyncStore(store), load_price_catalog(), linger_s=0.02)
    task = asyncio.create_task(billing.run())
    try:
        real = _finished("j-1", C1, START + 3600)
        scheduler = await _connect(deployed_server, "scheduler")
        await scheduler.publish(scheduler.subjects.placements(R, C1), placement_of(real, at=START - 60))
        await scheduler.close()
        # the forger even uses the message id an unkeyed publisher would give the real end, to
        # have JetStream drop it as a duplicate; the real agent's ids are keyed (Bus.msg_id)
        agent1.msg_id_key = b"agent-1's own secret"
        await agent2.js.publish(agent2.subjects.status(R, C2), _finished("j-1", C2, START + 60).to_bytes(),
                                headers={"Nats-Msg-Id": real.event_id})
        await agent2.js.publish(agent2.subjects.status(R, C2), _finished("invented", C2, START + 86400).to_bytes(),
                                headers={"Nats-Msg-Id": "forged-2"})
        assert await until(lambda: billing.rejected == 2, timeout=20, interval=0.05)
        assert store.query(f"SELECT count() FROM {store.database}.usage").scalar() == 0
        await agent1.publish(agent1.subjects.status(R, C1), real)

        def billed():
            return store.query(f"SELECT count(), sum(cost) FROM {store.database}.usage").rows[0]
        assert await until(lambda: billed()[0] == 1, timeout=20, interval=0.05)
        assert store.query(f"SELECT usage_id, cluster FROM {store.database}.usage").rows == [(real.event_id, C1)]
        info = await ops.js.stream_info(ops.stream_name("DLQ"), subjects_filter="fed.deadletter.>")
        assert info.state.subjects == {"fed.deadletter.billing": 4}  # 2 x (dead letter + security record)
    finally:
        billing.stop()
        await task
        for b in (agent1, agent2, billing_bus, ops):
            await b.close()


@pytest.fixture(params=["deployment", "embedded"])
def ops_server(request, tmp_path):
    """A nats-server with the permission table as the deployment renders it (``accounts.conf``,
    account ``FED``) and as ``fedsched up`` does (:func:`fedapp.natsauth.embedded_authorization`,
    the global account): the same grants must hold in both."""
    from fedapp import natsauth

    if request.param == "deployment":
        server = EmbeddedNats(tmp_path / "nats", accounts=DEPLOY.read_text(),
                              passwords={u: f"dev-{u}" for u in ("ops", "admission", "scheduler", "billing")})
    else:
        users = natsauth.federation_users("fed", [(R, C1)])
        passwords = {u.user: f"pw-{u.user}" for u in users}
        server = EmbeddedNats(tmp_path / "nats", accounts=natsauth.embedded_authorization(users, passwords),
                              passwords=passwords)
    server.start()
    yield server
    server.stop()


async def test_the_operators_credentials_cannot_speak_for_a_cluster_or_a_service(ops_server):
    """Tryouts published, with the ``ops`` user of the data dir, a job.finished on an agent's
    status subject (admission marked the job succeeded, billing billed it) and a copied
    job.placed on a cluster's placement subject (audit stored it as the scheduler's, the agent
    tried to run it, the job showed a fake attempt). ``ops`` publishes only what its jobs need:
    every subject family has exactly the publishers the design names (fedapp/natsauth.py)."""
    errors: list[Exception] = []
    await _set_up(ops_server)
    ops = await _connect(ops_server, "ops", errors)
    forged = _finished("j-forged", C1, START + 60)
    placement = placement_of(forged, at=START)
    refused = {  # subject -> who alone may publish there
        ops.subjects.placements(R, C1): "scheduler",
        ops.subjects.job("submitted", "search", "train"): "admission",
        ops.subjects.job("cancel", "search", "train"): "admission",
        ops.subjects.usage("search"): "billing",
        ops.subjects.decisions("search", "train"): "scheduler",
        ops.subjects.admission_rejected(): "admission",
        ops.subjects.governance_tenant("search"): "admission",
        ops.subjects.approval("search", "train"): "admission",
        ops.subjects.status(R, C1): f"agent-{C1}",
        ops.subjects.inventory(R, C1): f"agent-{C1}",
        ops.subjects.heartbeat(R, C1): f"agent-{C1}",
        ops.subjects.governance_policy(): "admission",
        "$KV.fed_spend.search": "billing",
        "$KV.fed_leases.scheduler": "scheduler",
        "$KV.fed_policy.policy": "admission",
        "$KV.fed_clock.clock": "admission",
        # no stream configuration: a subject transform or republish would store anything anywhere
        "$JS.API.STREAM.UPDATE.FED_EVENTS": "the services",
        "$JS.API.STREAM.UPDATE.FED_DLQ": "the services",
        "$JS.API.STREAM.CREATE.FORGE": "nobody",
        "$JS.API.STREAM.CREATE.KV_fed_clock": "admission",
        "$JS.API.STREAM.PURGE.FED_EVENTS": "nobody",
        "$JS.API.STREAM.DELETE.FED_EVENTS": "nobody",
        "$JS.API.STREAM.MSG.DELETE.FED_EVENTS": "nobody",
        "$JS.ACK.FED_EVENTS.audit-events.1.7.7.1700000000000000000.0": "audit",  # another consumer's ack
    }
    try:
        for subject in refused:
            await ops.nc.publish(subject, placement.to_bytes())
        await ops.nc.flush()

        def violations():  # (nats-py lower-cases the server's error)
            return {str(e).split('"')[1] for e in errors if "permissions violation" in str(e).lower()}
        expected = {s.lower() for s in refused}
        assert await until(lambda: violations() == expected, timeout=10, interval=0.05), expected - violations()
        info = await ops.js.stream_info(ops.stream_name("EVENTS"))
        assert info.state.messages == 0
        # through JetStream as well: a refused publish is never acknowledged
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await ops.js.publish(ops.subjects.placements(R, C1), placement.to_bytes(), timeout=1)
        # the setup user (fedsched up's setup connection) stores the first policy and a replay's
        # clock; ops reads them, asks the store (a request on its own inbox), reads any stream
        from fedapp.natsauth import SETUP_USER
        from fedsched.clocksync import ClockState, publish_clock, read_clock
        from fedsched.policystore import bootstrap, read_policy
        from fedsched.tenancy import bundled_policy_text

        setup = await _connect(ops_server, SETUP_USER)
        try:
            token = await bootstrap(setup, bundled_policy_text(), ops_server.store_dir / "admin.token", now=START)
            state = ClockState(anchor_wall=START, anchor_business=START, speed=60.0)
            await publish_clock(setup, state)
        finally:
            await setup.close()
        assert token and await read_policy(ops) is not None
        assert await read_clock(ops) == state
        with pytest.raises(nats.errors.NoRespondersError):
            await ops.nc.request("fed.svc.store.query", b'{"ping": true}', timeout=2)
        events = await ops.js.stream_info(ops.stream_name("EVENTS"), subjects_filter="fed.>")
        assert events.state.subjects == {"fed.governance.policy": 1}
        # the real publishers still may (same table)
        scheduler = await _connect(ops_server, "scheduler")
        try:
            await scheduler.publish(scheduler.subjects.placements(R, C1), placement)
        finally:
            await scheduler.close()
        assert violations() == expected  # nothing ops needs was refused
    finally:
        await ops.close()


async def test_the_operator_cannot_have_a_consumer_deliver_its_dead_letter_onto_a_job_subject(ops_server):
    """Issue 14 (review): ``ops`` may publish its own dead letters; a push consumer on the DLQ
    with ``deliver_subject=fed.jobs.cancel.<t>.<p>`` had the events stream store them there, and
    the scheduler cancelled the job. nats-server does not check a deliver subject against its
    creator's permissions (the create below succeeds), but delivers only where a client listens:
    ``ops`` may no longer subscribe there, nobody else does, so nothing is stored. ``ops`` also
    deletes no consumer and creates (updates) none named as a service's durable."""
    from nats.js import api

    from fedsched.bus import StreamFollower
    from fedsched.events import JobCancelRequested

    errors: list[Exception] = []
    await _set_up(ops_server)
    ops = await _connect(ops_server, "ops", errors)
    billing = await _connect(ops_server, "billing")  # a service's durable, on the deployment's streams
    try:
        await billing.js.add_consumer(ops.stream_name("EVENTS"), api.ConsumerConfig(
            name="billing", durable_name="billing", filter_subject="fed.status.>", ack_policy=api.AckPolicy.EXPLICIT))
        cancel = make_event("job.cancel_requested", JobCancelRequested(reason="forged"), producer="admission",
                            occurred_at=START, tenant="search", project="train", job_id="j-victim")
        target = ops.subjects.job("cancel", "search", "train")
        await ops.js.publish(ops.subjects.deadletter("ops"), cancel.to_bytes())  # its own dead letter: allowed
        await ops.nc.subscribe(target)  # the interest a push consumer needs: refused
        pushed = await ops.js.add_consumer(ops.stream_name("DLQ"), api.ConsumerConfig(
            deliver_subject=target, ack_policy=api.AckPolicy.NONE))
        # a push consumer delivering where ops does listen (its inbox) delivers at once ...
        own = ops.nc.new_inbox()
        inbox = await ops.nc.subscribe(own)
        await ops.js.add_consumer(ops.stream_name("DLQ"), api.ConsumerConfig(deliver_subject=own,
                                                                             ack_policy=api.AckPolicy.NONE))
        msg = await inbox.next_msg(timeout=10)
        assert Envelope.from_bytes(msg.data).event_id == cancel.event_id
        # ... the one onto the job subject has delivered nothing, and the events stream holds nothing
        info = await ops.js.consumer_info(ops.stream_name("DLQ"), pushed.name)
        assert info.delivered.stream_seq == 0 and info.num_pending == 1
        assert (await ops.js.stream_info(ops.stream_name("EVENTS"))).state.messages == 0
        # no durable create (legacy API), no delete, no create/update of a service's durable
        refused = ["$JS.API.CONSUMER.DURABLE.CREATE.FED_DLQ.probe", "$JS.API.CONSUMER.DELETE.FED_EVENTS.billing",
                   "$JS.API.CONSUMER.CREATE.FED_EVENTS.billing", "$JS.API.CONSUMER.CREATE.FED_EVENTS.billing.fed.>"]
        for subject in refused:
            await ops.nc.publish(subject, json.dumps({"stream_name": "FED_EVENTS", "config": {
                "name": "billing", "deliver_subject": target, "ack_policy": "none"}}).encode())
        await ops.nc.flush()

        def violations():  # (nats-py lower-cases the server's error)
            return {str(e).split('"')[1] for e in errors if "permissions violation" in str(e).lower()}
        expected = {target.lower(), *(s.lower() for s in refused)}
        assert await until(lambda: violations() == expected, timeout=10, interval=0.05), expected - violations()
        info = await ops.js.consumer_info(ops.stream_name("EVENTS"), "billing")
        assert info.config.deliver_subject is None and info.config.filter_subject == "fed.status.>"
        # what ops' own readers need still works: a follower of the dead letters
        seen: list = []
        follower = StreamFollower(ops, "DLQ", seen.append, name="ops-reader")
        task = asyncio.create_task(follower.run())
        try:
            assert await until(lambda: len(seen) == 1, timeout=10, interval=0.05)
        finally:
            follower.stop()
            await task
        assert violations() == expected
    finally:
        await billing.close()
        await ops.close()


async def test_admission_reads_a_stored_event_by_sequence_with_its_own_credentials(ops_server):
    """Issue 14 (review), item 3: a duplicate-acked submit reads the event JetStream kept
    (services.admission.service.stored_event); admission's user is granted that stream's message
    get (a permission violation and a 2 s timeout before), and nothing broader."""
    from services.admission.service import stored_event
    from tests.builders import spec, submitted

    errors: list[Exception] = []
    await _set_up(ops_server)
    admission = await _connect(ops_server, "admission", errors)
    try:
        job = spec()
        event = submitted("j-1", job, START)
        ack = await admission.js.publish(admission.subjects.job("submitted", job.tenant, job.project), event.to_bytes())
        got = await stored_event(admission, ack.seq, timeout_s=5)
        assert got is not None and got.event_id == event.event_id
        assert await stored_event(admission, ack.seq + 1, timeout_s=5) is None  # not stored (yet): None
        await admission.nc.publish("$JS.API.STREAM.MSG.GET.FED_DLQ", b'{"seq": 1}')  # another stream: refused
        await admission.nc.flush()
        assert await until(lambda: any('"$js.api.stream.msg.get.fed_dlq"' in str(e).lower() for e in errors),
                           timeout=10, interval=0.05)
        assert not any("fed_events" in str(e).lower() for e in errors)
    finally:
        await admission.close()
