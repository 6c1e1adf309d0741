"""The pure parts of the ``kubernetes`` backend: quantities, a node as NodeInventory, the
deploy manifests of the region agent (RBAC of least privilege, the topology it runs with)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedsched.topology import parse_topology
from services.inventory.kubernetes import KubeOptions, node_inventory, parse_quantity

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


@pytest.mark.parametrize(("q", "value"), [("8", 8.0), ("500m", 0.5), ("64Gi", 64 * 2**30), ("1e3", 1000.0),
                                          ("2k", 2000.0), ("", 0.0), (None, 0.0), (3, 3.0)])
def test_parse_quantity(q, value):
    assert parse_quantity(q) == value


def test_parse_quantity_refuses_garbage():
    with pytest.raises(ValueError):
        parse_quantity("12 parsecs")


def node(**status):
    return {"metadata": {"name": "n", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                 "nvidia.com/gpu.memory": "81559", "rdma": "True"}},
            "spec": {"taints": [{"key": "gpu", "value": "h100", "effect": "NoSchedule"},
                                {"key": "x", "effect": "PreferNoSchedule"}]},
            "status": {"allocatable": {"cpu": "95500m", "memory": "1000Gi", "nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True"}], **status}}


def test_a_node_as_inventory():
    n = node_inventory(node(), KubeOptions(rdma_label="rdma"), foreign_gpus=2)
    assert (n.card_model, n.gpus, n.gpu_memory_gib, n.cpu_milli, n.memory_mib) == (
        "nvidia-h100-80gb", 8, 79, 95500, 1000 * 1024)
    assert n.gpu_free_milli == (0, 0) + (1000,) * 6
    assert n.rdma and n.healthy and not n.unschedulable and n.taints == ("gpu=h100:NoSchedule",)
    cpu_only = node_inventory(node(), KubeOptions(gpu_resources=("huawei.com/Ascend910",)))
    assert (cpu_only.gpus, cpu_only.card_model, cpu_only.rdma) == (0, "", False)
    unknown = node_inventory(node(conditions=[{"type": "Ready", "status": "Unknown"},
                                              {"type": "DiskPressure", "status": "True"}]), KubeOptions())
    assert not unknown.healthy and unknown.unschedulable


def test_deploy_rbac_is_least_privilege():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((DEPLOY / "agent-rbac.yaml").read_text())}
    cluster_rules = docs[("ClusterRole", "fedsched-agent-read")]["rules"]
    assert cluster_rules == [{"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]}]
    role = docs[("Role", "fedsched-agent-jobs")]
    assert role["metadata"]["namespace"] == "fedsched-jobs"
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs == {("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
                     ("", "services"): {"create", "get", "list", "watch", "delete"},
                     ("", "pods"): {"get", "list", "watch"}, ("", "pods/log"): {"get"}}
    assert not any(k[0] == "ClusterRole" and k[1] != "fedsched-agent-read" for k in docs)


def test_deploy_agent_runs_the_kubernetes_backend_of_its_cluster():
    docs = list(yaml.safe_load_all((DEPLOY / "region-agent.yaml").read_text()))
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    assert agent["args"][:2] == ["service", "agents"]
    args = dict(zip(agent["args"][2::2], agent["args"][3::2]))
    assert pod["serviceAccountName"] == "fedsched-agent"
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    topo = parse_topology(yaml.safe_load(cm["data"]["topology.yaml"]))
    entry = topo.cluster(args["--cluster"])
    assert entry.backend == "kubernetes" and entry.kubernetes.kubeconfig is None  # in-cluster
    assert entry.kubernetes.namespace == "fedsched-jobs"
    secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    assert secrets == [f"fedsched-leaf-{args['--cluster']}"]  # only this cluster's NATS credentials


def test_long_attempt_names_are_shortened_deterministically_to_fit_pod_host_names():
    from services.inventory.backend import AttemptKey
    from services.inventory.kubernetes import k8s_name

    assert k8s_name(AttemptKey("train", 2, 0)) == "train-a2-s0"
    long = AttemptKey("j-" + "x" * 61, 12, 3)
    name = k8s_name(long)
    assert len(name) + len("-9999") <= 63 and name == k8s_name(AttemptKey("j-" + "x" * 61, 12, 3))
    assert name != k8s_name(AttemptKey("j-" + "x" * 61, 13, 3)) and name[0].isalpha() and name[-1] != "-"


def test_kustomize_keeps_the_agent_role_in_the_jobs_namespace():
    import shutil
    import subprocess

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (kustomize renders with `kubectl kustomize`)")
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objs = {(d["kind"], d["metadata"]["name"]): d["metadata"].get("namespace") for d in yaml.safe_load_all(out.stdout)}
    assert objs[("Role", "fedsched-agent-jobs")] == objs[("RoleBinding", "fedsched-agent-jobs")] == "fedsched-jobs"
    assert ("Namespace", "fedsched-jobs") in objs and objs[("Deployment", "agent-cn-north-1-c1")] == "fedsched"
