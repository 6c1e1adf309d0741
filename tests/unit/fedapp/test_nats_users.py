"""One permission table for the deployment and the embedded server (issue 14 item 2)."""

import json
import stat
from pathlib import Path

from fedapp import natsauth
from fedapp.natsauth import LocalUsers, federation_users, render_accounts_conf

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "nats" / "accounts.conf"


def test_deploy_accounts_file_is_the_tables_rendering():
    assert DEPLOY.read_text() == render_accounts_conf(), \
        "regenerate: python -m fedapp.natsauth > deploy/nats/accounts.conf"


def test_embedded_users_are_the_deployments_users_for_the_same_clusters():
    """The embedded server renders the same table: same users, same grants (only the passwords
    and the JetStream-domain copies for leaf-node agents differ)."""
    deploy = {u.user: u for u in federation_users("fed", natsauth.DEPLOY_CLUSTERS, js_domain="fed")}
    embedded = {u.user: u for u in federation_users("fed", natsauth.DEPLOY_CLUSTERS)}
    assert deploy.keys() == embedded.keys()
    for name, u in embedded.items():
        d = deploy[name]
        assert (u.subscribe, u.responses, u.full) == (d.subscribe, d.responses, d.full)
        assert set(u.publish) == {s for s in d.publish if not s.startswith("$JS.fed.API.")}


def test_an_agent_may_publish_only_its_own_subjects_and_no_stream_api():
    (agent,) = [u for u in federation_users("fed", [("cn-north-1", "cn-north-1-c1")]) if u.user.startswith("agent-")]
    business = [s for s in agent.publish if not s.startswith("$")]
    assert business == ["fed.inventory.cn-north-1.cn-north-1-c1", "fed.heartbeat.cn-north-1.cn-north-1-c1",
                        "fed.status.cn-north-1.cn-north-1-c1", "fed.deadletter.agent-cn-north-1-c1",
                        "fed.deadletter.agent-cn-north-1-c1-rebuild-p", "fed.deadletter.agent-cn-north-1-c1-rebuild-s"]
    # no stream API but reading the scheduler lease (its tenure fences late orders)
    reads = [s for s in agent.publish if ".STREAM." in s]
    assert reads == ["$JS.API.STREAM.MSG.GET.KV_fed_leases"]
    assert not [s for s in agent.publish if "*" in s or s.endswith(".>") and "ACK" not in s]
    creates = [s for s in agent.publish if ".CONSUMER.CREATE." in s]
    assert all(s.endswith((".fed.placements.cn-north-1.cn-north-1-c1", ".fed.status.cn-north-1.cn-north-1-c1"))
               for s in creates)
    assert agent.subscribe == ("_INBOX_agent-cn-north-1-c1.>", "fed.logs.cn-north-1.cn-north-1-c1")


def test_local_users_are_made_once_kept_0600_and_extended(tmp_path):
    users = LocalUsers(tmp_path)
    first = users.ensure(["ops", "admission"])
    assert stat.S_IMODE(users.path.stat().st_mode) == 0o600
    assert len(set(first.values())) == 2 and all(len(p) >= 32 for p in first.values())
    again = users.ensure(["ops", "admission", "agent-x"])
    assert {k: again[k] for k in first} == first and "agent-x" in again
    assert json.loads(users.path.read_text()) == again
    assert stat.S_IMODE(users.path.stat().st_mode) == 0o600


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or token not in ("*", s[i]):
            return False
    return len(p) == len(s)


def _publishers(users, subject: str) -> set[str]:
    return {u.user for u in users if u.full and not any(_matches(d, subject) for d in u.deny_publish)
            or any(_matches(a, subject) for a in u.publish)}


def test_each_subject_family_has_exactly_the_publishers_the_design_names():
    """Issue 14 tryout: ``ops`` published a copied ``job.placed`` (and could publish submissions
    and usage). Placements: the scheduler only; job requests, refusals and tenant changes:
    admission only; usage: billing only; a cluster's status: its agent (and the scheduler, which
    ends the attempts of a lost cluster); inventory and heartbeats: its agent only."""
    c1, c2 = ("cn-north-1", "cn-north-1-c1"), ("cn-east-1", "cn-east-1-c1")
    users = federation_users("fed", [c1, c2], js_domain="fed")
    expected = {
        "fed.placements.cn-north-1.cn-north-1-c1": {"scheduler"},
        "fed.decisions.search.train": {"scheduler"},
        "fed.jobs.submitted.search.train": {"admission"},
        "fed.jobs.cancel.search.train": {"admission"},
        "fed.admission.rejected": {"admission"},
        "fed.governance.tenant.search": {"admission"},
        "fed.governance.approval.search.train": {"admission", "scheduler"},
        "fed.governance.policy": {"admission"},  # (the first policy too: fedsched up's setup user)
        "fed.billing.usage.search": {"billing"},
        "fed.status.cn-north-1.cn-north-1-c1": {"agent-cn-north-1-c1", "scheduler"},
        "fed.inventory.cn-north-1.cn-north-1-c1": {"agent-cn-north-1-c1"},
        "fed.heartbeat.cn-east-1.cn-east-1-c1": {"agent-cn-east-1-c1"},
        "fed.logs.cn-north-1.cn-north-1-c1": {"admission"},
        "$KV.fed_spend.search": {"billing"},
        "$KV.fed_leases.scheduler": {"scheduler"},
        "$KV.fed_placements.j-1": {"billing"},
        "$KV.fed_clock.clock": {"admission"},  # a replay's clock (the setup user)
        # stream configuration (a subject transform or republish stores anything anywhere): the
        # services, for ensure_streams -- never ops, never an agent
        "$JS.API.STREAM.UPDATE.FED_EVENTS": {"admission", "scheduler", "audit", "billing"},
        "$JS.API.STREAM.PURGE.FED_EVENTS": set(),
        "$JS.API.STREAM.DELETE.FED_EVENTS": set(),
        "$JS.API.STREAM.MSG.DELETE.FED_EVENTS": set(),
    }
    assert {s: _publishers(users, s) for s in expected} == expected


def test_ops_reads_everything_and_answers_only_its_own_inbox():
    ops = natsauth.ops_user("fed")
    # issue 14 (review): it listens only on its inboxes and the store's queries -- a push consumer
    # (whose deliver subject no permission sees) delivers only where a client listens
    assert ops.subscribe == ("_INBOX.>", "_INBOX_ops.>", "fed.svc.store.query") and not ops.full
    assert ops.responses == ""
    for read in ("$JS.API.STREAM.INFO.FED_EVENTS", "$JS.API.CONSUMER.CREATE.FED_EVENTS.x.fed.>",
                 "$JS.API.DIRECT.GET.KV_fed_spend.$KV.fed_spend.search", "$JS.API.STREAM.MSG.GET.KV_fed_leases"):
        assert any(_matches(a, read) for a in ops.publish), read
    assert any(_matches(a, "_INBOX.abc.1") for a in ops.publish)  # the CLI's store queries (ops' inbox)
    assert not any(_matches(a, "_INBOX_admission.abc") for a in ops.publish)  # no service's request
    assert not [a for a in ops.publish if ".STREAM.CREATE." in a or ".STREAM.UPDATE." in a or a.startswith("$KV.")]
    # it sees every delivery: it may not acknowledge (or terminate) another consumer's messages
    assert not any(_matches(a, "$JS.ACK.FED_EVENTS.audit-events.1.7.7.1700000000000000000.0") for a in ops.publish)
    # it deletes no consumer and creates (updates) none named as a service's or agent's durable
    ops = natsauth.ops_user("fed", [("r", "c1")])
    assert not any(_matches(a, "$JS.API.CONSUMER.DELETE.FED_EVENTS.billing") for a in ops.publish)
    assert not any(_matches(a, "$JS.API.CONSUMER.DURABLE.CREATE.FED_EVENTS.x") for a in ops.publish)
    for durable in ("billing", "audit-events", "agent-c1", "agent-c1-rebuild-p"):
        assert any(_matches(d, f"$JS.API.CONSUMER.CREATE.FED_EVENTS.{durable}.fed.>") for d in ops.deny_publish)
        assert any(_matches(d, f"$JS.API.CONSUMER.CREATE.FED_EVENTS.{durable}") for d in ops.deny_publish)
    assert not any(_matches(d, "$JS.API.CONSUMER.CREATE.FED_EVENTS.Xa9b.fed.>") for d in ops.deny_publish)
