"""The topology in force, composed: the generated default and the backend factory.

* :func:`default_topology` writes today's documented split of a trace (``services/inventory/trace.py``:
  :data:`~services.inventory.trace.CLUSTERS` and :data:`~services.inventory.trace.SPLIT_WEIGHTS`,
  3 regions x 2 clusters) as a topology: every cluster has ``backend: trace`` on the same node
  list with ``split: {index: i, weights: SPLIT_WEIGHTS}``, so each node lands in the cluster
  :func:`~services.inventory.trace.cluster_of` gives it. ``fedsched topology show`` prints it.
* :func:`cluster_nodes` reads a trace cluster's nodes (its part of a shared list).
* :func:`build_backend` turns a cluster entry into the backend its agent drives; it knows
  ``trace`` and ``kubernetes``; ``slurm`` plugs in here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Callable

from fedsched.clock import Clock, SystemClock
from fedsched.errors import ValidationError
from fedsched.topology import BUNDLED, Cluster, Topology, parse_topology
from services.inventory.trace import CLUSTERS, SPLIT_WEIGHTS, ClusterDef, TraceNode, load_nodes, pick, unit_hash


def bundled_nodes() -> Path:
    """The bundled openb GPU node list."""
    return Path(str(resources.files("fedsched.data").joinpath("alibaba-gpu-2023", "openb_node_list_gpu_node.csv")))


def default_topology(nodes: Path | str | None = None) -> Topology:
    """Today's split of a trace as a topology (see the module docstring).

    Args:
        nodes: the node list all six clusters share (default: ``bundled``).
    """
    weights = {model: list(row) for model, row in SPLIT_WEIGHTS.items()}
    regions: dict[str, list[str]] = {}
    for c in CLUSTERS:
        regions.setdefault(c.region, []).append(c.zone)
    doc = {
        "regions": [{"name": r, "zones": zones} for r, zones in regions.items()],
        "clusters": [{"name": c.name, "region": c.region, "zone": c.zone, "backend": "trace",
                      "trace": {"nodes": str(nodes) if nodes is not None else BUNDLED,
                                "split": {"index": i, "weights": weights}},
                      "interconnect": c.interconnect, "storage_tier": c.storage_tier,
                      "residency_tags": list(c.residency_tags)}
                     for i, c in enumerate(CLUSTERS)],
    }
    return parse_topology(doc, base_dir=Path.cwd())


def cluster_def(topo: Topology, name: str) -> ClusterDef:
    """The agent's view of cluster ``name`` (names and reported properties).

    Raises:
        ValidationError: no such cluster (the message lists the known ones).
    """
    c = topo.cluster(name)
    return ClusterDef(c.name, c.region, c.zone, c.interconnect, c.storage_tier, tuple(c.residency_tags))


def nodes_path(topo: Topology, name: str) -> Path:
    """The node list file of trace cluster ``name`` (``bundled`` resolved)."""
    c = topo.cluster(name)
    if c.trace is None:
        raise ValidationError("backend", f"cluster {name} runs backend {c.backend}, not trace")
    return bundled_nodes() if c.trace.nodes == BUNDLED else topo.resolve(c.trace.nodes)


def cluster_nodes(topo: Topology, name: str, cache: dict[Path, list[TraceNode]] | None = None) -> list[TraceNode]:
    """The nodes of trace cluster ``name``: its node list, or its part of a shared one by the
    split rule (:class:`fedsched.topology.TraceSplit`).

    Args:
        cache: node lists already read (path -> nodes), filled in; lets clusters sharing a list
            read it once.

    Raises:
        ValidationError: not a trace cluster; unreadable or malformed node list (field ``nodes...``).
    """
    c = topo.cluster(name)
    path = nodes_path(topo, name)
    cache = {} if cache is None else cache
    if path not in cache:
        cache[path] = load_nodes(path)
    nodes = cache[path]
    split = c.trace.split
    if split is None:
        return list(nodes)
    default = split.weights["default"]
    return [n for n in nodes if pick(unit_hash(n.name), split.weights.get(n.card_model, default)) == split.index]


def _trace_backend(entry: Cluster, topo: Topology, cache: dict[Path, list[TraceNode]] | None, clock: Clock):
    from services.inventory.agent import TraceBackend

    return TraceBackend(cluster_nodes(topo, entry.name, cache), clock=clock, rdma=entry.rdma)


def _kubernetes_backend(entry: Cluster, topo: Topology, cache: dict[Path, list[TraceNode]] | None, clock: Clock):
    from services.inventory.kubernetes import from_settings
    from fedsched.topology import KubernetesSettings

    settings = entry.kubernetes or KubernetesSettings()
    kubeconfig = settings.kubeconfig
    if kubeconfig:
        settings = settings.model_copy(update={"kubeconfig": str(topo.resolve(kubeconfig))})
    return from_settings(settings, clock=clock, rdma_default=entry.rdma)


def _slurm_backend(entry: Cluster, topo: Topology, cache, clock: Clock):
    """A :class:`~services.inventory.slurm.SlurmBackend` from ``entry.slurm`` (relative paths
    resolve against the topology file). slurmrestd (``rest_url``) is not supported yet."""
    from services.inventory.slurm import SlurmBackend, SlurmConfig

    s = entry.slurm
    index = topo.cluster_names().index(entry.name)
    if s is None:
        raise ValidationError(f"clusters[{index}].slurm", "backend slurm needs a slurm: block (partition)")
    if s.rest_url:
        raise ValidationError(f"clusters[{index}].slurm.rest_url", "slurmrestd is not supported by this build: "
                                                                  "leave rest_url out to use sbatch/squeue/scancel/sinfo")
    conf = str(topo.resolve(s.conf)) if s.conf else None
    out = str(topo.resolve(s.output_dir)) if s.output_dir else str(Path(conf).parent / "fedsched-out" if conf
                                                                  else Path("/tmp") / "fedsched-out")
    return SlurmBackend(SlurmConfig(
        partition=s.partition, output_dir=out, conf=conf, bin_dir=str(topo.resolve(s.bin_dir)) if s.bin_dir else None,
        account=s.account, qos=s.qos, poll_s=s.poll_s, time_margin_s=s.time_margin_s,
        time_margin_ratio=s.time_margin_ratio, jobcomp_log=str(topo.resolve(s.jobcomp_log)) if s.jobcomp_log else None,
    ), clock=clock)


#: backend name -> factory ``(cluster entry, topology, node-list cache, business clock) -> backend``. The Slurm
#: and Kubernetes backends add ``"slurm"`` / ``"kubernetes"`` here (their settings are
#: ``entry.slurm`` / ``entry.kubernetes``; relative paths resolve with ``topo.resolve``).
BACKEND_FACTORIES: dict[str, Callable[[Cluster, Topology, dict | None, Clock], object]] = {"trace": _trace_backend,
                                                                                       "kubernetes": _kubernetes_backend,
                                                                                            "slurm": _slurm_backend}


def build_backend(entry: Cluster, topo: Topology, cache: dict[Path, list[TraceNode]] | None = None, *,
                  clock: Clock | None = None):
    """The backend the agent of cluster ``entry`` drives, built from its topology entry by
    :data:`BACKEND_FACTORIES`.

    Today: ``trace`` -> :class:`~services.inventory.agent.TraceBackend` over
    :func:`cluster_nodes` (RDMA from ``trace.rdma`` or the interconnect); ``kubernetes`` ->
    :class:`~services.inventory.kubernetes.KubernetesBackend` from ``entry.kubernetes`` (kubeconfig
    relative to the topology file; absent = in-cluster service account; RDMA from
    ``rdma_label``, else the interconnect); ``slurm`` -> :class:`~services.inventory.slurm.SlurmBackend`
    (sbatch & co.; not slurmrestd yet).

    Args:
        entry: the cluster's entry (``topo.cluster(name)``).
        topo: the topology it belongs to (resolves relative paths).
        cache: node lists already read (see :func:`cluster_nodes`).
        clock: the business clock the backend observes (default: the system clock).

    Raises:
        ValidationError: a backend this build cannot run (field ``clusters[i].backend``), or the
            trace node list cannot be read.
    """
    factory = BACKEND_FACTORIES.get(entry.backend)
    if factory is None:
        index = topo.cluster_names().index(entry.name)
        raise ValidationError(f"clusters[{index}].backend", f"backend {entry.backend!r} is not available in this "
                                                            f"build (available: {', '.join(BACKEND_FACTORIES)})")
    return factory(entry, topo, cache, clock if clock is not None else SystemClock())

#: The regions of the default split, in order (the bundled policy's and the overlay's homes).
DEFAULT_REGIONS: tuple[str, ...] = tuple(dict.fromkeys(c.region for c in CLUSTERS))


def map_region(region: str, regions: tuple[str, ...]) -> str:
    """Where a home region of the default split lands in a topology with ``regions`` (file order).

    Rule (documented in the README, "Your federation's topology"): a region the topology has
    stays; otherwise the i-th default region (cn-north-1, cn-east-1, cn-south-1) becomes
    ``regions[i % len(regions)]``, and any other name becomes ``regions[0]``. With the default
    topology nothing changes.
    """
    if region in regions:
        return region
    if region in DEFAULT_REGIONS:
        return regions[DEFAULT_REGIONS.index(region) % len(regions)]
    return regions[0]


def policy_for_topology(text: str, topo: Topology) -> str:
    """The bundled-style policy ``text`` with tenants' home regions moved into ``topo`` by
    :func:`map_region` (``regions`` lists dropped to those the topology has); ``text`` itself
    when nothing needs to move. Used for the first-start policy when no policy file is given."""
    from fedsched.yamltext import load_yaml
    import yaml

    data = load_yaml(text, "policy")
    regions = topo.region_names()
    if not isinstance(data, dict):
        return text
    changed = False
    for tenant in data.get("tenants") or []:
        if isinstance(tenant, dict) and isinstance(tenant.get("home_region"), str):
            home = map_region(tenant["home_region"], regions)
            changed |= home != tenant["home_region"]
            tenant["home_region"] = home
            if tenant.get("regions"):
                kept = sorted({map_region(r, regions) for r in tenant["regions"]})
                changed |= kept != tenant["regions"]
                tenant["regions"] = kept
    return yaml.safe_dump(data, sort_keys=False) if changed else text
