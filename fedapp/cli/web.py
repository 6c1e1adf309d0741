"""``fedsched web``: the web console as its own service, a gRPC client of admission.

The console holds no rights: each page calls the API with the signed-in user's token. Events,
cost and the usage charts come from ClickHouse as ``fedsched report`` reads it: a server
(``--clickhouse-url``) or the running system's query service over NATS (``--nats-url``, with an
admin's token for the store, ``--store-token``); without either, those sections say they are not
connected.
"""

from __future__ import annotations

import asyncio
import signal

import typer

from fedapp.cli.jobs import DEFAULT_SERVER, GRPC_ENV, server_address
from fedapp.cli.text import console, err, error_line
from fedsched.errors import FedError


def register(app: typer.Typer) -> None:
    """Add ``web`` to ``app``."""

    @app.command()
    def web(
        grpc_target: str = typer.Option("", "--server", "--grpc", show_default=False, callback=lambda v: server_address(v),
                                        help=f"Admission gRPC address, host:port (default: {GRPC_ENV}, else "
                                             f"{DEFAULT_SERVER}, as for the API commands; --grpc is the same option); TLS from "
                                             "FEDSCHED_TLS_CA / FEDSCHED_TLS_CLIENT_CERT / FEDSCHED_TLS_CLIENT_KEY."),
        port: int = typer.Option(8080, "--port", envvar="FEDSCHED_WEB_PORT", min=0, max=65535,
                                 help="Port to serve on (0 = any free port)."),
        host: str = typer.Option("127.0.0.1", "--host", envvar="FEDSCHED_WEB_HOST", help="Address to listen on."),
        nats_url: str = typer.Option("", "--nats-url", envvar="FEDSCHED_NATS_URL",
                                     help="Read events and usage through the running system's query service here."),
        prefix: str = typer.Option("fed", "--prefix", envvar="FEDSCHED_SUBJECT_PREFIX",
                                   help="Subject prefix of the running system (with --nats-url)."),
        store_token: str = typer.Option("", "--store-token", envvar="FEDSCHED_STORE_TOKEN", show_default=False,
                                        help="With --nats-url: an admin's token for store queries (when neither "
                                             "this nor FEDSCHED_STORE_TOKEN is set: FEDSCHED_TOKEN, else "
                                             "<FEDSCHED_DATA_DIR or .fedsched>/admin.token)."),
        clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                           help="Read events and usage from this ClickHouse server instead."),
        database: str = typer.Option("fedsched", "--database", envvar="FEDSCHED_CLICKHOUSE_DATABASE",
                                     help="ClickHouse database of the federation's tables."),
        chart_refresh: float = typer.Option(30.0, "--chart-refresh", min=1.0,
                                            help="Seconds between refreshes of the usage charts."),
    ):
        """Serve the web console (jobs, a job's attempts/explain/events/cost, queues, clusters,
        approvals, policy versions with diffs, live usage charts) until Ctrl-C."""
        from pathlib import Path

        from fedapp.cli.jobs import tls_from_env
        from fedapp.cli.reports import nats_query, store_query
        from fedapp.client import resolve_token, with_local_credentials
        from fedapp.web import ApiConfig, Reads, WebConfig, start_web

        try:
            reads = None
            if clickhouse_url:
                reads = Reads(store_query(Path("."), clickhouse_url, database), database)
            elif nats_url:
                reads = Reads(nats_query(with_local_credentials(nats_url), prefix, resolve_token(store_token or None)),
                              database)
        except (FedError, ValueError) as e:
            err.print(error_line("error:", e))
            raise typer.Exit(2) from None
        config = WebConfig(api=ApiConfig(grpc_target, tls_from_env()), reads=reads, chart_refresh_s=chart_refresh)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            server = await start_web(config, host, port)
            source = ("ClickHouse " + clickhouse_url.split("@")[-1] if clickhouse_url else
                      f"the system at {nats_url}" if nats_url else "not connected (--nats-url / --clickhouse-url)")
            console.print(f"web console: {server.url} (API {grpc_target}; events, cost and charts: {source}). "
                          f"Ctrl-C stops.", highlight=False)
            try:
                await stop.wait()
            finally:
                await server.stop()

        try:
            asyncio.run(main())
        except OSError as e:
            err.print(error_line("error:", f"cannot serve on {host}:{port}: {e}"))
            raise typer.Exit(1) from None
