"""``fedsched up --processes``: the federation as separate OS processes on one NATS.

One interpreter runs every service of ``fedsched up`` on one core (the GIL); this module runs
them as processes instead, the way a deployment does (deploy/k8s: one pod per service), so the
operating system spreads them over the cores:

===============  ===================================================================
process          what runs in it
===============  ===================================================================
supervisor       the ``fedsched up`` process itself: the embedded ``nats-server`` child
                 (unless ``--nats-url``), the streams, the data dir's lock; starts,
                 watches and stops the others
``store``        audit and billing together: the embedded chDB engine allows one process
                 per data dir (with ``--clickhouse-url`` they still share one process)
``scheduler``    the scheduler
``agents``       every agent of the topology (one process for all clusters)
``admission``    the gRPC front door (bootstraps the first policy and the admin token)
===============  ===================================================================

Each child is a :class:`~fedapp.runtime.System` with ``services`` narrowed to its own, started
with :mod:`multiprocessing`'s *spawn* method (a fresh interpreter: no state forked from the
supervisor), connected to the supervisor's NATS URL, and asks the kernel for SIGTERM should the
supervisor die (``PR_SET_PDEATHSIG``), so no child outlives it.

Lifecycle:

1. the supervisor starts NATS and the streams, then every child at once, and waits until each
   reports ready (or an error, or exits) -- at most ``start_timeout_s``;
2. Ctrl-C / SIGTERM: admission is stopped first (no new work), then the scheduler and the
   agents, then the store (so it writes what the others published last), each group with
   SIGTERM and ``stop_timeout_s`` to finish (then SIGKILL); NATS last;
3. a child that exits on its own is **not restarted**: the supervisor reports it (name, pid,
   exit code) on stderr, stops the others as in 2, and ``up`` exits 1. State is kept in the
   streams and the store, so ``fedsched up --processes`` again resumes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fedsched.gctune import enable_for_process
from fedsched.settings import Settings
from fedsched.topology import Topology

log = logging.getLogger(__name__)

#: The children of ``up --processes``: name -> services it runs, in start order. Stop order is
#: :data:`STOP_ORDER`.
CHILDREN: dict[str, tuple[str, ...]] = {
    "store": ("audit", "billing"),
    "scheduler": ("scheduler",),
    "agents": ("agents",),
    "admission": ("admission",),
}


def _child_metrics(settings: Settings, services: tuple[str, ...]) -> Settings:
    """A child's settings with its metrics base port: each service keeps the port it has in
    one ``up`` process (``metrics_port`` + its place in :data:`~fedsched.metrics.PORT_ORDER`),
    so the children never bind the same port; unset or 0 (free ports) stay as they are."""
    from fedsched.metrics import PORT_ORDER

    if not settings.metrics_port:
        return settings
    first = min(PORT_ORDER.index(x) for x in services)
    return settings.model_copy(update={"metrics_port": settings.metrics_port + first})


#: Groups stopped one after the other: the front door first, the writers last.
STOP_ORDER: tuple[tuple[str, ...], ...] = (("admission",), ("scheduler", "agents"), ("store",))


@dataclass(frozen=True)
class ChildSpec:
    """What one child process runs (picklable: it crosses the spawn boundary).

    Attributes:
        name: the child's name (a key of :data:`CHILDREN`).
        services: the services of :class:`~fedapp.runtime.SystemOptions` it runs.
        settings: runtime settings, ``nats_url`` pointing at the supervisor's NATS.
        policy: scheduling policy name.
        topology: the federation in force (agents, prices, region names).
        data_dir_locked: the supervisor holds the data dir's lock (see
            :attr:`~fedapp.runtime.SystemOptions.data_dir_locked`).
        verbose: log at INFO.
    """

    name: str
    services: tuple[str, ...]
    settings: Settings
    policy: str
    topology: Topology | None
    data_dir_locked: bool
    verbose: bool = False


@dataclass
class Child:
    """A started child: its process and the pipe it reports readiness on."""

    spec: ChildSpec
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    ready: dict | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self.process.pid


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the supervisor dies (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def child_main(spec: ChildSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a child process (runs in the spawned interpreter).

    Sends one message on ``conn``: ``{"ready": True, ...facts}`` once its services run, or
    ``{"error": text}`` when they cannot start; then runs until SIGTERM/SIGINT. Exits 0 after a
    requested stop, 1 when a service crashed or the start failed. SIGINT is ignored: Ctrl-C in
    the terminal reaches the whole process group, and the supervisor stops the children in order.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us in order
    _die_with_parent()
    enable_for_process()  # this process runs its services until it exits (fedsched.gctune)
    logging.basicConfig(level=logging.INFO if spec.verbose else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s")
    sys.exit(asyncio.run(_run_child(spec, conn)))


async def _run_child(spec: ChildSpec, conn: multiprocessing.connection.Connection) -> int:
    from fedsched.errors import FedError
    from fedapp.runtime import System, SystemOptions

    system = System(SystemOptions(settings=spec.settings, policy=spec.policy, topology=spec.topology,
                                  services=spec.services, data_dir_locked=spec.data_dir_locked))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    start = asyncio.create_task(system.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # stopped while starting
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await system.stop()
        return 0
    signalled.cancel()
    try:
        start.result()
    except (FedError, OSError) as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        await system.stop()
        return 1
    except BaseException as e:  # noqa: BLE001 - report it, then fail like any start error
        conn.send({"error": f"{type(e).__name__}: {e!r}"})
        await system.stop()
        return 1
    conn.send({"ready": True, "pid": os.getpid(), "grpc_target": system.grpc_target if system.admission else "",
               "agents": len(system.agents), "admin_token": bool(system.admin_token),
               "jobs": len(system.admission.view.jobs) if system.admission else None,
               "policy": system.admission.policy.version if system.admission and system.admission.policy else "",
               "scheduling_policy": system.scheduler.policy.version if system.scheduler else ""})
    failed = asyncio.create_task(system.failed.wait())
    await asyncio.wait({asyncio.create_task(stop.wait()), failed}, return_when=asyncio.FIRST_COMPLETED)
    await system.stop()
    if system.failed.is_set():
        log.error("%s: a service crashed (%r)", spec.name, system.failure)
        return 1
    return 0


class ChildExited(Exception):
    """A child process ended without being asked to (carries its name, pid and exit code)."""

    def __init__(self, name: str, pid: int | None, exitcode: int | None, detail: str = "") -> None:
        self.name, self.pid, self.exitcode, self.detail = name, pid, exitcode, detail
        super().__init__(f"{name} (pid {pid}) exited with code {exitcode}" + (f": {detail}" if detail else ""))


@dataclass
class Supervisor:
    """Starts, watches and stops the child processes of ``up --processes`` (module docstring).

    Attributes:
        settings: the ``up`` settings (data dir, URLs, gRPC address).
        topology: the federation in force (the agents' clusters).
        policy: scheduling policy name.
        run_agents: False with ``--no-agents``.
        verbose: children log at INFO.
        start_timeout_s: wall seconds every child has to report ready.
        stop_timeout_s: wall seconds each stop group has after SIGTERM before SIGKILL.
    """

    settings: Settings
    topology: Topology | None
    policy: str = "federated"
    run_agents: bool = True
    verbose: bool = False
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 15.0
    children: dict[str, Child] = field(default_factory=dict)
    system: object = None  # the supervisor's own System (NATS, streams, lock)
    stopping: bool = False

    async def start(self) -> None:
        """Start NATS and the streams here, then every child; returns when all are ready.

        Raises:
            ChildExited: a child reported an error or exited while starting (the others are
                stopped again).
            UnavailableError: NATS cannot be started; a child not ready in ``start_timeout_s``.
        """
        from fedsched.errors import UnavailableError
        from fedapp.runtime import System, SystemOptions

        self.system = System(SystemOptions(settings=self.settings, policy=self.policy, topology=self.topology,
                                           services=()))
        await self.system.start()
        child_settings = self.settings.model_copy(update={"nats_url": self.system.nats_url})
        locked = self.system._dir_lock is not None
        ctx = multiprocessing.get_context("spawn")
        for name, services in CHILDREN.items():
            if name == "agents" and not self.run_agents:
                continue
            spec = ChildSpec(name=name, services=services, settings=_child_metrics(child_settings, services),
                             policy=self.policy,
                             topology=self.topology, data_dir_locked=locked, verbose=self.verbose)
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child_main, args=(spec, child_end), name=f"fedsched-{name}", daemon=False)
            proc.start()
            child_end.close()
            self.children[name] = Child(spec, proc, parent_end)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        for child in self.children.values():
            while child.ready is None:
                if child.conn.poll():
                    try:
                        message = child.conn.recv()
                    except EOFError:
                        message = {}
                    if "error" in message or not message:
                        await asyncio.to_thread(child.process.join, 10)
                        raise ChildExited(child.spec.name, child.pid, child.process.exitcode,
                                          message.get("error", "no report"))
                    child.ready = message
                    break
                if not child.process.is_alive():
                    raise ChildExited(child.spec.name, child.pid, child.process.exitcode, "while starting")
                if loop.time() > deadline:
                    raise UnavailableError(f"{child.spec.name} (pid {child.pid}) not ready after "
                                           f"{self.start_timeout_s:.0f} s")
                await asyncio.to_thread(child.conn.poll, 0.2)  # wakes at once on a message

    async def wait(self, stop: asyncio.Event) -> ChildExited | None:
        """Run until ``stop`` is set (None) or a child exits on its own (returned)."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future = loop.create_future()

        def on_exit(child: Child) -> None:
            loop.remove_reader(child.process.sentinel)
            if not exited.done():
                exited.set_result(child)

        for child in self.children.values():
            loop.add_reader(child.process.sentinel, on_exit, child)
        waiters = {asyncio.ensure_future(stop.wait()), exited}
        if self.system is not None:
            waiters.add(asyncio.ensure_future(self.system.failed.wait()))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for child in self.children.values():
                loop.remove_reader(child.process.sentinel)
            for w in waiters:
                if w is not exited:
                    w.cancel()
        if exited.done():
            child = exited.result()
            await asyncio.to_thread(child.process.join, 5)
            return ChildExited(child.spec.name, child.pid, child.process.exitcode)
        if self.system is not None and self.system.failed.is_set():
            return ChildExited("supervisor", os.getpid(), None, repr(self.system.failure))
        return None

    async def stop(self) -> None:
        """Stop the children in :data:`STOP_ORDER` (SIGTERM, then SIGKILL after
        ``stop_timeout_s``), then NATS; idempotent."""
        self.stopping = True
        for group in STOP_ORDER:
            procs = [self.children[n].process for n in group if n in self.children]
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                await asyncio.to_thread(p.join, self.stop_timeout_s)
                if p.is_alive():
                    log.warning("%s (pid %s) did not stop in %.0f s; killing it", p.name, p.pid, self.stop_timeout_s)
                    p.kill()
                    await asyncio.to_thread(p.join, 5)
        for child in self.children.values():
            child.conn.close()
            child.process.close()
        self.children = {}
        if self.system is not None:
            await self.system.stop()

    def pids(self) -> dict[str, int]:
        """Name -> pid of every child, and ``nats-server`` when it runs here."""
        out = {name: c.pid for name, c in self.children.items() if c.pid is not None}
        nats = getattr(self.system, "nats", None)
        if nats is not None and nats._proc is not None:
            out["nats-server"] = nats._proc.pid
        return out


async def run_up(supervisor: Supervisor, stop: asyncio.Event, say: Callable[[str], None],
                 complain: Callable[[str], None]) -> int:
    """The ``up --processes`` foreground loop: start, print where everything runs, wait for
    Ctrl-C / SIGTERM (``stop``) or a child's exit, stop everything.

    Returns:
        The exit code: 0 after a requested stop, 1 when a child failed to start or exited on
        its own (it is not restarted).
    """
    start = asyncio.create_task(supervisor.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await supervisor.stop()
        say("stopped while starting")
        return 0
    signalled.cancel()
    try:
        start.result()
    except BaseException as e:  # noqa: BLE001 - report, stop what started, fail
        complain(f"cannot start: {e}")
        await supervisor.stop()
        return 1
    s = supervisor.settings
    adm = supervisor.children["admission"].ready
    system = supervisor.system
    nats = system.nats.url if system.nats else "(given)"
    store = ("chDB " + str(Path(s.data_dir) / "clickhouse")) if s.embedded_clickhouse else "(server)"
    say(f"fedsched is up (--processes): gRPC {adm['grpc_target']}, NATS {nats}, ClickHouse {store}")
    for name, pid in supervisor.pids().items():
        ready = supervisor.children[name].ready if name in supervisor.children else {}
        extra = {"store": " (audit + billing)", "agents": f" ({ready.get('agents', 0)} agent(s))",
                 "scheduler": f" (policy {ready.get('scheduling_policy', '')})",
                 "admission": f" ({ready.get('jobs')} job(s) known)"}.get(name, "")
        say(f"  {name} pid {pid}{extra}")
    token_note = (f"admin token in {s.admin_token_path}" if adm.get("admin_token") else
                  "no admin token in this data dir: pass --token / FEDSCHED_TOKEN")
    say(f"  policy {adm.get('policy')}; {token_note}. Ctrl-C stops.")
    exited = await supervisor.wait(stop)
    if exited is not None:
        complain(f"{exited} -- not restarted; stopping everything (state is kept: `fedsched up --processes` "
                 f"again resumes; -v shows the logs)")
    say("stopping ...")
    await supervisor.stop()
    say("stopped; state kept in " + str(s.data_dir))
    return 1 if exited is not None else 0
