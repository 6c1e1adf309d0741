"""NATS users and permissions of a federation: one table, rendered for the deployment
(``deploy/nats/accounts.conf``) and for the embedded server of ``fedsched up`` (issue 14, item 2).

Every component connects as its own user and may publish and subscribe only where its job is:

* ``admission``, ``scheduler``, ``audit``, ``billing`` -- their own subjects, the JetStream API of
  the streams and KV buckets they read or write (:func:`federation_users` lists them);
* one ``agent-<cluster>`` per cluster -- only its own ``<p>.status|inventory|heartbeat.<region>.<cluster>``,
  its dead-letter subjects, three consumers on the events stream each pinned by its create
  subject to one filter (its placements, and for the start-up rebuild its placements and its
  status), and log requests addressed to it; no stream API at all;
* ``ops`` -- the operator, the CLI and the composition process's control connection: reads
  everything, but publishes only what its jobs need (:func:`ops_user`): ``fedsched sql``/``report``
  requests and the answers of the store it holds. It speaks for no service and no cluster, and may
  configure no stream: placements, job requests, usage, decisions and status have exactly the
  publishers the design gives them (issue 14, tryout of item 1). The composition process sets the
  federation up (streams, the first policy, a replay's clock) as :data:`SETUP_USER`.

Replies go to each user's own inbox prefix ``_INBOX_<user>`` (:func:`inbox_prefix`), the only
place below ``_INBOX`` it may subscribe, so no user reads another's replies; ``ops`` keeps the
default ``_INBOX`` (it may subscribe only there, below ``_INBOX_ops`` and to the store's queries,
and publish below ``_INBOX.`` only: its own
requests' inboxes, so it can answer the CLI's store queries and no service's requests).

The embedded server (:func:`embedded_authorization`) gets exactly the table's users (in its
global account rather than ``FED``: that is where its JetStream store keeps the streams) with random
passwords (:class:`LocalUsers`: ``<data_dir>/nats.users``, mode 0600, made at first start and
extended when clusters are added); the deployment file (:func:`render_accounts_conf`) gets the
same table with development placeholders. ``tests/unit/fedapp/test_nats_users.py`` checks that
the committed ``deploy/nats/accounts.conf`` is this rendering.

Source of the JetStream API subjects: the NATS JetStream wire API reference
(https://docs.nats.io/reference/reference-protocols/nats_api_reference) and what nats-py sends:
a named consumer is created through ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`` (the
server refuses a create whose filter differs from the subject's), pulled through
``$JS.API.CONSUMER.MSG.NEXT.<stream>.<name>`` and acknowledged on ``$JS.ACK.<stream>.<name>.>``;
a KV bucket ``B`` is the stream ``KV_B`` with subjects ``$KV.B.>``, read by direct get
(``$JS.API.DIRECT.GET.KV_B.>``) and watched by an ordered push consumer (flow control replies
on ``$JS.FC.KV_B.>``). With a JetStream domain ``D`` the API prefix is ``$JS.D.API``.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

#: The users' file in a data dir (JSON ``{user: password}``, mode 0600).
USERS_FILE = "nats.users"

#: The operator user (full access inside the federation's account).
OPS = "ops"

#: The central services, each one user.
SERVICES = ("admission", "scheduler", "audit", "billing")

#: The user the composition process of ``fedsched up`` sets the federation up as (streams, the
#: first policy, a replay's clock; ``System.setup`` in :mod:`fedapp.runtime`): the front door,
#: whose job storing the first policy is anyway. Not ``ops``: whoever may create or update a
#: stream may give it a subject transform or a republish and so have the server store a message
#: on any subject -- a placement, a submission, a usage record.
SETUP_USER = "admission"

#: KV buckets (suffix after ``<prefix>_``) -> (writers, readers).
BUCKETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "policy": (("admission",), ("admission", "scheduler", "audit", "billing")),
    "spend": (("billing",), ("admission",)),
    "placements": (("billing",), ("billing",)),
    # a replay's clock: written by the composition's setup connection (SETUP_USER)
    "clock": (("admission",), ("admission", "scheduler", "audit", "billing")),
    # the scheduler replicas' lease (fedsched.lease); admission, billing and audit read its tenure to
    # fence late orders (agents: a read-only grant of their own, below)
    "leases": (("scheduler",), ("scheduler", "admission", "billing", "audit")),
    "jobs_ended": (("admission",), ("admission",)),  # ended jobs that left admission's memory
}

#: Object store buckets (suffix after ``<prefix>_``) -> the one service that writes and reads
#: it: the restart checkpoints (fedsched/snapshots.py).
OBJECT_BUCKETS: dict[str, str] = {"snapshot_admission": "admission", "snapshot_scheduler": "scheduler"}


@dataclass(frozen=True, slots=True)
class UserPermissions:
    """One NATS user of the federation.

    Attributes:
        user: its name (also the suffix of its inbox prefix).
        comment: what it is, one line (rendered above it in the config).
        publish: subjects it may publish on (empty with ``full`` access).
        subscribe: subjects it may subscribe to.
        responses: how it may answer requests made to it: "" = not at all, ``"true"`` =
            one reply per request, ``"stream"`` = up to 100000 replies within an hour (a log
            follow).
        full: everything allowed (``ops``) except ``deny_publish``.
        deny_publish: subjects it may not publish on although ``publish`` (or ``full``) allows
            them (``ops``: creating a consumer named as a service's durable, :func:`ops_user`).
    """

    user: str
    comment: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    responses: str = ""
    full: bool = False
    deny_publish: tuple[str, ...] = ()


def agent_user(cluster: str) -> str:
    """The user name of a cluster's agent: ``agent-<cluster>`` (its durable consumer's name)."""
    return f"agent-{cluster}"


def inbox_prefix(user: str) -> str:
    """The inbox prefix ``user``'s connections use (``_INBOX_<user>``; ``ops``: the default)."""
    return "" if user == OPS else f"_INBOX_{user}"


def _api_prefixes(js_domain: str) -> tuple[str, ...]:
    return ("$JS.API",) + ((f"$JS.{js_domain}.API",) if js_domain else ())


def _stream_admin(prefix: str) -> list[str]:
    out = []
    for suffix in ("EVENTS", "INVENTORY", "DLQ"):
        stream = f"{prefix.upper()}_{suffix}"
        out += [f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE")]
    return out


def _reads_stream(stream: str) -> list[str]:
    """Any consumer (named or not) on ``stream``: create/info/delete, pull, ack, flow control."""
    return [f"$JS.API.CONSUMER.*.{stream}", f"$JS.API.CONSUMER.*.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def _bucket(prefix: str, bucket: str, *, write: bool) -> list[str]:
    name = f"{prefix}_{bucket}"
    stream = f"KV_{name}"
    out = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
           f"$JS.API.STREAM.MSG.GET.{stream}", *_reads_stream(stream)]
    if write:
        out += [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}", f"$KV.{name}.>"]
    return out


def _object_bucket(prefix: str, bucket: str) -> list[str]:
    """An object store ``B`` is the stream ``OBJ_B`` with subjects ``$O.B.C.>`` (chunks) and
    ``$O.B.M.>`` (metadata); nats.py reads the metadata by message get, the chunks through an
    ordered consumer (created after looking the stream up by subject: ``STREAM.NAMES``, which
    lists stream names only), and purges a replaced object's chunks."""
    name = f"{prefix}_{bucket}"
    stream = f"OBJ_{name}"
    return [*(f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE", "PURGE", "MSG.GET")),
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>", f"$O.{name}.>", "$JS.API.STREAM.NAMES",
            *_reads_stream(stream)]


def _buckets(prefix: str, user: str) -> list[str]:
    out = []
    for bucket, (writers, readers) in BUCKETS.items():
        if user in writers or user in readers:
            out += _bucket(prefix, bucket, write=user in writers)
    for bucket, owner in OBJECT_BUCKETS.items():
        if user == owner:
            out += _object_bucket(prefix, bucket)
    return out


def service_durables(clusters: Iterable[tuple[str, str]] = ()) -> tuple[str, ...]:
    """The names of the durable consumers the services and agents keep (audit's one per stream,
    billing's two, each agent's own and its start-up rebuild pair): ``ops`` may not create --
    that is, update -- a consumer of these names (:func:`ops_user`)."""
    names = ["audit-events", "audit-inventory", "audit-dlq", "billing", "billing-transfer"]
    for _, cluster in clusters:
        user = agent_user(cluster)
        names += [user, f"{user}-rebuild-p", f"{user}-rebuild-s"]
    return tuple(names)


def ops_user(prefix: str, clusters: Iterable[tuple[str, str]] = ()) -> UserPermissions:
    """The operator's user ``ops`` (the CLI, the ``nats`` CLI, the control connection of the
    composition process of ``fedsched up``): reads every stream, bucket
    and consumer, but publishes only what those need -- the issue 14 tryout published a copied
    ``job.placed`` on a cluster's placement subject as ``ops`` and every consumer took it for the
    scheduler's.

    What ``ops`` publishes, and why (everything else is a permissions violation):

    * ``<p>.svc.store.query``: ``fedsched sql``/``report``/``web`` requests and the one-store ping
      (``System._check_one_store_per_bus``); ``_INBOX.>``: the answers of the store the composition
      process holds, to the requesters' inboxes -- only ``ops`` connections use the default
      ``_INBOX`` or ``_INBOX_ops`` (every other user has ``_INBOX_<user>``), so it can answer no
      service's request;
    * ``<p>.deadletter.ops|replay-driver``: what its own followers cannot decode (the replay
      driver follows the events stream);
    * JetStream: account info and every read -- stream info/names/list, message get, direct get,
      consumers on any stream: create (its readers' ephemeral pull consumers,
      :class:`fedsched.bus.StreamFollower`, and the ordered push consumers of KV watches: both
      ``CONSUMER.CREATE.<stream>[.<name>[.<filter>]]``), pull, flow control, info, names, list.
      Its readers acknowledge nothing, so it gets no ``$JS.ACK`` (it could otherwise acknowledge
      or terminate another consumer's messages before their effect is committed).

    What ``ops`` subscribes to: its inboxes (``_INBOX.>``, ``_INBOX_ops.>``: replies, its
    consumers' deliveries) and ``<p>.svc.store.query`` (the store the composition process holds),
    nothing else (issue 14: tryout of the permissions). A push consumer's deliver subject is part
    of the create request's body, which permissions cannot see, and nats-server (checked on
    v2.15.1) does not check it against its creator's publish or subscribe permissions: ``ops``
    made a push consumer on ``<P>_DLQ`` deliver its own dead letter (a ``job.cancel_requested``)
    to ``<p>.jobs.cancel.<t>.<p>`` and ``<P>_EVENTS`` stored it. The server delivers only to a
    subject some client has interest in, the streams' own capture not counting (checked: nothing
    stored); no user but ``ops`` subscribed to the business subjects, so without that
    subscription such a consumer delivers nothing (``tests/integration/test_nats_users.py``).
    Readers also refuse a type that does not belong on its subject (:func:`fedsched.trust.check_subject`).

    Not granted either: deleting a consumer, the legacy ``CONSUMER.DURABLE.CREATE``, and (denied)
    creating a consumer named as a service's or agent's durable (:func:`service_durables`; a
    create with an existing name updates that consumer: its filter, its deliver subject).

    Not granted: any business subject (``jobs``, ``placements``, ``decisions``, ``status``,
    ``inventory``, ``heartbeat``, ``billing.usage``, ``admission.rejected``, ``governance``,
    ``logs``), any bucket write, acknowledgements, and stream create/update/delete/purge/message
    delete: a stream created or updated with a ``subject_transform`` or a ``republish`` makes the
    server store a message on any subject (a tryout did so: ``fed.svc.store.query`` stored as
    ``fed.placements.<r>.<c>``). The services keep that grant for ``ensure_streams``; it is
    trusted like their credentials. Operators change streams (``nats stream edit``) with a
    service's or the system account's credentials.
    """
    p = prefix
    durables = service_durables(clusters)
    return UserPermissions(
        OPS, "operators, the CLI and the composition's control connection: reads everything; publishes only "
             "store queries and their answers (fedapp.natsauth.ops_user) -- never for a service or a cluster, "
             "and configures no stream",
        publish=(f"{p}.svc.store.query", "_INBOX.>", "_INBOX_ops.>", f"{p}.deadletter.ops", f"{p}.deadletter.replay-driver",
                 "$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
                 "$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>", *(f"$JS.API.CONSUMER.{verb}.>" for verb in (
                     "INFO", "NAMES", "LIST", "CREATE", "MSG.NEXT")), "$JS.FC.>"),
        subscribe=("_INBOX.>", "_INBOX_ops.>", f"{p}.svc.store.query"),
        deny_publish=tuple(f"$JS.API.CONSUMER.CREATE.*.{name}{tail}" for name in durables for tail in ("", ".>")))


def federation_users(prefix: str, clusters: Iterable[tuple[str, str]], *, js_domain: str = "") -> list[UserPermissions]:
    """The users of a federation and their permissions (the one table).

    Args:
        prefix: subject prefix (``fed``); streams are ``<PREFIX>_EVENTS`` etc.
        clusters: ``(region, cluster)`` of every cluster whose agent needs a user.
        js_domain: JetStream domain agents behind leaf nodes use ("" = none): their JetStream API
            grants are listed for ``$JS.API`` and for ``$JS.<domain>.API``.
    """
    p, P = prefix, prefix.upper()
    events, inventory, dlq = f"{P}_EVENTS", f"{P}_INVENTORY", f"{P}_DLQ"
    dl = lambda *names: [f"{p}.deadletter.{n}" for n in names]  # noqa: E731
    clusters = list(clusters)
    users = [ops_user(prefix, clusters)]
    users.append(UserPermissions(
        "admission", "the front door: job requests, refusals, governance changes and approval decisions, log "
                     "requests to agents, dry runs' what-if and status requests to the scheduler; follows the events "
                     "and inventory streams; writes the policy, reads spend",
        publish=(f"{p}.jobs.>", f"{p}.admission.rejected", f"{p}.governance.>", f"{p}.logs.>",
                 f"{p}.svc.scheduler.whatif", f"{p}.svc.scheduler.status",
                 f"$JS.API.CONSUMER.INFO.{dlq}.>",  # GetStatus: the lag of audit's dead-letter durable
                 # a duplicate-acked submit reads the stored event (services.admission.service.stored_event)
                 f"$JS.API.STREAM.MSG.GET.{events}",
                 *dl("admission", "admission-jobs", "admission-inventory", "admission-policy"), "$JS.API.INFO",
                 *_stream_admin(p), *_reads_stream(events), *_reads_stream(inventory), *_buckets(p, "admission")),
        subscribe=("_INBOX_admission.>",)))
    users.append(UserPermissions(
        "scheduler", "the decision maker: placements, stop orders, pending reasons, approval requests, the end of "
                     "attempts on a lost cluster (job.stopped on its status subject); answers its status and what-if "
                     "endpoints",
        publish=(f"{p}.placements.>", f"{p}.decisions.>", f"{p}.status.>", f"{p}.governance.approval.>",
                 *dl("scheduler", "scheduler-events", "scheduler-inventory"), "$JS.API.INFO", *_stream_admin(p),
                 *_reads_stream(events), *_reads_stream(inventory), *_buckets(p, "scheduler")),
        subscribe=("_INBOX_scheduler.>", f"{p}.svc.scheduler.status", f"{p}.svc.scheduler.whatif"),
        responses="true"))
    users.append(UserPermissions(
        "audit", "the append-only log: one durable per stream; answers read-only SQL when it holds the store",
        publish=(*dl("audit", "audit-events", "audit-inventory", "audit-dlq"), f"{p}.svc.store.query", "$JS.API.INFO",
                 *_stream_admin(p), *_reads_stream(events), *_reads_stream(inventory), *_reads_stream(dlq),
                 *_buckets(p, "audit")),
        subscribe=("_INBOX_audit.>", f"{p}.svc.store.query"), responses="true"))
    users.append(UserPermissions(
        "billing", "usage and cost: durables on status and placements, priced usage, the spend and placement "
                   "books",
        publish=(f"{p}.billing.usage.>", *dl("billing", "billing-transfer"), f"{p}.svc.store.query", "$JS.API.INFO",
                 *_stream_admin(p), *_reads_stream(events), *_buckets(p, "billing")),
        subscribe=("_INBOX_billing.>", f"{p}.svc.store.query"), responses="true"))
    for region, cluster in clusters:
        user = agent_user(cluster)
        own = f"{region}.{cluster}"
        placements, status = f"{p}.placements.{own}", f"{p}.status.{own}"
        api = []
        for a in _api_prefixes(js_domain):
            api += [f"{a}.CONSUMER.INFO.{events}.{user}", f"{a}.CONSUMER.CREATE.{events}.{user}.{placements}",
                    f"{a}.CONSUMER.MSG.NEXT.{events}.{user}",
                    f"{a}.STREAM.MSG.GET.KV_{p}_leases"]  # the scheduler lease's tenure (fencing)
            if a == "$JS.API":
                api.append(f"$JS.ACK.{events}.{user}.>")
            for kind, subject in (("p", placements), ("s", status)):
                name = f"{user}-rebuild-{kind}"
                api += [f"{a}.CONSUMER.DELETE.{events}.{name}", f"{a}.CONSUMER.CREATE.{events}.{name}.{subject}",
                        f"{a}.CONSUMER.MSG.NEXT.{events}.{name}"]
        users.append(UserPermissions(
            user, f"agent of {region} / {cluster}: its own subjects and consumers only",
            publish=(f"{p}.inventory.{own}", f"{p}.heartbeat.{own}", status,
                     *dl(user, f"{user}-rebuild-p", f"{user}-rebuild-s"), *api),
            subscribe=(f"_INBOX_{user}.>", f"{p}.logs.{own}"), responses="stream"))
    return users


# --------------------------------------------------------------------------- rendering


def _q(text: str) -> str:
    return json.dumps(text)  # a NATS config string: double quotes, JSON escapes


def _user_block(u: UserPermissions, password: str, indent: str) -> list[str]:
    out = [f"{indent}# ---- {u.user}: {u.comment}"]
    if u.full:
        deny = ""
        if u.deny_publish:
            deny = f", permissions: {{ publish: {{ deny: [{', '.join(_q(x) for x in u.deny_publish)}] }} }}"
        out.append(f"{indent}{{ user: {_q(u.user)}, password: {_q(password)}{deny} }}")
        return out
    i2, i3, i4 = indent + "  ", indent + "    ", indent + "      "
    out += [f"{indent}{{", f"{i2}user: {_q(u.user)}", f"{i2}password: {_q(password)}", f"{i2}permissions: {{",
            f"{i3}publish: {{", f"{i4}allow: ["]
    out += [f"{i4}  {_q(s)}" for s in u.publish]
    out += [f"{i4}]"]
    if u.deny_publish:
        out += [f"{i4}deny: ["] + [f"{i4}  {_q(s)}" for s in u.deny_publish] + [f"{i4}]"]
    out += [f"{i3}}}", f"{i3}subscribe: {{ allow: [{', '.join(_q(s) for s in u.subscribe)}] }}"]
    if u.responses == "true":
        out.append(f"{i3}allow_responses: true")
    elif u.responses == "stream":
        out.append(f'{i3}allow_responses: {{ max: 100000, expires: "1h" }}')
    out += [f"{i2}}}", f"{indent}}}"]
    return out


def render_accounts(users: Sequence[UserPermissions], passwords: dict[str, str], *, system_password: str = "") -> str:
    """The ``accounts { ... }`` block: account ``FED`` (JetStream) with ``users``, and, with a
    ``system_password``, the system account ``SYS`` (user ``sys``).

    Raises:
        KeyError: a user without a password in ``passwords``.
    """
    lines = ["accounts {"]
    if system_password:
        lines += ["  # The system account: server events, monitoring over NATS, JetStream meta operations.",
                  "  SYS: {", f"    users: [ {{ user: sys, password: {_q(system_password)} }} ]", "  }", ""]
    lines += ["  # Everything of the federation lives in one account (one JetStream namespace).",
              "  FED: {", "    jetstream: enabled", "    users: ["]
    for u in users:
        lines += _user_block(u, passwords[u.user], "      ")
    lines += ["    ]", "  }", "}"]
    return "\n".join(lines) + "\n"


ACCOUNTS_HEADER = """\
# Accounts, users and permissions of a fedsched federation (subject prefix "fed").
#
# GENERATED from the one permission table in fedapp/natsauth.py (federation_users), which also
# configures the embedded server of `fedsched up`; regenerate with
#   python -m fedapp.natsauth > deploy/nats/accounts.conf
# (tests/unit/fedapp/test_nats_users.py fails when this file and the table differ).
#
# Included by the region clusters of the super-cluster (supercluster/*.conf); every server a
# client or leaf node connects to must carry the same file. The compose cluster is open (no
# auth) for local development. Check a server config with: nats-server -c <file> -t
#
# Subjects (fedsched/events.py, class Subjects; streams in fedsched/bus.py):
#   fed.jobs.<verb>.<tenant>.<project>   admission -> scheduler            stream FED_EVENTS
#   fed.admission.rejected               admission (refusals)               FED_EVENTS
#   fed.governance.>                     admission (policy, tenants, approval decisions),
#                                        scheduler (approval requests)      FED_EVENTS
#   fed.placements.<region>.<cluster>    scheduler -> that cluster's agent  FED_EVENTS
#   fed.decisions.<tenant>.<project>     scheduler (pending reasons)        FED_EVENTS
#   fed.status.<region>.<cluster>        agent -> everyone (scheduler: ends  FED_EVENTS
#                                        the attempts of a lost cluster)
#   fed.billing.usage.<tenant>           billing                            FED_EVENTS
#   fed.inventory.<region>.<cluster>     agent snapshots                    FED_INVENTORY
#   fed.heartbeat.<region>.<cluster>     agent heartbeats                   FED_INVENTORY
#   fed.deadletter.<consumer>            any consumer                       FED_DLQ
#   fed.svc.scheduler.status, fed.svc.store.query    core request/reply (no stream)
#   fed.logs.<region>.<cluster>          admission -> that cluster's agent: log requests
# KV buckets (stream KV_<bucket>, subjects $KV.<bucket>.>): fed_policy (admission writes, the
# services read), fed_spend (billing writes, admission reads), fed_placements (billing's
# placement book), fed_clock (a replay's clock; written by the setup connection, as admission), fed_jobs_ended (admission's ended
# jobs that left its memory). Object stores (stream OBJ_<bucket>, subjects $O.<bucket>.>):
# fed_snapshot_admission / fed_snapshot_scheduler (each service's restart checkpoint, its own only).
#
# Agents are confined to fed.*.<region>.<cluster> and to three consumers on FED_EVENTS, each
# pinned to one filter by its create subject (agent-<cluster>: its placements; the start-up
# rebuild agent-<cluster>-rebuild-p / -s: its placements / its status), and get no stream API
# but one read: the last message of the scheduler lease (KV_fed_leases), to fence late orders.
# Their JetStream API grants are listed for $JS.API (agent connected to the region's servers)
# and $JS.fed.API (agent with FEDSCHED_JS_DOMAIN=fed, behind its leaf node).
#
# ops (operators, the CLI, the composition process's control connection) reads everything but
# publishes only store queries (fed.svc.store.query) and their answers: never a placement, job
# request, usage record, decision or status -- each subject family has exactly the publishers
# listed above -- and configures no stream (a stream's subject transform or republish would store
# a message on any subject). `fedsched up` sets the federation up as admission.
#
# Replies go to the connection's inbox prefix: every user has its own, _INBOX_<user>, and may
# subscribe only below it (FEDSCHED_INBOX_PREFIX; deploy/compose, deploy/k8s), so no user can
# read another's replies; ops keeps the default _INBOX and subscribes only to its inboxes and to
# fed.svc.store.query: a push consumer (whose deliver subject no permission sees) delivers only
# where a client listens, and no user listens on a stream's subjects. ops creates, pulls and reads
# consumers but deletes none and may not create (update) one named as a service's durable.
#
# Passwords here are development placeholders. For production use bcrypt hashes
# (`nats server passwd`), nkeys or the JWT/operator mode, and keep them out of git.

"""

#: The clusters the deployment examples name (deploy/topology/example.yaml).
DEPLOY_CLUSTERS = (("cn-north-1", "cn-north-1-c1"), ("cn-north-1", "cn-north-1-c2"),
                   ("cn-east-1", "cn-east-1-c1"), ("cn-east-1", "cn-east-1-c2"),
                   ("cn-south-1", "cn-south-1-c1"), ("cn-south-1", "cn-south-1-c2"))


def render_accounts_conf(prefix: str = "fed", clusters: Iterable[tuple[str, str]] = DEPLOY_CLUSTERS,
                         js_domain: str = "fed") -> str:
    """``deploy/nats/accounts.conf``: the table with development passwords ``dev-<user>``."""
    users = federation_users(prefix, clusters, js_domain=js_domain)
    passwords = {u.user: f"dev-{u.user}" for u in users}
    return ACCOUNTS_HEADER + render_accounts(users, passwords, system_password="dev-sys") + "\nsystem_account: SYS\n"


def embedded_authorization(users: Sequence[UserPermissions], passwords: dict[str, str]) -> str:
    """The embedded server's config block: the same users with the same permissions, in the
    server's global account (``authorization { users: [...] }``), where the embedded JetStream
    store of earlier versions already keeps the streams (a data dir made before per-user
    permissions resumes with its streams).

    Raises:
        KeyError: a user without a password in ``passwords``.
    """
    lines = ["authorization {", "  users: ["]
    for u in users:
        lines += _user_block(u, passwords[u.user], "    ")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


class LocalUsers:
    """The embedded server's users and their random passwords, in ``<data_dir>/nats.users``
    (JSON ``{user: password}``, mode 0600).

    Args:
        data_dir: the system's data dir.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / USERS_FILE

    def load(self) -> dict[str, str]:
        """The stored passwords ({} when there is no file or it is unreadable)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def ensure(self, users: Iterable[str]) -> dict[str, str]:
        """The passwords of ``users``: kept when stored, made (``secrets.token_urlsafe(24)``)
        for new users; the file is rewritten (mode 0600) only when a user was added."""
        stored = self.load()
        missing = [u for u in users if u not in stored]
        if missing:
            stored.update({u: secrets.token_urlsafe(24) for u in missing})
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(stored, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        return stored


if __name__ == "__main__":  # python -m fedapp.natsauth > deploy/nats/accounts.conf
    print(render_accounts_conf(), end="")
