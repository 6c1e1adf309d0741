"""Settings for every service, from the environment (prefix ``FEDSCHED_``) and CLI flags.

The embedded default needs nothing: a ``nats-server`` child process and chDB on ``data_dir``.
Setting ``nats_url`` and/or ``clickhouse_url`` switches to external servers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Runtime settings (environment variable = ``FEDSCHED_`` + upper-case field name).

    Attributes:
        data_dir: where the embedded NATS (``nats/``) and chDB (``clickhouse/``) keep their data.
        nats_url: external NATS server(s), comma separated; empty = start the embedded one.
        nats_port: port of the embedded nats-server (0 = pick a free one).
        clickhouse_url: ClickHouse server over HTTP(S), e.g. ``http://user:pw@host:8123``;
            empty = embedded chDB on ``data_dir/clickhouse``.
        clickhouse_database: database holding the tables (created by the migrations).
        clickhouse_path: chDB data path; default ``data_dir/clickhouse`` (chDB allows one path
            per process, so tests share one path and isolate by database).
        clickhouse_user / clickhouse_password: server credentials (the URL's ``user:pw@`` wins).
        clickhouse_ca_cert: CA bundle for an ``https://`` server; clickhouse_verify: check its
            certificate (default on).
        clickhouse_cluster: ClickHouse cluster name for the replicated schema (Distributed over
            Replicated tables, ``ON CLUSTER``); empty = single node.
        clickhouse_ttl_days: days to keep rows of high-volume tables, e.g.
            ``{"events": 400, "decisions": 90, "inventory": 30}`` (JSON in the environment);
            absent = forever. Applied at every start.
        subject_prefix: first token of every subject and the stream-name prefix; lets several
            federations (or test runs) share one NATS.
        grpc_address: where admission listens (``host:port``; port 0 = pick a free one).
        otel_exporter: ``none`` (default), ``console`` or ``otlp`` (needs the ``otlp`` extra).
        stream_max_age_s: how long JetStream keeps events (seconds).
        duplicate_window_s: JetStream duplicate-detection window for ``Nats-Msg-Id`` (seconds).
        heartbeat_interval_s: agents' heartbeat period (wall seconds).
        stale_after_s: a cluster whose newest heartbeat or inventory was stored longer ago than
            this (wall seconds) is excluded from scheduling, and its placed and running attempts
            are moved elsewhere (declared lost, reason ``cluster_lost``).
        cluster_gone_after_s: a cluster silent for longer than this (wall seconds; default 1 h,
            above ``stale_after_s``) is taken as decommissioned: ``fedsched clusters`` no longer
            lists it and ``fedsched status`` no longer reports it down (nor exits 1 for it); a
            message from it brings it back.
        schedule_interval_s: the scheduler's cycle period when something changed (wall seconds).
        reclaim_after_s: a placement its agent has not started after this long (wall seconds)
            is taken back and placed again elsewhere.
        writer_ack_wait_s: JetStream ack wait of the audit and billing consumers (wall
            seconds): a batch delivered and not acknowledged is delivered again after this long.
            A writer reports progress on its batch every quarter of it while it writes
            (:class:`fedsched.bus.DurableConsumer`), so a slow insert keeps its batch and the
            wait only bounds recovery: a batch a writer killed -9 had fetched -- or one a
            restarted NATS (the embedded one stops with the system) forgot the hand-back of --
            is written by its successor within about this long. Default 5 s; an existing
            durable with another ack wait is updated when its consumer subscribes.
        unschedulable_timeout_s: a job that no cluster could hold even empty (unplaceable) for
            this long (business seconds; default 24 h) is ended, CANCELLED with reason
            ``unschedulable_timeout``.
        price_catalog: optional YAML price catalog; the bundled one is used when empty.
        js_domain: JetStream domain to address (needed when services reach JetStream through
            a leaf node; "" = none).
        inbox_prefix: reply-subject prefix of this process's connections (give each NATS user
            its own so permissions keep replies private; "" = ``_INBOX``).
        stream_replicas: replicas of the streams (and of the scheduler lease's KV bucket) when
            fedsched creates them (existing streams keep what an operator set); 3 on a
            three-node NATS cluster survives the loss of any one node.
        scheduler_lease_ttl_s: the scheduler lease's duration (wall seconds,
            :mod:`fedsched.lease`): a standby scheduler takes over this long after the active
            one's last renewal (renewals every third of it).
        policy_file: governance policy stored at first start when NATS holds none (default: the
            bundled ``fedsched/catalog/policy.yaml``); later changes: ``fedsched policy apply``.
        grpc_max_request_bytes: largest gRPC request admission accepts (RESOURCE_EXHAUSTED above).
        tls_cert / tls_key: PEM server certificate and key: serve gRPC over TLS.
        tls_client_ca: PEM CA bundle: require client certificates signed by it (mTLS).
        admin_token_file: where the bootstrap admin token is kept (default
            ``data_dir/admin.token``). At first start admission uses the token already in this
            file if there is one (e.g. a mounted Kubernetes Secret), else it makes one and writes
            it there; deployments put the file on a volume that survives restarts.
        metrics_port: serve each service's Prometheus metrics (:mod:`fedsched.metrics`) on
            consecutive ports from this one, in the order admission, scheduler, audit, billing,
            agents (the services this process runs; one service per process = this port);
            0 = a free port each; None (default, unset) = no metrics endpoints.
        metrics_host: address the metrics endpoints bind (``0.0.0.0`` in containers).
        snapshot_every_s: the scheduler and admission write a restart checkpoint
            (:mod:`fedsched.snapshots`) this many wall seconds after the last one, or after
            ``snapshot_every_events`` events, and start from the newest one plus the stream after
            it; 0 = never (a start reads the whole stream).
        snapshot_every_events: see ``snapshot_every_s``.
        max_jobs_per_cycle: queued shards one scheduler cycle hands to ``decide`` at most
            (default 500, > 0; environment ``FEDSCHED_MAX_JOBS_PER_CYCLE``); the rest wait for the
            next cycle, one ``schedule_interval_s`` later, so a burst of submissions is placed in
            a stream of short cycles that publish as they go (issue 15; the scheduler's
            :meth:`~services.scheduler.service.SchedulerService.window`). Lower it when cycles
            take too long on a large view; raise it when many small jobs queue behind each other.
        retain_ended_jobs: ended jobs admission keeps in memory (older ones are read from its
            ended-jobs KV bucket); the scheduler keeps a tenth of it (at least 100) as whole
            entries and tombstones for twenty times as many.
    """

    model_config = SettingsConfigDict(env_prefix="FEDSCHED_", extra="ignore")

    data_dir: Path = Field(default=Path(".fedsched"))
    nats_url: str = ""
    nats_port: int = Field(default=0, ge=0, le=65535)
    clickhouse_url: str = ""
    clickhouse_database: str = "fedsched"
    clickhouse_path: Path | None = None
    clickhouse_user: str = ""
    clickhouse_password: SecretStr = SecretStr("")
    clickhouse_ca_cert: Path | None = None
    clickhouse_verify: bool = True
    clickhouse_cluster: str = ""
    clickhouse_ttl_days: dict[str, int] = Field(default_factory=dict)
    subject_prefix: str = "fed"
    grpc_address: str = "127.0.0.1:50051"
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    stream_max_age_s: float = Field(default=30 * 86400, gt=0)
    duplicate_window_s: float = Field(default=120, gt=0)
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=10.0, gt=0)
    cluster_gone_after_s: float = Field(default=3600.0, gt=0)
    schedule_interval_s: float = Field(default=0.02, gt=0)
    reclaim_after_s: float = Field(default=30.0, gt=0)
    writer_ack_wait_s: float = Field(default=5.0, gt=0)
    unschedulable_timeout_s: float = Field(default=86400.0, gt=0)
    price_catalog: Path | None = None
    js_domain: str = ""
    inbox_prefix: str = ""
    stream_replicas: int = Field(default=1, ge=1, le=5)
    scheduler_lease_ttl_s: float = Field(default=5.0, gt=0.1, le=600)
    policy_file: Path | None = None
    grpc_max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    admin_token_file: Path | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    snapshot_every_s: float = Field(default=60.0, ge=0)
    snapshot_every_events: int = Field(default=200_000, ge=1)
    retain_ended_jobs: int = Field(default=10_000, ge=1)
    max_jobs_per_cycle: int = Field(default=500, gt=0)
    metrics_host: str = "127.0.0.1"

    @field_validator("subject_prefix")
    @classmethod
    def _prefix_is_a_token(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", value):
            raise ValueError("subject_prefix must be 1-16 lower-case letters, digits or '_', starting with a letter")
        return value

    @field_validator("grpc_address")
    @classmethod
    def _address_is_host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"grpc_address must be host:port with a port 0-65535 (0 = any free one), got {value!r}")
        return value

    @field_validator("clickhouse_cluster")
    @classmethod
    def _cluster_is_identifier(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", value):
            raise ValueError("clickhouse_cluster must be an identifier")
        return value

    @field_validator("clickhouse_database")
    @classmethod
    def _database_is_identifier(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", value):
            raise ValueError("clickhouse_database must be a lower-case identifier")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> "Settings":
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        return self

    @property
    def admin_token_path(self) -> Path:
        """Where the system keeps its bootstrap admin token (mode 0600): ``admin_token_file``,
        else ``data_dir/admin.token``."""
        return Path(self.admin_token_file) if self.admin_token_file else Path(self.data_dir) / "admin.token"

    @property
    def embedded_nats(self) -> bool:
        """True when the system must start its own nats-server."""
        return not self.nats_url

    @property
    def embedded_clickhouse(self) -> bool:
        """True when the store is chDB in this process."""
        return not self.clickhouse_url
