"""Trace parsing (openb format, optional columns) and the split rule."""

from collections import Counter

import pytest

from fedsched.errors import ValidationError
from services.inventory.trace import CLUSTERS, UNLIMITED, cluster_of, load_nodes, load_pods, split_nodes


def test_bundled_node_list_parses_with_canonical_models(trace_nodes):
    nodes = load_nodes(trace_nodes)
    assert len(nodes) == 1213
    assert sum(n.gpus for n in nodes) == 6212
    models = Counter(n.card_model for n in nodes)
    assert models["alibaba-g2"] == 549 and models["nvidia-t4-16gb"] == 404 and models["nvidia-v100-16gb"] == 55


def test_bundled_pods_parse_with_runtimes_and_outcomes(trace_pods):
    pods = load_pods(trace_pods)
    assert len(pods) == 8152
    assert [p.creation_time for p in pods] == sorted(p.creation_time for p in pods)
    assert Counter(p.outcome for p in pods)["failed"] == 1870
    never = [p for p in pods if p.scheduled_time is None]
    assert len(never) == 897 and all(p.runtime_s == p.deletion_time - p.creation_time for p in never)
    assert all(p.runtime_s >= 0 for p in pods)
    assert {m for p in pods for m in p.gpu_spec} <= {"nvidia-p100-16gb", "nvidia-t4-16gb", "nvidia-v100-16gb",
                                                    "nvidia-v100-32gb", "alibaba-g2", "alibaba-g3", "nvidia-a10-24gb"}


def test_split_is_deterministic_uneven_and_covers_three_regions(trace_nodes):
    nodes = load_nodes(trace_nodes)
    a, b = split_nodes(nodes), split_nodes(list(reversed(nodes)))
    assert {k: sorted(n.name for n in v) for k, v in a.items()} == {k: sorted(n.name for n in v) for k, v in b.items()}
    assert sum(len(v) for v in a.values()) == len(nodes)
    regions = {c.region for c in CLUSTERS}
    assert len(regions) >= 3
    for region in regions:
        assert sum(1 for c in CLUSTERS if c.region == region) >= 2
    gpus = {name: sum(n.gpus for n in v) for name, v in a.items()}
    assert max(gpus.values()) > 3 * min(gpus.values())  # uneven capacity
    mixes = {name: frozenset(n.card_model for n in v) for name, v in a.items()}
    assert len(set(mixes.values())) >= 3  # uneven card mixes
    assert all(cluster_of(n).name == name for name, v in a.items() for n in v)


def test_other_trace_with_missing_optional_columns_and_new_models(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu,model\nnode-a,8,H800\nnode-b,4,A100 80G\nnode-c,0,\n")
    parsed = load_nodes(nodes)
    assert [n.card_model for n in parsed] == ["nvidia-h800-80gb", "nvidia-a100-80gb", ""]
    assert parsed[0].cpu_milli == UNLIMITED and parsed[0].memory_mib == UNLIMITED
    pods = tmp_path / "pods.csv"
    pods.write_text("name,creation_time,num_gpu,gpu_spec\np1,10,2,H800\np0,5,1,\np2,7,0,\n")
    got = load_pods(pods)
    assert [p.name for p in got] == ["p0", "p2", "p1"]
    p1 = got[-1]
    assert p1.gpu_milli == 1000 and p1.gpu_spec == ("nvidia-h800-80gb",)
    assert p1.qos == "BE" and p1.outcome == "succeeded"
    assert p1.runtime_s == 10 - 10 or p1.runtime_s >= 0  # no deletion column: runs to the trace end
    assert got[0].runtime_s == 10 - 5


def test_missing_required_column_is_a_clear_error(tmp_path):
    bad = tmp_path / "pods.csv"
    bad.write_text("name,num_gpu\np,1\n")
    with pytest.raises(ValidationError, match="creation_time"):
        load_pods(bad)


def test_non_numeric_value_names_file_line_and_column(tmp_path):
    bad = tmp_path / "nodes.csv"
    bad.write_text("sn,gpu,model\nn1,eight,T4\n")
    with pytest.raises(ValidationError) as e:
        load_nodes(bad)
    assert e.value.field == "nodes:2:gpu"


@pytest.mark.parametrize("cell, message", [("-1", "must be >= 0"), ("inf", "not a finite number"),
                                           ("nan", "not a finite number"), ("1e999", "not a finite number")])
def test_negative_or_infinite_values_are_rejected_with_their_place(tmp_path, cell, message):
    bad = tmp_path / "pods.csv"
    bad.write_text(f"name,creation_time,num_gpu,cpu_milli\np1,0,1,100\np2,5,1,{cell}\n")
    with pytest.raises(ValidationError, match=message) as e:
        load_pods(bad)
    assert e.value.field == "pods:3:cpu_milli"


def test_unreadable_and_non_utf8_files_are_clear_errors(tmp_path):
    binary = tmp_path / "pods.csv"
    binary.write_bytes(b"name,creation_time\n\xff\xfe,1\n")
    with pytest.raises(ValidationError, match="not UTF-8"):
        load_pods(binary)
    with pytest.raises(ValidationError, match="cannot read"):
        load_nodes(tmp_path / "missing.csv")


def test_repeated_names_are_kept_under_new_names_and_empty_names_rejected(tmp_path, caplog):
    pods = tmp_path / "pods.csv"
    pods.write_text("name,creation_time\np,0\np,1\np,2\np-dup2,3\n")
    with caplog.at_level("WARNING"):
        got = load_pods(pods)
    assert sorted(p.name for p in got) == ["p", "p-dup2", "p-dup2-dup2", "p-dup3"]
    assert "3 row(s) repeat an earlier name" in caplog.text
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu\nn1,1\n,2\n")
    with pytest.raises(ValidationError) as e:
        load_nodes(nodes)
    assert e.value.field == "nodes:3:sn"


def test_values_beyond_any_real_trace_are_rejected_with_their_place(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu\nn1,8\nn2,1e20\n")
    with pytest.raises(ValidationError, match="must be <=") as e:
        load_nodes(nodes)
    assert e.value.field == "nodes:3:gpu"
    pods = tmp_path / "pods.csv"
    pods.write_text("name,creation_time\np1,0\np2,1000000000000\n")
    with pytest.raises(ValidationError, match="100 years") as e:
        load_pods(pods)
    assert e.value.field == "pods:3:creation_time"
