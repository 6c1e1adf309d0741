"""The topology file: validation with the path of the bad key, references, paths, prices, bandwidth."""

import copy
from decimal import Decimal

import pytest

from fedsched.errors import ValidationError
from fedsched.topology import KnownNames, dump_topology, load_topology, parse_topology
from fedsched.yamltext import load_yaml

GOOD = {
    "regions": [{"name": "eu-west-1", "zones": ["eu-west-1a", "eu-west-1b"]},
                {"name": "us-east-1", "zones": ["us-east-1a"]}],
    "clusters": [
        {"name": "eu-west-1-a", "region": "eu-west-1", "zone": "eu-west-1a", "backend": "trace",
         "trace": {"nodes": "nodes.csv", "rdma": True}, "residency_tags": ["eu", "pii"]},
        {"name": "us-east-1-a", "region": "us-east-1", "zone": "us-east-1a", "backend": "slurm",
         "slurm": {"partition": "gpu"}},
        {"name": "us-east-1-k", "region": "us-east-1", "zone": "us-east-1a", "backend": "kubernetes",
         "kubernetes": {"kubeconfig": "kube.yaml", "context": "prod", "namespace": "jobs"}},
    ],
    "bandwidth": [{"between": ["eu-west-1", "us-east-1"], "gbit_s": 2.5}],
}


def _with(path: str, value):
    """GOOD with ``value`` set at a dotted/indexed path (``clusters.2.zone``); ``...`` deletes."""
    doc = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    key = int(last) if last.isdigit() else last
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return doc


@pytest.mark.parametrize("path, value, field, words", [
    ("clusters.2.zone", "us-east-1z", "clusters[2].zone",
     "'us-east-1z' is not a zone of region us-east-1 (zones: us-east-1a)"),
    ("clusters.0.zone", "eu-west-1z", "clusters[0].zone",
     "'eu-west-1z' is not a zone of region eu-west-1 (zones: eu-west-1a, eu-west-1b)"),
    ("clusters.1.region", "ap-south-1", "clusters[1].region",
     "'ap-south-1' is not a region of the topology (regions: eu-west-1, us-east-1)"),
    ("clusters.1.name", "eu-west-1-a", "clusters[1].name", "named twice"),
    ("clusters.0.name", "EU_West", "clusters[0].name", "not valid"),
    ("clusters.0.colour", "red", "clusters[0].colour", "unknown key"),
    ("colour", "red", "colour", "unknown key"),
    ("clusters.0.trace.nodez", "x.csv", "clusters[0].trace.nodez", "unknown key"),
    ("clusters.0.trace", ..., "clusters[0].trace", "required: backend trace needs"),
    ("clusters.0.slurm", {"partition": "x"}, "clusters[0].slurm", "unexpected for backend trace"),
    ("clusters.1.slurm", {}, "clusters[1].slurm.partition", "required"),
    ("clusters.2.kubernetes", {"namespace": "a", "cluster_url": "x"}, "clusters[2].kubernetes.cluster_url",
     "unknown key"),
    ("clusters.0.backend", "nomad", "clusters[0].backend", "'trace', 'slurm' or 'kubernetes'"),
    ("clusters.0.residency_tags", ["EU"], "clusters[0].residency_tags[0]", "not valid"),
    ("clusters.0.interconnect", "carrier-pigeon", "clusters[0].interconnect", "ethernet"),
    ("regions.1.name", "eu-west-1", "regions[1].name", "named twice"),
    ("regions.1.zones", ["eu-west-1a"], "regions[1].zones[0]", "already a zone of region eu-west-1"),
    ("regions.1.zones", [], "regions[1].zones", "at least 1"),
    ("regions", [], "regions", "at least 1"),
    ("clusters", ..., "clusters", "required"),
    ("bandwidth", [{"between": ["eu-west-1", "mars-1"], "gbit_s": 1}], "bandwidth[0].between[1]",
     "'mars-1' is not a region of the topology (regions: eu-west-1, us-east-1)"),
    ("bandwidth", [{"between": ["eu-west-1", "eu-west-1"], "gbit_s": 1}], "bandwidth[0].between", "twice"),
    ("bandwidth", [{"between": ["eu-west-1", "us-east-1"], "gbit_s": 1},
                   {"between": ["us-east-1", "eu-west-1"], "gbit_s": 2}], "bandwidth[1].between", "listed twice"),
    ("bandwidth", [{"between": ["eu-west-1", "us-east-1"], "gbit_s": 0}], "bandwidth[0].gbit_s", "greater than 0"),
    ("prices", {"entries": {"region_factor": {"cn-north-1": 1.0}}}, "prices.entries.region_factor",
     "'cn-north-1' is not a region of the topology"),
    ("prices", {"entries": {"base": {"T4": "x"}}}, "prices.entries", "malformed"),
    ("prices", {"catalog": "p.yaml", "entries": {}}, "prices", "not both"),
])
def test_a_bad_key_is_named_by_its_path(path, value, field, words):
    with pytest.raises(ValidationError) as e:
        parse_topology(_with(path, value))
    assert e.value.field == field, e.value
    assert words in e.value.reason, e.value.reason
    assert str(e.value).startswith(f"{field}: ")


def test_the_good_document_parses_with_its_names_and_defaults():
    topo = parse_topology(GOOD)
    assert topo.region_names() == ("eu-west-1", "us-east-1")
    assert topo.zone_names() == ("eu-west-1a", "eu-west-1b", "us-east-1a")
    assert topo.cluster_names() == ("eu-west-1-a", "us-east-1-a", "us-east-1-k")
    assert topo.cluster("eu-west-1-a").rdma and not topo.cluster("us-east-1-a").rdma
    assert topo.bandwidth_bps()[("us-east-1", "eu-west-1")] == 2.5e9 / 8
    with pytest.raises(ValidationError, match="clusters: eu-west-1-a, us-east-1-a, us-east-1-k"):
        topo.cluster("nope")


def test_relative_paths_resolve_against_the_file_and_round_trip(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "prices.yaml").write_text("base: {T4: 2.0}\nregion_factor: {us-east-1: 1.5}\n")
    doc = _with("prices", {"catalog": "prices.yaml"})
    path = tmp_path / "conf" / "topo.yaml"
    path.write_text(dump_topology(parse_topology(doc)))
    topo = load_topology(path)
    assert topo.resolve("nodes.csv") == tmp_path / "conf" / "nodes.csv"
    assert topo.price_catalog().gpu_hour("us-east-1", "nvidia-t4-16gb") == Decimal("3.000000")
    again = parse_topology(load_yaml(dump_topology(topo, "json"), "t"), base_dir=tmp_path / "conf")
    assert again == topo


def test_an_unknown_region_in_a_referenced_catalog_fails_at_load(tmp_path):
    (tmp_path / "prices.yaml").write_text("region_factor: {cn-north-1: 1.0}\n")
    path = tmp_path / "topo.yaml"
    path.write_text(dump_topology(parse_topology(_with("prices", {"catalog": "prices.yaml"}))))
    with pytest.raises(ValidationError) as e:
        load_topology(path)
    assert e.value.field == "prices.catalog.region_factor" and "regions: eu-west-1, us-east-1" in e.value.reason


def test_yaml_safety_aliases_and_size(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("regions: &r [{name: eu-west-1, zones: [eu-west-1a]}]\nclusters: *r\n")
    with pytest.raises(ValidationError, match="aliases"):
        load_topology(path)
    path.write_text("#" * 1_000_001)
    with pytest.raises(ValidationError, match="larger than"):
        load_topology(path)


def test_split_tables_must_agree_among_clusters_sharing_a_node_list():
    w = {"default": [1, 1]}
    doc = _with("clusters.0.trace", {"nodes": "n.csv", "split": {"index": 0, "weights": w}})
    doc["clusters"][1] = {"name": "eu-west-1-b", "region": "eu-west-1", "zone": "eu-west-1b", "backend": "trace",
                          "trace": {"nodes": "n.csv", "split": {"index": 0, "weights": w}}}
    with pytest.raises(ValidationError) as e:
        parse_topology(doc)
    assert e.value.field == "clusters[1].trace.split.index"
    doc["clusters"][1]["trace"]["split"] = {"index": 1, "weights": {"default": [1, 2]}}
    with pytest.raises(ValidationError) as e:
        parse_topology(doc)
    assert e.value.field == "clusters[1].trace.split.weights"
    doc["clusters"][1]["trace"]["split"] = {"index": 2, "weights": w}
    with pytest.raises(ValidationError) as e:
        parse_topology(doc)
    assert e.value.field == "clusters[1].trace.split.weights.default"


def test_known_names_check_lists_the_known_ones():
    names = KnownNames.of(parse_topology(GOOD))
    assert names.check("region", "us-east-1", "spec.home_region") == "us-east-1"
    with pytest.raises(ValidationError) as e:
        names.check("region", "cn-north-1", "tenant.home_region")
    assert e.value.field == "tenant.home_region"
    assert e.value.reason == "'cn-north-1' is not a region of the topology (regions: eu-west-1, us-east-1)"
    with pytest.raises(ValidationError, match="clusters: eu-west-1-a"):
        names.check("cluster", "c9", "x")
