"""The ``fedsched`` command line.

Run the federation (``up``, with the web console; ``web`` serves the console alone), replay a
trace through it (``replay``), query its event log (``sql``, ``report``), use the job API (``submit``, ``jobs``, ``job``, ``explain``, ``cancel``,
``watch``) and the governance API (``approvals``, ``approve``, ``reject``, ``tenants``, ``quota``,
``principal``, ``policy apply|show|diff``; ``token new``). Every setting also reads
``FEDSCHED_<NAME>`` from the environment; API commands send ``--token`` / ``FEDSCHED_TOKEN`` or
the embedded system's ``<data_dir>/admin.token``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fedsched.errors import FedError
from fedsched.gctune import enable_for_process



def redact(url: str) -> str:
    """:func:`fedsched.bus.redact`, imported on use: ``fedsched.bus`` loads nats.py and aiohttp
    (~0.3 s of every CLI start), which most commands never need."""
    from fedsched.bus import redact as _redact

    return _redact(url)


#: ``-h`` and ``--help`` on every command (subcommands inherit the root's context settings)
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
ROOT_HELP = (
    "The fedsched command line: run the federation (up, service; web for the console alone), replay a trace "
    "through it (replay), query its event log (sql, report), use the job API (submit, jobs, job, explain, cancel, "
    "hold, release, priority, watch, logs, clusters, status) and the governance API (approvals, approve, reject, "
    "tenants, quota, principal, policy; token new); print the ClickHouse DDL (schema) and the topology in force "
    "(topology show).\n\n"
    "Every setting also reads FEDSCHED_<NAME> from the environment; the gRPC address is FEDSCHED_GRPC_ADDRESS on "
    "both sides. API commands send --token / FEDSCHED_TOKEN or the embedded system's <data_dir>/admin.token.")
#: plain help (no markup mode: what is written is what prints, wrapped to the terminal)
app = typer.Typer(help=ROOT_HELP, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  context_settings=HELP_OPTIONS)
from fedapp.cli.text import SqlOutput, console, delimited, err, error_line, strict_json, styled


def _print_version(value: bool) -> None:
    if value:
        from fedsched.version import package_version

        console.print(f"fedsched {package_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the fedsched version and exit.")) -> None:
    pass


def _bundled(name: str) -> Path:
    return Path(str(resources.files("fedsched.data").joinpath("alibaba-gpu-2023", name)))


def _settings(**overrides):
    from fedsched.settings import Settings

    clean = {k: v for k, v in overrides.items() if v not in (None, "")}
    data_dir = clean.get("data_dir")
    if data_dir is not None and Path(data_dir).exists() and not Path(data_dir).is_dir():
        err.print(error_line("invalid setting:", f"--data-dir {data_dir} exists and is not a directory"))
        raise typer.Exit(2)
    try:
        return Settings(**clean)
    except Exception as e:  # pydantic ValidationError: show it plainly
        err.print(error_line("invalid setting:", e))
        raise typer.Exit(2) from e


TOPOLOGY_HELP = ("The federation's topology (YAML: regions, clusters, backends; see deploy/topology/example.yaml). "
                 "Default: the bundled trace split into 3 regions x 2 clusters (`fedsched topology show`).")


def _topology(path: Optional[Path], nodes: Optional[Path]):
    """The topology in ``path``, else the default split of ``nodes`` (default: the bundled
    node list); exits 2 naming the bad key when the file is invalid."""
    from fedapp.topology import default_topology
    from fedsched.topology import load_topology

    try:
        return load_topology(path) if path is not None else default_topology(nodes.resolve() if nodes else None)
    except FedError as e:
        err.print(error_line("invalid topology:", f"{path}: {e}" if path else e))
        raise typer.Exit(2) from e


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(e: Exception) -> None:
    err.print(error_line("error:", e))
    raise typer.Exit(1)


# --------------------------------------------------------------------------- up


async def _start_unless_stopped(system, stop: asyncio.Event) -> bool:
    """Start ``system``; Ctrl-C / SIGTERM (``stop``) during the start abandons it.

    Returns:
        True when the system runs; False when a signal came first (the system is stopped again).

    Raises:
        Whatever the start raised (the system is stopped first).
    """
    start = asyncio.create_task(system.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await system.stop()
        return False
    signalled.cancel()
    try:
        start.result()
    except BaseException:
        await system.stop()
        raise
    return True


@app.command()
def up(
    data_dir: Path = typer.Option(Path(".fedsched"), "--data-dir", envvar="FEDSCHED_DATA_DIR",
                                  help="Where the embedded NATS and ClickHouse keep their data (kept across runs)."),
    nats_url: str = typer.Option("", "--nats-url", envvar="FEDSCHED_NATS_URL",
                                 help="Use this NATS (nats://host:4222) instead of starting one."),
    clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                       help="Use this ClickHouse server (http://user:pw@host:8123) instead of chDB."),
    grpc_address: str = typer.Option("127.0.0.1:50051", "--grpc-address", envvar="FEDSCHED_GRPC_ADDRESS",
                                     help="Where admission serves gRPC."),
    nodes: Optional[Path] = typer.Option(None, "--nodes", help="Trace node list for the embedded trace agents "
                                         "(default: the bundled openb nodes)."),
    no_agents: bool = typer.Option(False, "--no-agents", help="Run no agents here (they run beside their clusters)."),
    topology: Optional[Path] = typer.Option(None, "--topology", envvar="FEDSCHED_TOPOLOGY", exists=True,
                                            dir_okay=False, help=TOPOLOGY_HELP),
    policy: str = typer.Option("federated", "--policy",
                               help="Scheduling policy: federated, local-only, least-loaded, cheapest or random."),
    policy_file: Optional[Path] = typer.Option(None, "--policy-file", envvar="FEDSCHED_POLICY_FILE",
                                               help="Governance policy to store at first start (default: the bundled "
                                                    "one); later: `fedsched policy apply`."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", envvar="FEDSCHED_TLS_CERT",
                                            help="Serve gRPC over TLS with this PEM certificate (with --tls-key)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", envvar="FEDSCHED_TLS_KEY", help="PEM private key."),
    tls_client_ca: Optional[Path] = typer.Option(None, "--tls-client-ca", envvar="FEDSCHED_TLS_CLIENT_CA",
                                                 help="Require client certificates signed by this CA (mTLS)."),
    web_port: int = typer.Option(8080, "--web-port", envvar="FEDSCHED_WEB_PORT", min=0, max=65535,
                                 help="Serve the web console on this port (0 = any free port)."),
    web_host: str = typer.Option("127.0.0.1", "--web-host", envvar="FEDSCHED_WEB_HOST",
                                 help="Address the web console listens on."),
    no_web: bool = typer.Option(False, "--no-web", help="Do not serve the web console."),
    metrics_port: int = typer.Option(9464, "--metrics-port", envvar="FEDSCHED_METRICS_PORT", min=0, max=65535,
                                     help="Serve each service's Prometheus metrics on consecutive ports from this one "
                                          "(admission, scheduler, audit, billing, agents); 0 = free ports."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Serve no metrics endpoints."),
    processes: bool = typer.Option(False, "--processes", help="Run the services as separate OS processes on the "
                                   "one NATS (admission, scheduler, audit+billing, the agents; see "
                                   "fedapp/processes.py); a process that exits stops them all (exit 1)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level (default: warnings only)."),
):
    """Run the whole federation in the foreground until Ctrl-C.

    NATS (JetStream) and ClickHouse run embedded on --data-dir unless URLs are given; the five
    services start on top, and the web console on --web-port (its URL is printed; sign in with a
    token). A second `up` on the same data dir resumes with the state kept.

    With --processes, admission, the scheduler, audit+billing (one process: embedded chDB
    allows one per data dir) and all agents (one process) run as separate OS processes; a
    process that exits on its own is reported and not restarted: everything stops, exit 1.
    """
    enable_for_process()  # one federation per process until it exits: services may freeze their heap (fedsched.gctune)
    _logging(verbose)
    from fedapp.runtime import System, SystemOptions

    settings = _settings(data_dir=data_dir, nats_url=nats_url, clickhouse_url=clickhouse_url, grpc_address=grpc_address,
                         policy_file=policy_file, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
    settings.metrics_port = None if no_metrics else metrics_port
    topo = _topology(topology, nodes)
    # before anything starts (NATS, the data dir, the lease): a data dir in use or a taken port is
    # one line, not tracebacks (the data dir first: its holder also holds the ports)
    from fedapp.runtime import data_dir_holder

    holder = data_dir_holder(Path(settings.data_dir))
    if holder is not None:
        err.print(error_line("error:", f"data dir {settings.data_dir} is in use by another fedsched process "
                                       f"(pid {holder}); stop it, or pass another --data-dir"))
        raise typer.Exit(1)
    grpc_host, _, grpc_port = settings.grpc_address.rpartition(":")
    taken = [(what, host, port, hint) for what, host, port, hint in (
        ("gRPC", grpc_host, grpc_port, "--grpc-address HOST:PORT (port 0 = any free port)"),
        ("web console", web_host, "" if no_web or processes else str(web_port), "--web-port (0 = any free port) or --no-web"))
        if port.isdigit() and _port_taken(host, int(port))]
    for what, host, port, hint in taken:
        err.print(error_line("error:", f"the {what} address {host}:{port} is in use (another fedsched up?); "
                                       f"stop that process or pass {hint}"))
    if taken:
        raise typer.Exit(1)
    if processes:
        _up_processes(settings, topo, policy, not no_agents, verbose)
        return
    wanted = tuple(x for x in SystemOptions(settings=settings).services if not (no_agents and x == "agents"))

    async def main() -> None:
        system = System(SystemOptions(settings=settings, policy=policy, topology=topo, services=wanted))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if not await _start_unless_stopped(system, stop):
            console.print("stopped while starting")
            return
        console.print(styled(("fedsched is up", "green"), f": gRPC {system.grpc_target}, NATS "
                                                               f"{system.nats.url if system.nats else redact(system.nats_url)}, "
                      f"ClickHouse {'chDB ' + str(Path(settings.data_dir) / 'clickhouse') if settings.embedded_clickhouse else redact(settings.clickhouse_url)}"))
        console.print(f"  {len(system.agents)} trace agent(s), policy {system.scheduler.policy.version}, "
                      f"{len(system.admission.view.jobs)} job(s) known. Ctrl-C stops.")
        token_note = (f"admin token in {settings.admin_token_path} (the CLI reads it; FEDSCHED_DATA_DIR="
                      f"{settings.data_dir})" if system.admin_token else
                      "no admin token in this data dir: pass --token / FEDSCHED_TOKEN")
        console.print(f"  policy {system.admission.policy.version}; {token_note}")
        _print_metrics(system)
        console.print(f"  try: FEDSCHED_GRPC_ADDRESS={system.grpc_target} fedsched submit --tenant search --project train "
                      f"--gpus 1 --duration 600")
        console_server = None
        if not no_web:
            from fedapp.web.serve import serve_system

            try:
                console_server = await serve_system(system, web_host, web_port)
                console.print(f"  web console: {console_server.url} (sign in with a token, e.g. the admin token)")
            except (OSError, FedError) as e:
                err.print(error_line("web console not started:", f"{e} (pass --web-port, or --no-web)"))
        failed = asyncio.create_task(system.failed.wait())
        await asyncio.wait({asyncio.create_task(stop.wait()), failed}, return_when=asyncio.FIRST_COMPLETED)
        if console_server is not None:
            await console_server.stop()
        if system.failed.is_set():
            err.print(error_line("error:", f"a service crashed ({system.failure!r}); stopping everything (state is "
                                           f"kept: `fedsched up` again resumes; -v shows the logs)"))
        console.print("stopping ...")
        await system.stop()
        console.print("stopped; state kept in " + str(settings.data_dir))
        if system.failed.is_set():
            raise typer.Exit(1)

    try:
        asyncio.run(main())
    except FedError as e:
        _fail(e)


def _port_taken(host: str, port: int) -> bool:
    """Whether TCP ``host:port`` cannot be listened on now (port 0: never; ``[::1]`` and names allowed)."""
    import socket

    if port == 0:
        return False
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # (an address that does not resolve: the server says so itself)
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


def _print_metrics(system) -> None:
    """One line per service: where its Prometheus metrics are served (nothing when off)."""
    for name, url in system.metrics_urls.items():
        console.print(f"  metrics {name}: {url}")


def _up_processes(settings, topo, policy: str, run_agents: bool, verbose: bool) -> None:
    """``up --processes``: the services as child processes (:mod:`fedapp.processes`); no web
    console in this mode (serve it with `fedsched web`)."""
    from fedapp.processes import Supervisor, run_up

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        supervisor = Supervisor(settings, topo, policy=policy, run_agents=run_agents, verbose=verbose)
        return await run_up(supervisor, stop, say=lambda text: console.print(text, highlight=False),
                            complain=lambda text: err.print(error_line("error:", text)))

    try:
        code = asyncio.run(main())
    except FedError as e:
        _fail(e)
    if code:
        raise typer.Exit(code)


# --------------------------------------------------------------------------- one service


SERVICES = ("admission", "scheduler", "audit", "billing", "agents", "writers")

#: ``writers`` = audit and billing in one process: with the embedded ClickHouse engine (chDB, one
#: process per data path) they cannot be two processes; against a ClickHouse server
#: (``--clickhouse-url``) run ``audit`` and ``billing`` as two.
_BUNDLES = {"writers": ("audit", "billing")}


@app.command()
def service(
    name: str = typer.Argument(..., help="admission, scheduler, audit, billing, agents (agent), or writers (audit "
                                         "and billing in one process: needed with the embedded chDB)"),
    nats_url: str = typer.Option(..., "--nats-url", envvar="FEDSCHED_NATS_URL", help="The federation's NATS."),
    clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                       help="ClickHouse server (audit, billing); empty = chDB in --data-dir."),
    data_dir: Path = typer.Option(Path(".fedsched"), "--data-dir", envvar="FEDSCHED_DATA_DIR",
                                  help="Local state (the embedded chDB of audit/billing, credentials, tokens)."),
    grpc_address: str = typer.Option("0.0.0.0:50051", "--grpc-address", envvar="FEDSCHED_GRPC_ADDRESS",
                                     help="admission: where it serves gRPC."),
    nodes: Optional[Path] = typer.Option(None, "--nodes", help="agents: trace node list (default: bundled openb)."),
    cluster: list[str] = typer.Option([], "--cluster", help="agents: run only this cluster's agent (repeatable)."),
    topology: Optional[Path] = typer.Option(None, "--topology", envvar="FEDSCHED_TOPOLOGY", exists=True,
                                            dir_okay=False, help=TOPOLOGY_HELP),

    policy: str = typer.Option("federated", "--policy",
                               help="scheduler: federated, local-only, least-loaded, cheapest or random."),
    policy_file: Optional[Path] = typer.Option(None, "--policy-file", envvar="FEDSCHED_POLICY_FILE",
                                               help="Governance policy to store if NATS holds none yet."),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", envvar="FEDSCHED_TLS_CERT",
                                            help="admission: serve gRPC over TLS (with --tls-key)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", envvar="FEDSCHED_TLS_KEY",
                                           help="admission: PEM private key of --tls-cert."),
    tls_client_ca: Optional[Path] = typer.Option(None, "--tls-client-ca", envvar="FEDSCHED_TLS_CLIENT_CA",
                                                 help="admission: require client certificates (mTLS)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level (default: warnings only)."),
):
    """Run one service against an existing NATS (the distributed deployment: one process per
    service, e.g. one container each in deploy/compose).

    Replicas: run 'scheduler' twice or more -- one is active by a lease in NATS KV, the others
    stand by and take over within FEDSCHED_SCHEDULER_LEASE_TTL_S seconds. 'audit' and 'billing'
    are separate processes against a ClickHouse server; on the embedded chDB (no
    --clickhouse-url) only one process may open the data dir, so run 'writers' (both).

    With --topology, agents run the clusters of the file (--cluster picks them) with the backend
    each names, and admission checks every region name against the file; without it, agents
    split --nodes by the default topology and admission learns regions from inventories.
    """
    enable_for_process()  # one federation per process until it exits: services may freeze their heap (fedsched.gctune)
    _logging(verbose)
    name = "agents" if name == "agent" else name
    if name not in SERVICES:
        _fail(ValueError(f"unknown service {name!r}; one of {', '.join(SERVICES)}"))
    from fedapp.runtime import System, SystemOptions

    from fedapp.client import with_local_credentials

    settings = _settings(data_dir=data_dir, nats_url=with_local_credentials(nats_url, data_dir),
                         clickhouse_url=clickhouse_url, grpc_address=grpc_address,
                         policy_file=policy_file, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
    topo = _topology(topology, None) if topology is not None else None
    if topo is not None:
        for c in cluster:  # before connecting anywhere: an unknown --cluster names the known ones
            try:
                topo.cluster(c)
            except FedError as e:
                err.print(error_line("invalid setting:", f"--cluster {c}: {e.reason}"))
                raise typer.Exit(2) from e
    options = SystemOptions(settings=settings, policy=policy, services=_BUNDLES.get(name, (name,)), clusters=tuple(cluster), topology=topo,
                            nodes_csv=(nodes or _bundled("openb_node_list_gpu_node.csv")) if name == "agents" else None)

    async def main() -> None:
        system = System(options)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if not await _start_unless_stopped(system, stop):
            return
        try:
            console.print(f"fedsched {name} running on {redact(system.nats_url)}" +
                          (f", gRPC {system.grpc_target}" if name == "admission" else ""))
            _print_metrics(system)
            waiter = asyncio.create_task(system.failed.wait())
            await asyncio.wait({asyncio.create_task(stop.wait()), waiter}, return_when=asyncio.FIRST_COMPLETED)
            if system.failed.is_set():
                raise typer.Exit(1)
        finally:
            await system.stop()

    try:
        asyncio.run(main())
    except FedError as e:
        _fail(e)


# --------------------------------------------------------------------------- schema


@app.command()
def schema(
    cluster: str = typer.Option("", "--cluster", help="Render the replicated variant for this ClickHouse cluster."),
    database: str = typer.Option("fedsched", "--database", help="Database the DDL creates its tables in."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write here instead of printing."),
):
    """Print the ClickHouse DDL (all migrations), single-node or ON CLUSTER."""
    from fedsched.store import check_identifier, load_migrations, render_sql

    try:
        check_identifier("--database", database)
        if cluster:
            check_identifier("--cluster", cluster)
    except FedError as e:
        _fail(e)
    parts = [f"CREATE DATABASE IF NOT EXISTS {database}{' ON CLUSTER ' + cluster if cluster else ''};"]
    for m in load_migrations():
        parts.append(f"-- migration {m.version:04d}_{m.name}")
        parts.extend(s + ";" for s in render_sql(m.sql, database, cluster=cluster or None))
    text = "\n\n".join(parts) + "\n"
    if out:
        out.write_text(text)
    else:
        console.print(text, markup=False, highlight=False)


# --------------------------------------------------------------------------- replay


@app.command()
def replay(
    nodes: Optional[Path] = typer.Option(None, "--nodes", exists=True, dir_okay=False,
                                         help="Trace node list (openb format), split by the default topology. "
                                              "Default: the bundled openb GPU nodes."),
    pods: Optional[Path] = typer.Option(None, "--pods", exists=True, dir_okay=False,
                                        help="Trace pod list (openb format). Default: the bundled gpuspec33 pods."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Replay only the first N pods."),
    topology: Optional[Path] = typer.Option(None, "--topology", envvar="FEDSCHED_TOPOLOGY", exists=True,
                                            dir_okay=False, help=TOPOLOGY_HELP),

    load: float = typer.Option(1.0, "--load", min=0.001,
                               help="Arrival compression: submit times / LOAD, runtimes unchanged (1 = as recorded; "
                                    "the openb timeline alone keeps under 70 of 6212 GPUs busy)."),
    speed: float = typer.Option(100.0, "--speed", min=0.001,
                                help="Trace seconds per wall second while the system is busy (idle time is skipped)."),
    policy: str = typer.Option("federated", "--policy",
                               help="federated, local-only, least-loaded, cheapest or random."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir",
                                            help="Fresh or empty directory for this replay's NATS and ClickHouse data "
                                                 "(default: a new temporary directory, removed afterwards)."),
    report_json: Optional[Path] = typer.Option(None, "--report-json", help="Also write the report as JSON here."),
    nats_url: str = typer.Option("", "--nats-url", envvar="FEDSCHED_NATS_URL",
                                 help="Use this NATS instead of starting one in --data-dir."),
    clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                       help="Use this ClickHouse server instead of chDB in --data-dir."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1.0,
                                  help="Give up after this many wall seconds: the report covers what happened, "
                                       "and the exit code is 2."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress (a bar on a terminal, else a line every "
                                                              "3 s while the figures change)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", min=0, max=65535,
                                               help="Serve each service's Prometheus metrics during the replay on "
                                                    "consecutive ports from this one (0 = free ports); default off."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level (default: warnings only)."),
):
    """Replay a GPU cluster trace through the whole federation and print the outcome.

    Brings up the embedded system on --topology (default: the trace's nodes split into 3 regions x
    2 clusters, see `fedsched topology show`), submits
    every pod as a job through the gRPC API at its creation time, waits until each job finished,
    was rejected or is provably unplaceable, and prints a summary computed by SQL from ClickHouse.
    """
    enable_for_process()  # one federation per process until it exits: services may freeze their heap (fedsched.gctune)
    _logging(verbose)
    from fedapp.replay.driver import ReplayDriver, ReplayOptions, write_report
    from fedapp.replay.render import print_report, progress_display
    from services.scheduler.core import POLICY_NAMES

    if policy not in POLICY_NAMES:
        _fail(ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICY_NAMES)}"))
    cleanup = None
    if data_dir is None:
        cleanup = tempfile.mkdtemp(prefix="fedsched-replay-")
        data_dir = Path(cleanup)
    elif data_dir.exists() and any(data_dir.iterdir()):
        _fail(ValueError(f"--data-dir {data_dir} is not empty; a replay needs a fresh directory"))
    if topology is not None and nodes is not None:
        _fail(ValueError("--nodes and --topology do not go together: the topology names its clusters' node lists"))
    settings = _settings(data_dir=data_dir, nats_url=nats_url, clickhouse_url=clickhouse_url,
                         grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5,
                         subject_prefix=os.environ.get("FEDSCHED_SUBJECT_PREFIX", "fed"), schedule_interval_s=0.002,
                         metrics_port=metrics_port)
    options = ReplayOptions(nodes_csv=nodes or _bundled("openb_node_list_gpu_node.csv"),
                            pods_csv=pods or _bundled("openb_pod_list_gpuspec33.csv"), settings=settings, limit=limit,
                            speed=speed, policy=policy, timeout_s=timeout, load=load,
                            topology=_topology(topology, None) if topology is not None else None)
    if metrics_port:
        from fedsched.metrics import PORT_ORDER, metric_ports

        for name, port in metric_ports(metrics_port, PORT_ORDER).items():
            console.print(f"  metrics {name}: http://{settings.metrics_host}:{port}/metrics")
    try:
        with progress_display(console, enabled=console.is_terminal, quiet=quiet) as update:
            report = asyncio.run(ReplayDriver(options, on_progress=update).run())
    except FedError as e:
        _fail(e)
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
    print_report(console, report)
    if report_json:
        try:
            write_report(report, report_json)
        except OSError as e:
            _fail(OSError(f"cannot write the report to {report_json}: {e.strerror or e}"))
        console.print(f"report written to {report_json}")
    if report.get("timed_out"):
        err.print(error_line("timeout:", f"stopped after {timeout:g} s with jobs still open; the figures cover "
                                         f"only what happened (raise --timeout or --speed)"))
        raise typer.Exit(2)


# --------------------------------------------------------------------------- topology

topology_app = typer.Typer(help="The federation's topology (regions, zones, clusters, backends).",
                           no_args_is_help=True, add_completion=False)
app.add_typer(topology_app, name="topology")


@topology_app.command("show")
def topology_show(
    topology: Optional[Path] = typer.Option(None, "--topology", envvar="FEDSCHED_TOPOLOGY", exists=True,
                                            dir_okay=False, help=TOPOLOGY_HELP),
    nodes: Optional[Path] = typer.Option(None, "--nodes", help="Without --topology: the node list the default "
                                         "topology splits (default: the bundled openb nodes)."),
    output: str = typer.Option("yaml", "--output", "-o", help="yaml or json"),
):
    """Print the topology in force (validated) in a form --topology accepts back."""
    from fedsched.topology import dump_topology

    if output not in ("yaml", "json"):
        _fail(ValueError(f"--output must be yaml or json, got {output!r}"))
    topo = _topology(topology, nodes)
    sys.stdout.write(dump_topology(topo, output))


# --------------------------------------------------------------------------- sql


@app.command()
def sql(
    query: str = typer.Argument(..., help="A SELECT against database `fedsched` (tables: events, usage, decisions, "
                                          "inventory)."),
    data_dir: Path = typer.Option(Path(".fedsched"), "--data-dir", envvar="FEDSCHED_DATA_DIR",
                                  help="Data dir of the embedded store (while `fedsched up` holds it, the "
                                       "running system answers)."),
    nats_url: str = typer.Option("", "--nats-url", envvar="FEDSCHED_NATS_URL",
                                 help="Ask the running system over this NATS instead of opening the store."),
    clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                       help="Query this ClickHouse server (http://user:pw@host:8123) instead."),
    output: SqlOutput = typer.Option(SqlOutput.table, "--output", "-o",
                                     help="table (for people), json (for scripts), csv or tsv (a header row, "
                                          "then one line per row, quoted by the csv module; NULL empty, times "
                                          "ISO-8601 UTC ending in Z)"),
    token: str = typer.Option("", "--token", envvar="FEDSCHED_TOKEN", show_default=False,
                              help="For a running system: an admin's token (default: <FEDSCHED_DATA_DIR or "
                                   ".fedsched>/admin.token)."),
):
    """Run a read-only SQL query against the federation's ClickHouse store.

    Opens the embedded store in --data-dir, or the server at --clickhouse-url. While a
    `fedsched up` on --data-dir runs (it holds the embedded store), the query goes to it, found
    through the data dir, with the data dir's admin token (or --token); --nats-url asks a
    running system elsewhere. Writes, DDL and file/url table functions are refused; a query stops after
    55 s; at most 10,000 rows come back.
    """
    from fedapp.cli.sql import run_sql

    try:
        columns, rows, total, types = run_sql(query, data_dir=data_dir, nats_url=nats_url, clickhouse_url=clickhouse_url,
                                prefix=os.environ.get("FEDSCHED_SUBJECT_PREFIX", "fed"),
                                inbox_prefix=os.environ.get("FEDSCHED_INBOX_PREFIX", ""), token=token or None)
    except FedError as e:
        _fail(e)
    if total > len(rows):
        err.print(styled(("warning:", "yellow"), f" the answer has more than {len(rows)} rows; only the first "
                         f"{len(rows)} are shown (add LIMIT/OFFSET or aggregate)"))
    if output == "json":
        console.print_json(strict_json([dict(zip(columns, r)) for r in rows]))
        return
    if output in ("csv", "tsv"):  # straight to stdout: no console wrapping or styling
        delimited(columns, rows, sys.stdout, delimiter="," if output == "csv" else "\t", types=types)
        return
    table = Table(*columns)
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    console.print(table)


# --------------------------------------------------------------------------- job API

from fedapp.cli import admin as admin_commands  # noqa: E402  (registers tenants, quotas, approvals, policy)
from fedapp.cli import jobs as job_commands  # noqa: E402  (registers submit/jobs/job/explain/cancel/watch)

job_commands.register(app)
from fedapp.cli import ops as ops_commands  # noqa: E402  (registers clusters, status)

ops_commands.register(app)
admin_commands.register(app)

from fedapp.cli import web as web_commands  # noqa: E402  (registers web)
from fedapp.cli import reports as report_commands  # noqa: E402  (registers report)

report_commands.register(app)
web_commands.register(app)


def main() -> None:
    """Entry point of the ``fedsched`` script."""
    from fedapp.cli.jobs import with_optional_values

    try:
        app(args=with_optional_values(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
    except (FedError, OSError, UnicodeError) as e:  # the commands' own handlers missed it: still no traceback
        err.print(error_line("error:", _describe(e)))
        sys.exit(1)


def _describe(e: BaseException) -> str:
    """A one-line account of an error for people (file errors name the file)."""
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start})"
    return str(e) or type(e).__name__


if __name__ == "__main__":
    main()
