"""The generated default topology is today's split; `topology show` round-trips; the backend factory;
the overlay and first-start policy under a custom topology."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedapp.replay.workload import TENANT_WEIGHTS, overlay
from fedapp.topology import (DEFAULT_REGIONS, build_backend, bundled_nodes, cluster_def, cluster_nodes,
                             default_topology, map_region, policy_for_topology)
from fedsched.errors import ValidationError
from fedsched.tenancy import bundled_policy_text, check_topology_names, parse_policy
from fedsched.topology import KnownNames, load_topology, parse_topology
from services.inventory.agent import TraceBackend
from services.inventory.trace import CLUSTERS, cluster_of, load_nodes, load_pods

FEDSCHED = [sys.executable, "-m", "fedapp.cli"]


def test_default_topology_puts_every_bundled_node_in_the_cluster_the_split_rule_gives_it():
    topo = default_topology()
    assert topo.cluster_names() == tuple(c.name for c in CLUSTERS)
    assert topo.region_names() == DEFAULT_REGIONS == ("cn-north-1", "cn-east-1", "cn-south-1")
    nodes = load_nodes(bundled_nodes())
    cache: dict = {}
    where = {n.name: c for c in topo.cluster_names() for n in cluster_nodes(topo, c, cache)}
    assert len(where) == len(nodes) == 1213  # every node in exactly one cluster
    assert all(where[n.name] == cluster_of(n).name for n in nodes)
    for c in CLUSTERS:  # the agents report the same names and properties as before
        assert cluster_def(topo, c.name) == c


def test_topology_show_round_trips_through_topology(tmp_path):
    shown = subprocess.run([*FEDSCHED, "topology", "show"], capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path / "t.yaml"
    path.write_text(shown.stdout)
    assert load_topology(path).cluster_names() == default_topology().cluster_names()
    again = subprocess.run([*FEDSCHED, "topology", "show", "--topology", str(path), "-o", "json"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert parse_topology(json.loads(again.stdout)) == default_topology().model_copy(update={"base_dir": Path(".")})
    assert parse_topology(json.loads(again.stdout)).to_document() == default_topology().to_document()


def test_an_invalid_topology_file_is_a_message_naming_the_key(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("regions: [{name: eu-west-1, zones: [eu-west-1a, eu-west-1b]}]\n"
                    "clusters: [{name: a, region: eu-west-1, zone: eu-west-1z, backend: trace, "
                    "trace: {nodes: n.csv}}]\n")
    result = subprocess.run([*FEDSCHED, "topology", "show", "--topology", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert ("clusters[0].zone: 'eu-west-1z' is not a zone of region eu-west-1 (zones: eu-west-1a, eu-west-1b)"
            in " ".join(result.stderr.split())), result.stderr


def _custom(tmp_path, backend_b: str = "trace"):
    (tmp_path / "held.csv").write_text("sn,cpu_milli,memory_mib,num_gpu,gpu,model\n"
                                       "held-1,32000,131072,,4,T4\nheld-2,32000,131072,,2,V100M16\n")
    other = {"trace": {"backend": "trace", "trace": {"nodes": "held.csv"}},
             "kubernetes": {"backend": "kubernetes", "kubernetes": {"namespace": "jobs", "kubeconfig": "kube.yaml",
                                                                    "gpu_resources": ["huawei.com/Ascend910"]}},
             "slurm": {"backend": "slurm", "slurm": {"partition": "gpu"}}}[backend_b]
    return parse_topology({
        "regions": [{"name": "eu-west-1", "zones": ["eu-west-1a"]}, {"name": "us-east-1", "zones": ["us-east-1a"]}],
        "clusters": [{"name": "eu-a", "region": "eu-west-1", "zone": "eu-west-1a", "interconnect": "rdma", **other},
                     {"name": "us-a", "region": "us-east-1", "zone": "us-east-1a", "backend": "trace",
                      "trace": {"nodes": "held.csv", "rdma": False}}],
    }, base_dir=tmp_path)


def test_build_backend_builds_each_backend_and_names_what_this_build_cannot_run(tmp_path):
    topo = _custom(tmp_path)
    backend = build_backend(topo.cluster("eu-a"), topo)
    assert isinstance(backend, TraceBackend)
    assert [(n.name, n.gpus, n.card_model, n.rdma) for n in backend.nodes()] == [
        ("held-1", 4, "nvidia-t4-16gb", True), ("held-2", 2, "nvidia-v100-16gb", True)]
    assert not any(n.rdma for n in build_backend(topo.cluster("us-a"), topo).nodes())  # trace.rdma: false wins
    k8s = _custom(tmp_path, "kubernetes")
    kb = build_backend(k8s.cluster("eu-a"), k8s)
    assert (kb.kind, kb.opts.namespace, kb.opts.kubeconfig, kb.opts.gpu_resources, kb.opts.rdma_default) == (
        "kubernetes", "jobs", str(tmp_path / "kube.yaml"), ("huawei.com/Ascend910",), True)
    slurm = _custom(tmp_path, "slurm")
    sb = build_backend(slurm.cluster("eu-a"), slurm)
    assert sb.kind == "slurm" and sb.config.partition == "gpu"
    # what this build cannot run is refused with the key to change
    rest = slurm.model_copy(update={"clusters": (slurm.clusters[0].model_copy(update={
        "slurm": slurm.clusters[0].slurm.model_copy(update={"rest_url": "https://slurmrestd:6820"})}),
        *slurm.clusters[1:])})
    with pytest.raises(ValidationError) as e:
        build_backend(rest.cluster("eu-a"), rest)
    assert e.value.field == "clusters[0].slurm.rest_url" and "not supported" in e.value.reason


def test_map_region_rule():
    two = ("eu-west-1", "us-east-1")
    assert [map_region(r, two) for r in DEFAULT_REGIONS] == ["eu-west-1", "us-east-1", "eu-west-1"]
    assert map_region("us-east-1", two) == "us-east-1" and map_region("ap-south-1", two) == "eu-west-1"
    assert [map_region(r, DEFAULT_REGIONS) for r in DEFAULT_REGIONS] == list(DEFAULT_REGIONS)


def test_overlay_and_first_start_policy_use_the_regions_in_force(tmp_path, trace_pods):
    topo = _custom(tmp_path)
    regions = topo.region_names()
    pods = load_pods(trace_pods)[:400]
    default = [overlay(p) for p in pods]
    custom = [overlay(p, regions) for p in pods]
    assert {s.home_region for s in default} == set(DEFAULT_REGIONS)
    assert {s.home_region for s in custom} == set(regions)
    assert {d.home_region for s in custom for d in s.datasets} <= set(regions)
    homes = dict((t, h) for t, h, _ in TENANT_WEIGHTS)
    stay = [(s.tenant, s.home_region) for s in custom if s.home_region == map_region(homes[s.tenant], regions)]
    assert len(stay) / len(custom) > 0.8  # ~85% stay in their tenant's (mapped) home
    text = policy_for_topology(bundled_policy_text(), topo)
    check_topology_names(parse_policy(text), KnownNames.of(topo))  # fits the topology
    assert {t.name: t.home_region for t in parse_policy(text).tenants} == {
        t: map_region(h, regions) for t, h in homes.items()}
    assert policy_for_topology(bundled_policy_text(), default_topology()) == bundled_policy_text()
    with pytest.raises(ValidationError) as e:
        check_topology_names(parse_policy(bundled_policy_text()), KnownNames.of(topo), prefix="policy.")
    assert e.value.field == "policy.tenants[0].home_region" and "regions: eu-west-1, us-east-1" in e.value.reason


def test_the_example_topology_loads_with_its_node_lists_and_prices():
    topo = load_topology(Path(__file__).parents[3] / "deploy" / "topology" / "example.yaml")
    assert topo.region_names() == ("eu-west-1", "us-east-1")
    assert topo.cluster_names() == ("eu-west-1-a", "us-east-1-a", "us-east-1-b")
    cache: dict = {}
    sizes = {c: len(cluster_nodes(topo, c, cache)) for c in topo.cluster_names()}
    assert sizes["eu-west-1-a"] == 5 and sizes["us-east-1-a"] + sizes["us-east-1-b"] == 1213
    assert topo.price_catalog().currency == "EUR"
    assert topo.listed_bandwidth_bps() == (("eu-west-1", "us-east-1", 5e9 / 8), ("us-east-1", "eu-west-1", 5e9 / 8))


def test_service_agents_refuses_a_cluster_outside_the_topology(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("regions: [{name: eu-west-1, zones: [eu-west-1a]}]\n"
                    "clusters: [{name: eu-a, region: eu-west-1, zone: eu-west-1a, backend: trace, "
                    "trace: {nodes: n.csv}}]\n")
    result = subprocess.run([*FEDSCHED, "service", "agent", "--topology", str(path), "--cluster", "cn-north-1-c1",
                             "--nats-url", "nats://127.0.0.1:1", "--data-dir", str(tmp_path / "d")],
                            capture_output=True, text=True, timeout=60)
    out = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in out, out
    assert "--cluster cn-north-1-c1: 'cn-north-1-c1' is not a cluster of the topology (clusters: eu-a)" in out, out
