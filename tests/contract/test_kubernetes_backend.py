"""The ``kubernetes`` backend beyond the shared contract, with the real client (``kubernetes_asyncio``)
over HTTP against the emulated cluster (tests/k8s_cluster.py): what it reads from nodes, the
manifests it sends, watch expiry and re-list, API errors (403, 409, 500, timeouts) as typed errors
with retries, the failure reasons, and lost attempts. The ``kube`` fixture is in conftest.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fedsched.events import WorkerBinding
from fedsched.workload import Workload
from services.inventory.backend import (NODE_FAILED, AttemptKey, AttemptSpec, BackendError, BackendUnavailable,
                                        Phase)
from tests.builders import spec
from tests.k8s_cluster import gpu_node

NS = "fedsched-test"


def attempt(h, job_id: str, *, workers: int = 1, runtime_s: float = 60, exit_code: int = 0, argv: str = "",
            image: str = "busybox:1.36", attempt_no: int = 1, **spec_kw) -> AttemptSpec:
    """An attempt of ``workers`` 1-GPU workers on the harness's first nodes running
    ``sh -c 'sleep N; exit C'`` (or ``argv``)."""
    wl = Workload(image=image, command=("sh", "-c", argv or f"sleep {runtime_s:g}; exit {exit_code}"),
                  env={"EPOCHS": "3"}, secret_env={"HF_TOKEN": "hf-creds/token"})
    job = spec(gpus=1, workers=workers, workload=wl, memory_mib=4096, **spec_kw)
    bindings = tuple(WorkerBinding(worker=i, node=h.nodes[i], gpu_indices=(0,), gpu_milli=1000, cpu_milli=1000,
                                   memory_mib=4096) for i in range(workers))
    return AttemptSpec(AttemptKey(job_id, attempt_no, 0), job.tenant, job.project, job, h.card_model, bindings)


async def until(h, key: AttemptKey, phase: Phase, timeout_s: float = 10.0) -> list:
    got = await h.statuses(lambda s: any(x.key == key and x.phase == phase for x in s), timeout_s=timeout_s)
    return [s for s in got if s.key == key]


async def eventually(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------- inventory


async def test_inventory_reads_models_zones_conditions_taints_rdma_and_other_accelerators(kube):
    a100 = gpu_node("a100-0", gpus=8, product="NVIDIA-A100-SXM4-80GB", rdma=True, zone="cn-north-1b")
    cordoned = gpu_node("cordoned", gpus=4)
    cordoned["spec"] = {"unschedulable": True, "taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
        {"key": "team", "value": "infra", "effect": "PreferNoSchedule"}]}
    pressure = gpu_node("pressure", gpus=2)
    pressure["status"]["conditions"][1]["status"] = "True"
    notready = gpu_node("notready", gpus=2)
    notready["status"]["conditions"][0]["status"] = "False"
    npu = gpu_node("npu-0", gpus=8, product="Ascend910B", resource="huawei.com/Ascend910")
    cpu_only = gpu_node("cpu-0", gpus=0)
    h = await kube((a100, cordoned, pressure, notready, npu, cpu_only),
                   gpu_resources=("nvidia.com/gpu", "huawei.com/Ascend910"),
                   rdma_label="feature.node.kubernetes.io/rdma.capable")
    inv = {n.name: n for n in await h.backend.inventory()}
    assert (inv["a100-0"].card_model, inv["a100-0"].gpus, inv["a100-0"].rdma) == ("nvidia-a100-80gb", 8, True)
    assert (inv["a100-0"].cpu_milli, inv["a100-0"].memory_mib) == (64000, 512 * 1024)
    assert (inv["a100-0"].zone, inv[h.nodes[0]].zone) == ("cn-north-1b", "cn-north-1a")
    assert inv["cordoned"].unschedulable and inv["cordoned"].healthy
    assert inv["cordoned"].taints == ("node.kubernetes.io/unschedulable=:NoSchedule",)  # PreferNoSchedule is not a taint that refuses
    assert inv["pressure"].unschedulable and inv["pressure"].healthy
    assert not inv["notready"].healthy
    assert (inv["npu-0"].card_model, inv["npu-0"].gpus) == ("huawei-ascend910b-64gb", 8)
    assert (inv["cpu-0"].gpus, inv["cpu-0"].card_model) == (0, "")
    assert not inv[h.nodes[0]].rdma


async def test_inventory_follows_the_node_watch_without_polling(kube):
    h = await kube()
    await h.backend.inventory()
    lists = sum(1 for verb, path in h.cluster.server.requests if verb == "LIST" and "/nodes" in path)
    h.cluster.server.create("nodes", "", gpu_node("late", gpus=2))
    h.cluster.set_ready(h.nodes[1], False)
    h.cluster.server.patch("nodes", "", h.nodes[2], {"spec": {"unschedulable": True}})

    async def seen():
        inv = {n.name: n for n in await h.backend.inventory()}
        return "late" in inv and not inv[h.nodes[1]].healthy and inv[h.nodes[2]].unschedulable

    deadline = time.monotonic() + 5
    while not await seen():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert sum(1 for verb, path in h.cluster.server.requests if verb == "LIST" and "/nodes" in path) == lists


async def test_gpus_of_pods_fedsched_did_not_place_are_not_free(kube):
    h = await kube()
    assert all(n.gpu_free_milli == () for n in await h.backend.inventory())
    h.cluster.server.create("pods", "other-team", {"metadata": {"name": "notebook"}, "spec": {
        "nodeName": h.nodes[0], "containers": [{"name": "c", "image": "jupyter",
                                                "resources": {"limits": {"nvidia.com/gpu": "3"}}}]},
        "status": {"phase": "Running"}})
    await eventually(lambda: bool(h.backend._foreign))
    inv = {n.name: n for n in await h.backend.inventory()}
    assert inv[h.nodes[0]].gpu_free_milli == (0, 0, 0) + (1000,) * 5
    assert inv[h.nodes[1]].gpu_free_milli == ()  # all free: the agent's ledger fills it


# ------------------------------------------------------------------------------- launch


async def test_a_gang_becomes_an_indexed_job_with_a_headless_service_labels_affinity_resources_and_env(kube):
    h = await kube(priority_classes={"high": "fedsched-high"}, kueue_queue="team-a")
    a = attempt(h, "gang", workers=2, priority="high")
    await h.backend.launch(a)
    job = h.cluster.server.get("jobs", NS, "gang-a1-s0")
    svc = h.cluster.server.get("services", NS, "gang-a1-s0")
    js = job["spec"]
    assert (js["completionMode"], js["completions"], js["parallelism"], js["backoffLimit"], js["suspend"]) == (
        "Indexed", 2, 2, 0, True)
    assert job["metadata"]["labels"] == {
        "fedsched.io/job-id": "gang", "fedsched.io/attempt": "1", "fedsched.io/shard": "0",
        "fedsched.io/tenant": a.tenant, "fedsched.io/project": a.project, "kueue.x-k8s.io/queue-name": "team-a"}
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": "gang-a1-s0"}
    pod = js["template"]["spec"]
    assert pod["subdomain"] == "gang-a1-s0" and pod["restartPolicy"] == "Never"
    assert pod["priorityClassName"] == "fedsched-high"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": list(h.nodes[:2])},
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"]}]}]
    assert pod["affinity"]["podAntiAffinity"]  # one worker per node
    c = pod["containers"][0]
    assert c["image"] == "busybox:1.36" and c["command"] == ["sh", "-c", "sleep 60; exit 0"]
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "1000m", "memory": "4096Mi",
                                                                      "nvidia.com/gpu": "1"}
    env = {e["name"]: e for e in c["env"]}
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert {k: env[k]["value"] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EPOCHS", "FEDSCHED_ATTEMPT")} == {
        "WORLD_SIZE": "2", "MASTER_ADDR": "gang-a1-s0-0.gang-a1-s0", "MASTER_PORT": "29500", "EPOCHS": "3",
        "FEDSCHED_ATTEMPT": "1"}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-creds", "key": "token"}}
    assert "value" not in env["HF_TOKEN"]


async def test_a_relaunch_adopts_its_job_but_a_foreign_job_of_that_name_is_refused(kube):
    h = await kube()
    a = attempt(h, "adopt")
    await h.backend.launch(a)
    await h.backend.launch(a)  # 409 -> adopt
    assert [v for v, p in h.cluster.server.requests if v == "POST" and p.endswith("/jobs")] == ["POST", "POST"]
    h.cluster.server.create("jobs", NS, {"metadata": {"name": "squat-a1-s0", "labels": {"app": "other"}},
                                         "spec": {"suspend": True, "template": {"spec": {"containers": []}}}})
    with pytest.raises(BackendError) as e:
        await h.backend.launch(attempt(h, "squat"))
    assert e.value.retryable is False and "not this attempt" in str(e.value)


# ------------------------------------------------------------------------------- API errors


async def test_403_is_a_permanent_error_and_launches_nothing(kube):
    h = await kube()
    h.cluster.server.fail("POST", "jobs", 403)
    with pytest.raises(BackendError) as e:
        await h.backend.launch(attempt(h, "denied"))
    assert e.value.retryable is False and "403" in str(e.value)
    assert h.cluster.server.get("jobs", NS, "denied-a1-s0") is None


async def test_a_500_is_retried_and_the_launch_goes_through(kube):
    h = await kube()
    h.cluster.server.fail("POST", "jobs", 500, count=2)
    a = attempt(h, "flaky")
    await h.backend.launch(a)
    assert h.cluster.server.get("jobs", NS, "flaky-a1-s0") is not None
    assert [s.phase for s in await until(h, a.key, Phase.RUNNING)] == [Phase.PENDING, Phase.RUNNING]


async def test_an_outage_and_a_timeout_are_retryable_errors(kube):
    h = await kube(request_timeout_s=0.5, retries=1)
    await h.backend.inventory()
    h.cluster.server.fail("POST", "jobs", 500, count=5)
    with pytest.raises(BackendUnavailable) as e:
        await h.backend.launch(attempt(h, "down"))
    assert e.value.retryable is True
    h.cluster.server.faults.clear()
    h.cluster.server.fail("DELETE", "jobs", 0, count=5, delay_s=2.0)
    with pytest.raises(BackendUnavailable):
        await h.backend.stop(AttemptKey("slow", 1, 0), "cancelled")
    h.cluster.server.faults.clear()
    h.cluster.server.fail("LIST", "jobs", 503, count=5)
    with pytest.raises(BackendUnavailable):
        await h.backend.list_attempts()


async def test_watch_expiry_relists_and_no_status_is_lost(kube):
    h = await kube()
    a = attempt(h, "expiry", runtime_s=30)
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    h.cluster.server.expire()          # history compacted, open watches closed: re-watch -> 410
    await h.advance(30)                # the pods end while the backend re-lists
    end = await until(h, a.key, Phase.SUCCEEDED)
    assert [s.phase for s in end] == [Phase.SUCCEEDED]
    assert h.backend.relists["gone"] >= 1


async def test_a_watch_that_errors_is_reopened_and_statuses_still_arrive(kube):
    h = await kube()
    await h.backend.inventory()
    h.cluster.server.fail("WATCH", "pods", 500, count=2)
    h.cluster.server.expire()  # the pod watch reconnects into the injected 500s
    a = attempt(h, "rewatch", runtime_s=10)
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    await h.advance(10)
    assert [s.phase for s in await until(h, a.key, Phase.SUCCEEDED)] == [Phase.SUCCEEDED]
    assert h.backend.relists["error"] >= 1


# ------------------------------------------------------------------------------- status


async def test_oom_killed_reports_exit_code_137_and_the_reason(kube):
    h = await kube()
    a = attempt(h, "oom", argv="sleep 5; oom")
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    await h.advance(5)
    end = (await until(h, a.key, Phase.FAILED))[-1]
    assert (end.exit_code, end.reason, end.worker) == (137, "oom_killed", 0)


async def test_image_pull_backoff_fails_the_attempt_past_the_limit(kube):
    h = await kube(image_pull_limit_s=120)
    a = attempt(h, "pull", image="registry.local/doesnotexist:1")
    await h.backend.launch(a)
    await eventually(lambda: any((p.get("status") or {}).get("containerStatuses")
                                 for p in h.cluster.server.items("pods")))
    await h.advance(60)
    assert Phase.FAILED not in [s.phase for s in await h.statuses(lambda s: False, timeout_s=0.2) if s.key == a.key]
    await h.advance(61)
    await h.advance(0)
    end = (await until(h, a.key, Phase.FAILED))[-1]
    assert (end.reason, end.exit_code) == ("image_pull", None) and "doesnotexist" in end.message


async def test_eviction_and_a_failed_node_stop_the_gang(kube):
    h = await kube()
    a = attempt(h, "evict", workers=2)
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    pod = next(p for p in h.cluster.server.items("pods") if p["metadata"]["labels"]["job-name"] == a.name)
    h.cluster.server.patch("pods", NS, pod["metadata"]["name"], {"status": {
        "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}})
    end = (await until(h, a.key, Phase.FAILED))[-1]
    assert end.reason == "evicted" and "memory" in end.message and end.worker in (0, 1)
    gang = lambda: [p for p in h.cluster.server.items("pods") if p["metadata"]["labels"]["job-name"] == a.name  # noqa: E731
                    and p["status"].get("phase") == "Running"]
    await eventually(lambda: not gang())  # the Job failed (backoffLimit 0): the rest of the gang ended
    b = attempt(h, "nodefail", workers=2, attempt_no=1)
    await h.backend.launch(b)
    await until(h, b.key, Phase.RUNNING)
    h.fail_node(h.nodes[1])
    end = (await until(h, b.key, Phase.FAILED))[-1]
    assert (end.reason, end.node, end.exit_code) == (NODE_FAILED, h.nodes[1], None)
    await eventually(lambda: h.cluster.server.get("jobs", NS, b.name) is None)  # deleted: the gang stops whole


async def test_pods_or_jobs_deleted_outside_fedsched_are_lost(kube):
    h = await kube()
    a, b = attempt(h, "podgone"), attempt(h, "jobgone")
    for x in (a, b):
        await h.backend.launch(x)
        await until(h, x.key, Phase.RUNNING)
    pod = next(p for p in h.cluster.server.items("pods") if p["metadata"]["labels"]["job-name"] == a.name)
    h.cluster.server.delete("pods", NS, pod["metadata"]["name"])
    assert (await until(h, a.key, Phase.LOST))[-1].reason == "lost"
    h.cluster.server.delete("jobs", NS, b.name, "Background")
    lost = (await until(h, b.key, Phase.LOST))[-1]
    assert "deleted outside fedsched" in lost.message


async def test_stop_deletes_with_foreground_propagation_and_a_gone_job_is_fine(kube):
    h = await kube()
    a = attempt(h, "fg", workers=2)
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    await h.backend.stop(a.key, "preempted")
    deletes = [p for v, p in h.cluster.server.requests if v == "DELETE" and a.name in p]
    assert deletes and all("propagationPolicy=Foreground" in p for p in deletes)
    assert not [p for p in h.cluster.server.items("pods") if p["metadata"]["labels"].get("job-name") == a.name]
    await h.backend.stop(a.key, "preempted")  # 404 -> already gone
    await h.advance(1)
    assert not [s for s in await h.statuses(lambda s: False, timeout_s=0.3) if s.key == a.key]


async def test_logs_follow_streams_until_the_worker_ends(kube):
    h = await kube()
    a = attempt(h, "follow", workers=2, runtime_s=20)
    await h.backend.launch(a)
    await until(h, a.key, Phase.RUNNING)
    lines: list[str] = []

    async def read():
        async for line in h.backend.logs(a.key, 1, follow=True):
            lines.append(line)

    reader = asyncio.create_task(read())
    await eventually(lambda: len(lines) >= 2)
    assert not reader.done()
    await h.advance(20)
    await asyncio.wait_for(reader, 5)
    assert lines[0] == "worker 1 of follow-a1-s0 starting" and lines[-1] == "exit 0"


async def test_a_restarted_agent_on_a_fresh_backend_adopts_its_job_and_stops_the_others(kube):
    """The agent process restarts: a NEW backend (empty caches) on the same cluster. The Job of the
    live attempt is adopted and reported once when it ends; an older attempt and an unknown Job
    are deleted and reported stopped."""
    from fedsched.events import JobPlaced, Subjects
    from services.inventory.agent import ClusterAgent
    from services.inventory.kubernetes import KubernetesBackend
    from services.inventory.trace import ClusterDef
    from tests.builders import FakePublisher, delivery, placement

    h = await kube()
    live, stale = attempt(h, "live", attempt_no=2, runtime_s=600), attempt(h, "live", attempt_no=1, runtime_s=600)
    orphan = attempt(h, "orphan", runtime_s=600)
    for a in (live, stale, orphan):
        await h.backend.launch(a)
        await until(h, a.key, Phase.RUNNING)
    await h.backend.close()
    h.backend = KubernetesBackend(h.backend.opts, clock=h.clock)  # closed again by the fixture
    cluster = ClusterDef("c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
    subjects, publisher = Subjects("t"), FakePublisher()
    agent = ClusterAgent(None, h.clock, cluster, h.backend, publisher=publisher, subjects=subjects)
    await agent.refresh_inventory()
    env = placement("live", live.spec, cluster.name, cluster.region, [(h.nodes[0], (0,))], attempt=2,
                    card_model=h.card_model)
    agent._see_attempt("live", 0, 2)
    await agent.reconcile({("live", 2, 0): (delivery(env, subjects.placements(cluster.region, cluster.name), 1, 0.0),
                                            env.payload_as(JobPlaced), h.clock.time())})
    assert sorted(agent.reconciled) == sorted([("adopted", str(live.key)), ("superseded", str(stale.key)),
                                               ("orphaned", str(orphan.key))])
    assert h.cluster.server.get("jobs", NS, stale.name) is None and h.cluster.server.get("jobs", NS, orphan.name) is None
    await h.advance(600)
    deadline = time.monotonic() + 5
    ends = [p for p in publisher.published if p.event.type != "agent.reconciled"]  # stops, then the end
    while len(ends) < 3 and time.monotonic() < deadline:
        await agent.finish_due()
        await asyncio.sleep(0.02)
        ends = [p for p in publisher.published if p.event.type != "agent.reconciled"]
    await agent.finish_due()
    ends = [p for p in publisher.published if p.event.type != "agent.reconciled"]
    assert [(p.event.type, p.event.job_id, p.event.attempt) for p in ends[2:]] == [("job.finished", "live", 2)]
    assert sorted(p.event.payload["reason"] for p in publisher.published if p.event.type == "agent.reconciled") == [
        "adopted", "orphaned", "superseded"]


async def test_deadline_exceeded_and_suspension_while_running_fail_the_attempt(kube):
    h = await kube()
    a, b = attempt(h, "deadline"), attempt(h, "kueued")
    for x in (a, b):
        await h.backend.launch(x)
        await until(h, x.key, Phase.RUNNING)
    h.cluster.server.patch("jobs", NS, a.name, {"status": {"conditions": [{
        "type": "Failed", "status": "True", "reason": "DeadlineExceeded",
        "message": "Job was active longer than specified deadline"}]}})
    assert (await until(h, a.key, Phase.FAILED))[-1].reason == "deadline_exceeded"
    h.cluster.server.patch("jobs", NS, b.name, {"spec": {"suspend": True}})  # as Kueue preempting it
    assert (await until(h, b.key, Phase.FAILED))[-1].reason == "suspended"


async def test_a_node_event_near_the_object_size_limit_is_read(kube):
    """A Node's ``status.images`` makes large watch events; one near etcd's 1.5 MiB object limit is read."""
    h = await kube()
    await h.backend.inventory()
    big = gpu_node("big", gpus=4)
    big["status"]["images"] = [{"names": [f"registry.example.com/team/image-{i:05d}@sha256:{'0' * 64}"],
                                "sizeBytes": 10 ** 9} for i in range(12000)]
    h.cluster.server.create("nodes", "", big)
    deadline = time.monotonic() + 5
    while "big" not in {n.name for n in await h.backend.inventory()}:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert h.backend.relists["error"] == 0
