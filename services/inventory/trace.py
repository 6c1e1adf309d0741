"""Trace input: the openb CSV formats and the fixed rule that splits one trace into a federation.

Formats (Alibaba cluster-trace-gpu-v2023; columns beyond the required ones are optional, and
absent or empty optional values take the documented default):

* node list -- ``sn`` (required), ``cpu_milli``, ``memory_mib`` (absent: not enforced),
  ``gpu`` (absent: 0), ``model`` (card model; any name, canonicalised through the catalog;
  unknown cards get a minted ``unlisted-*`` name).
* pod list -- ``name`` and ``creation_time`` (required, seconds from trace start), ``cpu_milli``,
  ``memory_mib`` (absent: 0), ``num_gpu`` (absent: 0), ``gpu_milli`` (absent: 1000 when the pod
  has GPUs), ``gpu_spec`` (allowed models, ``|``-separated, absent/empty: any), ``qos``
  (absent: ``BE``), ``pod_phase`` (absent: ``Succeeded``), ``scheduled_time``,
  ``deletion_time`` (absent: the pod lives until the trace end).

Split rule (:func:`split_nodes`), fixed and documented so a replay is reproducible: the
federation has three regions with two clusters each (:data:`CLUSTERS`). Each node goes to one
cluster by ``u = sha256(node name)[0:8] / 2**64`` against the cumulative weights of its card
model's row in :data:`SPLIT_WEIGHTS` (models without a row use ``default``). The weights are
deliberately uneven -- the north region holds most of the big 8-card nodes, the east most T4s,
the south is small and cheap -- so home regions fill at different rates and cross-region
placement matters.

This split is the *default topology* (``fedapp/topology.py``: ``default_topology``, shown by
``fedsched topology show``); ``--topology FILE`` replaces it with the operator's federation.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from fedsched import naming
from fedsched.errors import ValidationError
from fedsched.jobs import AttemptState

log = logging.getLogger(__name__)

UNLIMITED = 10**12  #: stands for "not enforced" when a node list has no cpu/memory columns
MAX_NODE_GPUS = 1024  #: most GPUs one node row may declare
MAX_TRACE_SPAN_S = 100 * 365 * 86400  #: creation and deletion times lie within 100 years of the first creation


@dataclass(frozen=True, slots=True)
class ClusterDef:
    """One cluster of the split: canonical names and properties the agent reports."""

    name: str
    region: str
    zone: str
    interconnect: str
    storage_tier: str
    residency_tags: tuple[str, ...]


#: The federation a trace is split into (3 regions x 2 clusters).
CLUSTERS: tuple[ClusterDef, ...] = (
    ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "infiniband", "nvme", ("cn", "finance")),
    ClusterDef("cn-north-1-c2", "cn-north-1", "cn-north-1b", "ethernet", "standard", ("cn",)),
    ClusterDef("cn-east-1-c1", "cn-east-1", "cn-east-1a", "rdma", "nvme", ("cn", "pii")),
    ClusterDef("cn-east-1-c2", "cn-east-1", "cn-east-1b", "ethernet", "standard", ("cn",)),
    ClusterDef("cn-south-1-c1", "cn-south-1", "cn-south-1a", "ethernet", "standard", ("cn",)),
    ClusterDef("cn-south-1-c2", "cn-south-1", "cn-south-1b", "ethernet", "hdd", ("cn",)),
)

#: card model -> weight per cluster, in :data:`CLUSTERS` order.
SPLIT_WEIGHTS: dict[str, tuple[float, ...]] = {
    "default":          (0.30, 0.10, 0.20, 0.15, 0.15, 0.10),
    "alibaba-g2":       (0.40, 0.05, 0.25, 0.05, 0.20, 0.05),
    "alibaba-g3":       (0.60, 0.00, 0.40, 0.00, 0.00, 0.00),
    "nvidia-t4-16gb":   (0.05, 0.10, 0.35, 0.25, 0.15, 0.10),
    "nvidia-p100-16gb": (0.00, 0.30, 0.00, 0.20, 0.30, 0.20),
    "nvidia-v100-16gb": (0.50, 0.00, 0.25, 0.00, 0.25, 0.00),
    "nvidia-v100-32gb": (0.70, 0.00, 0.30, 0.00, 0.00, 0.00),
    "nvidia-a10-24gb":  (0.00, 0.00, 0.50, 0.00, 0.50, 0.00),
}


@dataclass(frozen=True, slots=True)
class TraceNode:
    """A node of a trace node list (canonical card model; units milli-core, MiB)."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    card_model: str
    gpu_memory_gib: int | None


@dataclass(frozen=True, slots=True)
class TracePod:
    """A pod of a trace pod list (times in seconds from trace start).

    Attributes:
        runtime_s: how long it ran (deletion - scheduled; for never-scheduled pods,
            deletion - creation: as long as its owner kept it).
        outcome: ``succeeded`` or ``failed`` (the trace's ``Failed`` phase).
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    qos: str
    phase: str
    creation_time: int
    scheduled_time: int | None
    deletion_time: int
    runtime_s: int
    outcome: AttemptState


def _read_rows(path: Path | str | io.TextIOBase, required: Iterable[str], what: str) -> tuple[list[dict], list[str]]:
    try:
        text = path.read() if isinstance(path, io.TextIOBase) else Path(path).read_text("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValidationError(what, f"{path} is not UTF-8 text (byte {e.start}); expected the openb CSV format") from e
    except OSError as e:
        raise ValidationError(what, f"cannot read {path}: {e.strerror or e}") from e
    try:
        reader = csv.DictReader(io.StringIO(text))
        columns = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in required if c not in columns]
        if missing:
            raise ValidationError(what, f"missing required column(s) {', '.join(missing)}; "
                                        f"has {', '.join(columns) or 'none'}")
        rows = [{(k or "").strip(): (v if isinstance(v, str) else "").strip() for k, v in row.items()}
                for row in reader]
    except csv.Error as e:
        raise ValidationError(what, f"{path} is not valid CSV: {e}") from e
    return rows, columns


#: Largest value a count or size column may hold (a bound far above any real node or pod; it
#: keeps a corrupt row from overflowing the wire formats further on).
MAX_VALUE = 10**12


def _int(row: dict, key: str, default: int, what: str, line: int, *, minimum: int | None = 0,
         maximum: int = MAX_VALUE) -> int:
    """The integer in ``row[key]`` (``default`` when empty); decimals are truncated.

    Raises:
        ValidationError: not a finite number, or outside ``minimum``..``maximum`` (field
            ``what:line:key``).
    """
    raw = row.get(key, "")
    if raw == "":
        return default
    try:
        value = int(float(raw))
    except (ValueError, OverflowError) as e:  # "abc", "nan", "inf"
        raise ValidationError(f"{what}:{line}:{key}", f"not a finite number: {raw!r}") from e
    if minimum is not None and value < minimum:
        raise ValidationError(f"{what}:{line}:{key}", f"must be >= {minimum}, got {raw!r}")
    if value > maximum:
        raise ValidationError(f"{what}:{line}:{key}", f"must be <= {maximum}, got {raw!r}")
    return value


def _unique_names(rows: list[dict], key: str, what: str) -> None:
    """Make ``row[key]`` unique in place: a repeated name becomes ``name-dup2``, ``name-dup3``, ... (a
    warning says how many), so every row of the trace stays one node / one job.

    Raises:
        ValidationError: an empty name (field ``what:line:key``).
    """
    seen: dict[str, int] = {}
    renamed = []
    for line, row in enumerate(rows, start=2):
        name = row.get(key, "")
        if not name:
            raise ValidationError(f"{what}:{line}:{key}", "empty; every row needs a name")
        if name in seen:
            seen[name] += 1
            new = f"{name}-dup{seen[name]}"
            while new in seen:
                seen[name] += 1
                new = f"{name}-dup{seen[name]}"
            seen[new] = 1
            row[key] = new
            renamed.append(line)
        else:
            seen[name] = 1
    if renamed:
        log.warning("%s: %d row(s) repeat an earlier %s (first at line %d); kept, renamed NAME-dup2, NAME-dup3, ...",
                    what, len(renamed), key, renamed[0])


def load_nodes(path: Path | str) -> list[TraceNode]:
    """Parse a node list.

    Raises:
        ValidationError: missing ``sn`` column, unreadable or non-UTF-8 file, an empty name, or a
            non-numeric / negative value (field names file:line:column).
    """
    rows, columns = _read_rows(path, ["sn"], "nodes")
    _unique_names(rows, "sn", "nodes")
    catalog = naming.default_catalog()
    out = []
    for line, row in enumerate(rows, start=2):
        gpus = _int(row, "gpu", 0, "nodes", line, maximum=MAX_NODE_GPUS)
        model_raw = row.get("model", "")
        model = catalog.canonical(model_raw) if gpus > 0 and model_raw else (
            catalog.canonical("unlisted gpu") if gpus > 0 else None)
        out.append(TraceNode(
            name=row["sn"],
            cpu_milli=_int(row, "cpu_milli", UNLIMITED, "nodes", line) if "cpu_milli" in columns else UNLIMITED,
            memory_mib=_int(row, "memory_mib", UNLIMITED, "nodes", line) if "memory_mib" in columns else UNLIMITED,
            gpus=gpus,
            card_model=model.name if model else "",
            gpu_memory_gib=model.memory_gib if model else None,
        ))
    return out


def load_pods(path: Path | str) -> list[TracePod]:
    """Parse a pod list (see the module docstring for defaults), sorted by creation time.

    Raises:
        ValidationError: missing required columns, unreadable or non-UTF-8 file, an empty name,
            or a non-numeric / negative value (field names file:line:column).
    """
    rows, _ = _read_rows(path, ["name", "creation_time"], "pods")
    _unique_names(rows, "name", "pods")
    catalog = naming.default_catalog()
    parsed = []
    for line, row in enumerate(rows, start=2):
        num_gpu = _int(row, "num_gpu", 0, "pods", line)
        parsed.append(dict(
            row=row,
            creation=_int(row, "creation_time", 0, "pods", line),
            scheduled=_int(row, "scheduled_time", -1, "pods", line, minimum=None),
            deletion=_int(row, "deletion_time", -1, "pods", line, minimum=None),
            num_gpu=num_gpu,
            gpu_milli=_int(row, "gpu_milli", 1000, "pods", line) if num_gpu else 0,
            cpu_milli=_int(row, "cpu_milli", 0, "pods", line),
            memory_mib=_int(row, "memory_mib", 0, "pods", line),
            spec=tuple(sorted({catalog.canonical(m).name for m in row.get("gpu_spec", "").split("|") if m.strip()})),
        ))
    t0 = min((p["creation"] for p in parsed), default=0)
    for line, p in enumerate(parsed, start=2):
        for key, value in (("creation_time", p["creation"]), ("scheduled_time", p["scheduled"]),
                           ("deletion_time", p["deletion"])):
            if value - t0 > MAX_TRACE_SPAN_S:
                raise ValidationError(f"pods:{line}:{key}", f"{value} lies more than 100 years after the first "
                                                            f"creation_time ({t0}); times are seconds")
    trace_end = max((max(p["creation"], p["scheduled"], p["deletion"]) for p in parsed), default=0)
    pods = []
    for p in parsed:
        scheduled = p["scheduled"] if p["scheduled"] >= 0 else None
        deletion = p["deletion"] if p["deletion"] >= 0 else trace_end
        start = scheduled if scheduled is not None else p["creation"]
        phase = p["row"].get("pod_phase", "") or "Succeeded"
        pods.append(TracePod(
            name=p["row"]["name"], cpu_milli=p["cpu_milli"], memory_mib=p["memory_mib"], num_gpu=p["num_gpu"],
            gpu_milli=min(1000, max(1, p["gpu_milli"])) if p["num_gpu"] else 0, gpu_spec=p["spec"],
            qos=p["row"].get("qos", "") or "BE", phase=phase, creation_time=p["creation"], scheduled_time=scheduled,
            deletion_time=deletion, runtime_s=max(0, deletion - start),
            outcome=AttemptState.FAILED if phase == "Failed" else AttemptState.SUCCEEDED,
        ))
    pods.sort(key=lambda p: (p.creation_time, p.name))
    return pods


def unit_hash(*parts: object) -> float:
    """Deterministic number in [0, 1) from ``parts`` (sha256, first 8 bytes)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick(u: float, weights: Iterable[float]) -> int:
    """Index chosen by ``u`` in [0, 1) against cumulative normalised ``weights``."""
    weights = list(weights)
    total = sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def cluster_of(node: TraceNode) -> ClusterDef:
    """The cluster the split rule assigns ``node`` to."""
    weights = SPLIT_WEIGHTS.get(node.card_model, SPLIT_WEIGHTS["default"])
    return CLUSTERS[pick(unit_hash(node.name), weights)]


def split_nodes(nodes: Iterable[TraceNode]) -> dict[str, list[TraceNode]]:
    """Cluster name -> its nodes (every cluster of :data:`CLUSTERS` present, maybe empty)."""
    out: dict[str, list[TraceNode]] = {c.name: [] for c in CLUSTERS}
    for node in nodes:
        out[cluster_of(node).name].append(node)
    return out


def cluster_def(name: str) -> ClusterDef:
    """The :data:`CLUSTERS` entry called ``name``.

    Raises:
        ValidationError: no such cluster in the split.
    """
    for c in CLUSTERS:
        if c.name == name:
            return c
    raise ValidationError("cluster", f"{name!r} is not a cluster of the trace split ({', '.join(c.name for c in CLUSTERS)})")
