"""The federation's topology as configuration: regions, zones, clusters and what connects them.

A topology file (YAML or JSON; format in ``deploy/topology/example.yaml``) names every region
(with its zones), every cluster (its region, zone, execution backend and the backend's
connection settings, interconnect, storage tier, residency tags), the price catalog (inline
entries or a reference to a catalog file in the ``fedsched/catalog/prices.yaml`` format) and
the bandwidth between regions (Gbit/s per region pair)::

    regions:
      - name: eu-west-1
        zones: [eu-west-1a]
    clusters:
      - name: eu-west-1-a
        region: eu-west-1
        zone: eu-west-1a
        backend: trace
        trace: {nodes: path/to/nodes.csv}   # openb node format

Rules (checked by :func:`parse_topology`, every error a
:class:`~fedsched.errors.ValidationError` whose field is the path of the bad key, e.g.
``clusters[2].zone``):

* unknown keys are refused at every level (pydantic ``extra="forbid"``);
* region, zone, cluster names and residency tags follow :mod:`fedsched.naming`;
* names are unique (regions, zones across regions, clusters);
* a cluster's region exists and its zone is a zone of that region;
* a cluster carries exactly the settings block of its backend (``trace:`` for ``backend:
  trace``, ``slurm:`` for slurm, ``kubernetes:`` for kubernetes);
* bandwidth pairs name two different known regions, each pair at most once (either order);
  pairs not listed use ``default_bandwidth_gbit_s``;
* price catalog regions (``region_factor``, ``overrides``) are regions of the topology.

Relative paths (trace node lists, the price catalog file) resolve against the folder of the
topology file (:attr:`Topology.base_dir`); ``nodes: bundled`` names the bundled openb node list.
No I/O beyond reading the file itself: node lists and catalogs are read by whoever uses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from fedsched import naming
from fedsched.errors import FedError, ValidationError
from fedsched.pricing import PriceCatalog, load_price_catalog
from fedsched.yamltext import load_yaml, read_text

#: ``trace.nodes`` value naming the bundled openb node list.
BUNDLED = "bundled"
#: Bandwidth between two regions not listed in ``bandwidth`` (Gbit/s; 10 = 1.25e9 bytes/s, the
#: scheduler's former fixed figure).
DEFAULT_BANDWIDTH_GBIT_S = 10.0
#: Most regions / clusters one topology may name (a bound far above any real federation).
MAX_REGIONS = 256
MAX_CLUSTERS = 4096

_STRICT = ConfigDict(extra="forbid", frozen=True)


class Region(BaseModel):
    """A region and its zones (at least one)."""

    model_config = _STRICT
    name: str
    zones: tuple[str, ...] = Field(min_length=1, max_length=64)


class TraceSplit(BaseModel):
    """How clusters sharing one node list divide it (the rule of
    :func:`services.inventory.trace.cluster_of`): a node goes to the cluster whose ``index``
    equals ``pick(sha256(node name), weights[card model] or weights["default"])`` (cumulative
    normalised weights, one per cluster sharing the list).

    Attributes:
        index: this cluster's position among the clusters sharing the list (0-based).
        weights: canonical card model (or ``default``, required) -> one weight >= 0 per
            sharing cluster.
    """

    model_config = _STRICT
    index: int = Field(ge=0, lt=1024)
    weights: dict[str, tuple[float, ...]]


class TraceSettings(BaseModel):
    """``backend: trace``: nodes from an openb node list; jobs run for their recorded runtime.

    Attributes:
        nodes: node list path (relative to the topology file) or ``bundled``.
        rdma: nodes sit on an RDMA fabric (None = from the cluster's interconnect: ``rdma`` or
            ``infiniband``).
        split: when several clusters share ``nodes``: which part is this cluster's (absent =
            every node of the list).
    """

    model_config = _STRICT
    nodes: str = Field(min_length=1, max_length=4096)
    rdma: bool | None = None
    split: TraceSplit | None = None


class SlurmSettings(BaseModel):
    """``backend: slurm`` (filled in by the Slurm backend; the keys are fixed now so files stay
    valid): ``partition`` jobs go to, optional ``account`` and ``qos``, and how to reach the
    controller (``rest_url`` of slurmrestd, ``token_file`` holding its JWT; absent = the local
    ``sbatch``/``squeue`` commands)."""

    model_config = _STRICT
    partition: str = Field(min_length=1, max_length=128)
    account: str | None = None
    qos: str | None = None
    rest_url: str | None = None
    token_file: str | None = None
    #: ``SLURM_CONF`` of the cluster (relative to the topology file; absent = the client's default)
    conf: str | None = None
    #: directory of sbatch/squeue/scancel/sinfo (absent = ``PATH``)
    bin_dir: str | None = None
    #: per-attempt output files (absent = ``<dir of conf or /tmp>/fedsched-out``)
    output_dir: str | None = None
    #: the ``jobcomp/filetxt`` log, read for jobs that left squeue (absent = not read)
    jobcomp_log: str | None = None
    #: seconds between squeue polls
    poll_s: float = Field(default=1.0, gt=0, le=300)
    #: ``--time`` = estimate x (1 + ratio) + margin seconds, in whole minutes
    time_margin_s: float = Field(default=60.0, ge=0, le=7 * 86400)
    time_margin_ratio: float = Field(default=0.0, ge=0, le=10)


class KubernetesSettings(BaseModel):
    """``backend: kubernetes``: how the agent reaches its cluster and how it maps fedsched's
    vocabulary onto the cluster's (read by ``services/inventory/kubernetes.py``).

    Attributes:
        kubeconfig: kubeconfig file (relative to the topology file); absent = the in-cluster
            service account (``KUBERNETES_SERVICE_HOST`` + the mounted token).
        context: the kubeconfig context (absent = its current context).
        namespace: where the agent creates Jobs and Services (one namespace per cluster entry).
        gpu_resources: extended resource names counted as accelerators, first match per node
            (``nvidia.com/gpu``, Ascend NPUs ``huawei.com/Ascend910``...).
        card_model_label: node label holding the card model (GPU feature discovery's
            ``nvidia.com/gpu.product``), mapped through the naming module's aliases.
        gpu_memory_label: node label with one card's memory in MiB (GFD ``nvidia.com/gpu.memory``).
        rdma_label: node label whose value ``true`` (any case) / ``1`` marks an RDMA-capable node
            ("" = use the cluster's ``interconnect``).
        priority_classes: fedsched priority class -> Kubernetes ``priorityClassName`` (unmapped:
            none set).
        kueue_queue: when set, the cluster runs Kueue and Jobs go to this LocalQueue (label
            ``kueue.x-k8s.io/queue-name``), created suspended for Kueue to admit.
        image_pull_limit_s: seconds a worker may sit in ImagePullBackOff / ErrImagePull before the
            attempt is failed (``image_pull``).
        master_port: rank 0's rendezvous port (``MASTER_PORT``).
        request_timeout_s: per API request timeout (seconds); a timeout is a retryable error.
    """

    model_config = _STRICT
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = Field(default="default", min_length=1, max_length=63)
    gpu_resources: tuple[str, ...] = ("nvidia.com/gpu",)
    card_model_label: str = "nvidia.com/gpu.product"
    gpu_memory_label: str = "nvidia.com/gpu.memory"
    rdma_label: str = ""
    priority_classes: dict[str, str] = Field(default_factory=dict)
    kueue_queue: str | None = None
    image_pull_limit_s: float = Field(default=300.0, gt=0)
    master_port: int = Field(default=29500, ge=1, le=65535)
    request_timeout_s: float = Field(default=10.0, gt=0)


class Cluster(BaseModel):
    """One cluster of the federation.

    Attributes:
        name / region / zone: canonical names (the zone one of the region's).
        backend: how its agent runs work: ``trace``, ``slurm`` or ``kubernetes``.
        trace / slurm / kubernetes: the backend's settings (exactly the one of ``backend``).
        interconnect: node fabric reported to the scheduler (``ethernet``, ``rdma``, ``infiniband``).
        storage_tier: reported storage class (``nvme``, ``standard``, ``hdd``, ...).
        residency_tags: data-residency labels jobs may require (``pii``, ``finance``, ...).
    """

    model_config = _STRICT
    name: str
    region: str
    zone: str
    backend: Literal["trace", "slurm", "kubernetes"]
    trace: TraceSettings | None = None
    slurm: SlurmSettings | None = None
    kubernetes: KubernetesSettings | None = None
    interconnect: Literal["ethernet", "rdma", "infiniband"] = "ethernet"
    storage_tier: str = Field(default="standard", pattern=r"^[a-z][a-z0-9-]{0,31}$")
    residency_tags: tuple[str, ...] = ()

    @property
    def rdma(self) -> bool:
        """Whether its nodes sit on an RDMA fabric (trace ``rdma`` if set, else the interconnect)."""
        if self.trace is not None and self.trace.rdma is not None:
            return self.trace.rdma
        return self.interconnect in ("rdma", "infiniband")


class Bandwidth(BaseModel):
    """Bandwidth between two regions (both directions), Gbit/s."""

    model_config = _STRICT
    between: tuple[str, str]
    gbit_s: float = Field(gt=0, le=1e6)


class Prices(BaseModel):
    """The price catalog: ``catalog`` (a file in the ``prices.yaml`` format, relative to the
    topology file) or ``entries`` (the same document inline); neither = the bundled catalog."""

    model_config = _STRICT
    catalog: str | None = None
    entries: dict[str, Any] | None = None


class Topology(BaseModel):
    """The federation (see the module docstring for the rules).

    Attributes:
        regions / clusters: as in the file, in file order.
        bandwidth: listed region pairs; others get ``default_bandwidth_gbit_s``.
        prices: the price catalog (None = the bundled one).
        base_dir: folder relative paths resolve against (not part of the file).
    """

    model_config = _STRICT
    regions: tuple[Region, ...] = Field(min_length=1, max_length=MAX_REGIONS)
    clusters: tuple[Cluster, ...] = Field(min_length=1, max_length=MAX_CLUSTERS)
    bandwidth: tuple[Bandwidth, ...] = ()
    default_bandwidth_gbit_s: float = Field(default=DEFAULT_BANDWIDTH_GBIT_S, gt=0, le=1e6)
    prices: Prices | None = None
    base_dir: Path = Field(default=Path("."), exclude=True)

    # ------------------------------------------------------------------ names

    def region_names(self) -> tuple[str, ...]:
        """Region names in file order."""
        return tuple(r.name for r in self.regions)

    def zone_names(self) -> tuple[str, ...]:
        """Zone names of every region, in file order."""
        return tuple(z for r in self.regions for z in r.zones)

    def cluster_names(self) -> tuple[str, ...]:
        """Cluster names in file order."""
        return tuple(c.name for c in self.clusters)

    def cluster(self, name: str) -> Cluster:
        """The cluster called ``name``.

        Raises:
            ValidationError: no such cluster (field ``cluster``; the message lists the known ones).
        """
        for c in self.clusters:
            if c.name == name:
                return c
        raise ValidationError("cluster", f"{name!r} is not a cluster of the topology "
                                         f"(clusters: {', '.join(self.cluster_names())})")

    # ------------------------------------------------------------------ paths, prices, bandwidth

    def resolve(self, path: str) -> Path:
        """``path`` from the file, resolved against :attr:`base_dir` (absolute paths unchanged)."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)

    def price_catalog(self) -> PriceCatalog:
        """The catalog in force (inline entries, the referenced file, or the bundled one).

        Raises:
            ValidationError: unreadable or malformed catalog (field ``prices...``), or a region of
                the catalog that is not in the topology.
        """
        if self.prices is None or (self.prices.catalog is None and self.prices.entries is None):
            return load_price_catalog()
        if self.prices.entries is not None:
            text = json.dumps(self.prices.entries, sort_keys=True, default=str)
            where = "prices.entries"
        else:
            text = read_text(self.resolve(self.prices.catalog), "prices.catalog")
            where = "prices.catalog"
        try:
            catalog = PriceCatalog.from_yaml(text)
        except ValidationError as e:
            raise ValidationError(f"{where}.{e.field.removeprefix('price_catalog').lstrip('.')}".rstrip("."),
                                  e.reason) from e
        known = set(self.region_names())
        for region in [*catalog.region_factor, *(r for r, _ in catalog.overrides)]:
            if region not in known:
                raise ValidationError(f"{where}.region_factor" if region in catalog.region_factor
                                      else f"{where}.overrides", _unknown("region", region, self.region_names()))
        return catalog

    def bandwidth_bps(self) -> dict[tuple[str, str], float]:
        """(region a, region b) -> bytes per second, both orders, for every pair of distinct
        regions (listed pairs at their figure, others at ``default_bandwidth_gbit_s``;
        1 Gbit/s = 1.25e8 bytes/s)."""
        names = self.region_names()
        out = {(a, b): self.default_bandwidth_gbit_s * 1e9 / 8 for a in names for b in names if a != b}
        for bw in self.bandwidth:
            a, b = bw.between
            out[(a, b)] = out[(b, a)] = bw.gbit_s * 1e9 / 8
        return out

    def listed_bandwidth_bps(self) -> tuple[tuple[str, str, float], ...]:
        """``(region a, region b, bytes/s)`` for the listed pairs only, both orders, sorted (the
        scheduler's ``region_bandwidth_bps``; unlisted pairs use its default figure)."""
        out = []
        for bw in self.bandwidth:
            a, b = bw.between
            out += [(a, b, bw.gbit_s * 1e9 / 8), (b, a, bw.gbit_s * 1e9 / 8)]
        return tuple(sorted(out))

    def to_document(self) -> dict[str, Any]:
        """The topology as plain data that :func:`parse_topology` accepts back (defaults
        omitted)."""
        return self.model_dump(mode="json", exclude_none=True, exclude_defaults=True, exclude={"base_dir"})


def _unknown(kind: str, value: str, known: tuple[str, ...] | list[str]) -> str:
    return f"{value!r} is not a {kind} of the topology ({kind}s: {', '.join(known) or 'none'})"


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "topology"


def parse_topology(data: Any, *, base_dir: Path | str = ".", field: str = "topology") -> Topology:
    """Validate a topology document (already parsed YAML/JSON).

    Args:
        data: the document (a mapping).
        base_dir: folder its relative paths resolve against.
        field: names the whole document in errors about its shape.

    Raises:
        ValidationError: the first rule broken (see the module docstring); ``field`` is the path
            of the bad key (``clusters[2].zone``), the message names the known values.
    """
    if not isinstance(data, dict):
        raise ValidationError(field, f"must be a mapping with regions and clusters, got {type(data).__name__}")
    try:
        topo = Topology.model_validate({**data, "base_dir": Path(base_dir)})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        loc = tuple(p for p in first["loc"] if p not in ("function-after", "tagged-union"))
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = "unknown key"
        elif first["type"] == "missing":
            msg = "required"
        raise ValidationError(_path(loc), msg) from None
    _check_names(topo)
    return topo


def _check_names(topo: Topology) -> None:
    region_zones: dict[str, tuple[str, ...]] = {}
    zone_region: dict[str, str] = {}
    for i, region in enumerate(topo.regions):
        naming.check_name("region", region.name, f"regions[{i}].name")
        if region.name in region_zones:
            raise ValidationError(f"regions[{i}].name", f"region {region.name!r} is named twice")
        for j, zone in enumerate(region.zones):
            naming.check_name("zone", zone, f"regions[{i}].zones[{j}]")
            if zone in zone_region:
                raise ValidationError(f"regions[{i}].zones[{j}]", f"zone {zone!r} is already a zone of region "
                                                                  f"{zone_region[zone]}")
            zone_region[zone] = region.name
        region_zones[region.name] = region.zones
    names = tuple(region_zones)
    seen: set[str] = set()
    shared: dict[str, list[tuple[int, TraceSplit]]] = {}
    for i, c in enumerate(topo.clusters):
        f = f"clusters[{i}]"
        naming.check_name("cluster", c.name, f"{f}.name")
        if c.name in seen:
            raise ValidationError(f"{f}.name", f"cluster {c.name!r} is named twice")
        seen.add(c.name)
        naming.check_name("region", c.region, f"{f}.region")
        if c.region not in region_zones:
            raise ValidationError(f"{f}.region", _unknown("region", c.region, names))
        naming.check_name("zone", c.zone, f"{f}.zone")
        if c.zone not in region_zones[c.region]:
            raise ValidationError(f"{f}.zone", f"{c.zone!r} is not a zone of region {c.region} "
                                               f"(zones: {', '.join(region_zones[c.region])})")
        for k, tag in enumerate(c.residency_tags):
            naming.check_name("residency_tag", tag, f"{f}.residency_tags[{k}]")
        for block in ("trace", "slurm", "kubernetes"):
            present = getattr(c, block) is not None
            if block == c.backend and not present:
                raise ValidationError(f"{f}.{block}", f"required: backend {c.backend} needs its settings block "
                                                      f"({block}: {{...}})")
            if block != c.backend and present:
                raise ValidationError(f"{f}.{block}", f"unexpected for backend {c.backend} (only {c.backend}: "
                                                      f"{{...}} goes with it)")
        if c.trace is not None and c.trace.split is not None:
            split = c.trace.split
            if "default" not in split.weights:
                raise ValidationError(f"{f}.trace.split.weights", "needs a 'default' row (card models without "
                                                                  "a row of their own)")
            for model, row in split.weights.items():
                if model != "default":
                    try:
                        canonical = naming.canonical_card_model(model)
                    except FedError as e:
                        raise ValidationError(f"{f}.trace.split.weights.{model}", str(e)) from e
                    if canonical != model:
                        raise ValidationError(f"{f}.trace.split.weights.{model}",
                                              f"not a canonical card model (did you mean {canonical!r}?)")
                if split.index >= len(row) or any(w < 0 for w in row) or sum(row) <= 0:
                    raise ValidationError(f"{f}.trace.split.weights.{model}",
                                          f"needs one weight >= 0 per sharing cluster (index {split.index} "
                                          f"given, {len(row)} weights) and a positive sum")
            shared.setdefault(c.trace.nodes, []).append((i, split))
    for nodes, members in shared.items():
        first_i, first = members[0]
        for i, split in members[1:]:
            if split.weights != first.weights:
                raise ValidationError(f"clusters[{i}].trace.split.weights", f"differs from clusters[{first_i}]'s; "
                                      f"clusters sharing node list {nodes!r} split it by one table")
            if any(split.index == other.index for j, other in members if j < i):
                raise ValidationError(f"clusters[{i}].trace.split.index", f"index {split.index} is taken by "
                                      f"another cluster sharing node list {nodes!r}")
    pairs: set[frozenset[str]] = set()
    for i, bw in enumerate(topo.bandwidth):
        for k, r in enumerate(bw.between):
            if r not in region_zones:
                raise ValidationError(f"bandwidth[{i}].between[{k}]", _unknown("region", r, names))
        pair = frozenset(bw.between)
        if len(pair) != 2:
            raise ValidationError(f"bandwidth[{i}].between", "names one region twice; a pair is two regions")
        if pair in pairs:
            raise ValidationError(f"bandwidth[{i}].between", f"the pair {' / '.join(sorted(pair))} is listed twice")
        pairs.add(pair)
    if topo.prices is not None:
        if topo.prices.catalog is not None and topo.prices.entries is not None:
            raise ValidationError("prices", "either catalog (a file) or entries (inline), not both")
        if topo.prices.entries is not None:
            topo.price_catalog()  # region names and entries checked now, not at first use


def load_topology(path: Path | str) -> Topology:
    """Read and validate the topology file at ``path`` (YAML or JSON: no aliases, size-capped
    by :mod:`fedsched.yamltext`); relative paths inside resolve against its folder.

    Raises:
        ValidationError: unreadable file, not YAML, or a rule broken (field: path of the bad key).
    """
    path = Path(path)
    text = read_text(path, "topology")
    data = load_yaml(text, "topology")
    topo = parse_topology(data, base_dir=path.resolve().parent)
    if topo.prices is not None and topo.prices.catalog is not None:
        topo.price_catalog()  # fail at load, not at first use
    return topo


def dump_topology(topo: Topology, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """``topo`` as text :func:`load_topology` accepts back (paths as written in the file)."""
    doc = topo.to_document()
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)


class KnownNames:
    """The region, zone and cluster names in force, for checks at entry points.

    Args:
        regions / zones / clusters: the names (iterables of str).

    :meth:`check` raises a ValidationError naming the field and the known names.
    """

    def __init__(self, regions, zones=(), clusters=()) -> None:
        self.regions = tuple(regions)
        self.zones = tuple(zones)
        self.clusters = tuple(clusters)

    @classmethod
    def of(cls, topo: Topology) -> "KnownNames":
        """The names of ``topo``."""
        return cls(topo.region_names(), topo.zone_names(), topo.cluster_names())

    def check(self, kind: Literal["region", "zone", "cluster"], value: str, field: str) -> str:
        """``value`` if it is a known name of ``kind``.

        Raises:
            ValidationError: unknown (field ``field``; the message lists the known names).
        """
        known = {"region": self.regions, "zone": self.zones, "cluster": self.clusters}[kind]
        if value not in known:
            raise ValidationError(field, _unknown(kind, value, known))
        return value
