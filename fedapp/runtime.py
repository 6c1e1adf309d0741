"""Bringing the whole federation up: embedded by default, external servers when configured.

:class:`System` starts, in order: NATS (a ``nats-server`` child process on
``data_dir/nats`` unless ``nats_url`` is set), the ClickHouse store (chDB on
``data_dir/clickhouse`` unless ``clickhouse_url`` is set; migrations applied), the streams,
then the services -- audit, billing, scheduler, one agent per cluster, admission (gRPC) -- each
on its own NATS connection, as they would be in separate processes. :meth:`System.stop` stops
them in reverse order; a later start on the same data dir resumes from the streams.

Governance: when admission starts and NATS KV holds no policy yet, the default policy
(``policy_text`` / ``settings.policy_file`` / the bundled one) is stored with a bootstrap admin
whose token goes to ``<data_dir>/admin.token`` (mode 0600; see
:func:`fedsched.policystore.bootstrap`); the CLI reads that file when no token is given. Other
services follow whatever policy is stored.

The process that holds the chDB store also answers read-only SQL on
``<p>.svc.store.query`` so ``fedsched sql`` works while the system runs (chDB allows one
process per data dir).

Metrics: every service gets its own registry (:mod:`fedsched.metrics`; :attr:`System.metrics`);
with ``settings.metrics_port`` set, each is served on its own port (consecutive, in the order
of :data:`fedsched.metrics.PORT_ORDER`; :attr:`System.metrics_urls`), and the services that own
durable consumers (audit, billing, agents) sample their lag every
:data:`~fedsched.metrics.LAG_SAMPLE_INTERVAL_S` seconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsched import telemetry
from fedsched.bus import Bus
from fedsched.clock import Clock, SystemClock
from fedsched.errors import ConflictError, FedError, UnavailableError
from fedsched.metrics import (PORT_ORDER, AdmissionMetrics, AgentMetrics, MetricsServer, SchedulerMetrics,
                              ServiceMetrics, WriterMetrics, metric_ports, serve)
from fedsched.lease import nats_lease
from fedsched.natsd import EmbeddedNats
from fedapp import natsauth
from fedapp.client import write_store_endpoint
from fedsched.pricing import PriceCatalog, load_price_catalog
from fedsched.tenancy import bundled_policy_text, check_topology_names, parse_policy
from fedsched.policystore import PolicyFollower, PolicyHolder, bootstrap
from fedsched.settings import Settings
from fedsched.yamltext import read_text
from fedsched.store import MAX_QUERY_ROWS, AsyncStore, Store, open_store_from
from services.admission.convert import Limits
from services.admission.service import AdmissionService, TlsFiles
from services.audit.service import AuditService
from services.billing.service import BillingService
from fedsched.topology import KnownNames, Topology
from fedapp.topology import build_backend, cluster_def, default_topology, policy_for_topology
from services.inventory.agent import ClusterAgent, SharedReads, TraceBackend, shared_lease_reader
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)


def scheduler_settings(s: Settings) -> dict[str, Any]:
    """The :class:`~services.scheduler.service.SchedulerService` keyword arguments that come
    from ``s`` (what every scheduler replica of :class:`System` is built with): staleness,
    cycle period, reclaim and unschedulable timeouts, retentions (a tenth of
    ``retain_ended_jobs``, at least 100, as whole entries; twenty times it as tombstones),
    checkpoint cadence and ``max_jobs_per_cycle``."""
    return dict(stale_after_s=s.stale_after_s, interval_s=s.schedule_interval_s, reclaim_after_s=s.reclaim_after_s,
                unschedulable_timeout_s=s.unschedulable_timeout_s,
                retain_ended=max(100, s.retain_ended_jobs // 10), retain_tombstones=20 * s.retain_ended_jobs,
                snapshot_every_s=s.snapshot_every_s, snapshot_every_events=s.snapshot_every_events,
                max_jobs_per_cycle=s.max_jobs_per_cycle)


@dataclass
class SystemOptions:
    """What to run.

    Attributes:
        settings: runtime settings.
        clock: business clock shared by the services (a replay passes its compressed clock).
        policy: scheduling policy name.
        nodes_csv: trace node list for the embedded trace agents when no ``topology`` is given
            (split by :func:`fedapp.topology.default_topology`); None and no topology = run no
            agents (agents then run beside their clusters: ``fedsched service agents``).
        topology: the federation in force (:mod:`fedsched.topology`): agents run for its
            clusters (backend from :func:`fedapp.topology.build_backend`), its price catalog and
            inter-region bandwidth reach billing, admission and the scheduler, and admission
            checks region names against it. None = no topology given: agents (if any) use the
            default split of ``nodes_csv`` and admission learns regions from inventories.
        services: which services to run (default all).
        agent_tick_s: how often agents check for jobs that ended (wall seconds).
        data_dir_locked: a supervising process already holds the data dir's lock
            (``fedsched up --processes``, :mod:`fedapp.processes`): this system, one of its
            children, does not take it again.
    """

    settings: Settings
    clock: Clock = field(default_factory=SystemClock)
    policy: str = "federated"
    nodes_csv: Path | None = None
    services: tuple[str, ...] = ("audit", "billing", "scheduler", "agents", "admission")
    topology: Topology | None = None
    agent_tick_s: float = 0.01
    clusters: tuple[str, ...] = ()  # run only these clusters' agents (default: every cluster of the split)
    split: dict | None = None  # cluster name -> trace nodes, instead of splitting nodes_csv (tests, drills)
    policy_text: str | None = None  # governance policy stored at first start (default: settings.policy_file / bundled)
    prices: PriceCatalog | None = None
    limits: Limits | None = None
    data_dir_locked: bool = False


class System:
    """The running federation (see the module docstring).

    Attributes (after :meth:`start`): ``nats_url``, ``grpc_target``, ``store``, ``scheduler``,
    ``admission``, ``audit``, ``billing``, ``agents``, ``admin_token`` (the bootstrap admin's
    token if this data dir holds it: written to ``<data_dir>/admin.token`` at first start),
    ``metrics`` (service -> its :class:`~fedsched.metrics.ServiceMetrics`), ``metrics_urls``.
    """

    def __init__(self, options: SystemOptions) -> None:
        self.options = options
        self.settings = options.settings
        self.nats: EmbeddedNats | None = None
        self.nats_url = self.settings.nats_url
        self.store: AsyncStore | None = None
        self.sync_store: Store | None = None
        self._read_store: Store | None = None
        self._query_policy: PolicyHolder | None = None
        self._followers: list[PolicyFollower] = []
        self._reader_lock = threading.Lock()
        self.buses: list[Bus] = []
        self.tasks: list[asyncio.Task] = []
        self.scheduler: SchedulerService | None = None
        self.schedulers: list[SchedulerService] = []
        self._scheduler_tasks: dict[int, asyncio.Task] = {}
        self._replicas = 0
        self.admission: AdmissionService | None = None
        self.audit: AuditService | None = None
        self.billing: BillingService | None = None
        self.agents: list[ClusterAgent] = []
        self.lease_reads: SharedReads | None = None  #: the agents' shared reads of the scheduler lease
        self.control: Bus | None = None
        #: the connection that sets the federation up (streams, the first policy, a replay's clock):
        #: admission's user where the local users are known (``ops`` may create no stream: a stream's
        #: subject transform or republish would let it publish anywhere), else ``control``
        self.setup: Bus | None = None
        self._query_sub = None
        self.failed = asyncio.Event()
        self.failure: BaseException | None = None
        self.admin_token: str | None = None
        self.nats_restarts = 0
        self.nats_users: dict[str, str] = {}  #: user -> password of the local NATS users ({} = use nats_url as is)
        self._nats_watchdog: asyncio.Task | None = None
        self._dir_lock = None
        self._endpoint_file: Path | None = None  #: data_dir/store-query.json while this process answers queries
        self.metrics: dict[str, ServiceMetrics] = {}
        self.metrics_servers: dict[str, MetricsServer] = {}
        self._metric_tasks: list[asyncio.Task] = []
        self._metrics_stop: asyncio.Event | None = None

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        self.tasks.append(task)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        log.error("service %s crashed: %r", task.get_name(), task.exception(), exc_info=task.exception())
        self.failed.set()

    @property
    def grpc_target(self) -> str:
        """``host:port`` of the admission gRPC server."""
        host = self.settings.grpc_address.rsplit(":", 1)[0]
        return f"{host}:{self.admission.port}" if self.admission else self.settings.grpc_address

    def _user_of(self, name: str) -> str:
        """The NATS user a connection named ``name`` logs in as (:mod:`fedapp.natsauth`): the
        service's own (``admission``, ``scheduler``, ``audit``, ``billing``, ``agent-<cluster>``),
        ``ops`` for the composition's control connection and :data:`~fedapp.natsauth.SETUP_USER`
        for its ``setup`` connection."""
        return {"control": natsauth.OPS, "setup": natsauth.SETUP_USER}.get(name, name)

    def _url_for(self, user: str) -> tuple[str, str]:
        """(URL, inbox prefix) of ``user``'s connections: its own credentials and inbox when this
        system knows the local users' passwords (embedded NATS, or a loopback URL with the
        data dir's ``nats.users``), else the configured URL and inbox prefix."""
        if user not in self.nats_users:
            return self.nats_url, self.settings.inbox_prefix
        from urllib.parse import quote, urlparse

        u = urlparse(self.nats_url.split(",")[0])
        url = f"{u.scheme or 'nats'}://{quote(user, safe='')}:{quote(self.nats_users[user], safe='')}@{u.hostname}:{u.port}"
        return url, natsauth.inbox_prefix(user)

    async def _bus(self, name: str, metrics: ServiceMetrics | None = None) -> Bus:
        s = self.settings
        url, inbox = self._url_for(self._user_of(name))
        bus = await Bus.connect(url, s.subject_prefix, name=name, duplicate_window_s=s.duplicate_window_s,
                                max_age_s=s.stream_max_age_s, js_domain=s.js_domain, inbox_prefix=inbox,
                                replicas=s.stream_replicas)
        password = _password_of(url)
        if name.startswith("agent-") and password:
            # an agent's message ids are keyed with its own secret, so no other agent can make
            # JetStream drop its events as duplicates (Bus.msg_id)
            bus.msg_id_key = hashlib.sha256(f"fedsched msg-id {password}".encode()).digest()
        if metrics is not None:
            bus.on_dead_letter = metrics.dead_letter
        self.buses.append(bus)
        return bus

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Service -> its scrape URL (empty when ``settings.metrics_port`` is unset)."""
        return {name: server.url for name, server in self.metrics_servers.items()}

    def _start_metrics(self, services: set[str]) -> None:
        """Make a registry per service and, with ``settings.metrics_port`` set, serve each
        (consecutive ports, :func:`~fedsched.metrics.metric_ports`).

        Raises:
            UnavailableError: a metrics port cannot be bound.
        """
        makers = {"admission": AdmissionMetrics, "scheduler": SchedulerMetrics, "agents": AgentMetrics,
                  "audit": lambda: WriterMetrics("audit"), "billing": lambda: WriterMetrics("billing")}
        for name in PORT_ORDER:
            if name in services and name not in self.metrics:
                self.metrics[name] = makers[name]()
        s = self.settings
        if s.metrics_port is None:
            return
        if self._metrics_stop is None:
            self._metrics_stop = asyncio.Event()
        for name, port in metric_ports(s.metrics_port, self.metrics).items():
            if name not in self.metrics_servers:
                self.metrics_servers[name] = serve(self.metrics[name].registry, s.metrics_host, port)

    def _sample_lag(self, service: str, sources) -> None:
        """Sample the lag of ``sources()`` (``(durable, async lag())`` pairs) into ``service``'s
        metrics while the system runs (only when metrics are served)."""
        if self._metrics_stop is None:
            return
        task = asyncio.create_task(self.metrics[service].sample_lag(sources, self._metrics_stop),
                                   name=f"{service}-lag-metrics")
        self._metric_tasks.append(task)

    def _agents_topology(self) -> Topology | None:
        """The topology whose clusters get agents (None: no agents configured)."""
        opts = self.options
        if opts.topology is not None:
            return opts.topology
        if opts.nodes_csv is not None or opts.split is not None:
            return default_topology(opts.nodes_csv)
        return None

    def _nats_users(self) -> list[natsauth.UserPermissions]:
        """The embedded server's users: the services, ``ops`` and one agent per cluster of the
        agents' topology (and of a ``split``)."""
        topo = self._agents_topology()
        clusters = [(c.region, c.name) for c in topo.clusters] if topo is not None else []
        known = {name for _, name in clusters}
        for name in (self.options.split or {}):
            if name not in known:
                clusters.append((cluster_region(name), name))
        return natsauth.federation_users(self.settings.subject_prefix, clusters)

    async def start(self) -> None:
        """Start everything; returns when admission serves.

        Raises:
            UnavailableError: NATS or ClickHouse cannot be started/reached.
            SchemaError: the store's schema is newer than this binary.
        """
        s = self.settings
        opts = self.options
        telemetry.setup_tracing(s.otel_exporter)
        wants = set(opts.services)
        if not opts.data_dir_locked and (s.embedded_nats or (s.embedded_clickhouse and wants & {"audit", "billing"})):
            self._lock_data_dir(Path(s.data_dir))
        if s.embedded_nats:
            # one NATS user per service and per agent, with the deployment's permissions
            # (fedapp/natsauth.py), passwords made at first start and kept 0600 in the data dir
            users = self._nats_users()
            self.nats_users = natsauth.LocalUsers(Path(s.data_dir)).ensure(u.user for u in users)
            self.nats = EmbeddedNats(Path(s.data_dir) / "nats", port=s.nats_port or _remembered_port(Path(s.data_dir)),
                                     accounts=natsauth.embedded_authorization(users, self.nats_users),
                                     passwords=self.nats_users)
            self.nats.spawn()  # from the loop's thread: the child dies with this process
            await asyncio.to_thread(self.nats.wait_ready)
            self.nats_url = self.nats.url
            self._nats_watchdog = asyncio.create_task(self._watch_nats(), name="nats-watchdog")
        elif _loopback_without_user(self.nats_url):  # a service beside a local `fedsched up`
            self.nats_users = natsauth.LocalUsers(Path(s.data_dir)).load()
        self.control = await self._bus("control")
        self.setup = await self._bus("setup") if natsauth.SETUP_USER in self.nats_users else self.control
        if set(opts.services) != {"agents"}:
            # agents (beside their clusters, confined by NATS permissions) never create or change
            # streams: they wait for the central services to have made them
            await self.setup.ensure_streams()
        if "admission" in wants:  # the front door stores the first policy (and keeps the admin token)
            policy_text = opts.policy_text or (read_text(Path(s.policy_file), "policy_file") if s.policy_file
                                               else bundled_policy_text())
            if opts.topology is not None:
                if not opts.policy_text and not s.policy_file:
                    policy_text = policy_for_topology(policy_text, opts.topology)
                # the first-start policy must name only the topology's regions and clusters
                check_topology_names(parse_policy(policy_text), KnownNames.of(opts.topology), prefix="policy.")
            self.admin_token = await bootstrap(self.setup, policy_text, s.admin_token_path, now=opts.clock.time())
        if wants & {"audit", "billing"}:
            self.sync_store = await asyncio.to_thread(open_store_from, s)
            self.store = AsyncStore(self.sync_store)
            await self._check_one_store_per_bus()
            self._query_policy = PolicyHolder()  # store queries are for admins: their tokens come from the policy
            follower = PolicyFollower(self.control, self._query_policy, name="store-query-policy")
            self._followers.append(follower)
            self._spawn(follower.run(), "store-query-policy")
            self._query_sub = await self.control.nc.subscribe(f"{s.subject_prefix}.svc.store.query", cb=self._on_query)
            default_path = Path(s.data_dir) / "clickhouse"
            if s.embedded_clickhouse and Path(s.clickhouse_path or default_path).resolve() == default_path.resolve():
                # chDB opens data_dir/clickhouse in one process only: `fedsched sql --data-dir` finds this one
                self._endpoint_file = write_store_endpoint(s.data_dir, self.nats_url, s.subject_prefix)
        topo = opts.topology
        prices = opts.prices or (topo.price_catalog() if topo is not None and topo.prices is not None
                                 else load_price_catalog(s.price_catalog))
        clock = opts.clock
        self._start_metrics(wants)
        if "audit" in wants:
            m = self.metrics["audit"]
            self.audit = AuditService(await self._bus("audit", m), self.store, metrics=m,
                                      ack_wait_s=s.writer_ack_wait_s)
            self._spawn(self.audit.run(), "audit")
            self._sample_lag("audit", lambda: [(c.durable, c.lag) for c in self.audit.consumers])
        if "billing" in wants:
            m = self.metrics["billing"]
            self.billing = BillingService(await self._bus("billing", m), self.store, prices, metrics=m,
                                          ack_wait_s=s.writer_ack_wait_s)
            self._spawn(self.billing.run(), "billing")
            self._sample_lag("billing", lambda: [(c.durable, c.lag) for c in self.billing.consumers])
        if "agents" in wants and (topo is not None or opts.nodes_csv is not None or opts.split is not None):
            agents_topo = self._agents_topology()
            for name in opts.clusters:  # an unknown --cluster fails here, naming the known ones
                agents_topo.cluster(name)
            cache: dict = {}
            # the agents of this federation share their reads of the scheduler lease, each agent on
            # its own connection (one read per batch each was ~5% of the agents process's CPU)
            self.lease_reads = SharedReads()
            for entry in agents_topo.clusters:
                if opts.clusters and entry.name not in opts.clusters:
                    continue
                if opts.split is not None and entry.backend == "trace":  # other backends read their cluster
                    nodes = opts.split.get(entry.name, [])
                    backend = TraceBackend(nodes, clock=clock, rdma=entry.rdma) if nodes else None
                else:
                    backend = build_backend(entry, agents_topo, cache, clock=clock)
                if backend is None or (isinstance(backend, TraceBackend) and not backend.nodes()):
                    continue  # a trace cluster left without nodes by the split: no agent
                cluster = cluster_def(agents_topo, entry.name)
                m = self.metrics["agents"]
                agent_bus = await self._bus(f"agent-{cluster.name}", m)
                agent = ClusterAgent(agent_bus, clock, cluster, backend,
                                     heartbeat_interval_s=s.heartbeat_interval_s, tick_s=opts.agent_tick_s,
                                     metrics=m, tenure=shared_lease_reader(self.lease_reads, agent_bus))
                self.agents.append(agent)
                self._spawn(agent.run(), f"agent-{cluster.name}")
            self._sample_lag("agents", lambda: [(a.durable, a.lag) for a in self.agents])
        if "scheduler" in wants:
            await self.start_scheduler()
        if "admission" in wants:
            tls = TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None
            m = self.metrics["admission"]
            self.admission = AdmissionService(await self._bus("admission", m), clock, address=s.grpc_address,
                                              limits=opts.limits, prices=prices, tls=tls,
                                              names=KnownNames.of(topo) if topo is not None else None,
                                              max_message_bytes=s.grpc_max_request_bytes,
                                              stale_after_s=s.stale_after_s, metrics=m,
                                              cluster_gone_after_s=s.cluster_gone_after_s,
                                              retain_ended=s.retain_ended_jobs,
                                              snapshot_every_s=s.snapshot_every_s,
                                              snapshot_every_events=s.snapshot_every_events)
            self._spawn(self.admission.run(), "admission")
            task = self.tasks[-1]
            self._sample_lag("admission", self.admission.lag_sources)
            ready = asyncio.create_task(self.admission.ready.wait())
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                ready.cancel()
                task.result()  # raises the startup error

    async def start_scheduler(self) -> SchedulerService:
        """Start a scheduler replica (it rebuilds its state from the streams) on its own
        connection; :attr:`scheduler` is the new one, :attr:`schedulers` all that run.

        Every replica competes for the scheduler lease (:mod:`fedsched.lease`, KV bucket
        ``<prefix>_leases``, TTL ``scheduler_lease_ttl_s``): one is active, the others stand
        by and take over when its lease expires (or at once when it stops and releases it)."""
        s, opts = self.settings, self.options
        topo = opts.topology
        prices = opts.prices or (topo.price_catalog() if topo is not None and topo.prices is not None
                                 else load_price_catalog(s.price_catalog))
        bandwidth = {} if topo is None else dict(  # the topology's inter-region links
            region_bandwidth_bps=topo.listed_bandwidth_bps(),
            inter_region_bandwidth_bps=topo.default_bandwidth_gbit_s * 1e9 / 8)
        self._start_metrics({"scheduler"})
        m = self.metrics["scheduler"]
        bus = await self._bus("scheduler", m)
        self._replicas += 1
        holder = f"{socket.gethostname()}/{os.getpid()}/scheduler-{self._replicas}"
        lease = await nats_lease(bus, "scheduler", holder, ttl_s=s.scheduler_lease_ttl_s)
        self.scheduler = SchedulerService(bus, opts.clock,
                                          build_policy(opts.policy, **bandwidth), prices,
                                          metrics=m, lease=lease, **scheduler_settings(s))
        self.schedulers.append(self.scheduler)
        if self._replicas == 1:  # (one sample loop: the followers of whichever replica is first in the list)
            self._sample_lag("scheduler", lambda: self.schedulers[0].lag_sources() if self.schedulers else [])
        self._spawn(self.scheduler.run(), "scheduler")
        self._scheduler_tasks[id(self.scheduler)] = self.tasks[-1]
        return self.scheduler

    async def stop_scheduler(self, timeout_s: float = 10.0, which: SchedulerService | None = None) -> None:
        """Stop a scheduler replica (default :attr:`scheduler`; drill: a scheduler restart is
        this, then :meth:`start_scheduler`); the rest keeps running. A stopped replica releases
        the lease, so a standby takes over at once."""
        svc = which if which is not None else self.scheduler
        if svc is None:
            return
        svc.stop()
        task = self._scheduler_tasks.pop(id(svc), None)
        if task is not None:
            await asyncio.wait([task], timeout=timeout_s)
            self.tasks = [t for t in self.tasks if t is not task]
        self.schedulers = [x for x in self.schedulers if x is not svc]
        if self.scheduler is svc:
            self.scheduler = self.schedulers[-1] if self.schedulers else None

    async def kill_scheduler(self, which: SchedulerService) -> None:
        """Drill: end a scheduler replica abruptly -- its task cancelled and its NATS
        connection closed without releasing the lease, as a ``kill -9`` would; a standby takes
        over once the lease's TTL has passed."""
        task = self._scheduler_tasks.pop(id(which), None)
        if which.lease is not None:
            which.lease.abandon()  # a dead process writes nothing more: the lease stays as it was
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.tasks = [t for t in self.tasks if t is not task]
        if which.bus is not None:
            try:
                await which.bus.nc.close()
            except Exception:  # noqa: BLE001 - already closed
                pass
        self.schedulers = [x for x in self.schedulers if x is not which]
        if self.scheduler is which:
            self.scheduler = self.schedulers[-1] if self.schedulers else None

    def active_scheduler(self) -> SchedulerService | None:
        """The replica that holds the lease and is active (None during a takeover)."""
        return next((x for x in self.schedulers if x.leading), None)

    def _lock_data_dir(self, data_dir: Path) -> None:
        """Hold an exclusive lock on ``data_dir/.lock`` while this system runs.

        Two processes on one data dir would run two nats-servers on one JetStream store (and
        fight over the chDB files); the second one fails here, saying which process holds it.

        Raises:
            UnavailableError: another process holds the lock.
        """
        data_dir.mkdir(parents=True, exist_ok=True)
        # the data dir holds every tenant's events and usage (chDB writes its files 0644 under the
        # umask), the NATS store and credentials: only this user may enter it
        os.chmod(data_dir, 0o700)
        f = open(data_dir / ".lock", "a+")  # noqa: SIM115 - held open while running
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise UnavailableError(f"data dir {data_dir} is in use by another fedsched process (pid {holder}); "
                                   f"stop it, or pass another --data-dir") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._dir_lock = f

    async def _watch_nats(self, interval_s: float = 1.0) -> None:
        """Restart the embedded nats-server if it dies (same port, same store): every client
        reconnects by itself, and JetStream resumes from the store."""
        while True:
            await asyncio.sleep(interval_s)
            if self.nats is None or self.nats.running:
                continue
            log.error("the embedded nats-server exited; restarting it on port %d", self.nats.port)
            try:
                self.nats.spawn()
                await asyncio.to_thread(self.nats.wait_ready)
                self.nats_restarts += 1
                log.warning("the embedded nats-server is back (restart %d)", self.nats_restarts)
            except Exception as e:  # noqa: BLE001 - keep trying
                log.error("cannot restart the embedded nats-server: %s", e)
                await asyncio.sleep(5 * interval_s)

    async def stop(self) -> None:
        """Stop the services, then the store and NATS, then the metrics endpoints (idempotent)."""
        if self._endpoint_file is not None:  # first: `fedsched sql` opens the store itself from now on
            self._endpoint_file.unlink(missing_ok=True)
            self._endpoint_file = None
        for follower in self._followers:
            follower.stop()
        if self._metrics_stop is not None:
            self._metrics_stop.set()
        if self._metric_tasks:
            _, pending = await asyncio.wait(self._metric_tasks, timeout=2)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self._metric_tasks, return_exceptions=True)
            self._metric_tasks = []
        if self._nats_watchdog is not None:
            self._nats_watchdog.cancel()
            await asyncio.gather(self._nats_watchdog, return_exceptions=True)
            self._nats_watchdog = None
        for svc in (self.admission, *self.schedulers, *self.agents, self.billing, self.audit):
            if svc is not None:
                svc.stop()
        if self.tasks:
            done, pending = await asyncio.wait(self.tasks, timeout=10)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    log.warning("%s ended with %r", t.get_name(), t.exception())
        self.tasks = []
        if self._query_sub is not None:
            try:
                await self._query_sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
            self._query_sub = None
        for bus in reversed(self.buses):
            try:
                await asyncio.wait_for(bus.close(), timeout=5)
            except Exception:  # noqa: BLE001
                pass
        self.buses = []
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._read_store is not None:
            self._read_store.close()
            self._read_store = None
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
            self.nats = None
        if self._dir_lock is not None:
            self._dir_lock.close()  # releases the flock
            self._dir_lock = None
        await asyncio.gather(*(asyncio.to_thread(server.close) for server in self.metrics_servers.values()))
        self.metrics_servers = {}

    async def __aenter__(self) -> "System":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ helpers

    async def stop_producers(self) -> None:
        """Stop every service that publishes on its own (agents, scheduler, admission) but keep
        audit and billing writing: afterwards the event log stops growing once they drain."""
        producers = [*self.agents, *self.schedulers, self.admission]
        for svc in producers:
            if svc is not None:
                svc.stop()
        names = {f"agent-{a.cluster.name}" for a in self.agents} | {"scheduler", "admission"}
        tasks = [t for t in self.tasks if t.get_name() in names]
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def stream_messages(self) -> int:
        """Messages in all the federation's streams (what the audit log must hold)."""
        total = 0
        for suffix in ("EVENTS", "INVENTORY", "DLQ"):
            info = await self.control.js.stream_info(self.control.stream_name(suffix))
            total += int(info.state.messages)
        return total

    async def stream_last_seq(self, suffix: str = "EVENTS") -> int:
        """Last sequence of a stream."""
        info = await self.control.js.stream_info(self.control.stream_name(suffix))
        return int(info.state.last_seq)

    async def drain_writers(self, timeout_s: float = 120.0) -> None:
        """Wait until audit and billing have written everything published so far (before the call;
        what keeps arriving meanwhile, e.g. heartbeats, does not hold the drain:
        :meth:`~fedsched.bus.DurableConsumer.drained_through`).

        Raises:
            UnavailableError: not drained within ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # billing first: it publishes usage.recorded before it acknowledges, so once it has handled
        # everything published before the drain, those events are on the bus before audit's marks
        for writer in (self.billing, self.audit):
            if writer is None:
                continue
            marks = {c.stream: await self._last_seq(c.stream) for c in writer.consumers}
            while True:
                behind = [c.durable for c in writer.consumers if not await c.drained_through(marks[c.stream])]
                if not behind:
                    break
                if loop.time() > deadline:
                    lag = sum([await c.lag() for c in writer.consumers])
                    raise UnavailableError(f"audit/billing still {lag} events behind after {timeout_s:.0f}s "
                                           f"({', '.join(behind)} not through what was published before the drain)")
                await asyncio.sleep(0.1)

    async def _last_seq(self, stream: str) -> int:
        """Last sequence of the stream named ``stream`` (full name)."""
        return int((await self.control.js.stream_info(stream)).state.last_seq)

    async def _check_one_store_per_bus(self) -> None:
        """Refuse to write the audit log into a second store on this bus.

        Audit and billing consume durable consumers shared by name; two processes writing to two
        different stores would split the log between them (each event in one store only). The
        process holding a store answers pings on ``<p>.svc.store.query`` with its store's
        identity: another identity answering means another store is already fed from this bus.

        Raises:
            ConflictError: a different store is being written from this bus.
        """
        import nats.errors

        subject = f"{self.settings.subject_prefix}.svc.store.query"
        try:
            reply = await self.control.nc.request(subject, json.dumps({"ping": True}).encode(), timeout=2)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return
        other = json.loads(reply.data or b"{}").get("store")
        if other and other != self.sync_store.identity:
            raise ConflictError(f"another fedsched already writes the audit log of this NATS (subject prefix "
                                f"{self.settings.subject_prefix!r}) into a different store ({other}); both would get "
                                f"half of the events. Use that system (fedsched sql/report --nats-url), give this "
                                f"one its own NATS or FEDSCHED_SUBJECT_PREFIX, or point it at the same ClickHouse")

    async def _on_query(self, msg) -> None:
        """Answer ``<p>.svc.store.query`` (``{"sql", "parameters", "token"}``) on the read-only
        handle, for an admin's token only (the store holds every tenant's data).

        The reply is ``{"columns", "types", "rows", "truncated", "total_rows"}`` (``types``: each
        column's ClickHouse type name, so a client tells a time from a string that looks like one)
        or ``{"error", "code"}``
        (``unauthenticated``, ``permission_denied``, ``invalid``, ``unavailable``); rows are cut
        to :data:`~fedsched.store.MAX_QUERY_ROWS` and to what fits in one NATS message.
        """
        try:
            req = json.loads(msg.data or b"{}")
            if req.get("ping"):  # which store answers here (see _check_one_store_per_bus)
                await msg.respond(json.dumps({"store": self.sync_store.identity}).encode())
                return
            principal = self._query_principal(str(req.get("token") or ""))
            if principal is None:
                body = {"code": "unauthenticated", "error": "store queries need an admin's token (--token, "
                                                            "FEDSCHED_TOKEN, or FEDSCHED_DATA_DIR holding admin.token)"}
            elif not principal.is_admin:
                body = {"code": "permission_denied", "error": f"{principal.name} is not an admin; store queries read "
                                                              f"every tenant's data"}
            else:
                sql = str(req.get("sql", ""))
                result = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self._reader().query(sql, req.get("parameters") or {}))
                body = {"columns": list(result.columns), "types": list(result.types),
                        "rows": [list(r) for r in result.rows[:MAX_QUERY_ROWS]],
                        "truncated": len(result.rows) > MAX_QUERY_ROWS, "total_rows": len(result.rows)}
        except FedError as e:
            body = {"code": "unavailable" if isinstance(e, UnavailableError) else "invalid", "error": e.message}
        except Exception as e:  # noqa: BLE001 - report, never crash the responder
            body = {"code": "invalid", "error": f"{type(e).__name__}: {e}"}
        await msg.respond(_fit_reply(body, self.control.nc.max_payload))

    def read_query(self, sql: str, parameters: dict | None = None):
        """Run a SELECT on this process's store through its read-only handle (the one
        ``fedsched sql`` reaches over NATS), with ``{name:Type}`` parameters; blocking.

        Raises:
            UnavailableError: this system holds no store (it runs neither audit nor billing).
        """
        if self.sync_store is None:
            raise UnavailableError("this process holds no ClickHouse store (audit and billing run elsewhere)")
        return self._reader().query(sql, parameters or {})

    def _query_principal(self, token: str):
        """The principal holding ``token`` under the policy in force (None: unknown or no policy)."""
        gov = self._query_policy.current if self._query_policy is not None else None
        return gov.authenticate(token) if gov is not None and token else None

    def _reader(self) -> Store:
        """The read-only store handle for queries from outside (opened at first use)."""
        with self._reader_lock:
            if self._read_store is None:
                self._read_store = self.sync_store.reader()
            return self._read_store


def _password_of(url: str) -> str:
    """The password in (the first server of) a NATS URL, "" if none."""
    from urllib.parse import unquote, urlparse

    password = urlparse(url.split(",")[0]).password
    return unquote(password) if password else ""


def _loopback_without_user(url: str) -> bool:
    """A single loopback NATS URL (with or without the CLI's ``ops`` credentials)."""
    from urllib.parse import urlparse

    u = urlparse(url)
    return "," not in url and u.hostname in ("127.0.0.1", "localhost", "::1") and u.username in (None, natsauth.OPS)


def cluster_region(cluster: str) -> str:
    """The region of a cluster named ``<region>-<suffix>`` (the default topology's scheme)."""
    return cluster.rsplit("-", 1)[0]


def _remembered_port(data_dir: Path) -> int:
    """The embedded NATS port this data dir used last time if it is free now, else a new free
    one; remembered in ``data_dir/nats/port`` so `fedsched up` keeps its URL across restarts."""
    from fedsched.natsd import free_port

    record = data_dir / "nats" / "port"
    try:
        port = int(record.read_text().strip())
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    except (OSError, ValueError):
        port = free_port()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(str(port))
    return port


def _fit_reply(body: dict, max_bytes: int) -> bytes:
    """``body`` as JSON within ``max_bytes`` (the NATS max payload): rows are halved until it
    fits, and ``truncated`` says so."""
    data = json.dumps(body, default=_json_default).encode()
    rows = body.get("rows")
    while len(data) > max_bytes - 1024 and rows:
        rows = rows[:len(rows) // 2]
        body = {**body, "rows": rows, "truncated": True}
        data = json.dumps(body, default=_json_default).encode()
    if len(data) > max_bytes - 1024:
        data = json.dumps({"code": "invalid", "error": "the answer is too large for one message"}).encode()
    return data


def _json_default(value):
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    return str(value)


def data_dir_holder(data_dir: Path) -> str | None:
    """The pid (as recorded) of the process holding ``data_dir``'s lock, or None when no process
    holds it (nothing is created: a directory or lock file that does not exist is not held).
    What :class:`System` refuses a second time with; ``up`` asks first, before anything starts."""
    lock = Path(data_dir) / ".lock"
    if not lock.exists():
        return None
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            return f.read().strip() or "?"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None
