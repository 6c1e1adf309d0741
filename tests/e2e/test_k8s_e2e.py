"""End to end with a Kubernetes cluster: a topology where eu-west-1's cluster is ``backend:
kubernetes`` (the emulated API server of tests/k8s_cluster.py, reached through a kubeconfig file
and context as a real cluster is) and us-east-1's is ``trace``. A generated pod list is replayed
through the embedded system: the jobs placed on the Kubernetes cluster are created there as
indexed Jobs, their starts and ends come back from the pod watch (the fake kubelet runs each pod
for the job's trace runtime on the replay clock), and billing closes them like the trace ones."""

from __future__ import annotations

import time

import pytest

from fedapp import topology as fedapp_topology
from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedsched.settings import Settings
from fedsched.topology import dump_topology, load_topology, parse_topology
from tests.builders import unique
from tests.k8s_cluster import EmulatedCluster, gpu_node

pytestmark = pytest.mark.e2e

PODS = 24
NAMESPACE = "fedsched-jobs"
TOPOLOGY = {
    "regions": [{"name": "eu-west-1", "zones": ["eu-west-1a"]}, {"name": "us-east-1", "zones": ["us-east-1a"]}],
    "clusters": [
        {"name": "eu-west-1-k8s", "region": "eu-west-1", "zone": "eu-west-1a", "backend": "kubernetes",
         "kubernetes": {"kubeconfig": "kubeconfig.yaml", "context": "emulated", "namespace": NAMESPACE}},
        {"name": "us-east-1-a", "region": "us-east-1", "zone": "us-east-1a", "backend": "trace",
         "trace": {"nodes": "us-nodes.csv"}},
    ],
}
KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: emulated
  cluster: {{server: "{url}"}}
users:
- name: agent
  user: {{token: not-checked-by-the-emulator}}
contexts:
- name: other
  context: {{cluster: emulated, user: agent, namespace: wrong}}
- name: emulated
  context: {{cluster: emulated, user: agent}}
current-context: other
"""


def _pods_csv() -> str:
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
            "scheduled_time"]
    for i in range(PODS):
        start = i * 20
        rows.append(f"k8s-pod-{i:03d},4000,8192,1,1000,T4,LS,Succeeded,{start},{start + 300 + 10 * i},{start}")
    return "\n".join(rows) + "\n"


class _LateClock:
    """The emulated cluster's clock: the replay's business clock once the agent's backend is
    built with it (the replay creates its clock when it starts), the system clock before."""

    def __init__(self) -> None:
        self.clock = None

    def __call__(self) -> float:
        return self.clock.time() if self.clock is not None else time.time()


@pytest.fixture(scope="module")
async def replayed(nats_server, chdb_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s")
    (root / "us-nodes.csv").write_text("sn,cpu_milli,memory_mib,num_gpu,gpu,model\n"
                                       + "".join(f"us-node-{i},64000,262144,,8,T4\n" for i in range(2)))
    (root / "pods.csv").write_text(_pods_csv())
    clock = _LateClock()
    async with EmulatedCluster(clock, [gpu_node(f"eu-gpu-{i}", gpus=8, zone="eu-west-1a") for i in range(2)]) as k8s:
        (root / "kubeconfig.yaml").write_text(KUBECONFIG.format(url=k8s.server.url))
        path = root / "topology.yaml"
        path.write_text(dump_topology(parse_topology(TOPOLOGY)))
        topo = load_topology(path)
        real = fedapp_topology.BACKEND_FACTORIES["kubernetes"]

        def factory(entry, topo_, cache, business_clock):
            clock.clock = business_clock  # the cluster's kubelet runs pods on the replay clock
            return real(entry, topo_, cache, business_clock)

        settings = Settings(data_dir=root / "data", nats_url=nats_server.url, subject_prefix=unique("k8"),
                            clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                            heartbeat_interval_s=0.5, schedule_interval_s=0.002)
        driver = ReplayDriver(ReplayOptions(nodes_csv=root / "unused.csv", pods_csv=root / "pods.csv",
                                            settings=settings, timeout_s=150, topology=topo))
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(fedapp_topology.BACKEND_FACTORIES, "kubernetes", factory)
            report = await driver.run()
        from fedsched.store import open_store

        store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)
        yield report, store, k8s


async def test_jobs_on_the_kubernetes_cluster_run_as_jobs_and_are_billed(replayed):
    report, store, k8s = replayed
    jobs = report["jobs"]
    assert jobs["submitted"] == PODS and jobs["rejected"] == 0, report["rejected_reasons"]
    assert jobs["finished"] == PODS and not report["timed_out"], report
    db = store.database
    placed = {r[0]: r[1] for r in store.query(
        f"SELECT cluster, groupArray(job_id) FROM {db}.events WHERE type = 'job.placed' GROUP BY cluster").rows}
    on_k8s = set(placed.get("eu-west-1-k8s", []))
    assert on_k8s and placed.get("us-east-1-a")
    # every placement there became an indexed Job in the context's cluster and namespace
    created = [p for v, p in k8s.server.requests if v == "POST" and p.endswith(f"/namespaces/{NAMESPACE}/jobs")]
    assert len(created) >= len(on_k8s)
    finished = {r[0]: (r[1], r[2]) for r in store.query(
        f"SELECT job_id, cluster, occurred_at FROM {db}.events WHERE type = 'job.finished'").rows}
    assert on_k8s <= set(finished) and all(finished[j][0] == "eu-west-1-k8s" for j in on_k8s)
    # billing closed them: one usage row per job, priced GPU-seconds of the run the pods reported
    usage = {r[0]: (r[1], float(r[2])) for r in store.query(
        f"SELECT job_id, cluster, sum(gpu_seconds) FROM {db}.usage GROUP BY job_id, cluster").rows}
    for job_id in on_k8s:
        cluster, gpu_s = usage[job_id]
        assert cluster == "eu-west-1-k8s" and 300 <= gpu_s <= 300 + 10 * PODS + 5  # the runtimes of the pod list
    assert set(usage) == set(finished)
