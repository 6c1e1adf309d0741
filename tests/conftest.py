"""Shared fixtures: a real nats-server per test session, a real chDB store, fresh names per test.

Fixture chain (nats.py style): ``nats_server`` (session, free port, own data dir) -> ``bus``
(per test, its own subject prefix so streams never collide) ; ``chdb_path`` (session: chDB
allows one data path per process) -> ``store`` (per test, its own database).
``FEDSCHED_CLICKHOUSE_URL`` switches ``store`` to a ClickHouse server.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedsched.bus import Bus
from fedsched.natsd import EmbeddedNats
from fedsched.store import open_store
from tests.builders import DATA, unique

@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(nats_server.url, unique("t"), name="test")
    await b.ensure_streams()
    yield b
    await b.close()


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chdb") / "clickhouse"


@pytest.fixture
def store(chdb_path):
    url = os.environ.get("FEDSCHED_CLICKHOUSE_URL", "")
    return open_store(url=url, chdb_path=None if url else chdb_path, database=unique("db"))


@pytest.fixture
def trace_nodes() -> Path:
    return DATA / "openb_node_list_gpu_node.csv"


@pytest.fixture
def trace_pods() -> Path:
    return DATA / "openb_pod_list_gpuspec33.csv"
