"""Contract fixtures: the identical suite runs on every ClickHouse engine available.

``engine`` is parametrised: ``chdb`` (always: the embedded engine in this process) and
``server`` (a ClickHouse server: ``FEDSCHED_CLICKHOUSE_URL`` if set, else a testcontainers
``ClickHouseContainer`` when a Docker daemon answers; skipped with the reason otherwise).

Each engine can be made unavailable and available again -- honestly, with the real client:

* chDB: every store the engine opened has its client handle closed (clickhouse-connect then
  fails every call with "The client has been closed", translated to ``UnavailableError``), and
  reopening a handle is refused while the engine is "down" (as if the data dir were locked by
  another process); when it is "up" the store's next call opens a new real handle on the path.
* server: clients go through a :class:`~tests.contract.proxy.TcpProxy`; "down" closes the
  proxy's listening socket and every open connection (connection refused/reset), "up" listens
  again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest

from fedsched.errors import UnavailableError
from fedsched.store import Store, open_store
from tests.builders import unique
from tests.contract.proxy import TcpProxy


def _docker_problem() -> str:
    """'' if a Docker daemon answers, else why not."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return ""
    except Exception as e:  # noqa: BLE001 - any failure means: no Docker here
        return f"no Docker daemon ({type(e).__name__}: {str(e)[:120]})"


@pytest.fixture(scope="session")
def clickhouse_server():
    """(url, '') of a ClickHouse server, or (None, reason)."""
    url = os.environ.get("FEDSCHED_CLICKHOUSE_URL", "")
    if url:
        yield url, ""
        return
    problem = _docker_problem()
    if problem:
        yield None, f"no ClickHouse server: FEDSCHED_CLICKHOUSE_URL is not set and {problem}"
        return
    from testcontainers.community.clickhouse import ClickHouseContainer

    with ClickHouseContainer("clickhouse/clickhouse-server:latest") as ch:
        host, port = ch.get_container_host_ip(), ch.get_exposed_port(8123)
        yield f"http://{ch.username}:{ch.password}@{host}:{port}", ""


@dataclass
class Engine:
    """One ClickHouse engine under test (see the module docstring)."""

    kind: str
    chdb_path: Path | None = None
    url: str = ""
    proxy: TcpProxy | None = None
    available: bool = True
    stores: list[Store] = field(default_factory=list)

    def open(self, database: str | None = None) -> Store:
        """A migrated store on a fresh (or the named) database, on its own client."""
        database = database or unique("db")
        if self.kind == "chdb":
            import clickhouse_connect

            path = str(self.chdb_path.resolve())

            def connect():
                if not self.available:
                    raise UnavailableError("embedded ClickHouse is locked (simulated outage)")
                return clickhouse_connect.get_client(interface="chdb", path=path)

            store = Store(connect(), database, embedded=True, reopen=connect, read_client=connect)
            store.migrate()
        else:
            store = open_store(url=self.proxied_url, database=database)
        self.stores.append(store)
        return store

    @property
    def proxied_url(self) -> str:
        u = urlparse(self.url)
        auth = f"{u.username}:{u.password}@" if u.username else ""
        return f"{u.scheme}://{auth}127.0.0.1:{self.proxy.port}{u.path}"

    def down(self) -> None:
        """Make the engine unavailable to every store it opened."""
        self.available = False
        if self.kind == "chdb":
            for s in self.stores:
                s.close()
        else:
            self.proxy.stop()

    def up(self) -> None:
        """Make it available again."""
        self.available = True
        if self.proxy is not None:
            self.proxy.start()


@pytest.fixture(params=["chdb", "server"])
def engine(request, chdb_path):
    if request.param == "chdb":
        eng = Engine("chdb", chdb_path=chdb_path)
        yield eng
        eng.available = True
        return
    url, reason = request.getfixturevalue("clickhouse_server")
    if url is None:
        pytest.skip(reason)
    u = urlparse(url)
    proxy = TcpProxy(u.hostname or "127.0.0.1", u.port or 8123)
    proxy.start()
    eng = Engine("server", url=url, proxy=proxy)
    yield eng
    proxy.close()


# ---------------------------------------------------------------------------- execution backends
#
# ``backend_under_test`` runs tests/contract/test_backend_contract.py on every execution backend
# (services/inventory/backend.py). Here: ``trace`` on a FakeClock-driven business clock. The Slurm
# and Kubernetes issues add a harness class and a param below; a harness whose cluster is not
# reachable skips with the reason (as ``engine`` does for ClickHouse servers).


class BackendHarness:
    """How the contract suite drives one backend.

    Attributes:
        backend: the :class:`~services.inventory.backend.Backend` under test.
        clock: the business clock an agent on that cluster uses (``time()`` in POSIX s).
        nodes: names of (at least two) healthy GPU nodes of one card model on its cluster.
        card_model: their canonical card model.
        gpus_per_node: whole GPUs each of them has.
        keeps_logs: False for a backend that keeps no logs (its ``logs`` raises NoLogsKept).
    """

    backend = None
    clock = None
    keeps_logs = True
    nodes: tuple[str, ...] = ()
    card_model: str = ""
    gpus_per_node: int = 0
    #: cluster seconds per second of a job's ``runtime_s`` (a real cluster runs jobs shortened)
    time_scale: float = 1.0
    #: seconds a real cluster's recorded run time may exceed the workload's (launching the step)
    start_overhead_s: float = 0.0
    #: capability -> why this backend's harness cannot offer it (the case is skipped with it)
    cannot: dict[str, str] = {}

    def require(self, capability: str) -> None:
        """Skip the calling case, with the reason, when this harness cannot offer ``capability``."""
        if capability in self.cannot:
            pytest.skip(self.cannot[capability])

    async def close(self) -> None:
        """Clean up what the case left on the cluster."""

    def job(self, *, runtime_s: float, exit_code: int = 0, workers: int = 1):
        """A JobSpec whose workload runs ``runtime_s`` seconds and exits ``exit_code`` (trace:
        annotations; a real backend: a workload command such as ``sleep N; exit C``)."""
        raise NotImplementedError

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` of the cluster's time pass (trace: the business clock; real: sleep)."""
        raise NotImplementedError

    def fail_node(self, node: str) -> None:
        """Make ``node`` fail (trace: drill; a real cluster: NotReady/DOWN by the harness's means)."""
        raise NotImplementedError

    async def statuses(self, until, *, timeout_s: float = 10.0) -> list:
        """Drain ``backend.ready()`` until ``until(collected)`` holds or ``timeout_s`` wall
        seconds pass; returns what was collected (the caller asserts on it)."""
        import asyncio
        import time

        got: list = []
        deadline = time.monotonic() + timeout_s
        while True:
            got.extend(self.backend.ready())
            if until(got) or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.01)


class TraceHarness(BackendHarness):
    """The trace backend on a FakeClock: time passes only in :meth:`advance`. It runs no
    workload, so it keeps no logs."""

    keeps_logs = False

    def __init__(self) -> None:
        from services.inventory.agent import TraceBackend
        from tests.builders import T4, FakeClock, nodes

        self.clock = FakeClock()
        self.card_model = T4
        self.gpus_per_node = 8
        node_list = nodes("n", 3, gpus=self.gpus_per_node, model=T4)
        self.nodes = tuple(n.name for n in node_list)
        self.backend = TraceBackend(node_list, clock=self.clock)

    def job(self, *, runtime_s: float, exit_code: int = 0, workers: int = 1):
        from tests.builders import spec

        ann = {"trace.runtime_s": str(runtime_s)}
        if exit_code:
            ann["trace.outcome"] = "failed"
        return spec(gpus=1, workers=workers, annotations=ann)

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def fail_node(self, node: str) -> None:
        self.backend.set_node_health(node, False)


class KubernetesHarness(BackendHarness):
    """The ``kubernetes`` backend with the real client (``kubernetes_asyncio``) over HTTP against
    the emulated cluster of tests/k8s_cluster.py (API server + fake kubelet/Job controller) on a
    FakeClock: pods run and end only as :meth:`advance` moves the cluster's clock."""

    namespace = "fedsched-test"

    def __init__(self) -> None:
        from tests.builders import T4, FakeClock

        self.clock = FakeClock()
        self.card_model = T4
        self.gpus_per_node = 8
        self.nodes = ("gpu-0", "gpu-1", "gpu-2")
        self.cluster = None

    async def setup(self, extra_nodes: tuple[dict, ...] = (), **options) -> None:
        """Start the emulated cluster (the harness's nodes + ``extra_nodes``, v1.Node dicts) and a
        backend on it (``options``: :class:`~services.inventory.kubernetes.KubeOptions` fields)."""
        from services.inventory.kubernetes import KubeOptions, KubernetesBackend
        from tests.k8s_cluster import EmulatedCluster, gpu_node

        nodes = [gpu_node(n, gpus=self.gpus_per_node) for n in self.nodes] + list(extra_nodes)
        self.cluster = EmulatedCluster(self.clock.time, nodes)
        await self.cluster.__aenter__()
        options.setdefault("request_timeout_s", 2.0)
        self.backend = KubernetesBackend(KubeOptions(namespace=self.namespace, configuration=self.cluster.configuration(),
                                                     **options), clock=self.clock)

    async def teardown(self) -> None:
        await self.backend.close()
        await self.cluster.__aexit__(None, None, None)

    def job(self, *, runtime_s: float, exit_code: int = 0, workers: int = 1):
        from fedsched.workload import Workload
        from tests.builders import spec

        wl = Workload(image="busybox:1.36", command=("sh", "-c", f"sleep {runtime_s:g}; exit {exit_code}"))
        return spec(gpus=1, workers=workers, workload=wl)

    async def advance(self, seconds: float) -> None:
        # the cluster catches up first (pods of Jobs just created are started at the current
        # time, as the trace backend starts an attempt at launch), then time passes
        await self.cluster.kubelet.sync()
        await self.cluster.kubelet.sync()
        self.clock.advance(seconds)
        await self.cluster.kubelet.sync()

    def fail_node(self, node: str) -> None:
        self.cluster.set_ready(node, False)


class RealKubernetesHarness(KubernetesHarness):
    """The same suite on a real cluster: ``FEDSCHED_K8S_CONTEXT`` (a kubeconfig context) or
    ``KUBECONFIG``; namespace ``FEDSCHED_K8S_NAMESPACE`` (default ``fedsched-test``, must exist and
    the credentials must allow what deploy/k8s/region-agent.yaml grants). The cluster needs >= 3
    Ready nodes with ``nvidia.com/gpu`` and the ``nvidia.com/gpu.product`` label; time passes for
    real; node failure cannot be caused (that case skips)."""

    async def setup(self) -> None:
        import os

        from fedsched.clock import SystemClock
        from services.inventory.kubernetes import KubeOptions, KubernetesBackend

        context = os.environ.get("FEDSCHED_K8S_CONTEXT")
        if not context and not os.environ.get("KUBECONFIG"):
            pytest.skip("no real Kubernetes cluster: set FEDSCHED_K8S_CONTEXT (a kubeconfig context) or KUBECONFIG")
        self.clock = SystemClock()
        self.namespace = os.environ.get("FEDSCHED_K8S_NAMESPACE", "fedsched-test")
        self.backend = KubernetesBackend(KubeOptions(namespace=self.namespace, context=context), clock=self.clock)
        inv = [n for n in await self.backend.inventory() if n.healthy and n.gpus and not n.unschedulable]
        if len(inv) < 3:
            await self.backend.close()
            pytest.skip(f"the cluster has {len(inv)} Ready GPU nodes; the suite needs 3")
        self.nodes = tuple(n.name for n in inv[:3])
        self.card_model = inv[0].card_model
        self.gpus_per_node = inv[0].gpus

    async def teardown(self) -> None:
        for o in await self.backend.list_attempts():
            await self.backend.stop(o.key, "test teardown")
        await self.backend.close()

    async def advance(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(seconds)

    def fail_node(self, node: str) -> None:
        pytest.skip("a real cluster's node cannot be failed by the test")


class SlurmHarness(BackendHarness):
    """:class:`~services.inventory.slurm.SlurmBackend` on the session's real one-node Slurm
    (``slurm_cluster``). Jobs run ``sleep`` for ``runtime_s x time_scale`` wall seconds; every
    binding names the one node (a gang = several tasks on it). A node failure cannot be shown on
    one node without also ending the other attempts the case expects to survive: that case is
    skipped here and covered in tests/integration/test_slurm_backend.py (``state=down`` ->
    NODE_FAIL, ``state=drain`` -> unschedulable)."""

    time_scale = 0.05
    start_overhead_s = 3.0  # Slurm's start_time is the allocation; slurmd starts the script 1-2 s later
    cannot = {"node_failure": "one Slurm node here (Debian slurmd has no multiple-slurmd support): failing it "
                              "ends every attempt, not only the gang's; see test_slurm_backend.py"}

    def __init__(self, cluster, out_dir) -> None:
        from fedsched.naming import canonical_card_model
        from fedsched.clock import SystemClock
        from services.inventory.slurm import SlurmConfig, SlurmBackend

        self.cluster = cluster
        self.clock = SystemClock()
        self.card_model = canonical_card_model("a100")
        self.gpus_per_node = cluster.gpus["a100"]
        self.nodes = (cluster.node,) * 3
        self.backend = SlurmBackend(SlurmConfig(
            partition=cluster.partition, output_dir=str(out_dir), conf=cluster.env["SLURM_CONF"],
            env={"PATH": cluster.env["PATH"]}, poll_s=0.2, jobcomp_log=str(cluster.dir / "jobcomp.log")),
            clock=self.clock)

    def job(self, *, runtime_s: float, exit_code: int = 0, workers: int = 1):
        from fedsched.workload import Workload
        from tests.builders import spec

        script = f"echo started; sleep {runtime_s * self.time_scale:.2f}; exit {exit_code}"
        return spec(gpus=1, workers=workers, workload=Workload(image="ignored", command=("/bin/sh", "-c", script)))

    async def advance(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(seconds * self.time_scale)

    async def close(self) -> None:
        import json

        from services.inventory.slurm_json import parse_jobs

        await self.backend.close()
        doc = json.loads(self.cluster.run("squeue", "--json").stdout)
        live = [str(j.job_id) for j in parse_jobs(doc) if j.tag is not None and not j.finished]
        if live:
            self.cluster.run("scancel", *live, check=False)


BACKEND_HARNESSES = {"trace": TraceHarness, "kubernetes": KubernetesHarness, "kubernetes-real": RealKubernetesHarness,
                     "slurm": SlurmHarness}


@pytest.fixture(params=sorted(BACKEND_HARNESSES))
async def backend_under_test(request, tmp_path):
    """One harness per execution backend (see :class:`BackendHarness`): ``slurm`` needs the
    session's ``slurm_cluster`` (skipped with its reason when Slurm cannot run here); harnesses
    with a ``setup``/``teardown`` (a cluster to start) get them awaited around the test, the
    others :meth:`BackendHarness.close` after it."""
    if request.param == "slurm":
        h = SlurmHarness(request.getfixturevalue("slurm_cluster"), tmp_path / "slurm-out")
    else:
        h = BACKEND_HARNESSES[request.param]()
    if hasattr(h, "setup"):
        await h.setup()
    yield h
    if hasattr(h, "teardown"):
        await h.teardown()
    else:
        await h.close()


@pytest.fixture
async def kube():
    """An async factory ``await kube(extra_nodes=(), **KubeOptions fields)`` -> a started
    :class:`KubernetesHarness` (emulated cluster); every one made is torn down after the test."""
    made: list[KubernetesHarness] = []

    async def make(extra_nodes: tuple[dict, ...] = (), **options) -> KubernetesHarness:
        h = KubernetesHarness()
        await h.setup(extra_nodes, **options)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.teardown()
