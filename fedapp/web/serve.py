"""Serving the console beside a running :class:`~fedapp.runtime.System` (``fedsched up``)."""

from __future__ import annotations

from fedapp.runtime import System
from fedapp.web.api import ApiConfig
from fedapp.web.app import WebConfig, WebServer, start_web
from fedapp.web.reads import Reads
from fedsched.errors import ValidationError


async def serve_system(system: System, host: str = "127.0.0.1", port: int = 8080, *,
                       chart_refresh_s: float = 30.0, jobs_refresh_s: float = 10.0) -> WebServer:
    """Start the console for ``system``: a gRPC client of its admission (plaintext, on the
    address it serves) and, when this process holds the ClickHouse store, reads through the
    store's read-only handle (:meth:`System.read_query`).

    Raises:
        ValidationError: admission serves TLS (use ``fedsched web`` with the CA, and with a
            client certificate for mTLS).
        OSError: ``host:port`` cannot be bound.
    """
    if system.settings.tls_cert:
        raise ValidationError("web", "admission serves TLS here; run the console with `fedsched web --grpc ... "
                                     "--tls-ca ...` instead")
    reads = Reads(system.read_query, system.settings.clickhouse_database) if system.sync_store is not None else None
    config = WebConfig(api=ApiConfig(system.grpc_target), reads=reads, chart_refresh_s=chart_refresh_s,
                       jobs_refresh_s=jobs_refresh_s)
    return await start_web(config, host, port)
