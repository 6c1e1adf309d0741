"""End to end: a custom topology (eu-west-1 with one cluster on a held node list, us-east-1 with two
clusters sharing a split node list, inline prices, pair bandwidth) replays a generated pod list
through the embedded system; every placement, usage row and home region stays inside it."""

from decimal import Decimal

import pytest

from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedsched.settings import Settings
from fedsched.topology import dump_topology, load_topology, parse_topology
from tests.builders import unique

pytestmark = pytest.mark.e2e

PODS = 40
TOPOLOGY = {
    "regions": [{"name": "eu-west-1", "zones": ["eu-west-1a"]},
                {"name": "us-east-1", "zones": ["us-east-1a", "us-east-1b"]}],
    "clusters": [
        {"name": "eu-west-1-a", "region": "eu-west-1", "zone": "eu-west-1a", "backend": "trace",
         "trace": {"nodes": "held/eu-nodes.csv"}, "interconnect": "infiniband", "residency_tags": ["finance", "pii"]},
        {"name": "us-east-1-a", "region": "us-east-1", "zone": "us-east-1a", "backend": "trace",
         "trace": {"nodes": "us-nodes.csv", "split": {"index": 0, "weights": {"default": [1, 1]}}}},
        {"name": "us-east-1-b", "region": "us-east-1", "zone": "us-east-1b", "backend": "trace",
         "trace": {"nodes": "us-nodes.csv", "split": {"index": 1, "weights": {"default": [1, 1]}}}},
    ],
    "bandwidth": [{"between": ["eu-west-1", "us-east-1"], "gbit_s": 4}],
    "prices": {"entries": {"currency": "EUR", "base": {"nvidia-t4-16gb": 2.0}, "default_gpu_hour": 3.0,
                           "region_factor": {"eu-west-1": 1.5}}},
}


def _nodes_csv(prefix: str, count: int) -> str:
    rows = ["sn,cpu_milli,memory_mib,num_gpu,gpu,model"]
    rows += [f"{prefix}-{i:02d},64000,262144,,8,T4" for i in range(count)]
    return "\n".join(rows) + "\n"


def _pods_csv() -> str:
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
            "scheduled_time"]
    for i in range(PODS):
        gpus, milli = (2, 1000) if i % 5 == 0 else (1, 500 if i % 2 else 1000)
        qos = ("LS", "BE", "Burstable")[i % 3]
        start = i * 30
        rows.append(f"topo-pod-{i:03d},4000,8192,{gpus},{milli},{'T4' if i % 4 else ''},{qos},Succeeded,"
                    f"{start},{start + 600 + 40 * i},{start}")
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
async def replayed(nats_server, chdb_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("topo")
    (root / "held").mkdir()
    (root / "held" / "eu-nodes.csv").write_text(_nodes_csv("eu-node", 3))
    (root / "us-nodes.csv").write_text(_nodes_csv("us-node", 8))
    (root / "pods.csv").write_text(_pods_csv())
    path = root / "topology.yaml"
    path.write_text(dump_topology(parse_topology(TOPOLOGY)))
    topo = load_topology(path)  # from the file: relative node lists resolve against its folder
    settings = Settings(data_dir=root / "data", nats_url=nats_server.url, subject_prefix=unique("tp"),
                        clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    driver = ReplayDriver(ReplayOptions(nodes_csv=root / "unused.csv", pods_csv=root / "pods.csv", settings=settings,
                                        timeout_s=120, topology=topo))
    report = await driver.run()
    from fedsched.store import open_store
    store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)
    return report, store, driver


async def test_every_job_runs_inside_the_topology(replayed):
    report, store, driver = replayed
    jobs = report["jobs"]
    assert jobs["submitted"] == PODS and jobs["rejected"] == 0, report["rejected_reasons"]
    assert jobs["placed"] == PODS and jobs["finished"] == PODS and not report["timed_out"]
    assert {r["region"] for r in report["by_region"]} == {"eu-west-1", "us-east-1"}
    assert report["capacity_gpus"] == (3 + 8) * 8
    db = store.database
    clusters = {r[0]: r[1] for r in store.query(
        f"SELECT cluster, count() FROM {db}.events WHERE type = 'job.placed' GROUP BY cluster").rows}
    assert set(clusters) <= {"eu-west-1-a", "us-east-1-a", "us-east-1-b"} and clusters.get("eu-west-1-a")
    homes = {r[0] for r in store.query(
        f"SELECT DISTINCT JSONExtractString(payload, 'spec', 'home_region') FROM {db}.events "
        f"WHERE type = 'job.submitted'").rows}
    assert homes == {"eu-west-1", "us-east-1"}
    inventory = {r[0] for r in store.query(f"SELECT DISTINCT cluster FROM {db}.events "
                                           f"WHERE type = 'inventory.snapshot'").rows}
    assert inventory == {"eu-west-1-a", "us-east-1-a", "us-east-1-b"}  # the split left both us clusters nodes


async def test_usage_is_priced_by_the_topology_catalog(replayed):
    report, store, _ = replayed
    assert report["currency"] == "EUR"
    rows = store.query(f"SELECT region, card_model, unit_price, currency FROM {store.database}.usage "
                       f"GROUP BY region, card_model, unit_price, currency").rows
    prices = {(r[0], r[1]): (Decimal(str(r[2])), r[3]) for r in rows}
    assert prices[("eu-west-1", "nvidia-t4-16gb")] == (Decimal("3.000000"), "EUR")  # 2.0 x region factor 1.5
    assert prices[("us-east-1", "nvidia-t4-16gb")] == (Decimal("2.000000"), "EUR")
