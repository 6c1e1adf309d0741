"""The replay overlay: deterministic, documented, and faithful to the pod's resources."""

from collections import Counter

from fedsched.jobs import JobKind, Locality, PriorityClass
from fedapp.replay.workload import REGIONS, overlay, trace_jobs
from services.inventory.trace import load_pods


def test_overlay_is_deterministic_and_keeps_resources(trace_pods):
    pods = load_pods(trace_pods)[:2000]
    a, b = [overlay(p) for p in pods], [overlay(p) for p in pods]
    assert a == b
    for p, s in zip(pods, a):
        assert s.cpu_milli == p.cpu_milli and s.memory_mib == p.memory_mib
        assert s.card_models == p.gpu_spec
        if p.num_gpu == 1:
            assert (s.gpus_per_worker, s.gpu_milli) == (1, p.gpu_milli)
        else:
            assert s.gpus_per_worker == p.num_gpu
        assert s.annotations["trace.runtime_s"] == str(p.runtime_s)
        assert s.annotations["trace.outcome"] == p.outcome
        assert 0.5 * p.runtime_s - 1e-6 <= s.estimated_duration_s <= 4 * p.runtime_s + 1e-6
        assert s.home_region in REGIONS
        if p.qos == "LS":
            assert s.priority == PriorityClass.HIGH
        if p.num_gpu >= 2:
            assert s.kind == JobKind.TRAINING


def test_overlay_mix_is_roughly_as_documented(trace_pods):
    specs = [overlay(p) for p in load_pods(trace_pods)]
    tenants = Counter(s.tenant for s in specs)
    assert abs(tenants["search"] / len(specs) - 0.30) < 0.03
    loc = Counter(s.locality for s in specs)
    assert abs(loc[Locality.MUST_LOCAL] / len(specs) - 0.10) < 0.02
    homes = Counter(s.home_region for s in specs)
    assert homes.most_common(1)[0][0] == "cn-north-1"


def test_load_compresses_arrivals_not_runtimes(trace_pods):
    pods = load_pods(trace_pods)[:100]
    plain, fast = trace_jobs(pods), trace_jobs(pods, load=10)
    assert fast[-1].submit_at_s == plain[-1].submit_at_s // 10
    assert [j.pod.runtime_s for j in plain] == [j.pod.runtime_s for j in fast]
    assert plain[0].request_id == "replay-" + pods[0].name


def test_any_pod_name_becomes_a_valid_distinct_job_label():
    from fedsched import naming
    from fedapp.replay.workload import _label

    names = ["openb-pod-0001", "P_Upper_Name", "p-upper-name", "Ünïcode pod", "123abc", "x" * 80, "-", "a--b"]
    labels = [_label(n) for n in names]
    assert labels[0] == "openb-pod-0001"  # canonical names stay as they are
    assert len(set(labels)) == len(labels)
    for label in labels:
        naming.check_name("job", label)
