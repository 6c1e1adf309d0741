"""The ``kubernetes`` execution backend: a region agent running job attempts on a Kubernetes cluster.

Implements :class:`services.inventory.backend.Backend` with ``kubernetes_asyncio`` (the official
client's asyncio sibling: the agent is an asyncio program, so watches are async iterators on the
agent's loop -- no thread per watch, no thread pool between the API and the agent's ledger).

What it reads (WATCHES, never polling loops; each is LIST then WATCH from the list's
``resourceVersion``, bookmarks advance it, ``410 Gone`` -> re-list, other errors -> back off and
re-list; a watch never ends the agent):

* nodes (cluster-wide): allocatable extended resources named in the topology
  (``gpu_resources``: ``nvidia.com/gpu``, ``huawei.com/Ascend910`` ...), card model from a node
  label (``card_model_label``, GPU feature discovery's ``nvidia.com/gpu.product``) mapped through
  :func:`fedsched.naming.canonical_card_model`, zone ``topology.kubernetes.io/zone``, conditions
  (``Ready``; Memory/Disk/PID pressure -> unschedulable), ``spec.unschedulable``, NoSchedule /
  NoExecute taints, RDMA from ``rdma_label``;
* pods (cluster-wide: fedsched's pods give attempt status, the others the GPUs in use that
  fedsched did not place);
* Jobs in the agent's namespace under fedsched's labels.

How an attempt runs (one :class:`~services.inventory.backend.AttemptKey` = one ``batch/v1`` Job):

* Job ``<job>-a<N>-s<S>`` (:attr:`AttemptKey.name`; :func:`k8s_name` shortens a long one),
  ``completionMode: Indexed``,
  ``completions = parallelism = workers``, ``backoffLimit: 0`` (retries belong to the federation),
  labels job id / attempt / shard / tenant / project (and ``kueue.x-k8s.io/queue-name`` when the
  cluster runs Kueue: then created ``suspend: true`` for Kueue to admit), annotation
  ``fedsched.io/nodes`` (the bound nodes, worker order);
* a headless Service of the same name; pods get ``subdomain`` = that name, so rank 0 is
  ``MASTER_ADDR=<name>-0.<name>``; ``RANK``/``GROUP_RANK`` come from the pod's completion index
  (downward API ``batch.kubernetes.io/job-completion-index``), the rest of
  :func:`fedsched.workload.worker_env` is the same for every index;
* required node affinity: ``kubernetes.io/hostname`` in the bound nodes and the card-model label
  in the raw values the cluster uses for the canonical model; a pod anti-affinity spreads a gang
  one worker per node when its bindings name distinct nodes (an indexed Job has one pod
  template, so "worker i on node i" is "the gang on exactly these nodes");
* requests = limits for the GPU extended resource (whole cards), CPU (milli) and memory (MiB);
* image, ``command``, ``args``, ``workingDir``, env, ``secret_env`` as ``secretKeyRef``; the
  job's ``annotations`` (opaque, for backends) as pod annotations ``fedsched.io/<key>``;
* ``priorityClassName`` through ``priority_classes``;
* a create answered ``409 AlreadyExists`` adopts the existing Job when its labels name the same
  attempt (refused otherwise: a foreign object owns the name).

Status (from the pod and Job watches; ``at`` = the time the cluster stamped on the change --
container ``startedAt``/``finishedAt`` -- else the agent's clock):

* PENDING when the attempt is launched (or first seen);
* RUNNING when every index has a Running pod;
* SUCCEEDED when every index succeeded (or the Job is ``Complete``), exit code 0;
* FAILED with the failing container's exit code and a reason: ``exit_code``, ``oom_killed``,
  ``evicted``, ``deadline_exceeded``, ``image_pull`` (ImagePullBackOff/ErrImagePull longer than
  ``image_pull_limit_s``), ``node_failed`` (a pod's node NotReady). For these two the Job is
  deleted so the rest of the gang stops; for the others the Job controller does it
  (``backoffLimit: 0`` fails the Job at the first failed pod and ends its active pods), and the
  Job stays for its logs;
* LOST when the Job, or a pod of a running attempt, is deleted by someone else than fedsched.

Stop deletes the Job (``propagationPolicy: Foreground``) and its Service; 404 = already gone.
Errors: HTTP 404 on a named object -> :class:`AttemptNotFound`; 408/429/5xx, timeouts and
connection errors -> :class:`BackendUnavailable` (retried here a few times for idempotent calls,
then left to the agent); 400/401/403/409/422 -> ``BackendError(retryable=False)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import AsyncIterator, Callable

from fedsched.clock import Clock
from fedsched.events import NodeInventory
from fedsched.workload import worker_env
from services.inventory.backend import (LABEL_PREFIX, NODE_FAILED, TERMINAL_PHASES, AttemptKey, AttemptNotFound,
                                        AttemptSpec, AttemptStatus, BackendError, BackendUnavailable,
                                        ObservedAttempt, Phase)

log = logging.getLogger("fedsched.agent.kubernetes")

__all__ = ["KubeOptions", "KubernetesBackend", "parse_quantity", "node_inventory", "k8s_name"]

JOB_ID_LABEL = LABEL_PREFIX + "job-id"
NODES_ANNOTATION = LABEL_PREFIX + "nodes"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PRESSURES = ("MemoryPressure", "DiskPressure", "PIDPressure")
PULL_WAITING = frozenset({"ImagePullBackOff", "ErrImagePull"})


@dataclass(frozen=True)
class KubeOptions:
    """The backend's settings (from :class:`fedsched.topology.KubernetesSettings`; field
    meanings there). ``configuration``: a ready ``kubernetes_asyncio.client.Configuration``
    (tests, or a caller that loaded it) -- when given, kubeconfig/context are not read."""

    namespace: str = "default"
    kubeconfig: str | None = None
    context: str | None = None
    gpu_resources: tuple[str, ...] = ("nvidia.com/gpu",)
    card_model_label: str = "nvidia.com/gpu.product"
    gpu_memory_label: str = "nvidia.com/gpu.memory"
    rdma_label: str = ""
    rdma_default: bool = False
    priority_classes: dict[str, str] = field(default_factory=dict)
    kueue_queue: str | None = None
    image_pull_limit_s: float = 300.0
    master_port: int = 29500
    request_timeout_s: float = 10.0
    watch_timeout_s: int = 300
    retries: int = 2
    configuration: object | None = None


_ANNOTATION_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "Ti": 1024 ** 4, "Pi": 1024 ** 5}


def parse_quantity(q: str | int | float | None) -> float:
    """A Kubernetes quantity (``"8"``, ``"500m"``, ``"64Gi"``, ``"1e3"``) as a float in base
    units (cores, bytes, devices); None/"" -> 0.

    Raises:
        ValueError: not a quantity.
    """
    if q is None or q == "":
        return 0.0
    if isinstance(q, (int, float)):
        return float(q)
    q = str(q).strip()
    try:
        return float(q)
    except ValueError:
        pass
    m = _QUANTITY.match(q)
    if m is None or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {q!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def k8s_name(key: AttemptKey) -> str:
    """The Job and Service name of ``key``: :attr:`AttemptKey.name` when the pods' host names
    ``<name>-<index>`` fit a DNS label (63 characters, indices up to 4 digits), else its first
    characters and an 8-hex digest of the whole name (deterministic: a relaunch finds the same
    Job; reconcile reads the labels, not the name)."""
    import hashlib

    name = key.name
    if len(name) <= 63 - 5:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:63 - 5 - 9].rstrip('-')}-{digest}"


def _ts(value: str | None) -> float | None:
    """RFC 3339 timestamp -> POSIX seconds (None if absent/malformed)."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _truthy(value: str | None) -> bool:
    return str(value or "").strip().lower() in ("true", "1", "yes", "enabled")


def node_inventory(node: dict, opts: KubeOptions, foreign_gpus: int = 0) -> NodeInventory:
    """One ``v1.Node`` (JSON dict) as a :class:`NodeInventory` (pure).

    GPUs: the first of ``opts.gpu_resources`` the node's ``allocatable`` has (whole devices);
    ``foreign_gpus`` of them are in use by pods fedsched did not place (reported as 0 free
    milli-GPU on that many devices). CPU: allocatable milli-cores; memory: allocatable MiB.
    ``zone`` = label ``topology.kubernetes.io/zone``;
    ``healthy`` = condition Ready is True; ``unschedulable`` = ``spec.unschedulable`` or a
    pressure condition True; taints with effect NoSchedule/NoExecute as ``key=value:Effect``.
    """
    from fedsched.naming import canonical_card_model

    meta, spec, status = node.get("metadata", {}), node.get("spec", {}) or {}, node.get("status", {}) or {}
    labels = meta.get("labels") or {}
    alloc = status.get("allocatable") or {}
    gpus = 0
    for res in opts.gpu_resources:
        if res in alloc:
            gpus = int(parse_quantity(alloc[res]))
            break
    raw_model = labels.get(opts.card_model_label, "")
    mem_mib = labels.get(opts.gpu_memory_label)
    mem_gib = int(parse_quantity(mem_mib) // 1024) if mem_mib else None
    model = ""
    if raw_model and gpus:
        try:
            model = canonical_card_model(raw_model, mem_gib or None)
        except Exception:  # noqa: BLE001 - an unknown label value: reported raw, lower-case
            model = raw_model.lower()
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    taints = tuple(f"{t.get('key')}={t.get('value') or ''}:{t.get('effect')}" for t in spec.get("taints") or []
                   if t.get("effect") in ("NoSchedule", "NoExecute"))
    used = min(max(foreign_gpus, 0), gpus)
    return NodeInventory(
        name=meta.get("name", ""), card_model=model, gpus=gpus, gpu_memory_gib=mem_gib,
        gpu_free_milli=tuple([0] * used + [1000] * (gpus - used)) if used else (),
        cpu_milli=int(parse_quantity(alloc.get("cpu")) * 1000), memory_mib=int(parse_quantity(alloc.get("memory")) // 2**20),
        healthy=conds.get("Ready") == "True",
        rdma=_truthy(labels.get(opts.rdma_label)) if opts.rdma_label else opts.rdma_default,
        unschedulable=bool(spec.get("unschedulable")) or any(conds.get(p) == "True" for p in PRESSURES),
        taints=taints, zone=labels.get(ZONE_LABEL, ""))


@dataclass
class _Tracked:
    """What the backend knows of one attempt it launched or found."""

    key: AttemptKey
    phase: Phase | None = None
    started_at: float | None = None
    stopped: bool = False
    seen_job: bool = False
    seen_pods: set[int] = field(default_factory=set)
    pull_since: dict[int, float] = field(default_factory=dict)


class _Gone(Exception):
    """A watch's resourceVersion is too old (410): re-list."""


class KubernetesBackend:
    """The Kubernetes :class:`~services.inventory.backend.Backend` (module docstring).

    Args:
        options: :class:`KubeOptions`.
        clock: the agent's business clock (``time()`` POSIX s), used when the cluster stamped no time.
    """

    kind = "kubernetes"
    durable = True

    def __init__(self, options: KubeOptions, *, clock: Clock) -> None:
        self.opts = options
        self.clock = clock
        self._api = None
        self._core = None
        self._batch = None
        self._nodes: dict[str, dict] = {}
        self._pods: dict[str, dict] = {}        # our pods, by name
        self._pods_by_key: dict[AttemptKey, set[str]] = {}  # attempt -> its pods' names
        self._pods_by_node: dict[str, set[str]] = {}        # node -> our pods' names on it
        self._foreign: dict[str, tuple[str, int]] = {}  # other pods: name -> (node, GPUs)
        self._jobs: dict[str, dict] = {}
        self._tracked: dict[AttemptKey, _Tracked] = {}
        self._pulling: dict[AttemptKey, None] = {}  # tracked attempts with pull_since set, re-evaluated per tick
        self._ready: list[AttemptStatus] = []
        self._wake = asyncio.Event()
        self._synced = {"nodes": asyncio.Event(), "pods": asyncio.Event(), "jobs": asyncio.Event()}
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        #: watch restarts by cause, for tests and metrics: ``{"gone": n, "error": n}``
        self.relists = {"gone": 0, "error": 0}

    # ------------------------------------------------------------------ client & watches

    async def _client(self):
        if self._api is None:
            from kubernetes_asyncio import client, config

            cfg = self.opts.configuration
            if cfg is None:
                cfg = client.Configuration()
                if self.opts.kubeconfig or self.opts.context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
                    await config.load_kube_config(config_file=self.opts.kubeconfig, context=self.opts.context,
                                                  client_configuration=cfg)
                else:
                    config.load_incluster_config(client_configuration=cfg)
            self._api = client.ApiClient(cfg)
            self._core, self._batch = client.CoreV1Api(self._api), client.BatchV1Api(self._api)
        return self._api

    async def start(self) -> None:
        """Start the node, pod and Job watches (idempotent; every method calls it)."""
        if self._tasks:
            return
        await self._client()
        ns = self.opts.namespace
        self._tasks = [
            asyncio.create_task(self._watch("nodes", self._core.list_node, (), self._on_node)),
            asyncio.create_task(self._watch("pods", self._core.list_pod_for_all_namespaces, (), self._on_pod)),
            asyncio.create_task(self._watch("jobs", self._batch.list_namespaced_job, (ns,), self._on_job,
                                            label_selector=JOB_ID_LABEL)),
        ]

    async def close(self) -> None:
        """Stop the watches (and deletions in flight) and close the client."""
        tasks = self._tasks + list(self._bg)
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        self._tasks = []
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _synced_all(self, *which: str) -> None:
        """Start the watches and wait until ``which`` (default: all) were listed once.

        Raises:
            BackendUnavailable: not listed within twice the request timeout (API down, RBAC).
        """
        await self.start()
        which = which or tuple(self._synced)
        try:
            async with asyncio.timeout(self.opts.request_timeout_s * 2):
                for w in which:
                    await self._synced[w].wait()
        except TimeoutError:
            missing = [w for w in which if not self._synced[w].is_set()]
            raise BackendUnavailable(f"kubernetes: {', '.join(missing)} not listed within "
                                     f"{self.opts.request_timeout_s * 2:g} s") from None

    async def _watch(self, what: str, list_fn, args: tuple, on_event: Callable[[str, dict], None], **kw) -> None:
        """LIST + WATCH ``what`` forever: replace the cache on every list, apply events, follow
        bookmarks, re-list on 410 Gone, back off (0.2 s doubling to 5 s) on other errors."""
        backoff = 0.2
        while True:
            try:
                resp = await _checked(await list_fn(*args, _preload_content=False,
                                                    _request_timeout=self.opts.request_timeout_s, **kw))
                body = json.loads(await resp.read())
                rv = body.get("metadata", {}).get("resourceVersion", "")
                on_event("RELIST", {"items": body.get("items") or []})
                self._synced[what].set()
                while True:
                    resp = await list_fn(*args, watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                         timeout_seconds=self.opts.watch_timeout_s, _preload_content=False,
                                         _request_timeout=self.opts.watch_timeout_s + 30, **kw)
                    resp = await _checked(resp)
                    try:
                        async for line in _lines(resp):
                            if not line.strip():
                                continue
                            ev = json.loads(line)
                            obj = ev.get("object") or {}
                            if ev.get("type") == "ERROR":
                                if obj.get("code") == 410:
                                    raise _Gone(obj.get("message", "gone"))
                                raise BackendUnavailable(f"watch {what}: {obj.get('message', obj)}")
                            rv = obj.get("metadata", {}).get("resourceVersion") or rv
                            if ev.get("type") != "BOOKMARK":
                                on_event(ev["type"], obj)
                            backoff = 0.2
                    finally:
                        resp.release()
            except asyncio.CancelledError:
                raise
            except _Gone:
                self.relists["gone"] += 1
                log.info("watch %s: resourceVersion expired (410), re-listing", what)
            except Exception as e:  # noqa: BLE001 - a watch never dies: back off, re-list
                if getattr(e, "status", None) == 410:
                    self.relists["gone"] += 1
                    continue
                self.relists["error"] += 1
                log.warning("watch %s: %s: %s; re-listing in %.1f s", what, type(e).__name__, str(e)[:200], backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # ------------------------------------------------------------------ caches

    def _on_node(self, kind: str, obj: dict) -> None:
        if kind == "RELIST":
            self._nodes = {n["metadata"]["name"]: n for n in obj["items"]}
            changed = set(self._nodes)
        else:
            name = obj["metadata"]["name"]
            was = self._ready_node(name)
            if kind == "DELETED":
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = obj
            # status heartbeats are most node events: only a change of Ready concerns attempts
            changed = {name} if self._ready_node(name) != was else set()
        keys = {self._key_of(self._pods[p]) for n in changed for p in self._pods_by_node.get(n, ())}
        for key in keys - {None}:
            self._evaluate(key)

    def _on_pod(self, kind: str, obj: dict) -> None:
        if kind == "RELIST":
            self._pods, self._foreign, self._pods_by_key, self._pods_by_node = {}, {}, {}, {}
            for p in obj["items"]:
                self._store_pod(p)
            keys = {self._key_of(p) for p in self._pods.values()} | set(self._tracked)  # deletions in the gap
        else:
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self._drop_pod(name)
                self._foreign.pop(name, None)
            else:
                self._store_pod(obj)
            keys = {self._key_of(obj)}
        for key in keys - {None}:
            self._evaluate(key)

    def _store_pod(self, p: dict) -> None:
        meta = p["metadata"]
        key = self._key_of(p)
        if key is not None and meta.get("namespace", self.opts.namespace) == self.opts.namespace:
            self._drop_pod(meta["name"])
            self._pods[meta["name"]] = p
            self._pods_by_key.setdefault(key, set()).add(meta["name"])
            node = (p.get("spec") or {}).get("nodeName")
            if node:
                self._pods_by_node.setdefault(node, set()).add(meta["name"])
            return
        phase = (p.get("status") or {}).get("phase")
        node = (p.get("spec") or {}).get("nodeName")
        if node and phase not in ("Succeeded", "Failed"):
            gpus = 0
            for c in (p.get("spec") or {}).get("containers") or []:
                req = (c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits") or {}
                gpus += sum(int(parse_quantity(req.get(r))) for r in self.opts.gpu_resources if r in req)
            if gpus:
                self._foreign[meta["name"]] = (node, gpus)
                return
        self._foreign.pop(meta["name"], None)

    def _drop_pod(self, name: str) -> None:
        p = self._pods.pop(name, None)
        if p is None:
            return
        for index, k in ((self._pods_by_key, self._key_of(p)), (self._pods_by_node, (p.get("spec") or {}).get("nodeName"))):
            names = index.get(k)
            if names is not None:
                names.discard(name)
                if not names:
                    del index[k]

    def _on_job(self, kind: str, obj: dict) -> None:
        if kind == "RELIST":
            self._jobs = {j["metadata"]["name"]: j for j in obj["items"]}
            keys = {self._key_of(j) for j in self._jobs.values()} | set(self._tracked)
        elif kind == "DELETED":
            self._jobs.pop(obj["metadata"]["name"], None)
            keys = {self._key_of(obj)}
            tr = self._tracked.get(self._key_of(obj))
            if tr is not None and (tr.stopped or tr.phase in TERMINAL_PHASES):
                del self._tracked[tr.key]  # ended and gone: forget it (memory bounded by the cluster)
                return
        else:
            self._jobs[obj["metadata"]["name"]] = obj
            keys = {self._key_of(obj)}
        for key in keys - {None}:
            if key not in self._tracked and k8s_name(key) in self._jobs:
                # found on the cluster (an agent restart): tracked from now on, phase as derived
                self._tracked[key] = _Tracked(key)
            self._evaluate(key)

    @staticmethod
    def _key_of(obj: dict) -> AttemptKey | None:
        return AttemptKey.from_labels((obj.get("metadata") or {}).get("labels") or {})

    def _pods_of(self, key: AttemptKey) -> dict[int, dict]:
        """index -> the newest pod of that index of ``key``'s Job."""
        out: dict[int, dict] = {}
        for name in self._pods_by_key.get(key, ()):
            p = self._pods[name]
            meta = p["metadata"]
            ann = meta.get("annotations") or {}
            lab = meta.get("labels") or {}
            idx = ann.get(INDEX_ANNOTATION, lab.get(INDEX_ANNOTATION))
            try:
                i = int(idx)
            except (TypeError, ValueError):
                continue
            if i not in out or (meta.get("creationTimestamp") or "") > (out[i]["metadata"].get("creationTimestamp") or ""):
                out[i] = p
        return out

    # ------------------------------------------------------------------ status

    def _emit(self, tr: _Tracked, phase: Phase, at: float | None, **kw) -> None:
        tr.phase = phase
        if phase == Phase.RUNNING:
            tr.started_at = at if at is not None else self.clock.time()
        self._ready.append(AttemptStatus(tr.key, phase, at if at is not None else self.clock.time(), **kw))
        self._wake.set()

    def _derive(self, key: AttemptKey, tr: _Tracked | None = None) -> tuple[Phase, float | None, dict]:
        """The phase the cluster shows for ``key`` now: (phase, at, AttemptStatus fields)."""
        job = self._jobs.get(k8s_name(key))
        pods = self._pods_of(key)
        if job is None:
            return Phase.LOST, None, {"reason": "lost", "message": f"Job {k8s_name(key)} deleted outside fedsched"}
        spec, jstatus = job.get("spec") or {}, job.get("status") or {}
        workers = int(spec.get("completions") or 1)
        for c in jstatus.get("conditions") or []:
            if c.get("status") != "True":
                continue
            if c.get("type") == "Failed":
                reason = c.get("reason") or ""
                code = "deadline_exceeded" if reason == "DeadlineExceeded" else None
                if code:
                    return Phase.FAILED, _ts(c.get("lastTransitionTime")), {"reason": code, "message": c.get("message", "")}
        now = self.clock.time()
        started: list[float] = []
        finished: list[float] = []
        running = succeeded = 0
        for i, p in sorted(pods.items()):
            status = p.get("status") or {}
            node = (p.get("spec") or {}).get("nodeName")
            phase = status.get("phase")
            cstats = status.get("containerStatuses") or []
            term = next((c["state"]["terminated"] for c in cstats if (c.get("state") or {}).get("terminated")), None)
            if phase == "Failed" or (term and term.get("exitCode")):
                if status.get("reason") == "Evicted":
                    return Phase.FAILED, now, {"reason": "evicted", "worker": i, "node": node,
                                               "message": f"worker {i} evicted: {status.get('message', '')}".rstrip(": ")}
                if status.get("reason") == "DeadlineExceeded":
                    return Phase.FAILED, now, {"reason": "deadline_exceeded", "worker": i, "node": node,
                                               "message": f"worker {i} exceeded its active deadline"}
                code = term.get("exitCode") if term else None
                reason = "oom_killed" if term and term.get("reason") == "OOMKilled" else "exit_code"
                if code in (None, 0) and reason == "exit_code":
                    reason = (status.get("reason") or "pod_failed").lower()
                why = (term or {}).get("reason") or status.get("reason") or "Failed"
                detail = (term or {}).get("message") or status.get("message") or ""
                return Phase.FAILED, _ts((term or {}).get("finishedAt")), {
                    "exit_code": code, "reason": reason, "worker": i, "node": node,
                    "message": f"worker {i} exited with code {code} ({why})" + (f": {detail}" if detail else "")}
            if node and node in self._nodes and not self._ready_node(node) and phase in ("Running", "Pending"):
                return Phase.FAILED, now, {"reason": NODE_FAILED, "worker": i, "node": node,
                                           "message": f"node {node} is NotReady"}
            waiting = next((c["state"]["waiting"] for c in cstats if (c.get("state") or {}).get("waiting")), None)
            if tr is not None and waiting and waiting.get("reason") in PULL_WAITING:
                since = tr.pull_since.setdefault(i, now)
                self._pulling[tr.key] = None
                if now - since >= self.opts.image_pull_limit_s:
                    return Phase.FAILED, now, {"reason": "image_pull", "worker": i, "node": node, "message": (
                        f"worker {i}: {waiting.get('reason')} for {now - since:.0f} s (limit "
                        f"{self.opts.image_pull_limit_s:g} s): {waiting.get('message') or ''}")}
            elif tr is not None:
                tr.pull_since.pop(i, None)
            if phase == "Succeeded":
                succeeded += 1
                if term and _ts(term.get("finishedAt")):
                    finished.append(_ts(term.get("finishedAt")))
            elif phase == "Running":
                running += 1
                st = next((_ts(c["state"]["running"].get("startedAt")) for c in cstats
                           if (c.get("state") or {}).get("running")), None)
                if st:
                    started.append(st)
        failed = next((c for c in jstatus.get("conditions") or []
                       if c.get("type") == "Failed" and c.get("status") == "True"), None)
        if failed is not None:  # the Job failed and no pod says why (they are gone)
            return Phase.FAILED, _ts(failed.get("lastTransitionTime")), {
                "reason": (failed.get("reason") or "job_failed").lower(),
                "message": f"Job failed: {failed.get('reason', '')} {failed.get('message', '')}".strip()}
        if spec.get("suspend") and tr is not None and tr.phase == Phase.RUNNING:
            return Phase.FAILED, now, {"reason": "suspended", "message": "the Job was suspended while running "
                                                                          "(Kueue preemption or an operator)"}
        if tr is not None:
            lost = tr.seen_pods - set(pods)
            if lost and not any(c.get("type") == "Complete" and c.get("status") == "True"
                                for c in jstatus.get("conditions") or []):
                i = min(lost)
                return Phase.LOST, now, {"reason": "lost", "worker": i,
                                         "message": f"pod of worker {i} deleted outside fedsched"}
        complete = any(c.get("type") == "Complete" and c.get("status") == "True" for c in jstatus.get("conditions") or [])
        if succeeded == workers or complete:
            return Phase.SUCCEEDED, max(finished) if finished else None, {"exit_code": 0}
        if running + succeeded == workers and running:
            return Phase.RUNNING, max(started) if started else None, {}
        return Phase.PENDING, None, {}

    def _ready_node(self, name: str) -> bool:
        conds = (self._nodes.get(name, {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

    def _evaluate(self, key: AttemptKey) -> None:
        tr = self._tracked.get(key)
        if tr is None or tr.stopped or tr.phase in TERMINAL_PHASES:
            return
        if k8s_name(key) in self._jobs:
            tr.seen_job = True
        elif not tr.seen_job:
            return  # launched, not yet seen by the watch
        phase, at, kw = self._derive(key, tr)
        tr.seen_pods |= set(self._pods_of(key))
        if phase == tr.phase or (phase == Phase.PENDING and tr.phase == Phase.RUNNING):
            return
        if tr.phase is None and phase != Phase.PENDING:
            self._emit(tr, Phase.PENDING, at)
        if phase == Phase.SUCCEEDED and tr.phase == Phase.PENDING:
            self._emit(tr, Phase.RUNNING, at)  # ran and ended between two observations
        self._emit(tr, phase, at, **kw)
        if phase == Phase.FAILED and kw.get("reason") in (NODE_FAILED, "image_pull"):
            # a gang never runs partially. A worker that exited or was evicted fails the Job
            # (backoffLimit 0) and the Job controller ends the others; a worker on a NotReady
            # node or stuck pulling its image does not, so the Job is deleted here.
            task = asyncio.get_running_loop().create_task(self._delete(key, kw["reason"]))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ API calls

    async def _call(self, what: str, fn, *args, retries: int | None = None, **kw):
        """``fn(*args, **kw)`` with the request timeout, errors typed (module docstring) and
        retryable ones retried ``retries`` times (0.1 s, 0.2 s ...)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        retries = self.opts.retries if retries is None else retries
        for n in range(retries + 1):
            try:
                return await _checked(await fn(*args, _request_timeout=self.opts.request_timeout_s, **kw))
            except ApiException as e:
                err = _api_error(e, what)
            except (asyncio.TimeoutError, OSError) as e:
                err = BackendUnavailable(f"{what}: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - aiohttp.ClientError and friends
                if type(e).__module__.startswith("aiohttp"):
                    err = BackendUnavailable(f"{what}: {type(e).__name__}: {e}")
                else:
                    raise
            if not err.retryable or n == retries:
                raise err
            await asyncio.sleep(0.1 * 2 ** n)
        raise AssertionError("unreachable")

    async def _delete(self, key: AttemptKey, reason: str, *, quiet: bool = True) -> None:
        """Delete the attempt's Job (foreground: its pods first) and Service; one already gone
        is fine. Other errors are logged when ``quiet``, else raised (:class:`BackendError`)."""
        for fn in (self._batch.delete_namespaced_job, self._core.delete_namespaced_service):
            try:
                await self._call(f"delete {k8s_name(key)}", fn, k8s_name(key), self.opts.namespace,
                                 propagation_policy="Foreground")
            except AttemptNotFound:
                pass
            except BackendError as e:
                if not quiet:
                    raise
                log.warning("delete %s (%s): %s", k8s_name(key), reason, e)

    # ------------------------------------------------------------------ Backend

    async def inventory(self) -> list[NodeInventory]:
        """Every node from the node watch's cache (see :func:`node_inventory`); GPUs used by
        pods fedsched did not place are reported not free.

        Raises:
            BackendUnavailable: nodes or pods not listed yet within twice the request timeout.
        """
        await self._synced_all("nodes", "pods")
        foreign: dict[str, int] = {}
        for node, gpus in self._foreign.values():
            foreign[node] = foreign.get(node, 0) + gpus
        return [node_inventory(n, self.opts, foreign.get(name, 0)) for name, n in sorted(self._nodes.items())]

    def manifests(self, a: AttemptSpec) -> tuple[dict, dict]:
        """The (Job, Service) a launch creates for ``a`` (pure given the node cache; module docstring).

        Raises:
            BackendError: not retryable -- a bound node the cluster does not have.
        """
        spec, name, ns = a.spec, k8s_name(a.key), self.opts.namespace
        nodes = [b.node for b in sorted(a.bindings, key=lambda b: b.worker)]
        missing = [n for n in nodes if n not in self._nodes]
        if missing:
            raise BackendError(f"{a.key}: node(s) {', '.join(missing)} not in the cluster", retryable=False)
        workers = spec.workers
        labels = a.labels()
        if self.opts.kueue_queue:
            labels[KUEUE_LABEL] = self.opts.kueue_queue
        wl = spec.workload
        env = worker_env(spec, job_id=a.key.job_id, attempt=a.key.attempt, rank=0, master_addr=f"{name}-0.{name}",
                         master_port=self.opts.master_port, shard=a.key.shard)
        index_ref = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
        env_list = [{"name": k, **index_ref} if k in ("RANK", "GROUP_RANK") else {"name": k, "value": v}
                    for k, v in sorted(env.items())]
        if a.resume_from_s:
            env_list.append({"name": "FEDSCHED_RESUME_FROM_S", "value": f"{a.resume_from_s:g}"})
        if wl is not None:
            for k, ref in sorted(wl.secret_env.items()):
                secret, _, skey = ref.partition("/")
                env_list.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": skey}}})
        res: dict[str, str] = {}
        if spec.cpu_milli:
            res["cpu"] = f"{spec.cpu_milli}m"
        if spec.memory_mib:
            res["memory"] = f"{spec.memory_mib}Mi"
        if spec.gpus_per_worker:
            gpu_res = next((r for r in self.opts.gpu_resources
                            if nodes and r in ((self._nodes[nodes[0]].get("status") or {}).get("allocatable") or {})),
                           self.opts.gpu_resources[0])
            res[gpu_res] = str(spec.gpus_per_worker)
        container: dict = {"name": "worker", "image": wl.image if wl else "busybox:1.36", "env": env_list,
                           "resources": {"requests": dict(res), "limits": dict(res)}}
        if wl is not None:
            if wl.command:
                container["command"] = list(wl.command)
            if wl.args:
                container["args"] = list(wl.args)
            if wl.workdir:
                container["workingDir"] = wl.workdir
        match = [{"key": HOSTNAME_LABEL, "operator": "In", "values": sorted(set(nodes))}] if nodes else []
        if a.card_model:
            raw = sorted({(n.get("metadata", {}).get("labels") or {}).get(self.opts.card_model_label, "")
                          for name_, n in self._nodes.items() if name_ in nodes} - {""})
            if raw:
                match.append({"key": self.opts.card_model_label, "operator": "In", "values": raw})
        pod_spec: dict = {"restartPolicy": "Never", "subdomain": name, "containers": [container]}
        # the job's opaque backend annotations, as pod annotations ``fedsched.io/<key>``
        pod_ann = {NODES_ANNOTATION: ",".join(nodes)}
        pod_ann.update({LABEL_PREFIX + k: v for k, v in sorted(spec.annotations.items()) if _ANNOTATION_NAME.fullmatch(k)})
        affinity: dict = {}
        if match:
            affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": match}]}}
        if workers > 1 and len(set(nodes)) == len(nodes):
            affinity["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {"job-name": name}}, "topologyKey": HOSTNAME_LABEL}]}
        if affinity:
            pod_spec["affinity"] = affinity
        pc = self.opts.priority_classes.get(str(spec.priority))
        if pc:
            pod_spec["priorityClassName"] = pc
        meta = {"name": name, "namespace": ns, "labels": labels,
                "annotations": {NODES_ANNOTATION: ",".join(nodes)}}
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
            "completionMode": "Indexed", "completions": workers, "parallelism": workers, "backoffLimit": 0,
            **({"suspend": True} if self.opts.kueue_queue else {}),
            "template": {"metadata": {"labels": dict(a.labels()), "annotations": pod_ann},
                         "spec": pod_spec}}}
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns, "labels": a.labels()},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": self.opts.master_port}]}}
        return job, svc

    async def launch(self, attempt: AttemptSpec) -> None:
        """Create the attempt's Service and indexed Job (module docstring); 409 adopts a Job
        carrying the same attempt's labels.

        Raises:
            BackendError: not retryable for an unknown node, a refused request (400/403/422) or a
                foreign object owning the name; :class:`BackendUnavailable` for API outages.
        """
        await self._synced_all("nodes", "jobs")
        job, svc = self.manifests(attempt)
        ns, key = self.opts.namespace, attempt.key
        try:
            await self._call(f"create Service {k8s_name(key)}", self._core.create_namespaced_service, ns, svc)
        except BackendError as e:
            if "HTTP 409" not in str(e):
                raise
        try:
            await self._call(f"create Job {k8s_name(key)}", self._batch.create_namespaced_job, ns, job)
        except BackendError as e:
            if "HTTP 409" not in str(e):
                raise
            existing = await self._call(f"read Job {k8s_name(key)}", self._batch.read_namespaced_job, k8s_name(key), ns,
                                        _preload_content=False)
            meta = json.loads(await existing.read()).get("metadata") or {}
            if AttemptKey.from_labels(meta.get("labels") or {}) != key:
                raise BackendError(f"{key}: a Job named {k8s_name(key)} exists and is not this attempt's",
                                   retryable=False) from None
            if meta.get("deletionTimestamp"):
                raise BackendUnavailable(f"{key}: its Job is being deleted; launch again once it is gone") from None
        tr = self._tracked.get(key)
        if tr is None or tr.stopped:
            tr = self._tracked[key] = _Tracked(key)
        if tr.phase is None:
            self._emit(tr, Phase.PENDING, None)
        self._evaluate(key)

    async def stop(self, key: AttemptKey, reason: str) -> None:
        """Delete the Job (foreground propagation: its pods go first) and the Service; 404 = gone.

        Raises:
            BackendUnavailable: the API did not answer (after retries).
        """
        await self.start()
        tr = self._tracked.setdefault(key, _Tracked(key))
        tr.stopped = True
        await self._delete(key, reason, quiet=False)

    async def list_attempts(self) -> list[ObservedAttempt]:
        """Every Job under fedsched's labels in the namespace (a fresh LIST), phases from the
        status already reported or derived from the pod cache; Jobs being deleted (stopped) are
        left out.

        Raises:
            BackendError: the Jobs could not be listed.
        """
        await self._synced_all()
        resp = await self._call("list Jobs", self._batch.list_namespaced_job, self.opts.namespace,
                                label_selector=JOB_ID_LABEL, _preload_content=False)
        out = []
        for j in json.loads(await resp.read()).get("items") or []:
            meta = j.get("metadata") or {}
            key = self._key_of(j)
            if key is None or meta.get("deletionTimestamp"):
                continue
            tr = self._tracked.get(key)
            if tr is not None and tr.stopped:
                continue
            self._jobs.setdefault(k8s_name(key), j)
            if tr is not None and tr.phase is not None:
                phase, started = tr.phase, tr.started_at
            else:
                phase, at, _ = self._derive(key)
                started = at if phase == Phase.RUNNING else None
            pods = self._pods_of(key)
            bound = [n for n in ((meta.get("annotations") or {}).get(NODES_ANNOTATION) or "").split(",") if n]
            nodes = tuple((pods[i].get("spec") or {}).get("nodeName") or (bound[i] if i < len(bound) else "")
                          if i in pods else (bound[i] if i < len(bound) else "")
                          for i in range(int((j.get("spec") or {}).get("completions") or 1)))
            out.append(ObservedAttempt(key, phase, started, nodes, dict(meta.get("labels") or {})))
        return out

    def _tick(self) -> None:
        """Re-evaluate attempts whose failure depends on time passing (a worker in image-pull
        back-off), not only on a watch event."""
        for key in list(self._pulling):  # only attempts with a worker waiting on its image
            tr = self._tracked.get(key)
            if tr is None or not tr.pull_since:
                self._pulling.pop(key, None)
                continue
            self._evaluate(key)

    def ready(self) -> list[AttemptStatus]:
        """Statuses observed and not yet returned (no waiting)."""
        self._tick()
        out, self._ready = self._ready, []
        self._wake.clear()
        return out

    async def events(self) -> AsyncIterator[AttemptStatus]:
        """The same stream as :meth:`ready`, waiting for the watches."""
        await self.start()
        while True:
            while not self._ready:
                self._wake.clear()
                self._tick()
                if self._ready:
                    break
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except TimeoutError:
                    pass
            yield self._ready.pop(0)

    async def logs(self, key: AttemptKey, worker: int | None = None, follow: bool = False) -> AsyncIterator[str]:
        """Pod logs of ``worker`` (every worker, prefixed ``[worker K] ``, when None); with
        ``follow`` the API's ``follow=true`` stream until the container ends. Waits up to the
        request timeout for a just-created pod to appear.

        Raises:
            AttemptNotFound: no such Job, or ``worker`` outside ``0..workers-1``.
            BackendError: the API could not be read.
        """
        await self._synced_all("pods")
        resp = await self._call(f"read Job {k8s_name(key)}", self._batch.read_namespaced_job, k8s_name(key),
                                self.opts.namespace, _preload_content=False)
        job = json.loads(await resp.read())
        workers = int((job.get("spec") or {}).get("completions") or 1)
        if worker is not None and not 0 <= worker < workers:
            raise AttemptNotFound(f"{key}: no worker {worker} (workers 0..{workers - 1})")
        for w in ([worker] if worker is not None else range(workers)):
            deadline = asyncio.get_running_loop().time() + self.opts.request_timeout_s
            while w not in self._pods_of(key):
                if asyncio.get_running_loop().time() > deadline:
                    raise AttemptNotFound(f"{key}: worker {w} has no pod")
                await asyncio.sleep(0.05)
            pod = self._pods_of(key)[w]["metadata"]["name"]
            prefix = f"[worker {w}] " if worker is None else ""
            if follow:
                r = await self._call(f"logs {pod}", self._core.read_namespaced_pod_log, pod, self.opts.namespace,
                                     follow=True, _preload_content=False, retries=0)
                try:
                    async for line in _lines(r):
                        yield prefix + line.decode(errors="replace").rstrip("\r")
                finally:
                    r.release()
            else:
                text = await self._call(f"logs {pod}", self._core.read_namespaced_pod_log, pod, self.opts.namespace)
                for line in str(text).splitlines():
                    yield prefix + line


async def _lines(resp) -> AsyncIterator[bytes]:
    """The lines of a streamed response body, without the newline, whatever their length
    (aiohttp's ``readline`` refuses lines over twice its read buffer: 4 MiB with the client's
    2 MiB buffer; events of large objects, e.g. Nodes with long ``status.images``, stay readable)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line
    if buf:
        yield buf


async def _checked(resp):
    """``resp`` unchanged, or ``ApiException`` for a non-2xx raw response (with
    ``_preload_content=False`` the client returns error responses instead of raising)."""
    status = getattr(resp, "status", None)
    if isinstance(status, int) and not 200 <= status <= 299:
        from kubernetes_asyncio.client.exceptions import ApiException

        body = await resp.read()
        resp.release()
        e = ApiException(status=status, reason=getattr(resp, "reason", ""))
        e.body = body.decode(errors="replace")
        raise e
    return resp


def _api_error(e, what: str) -> BackendError:
    """An ``ApiException`` as a typed :class:`BackendError` (module docstring)."""
    try:
        message = json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        message = str(e.body)[:200]
    text = f"{what}: HTTP {e.status} {e.reason or ''}: {message}".strip()
    if e.status == 404:
        return AttemptNotFound(text)
    if e.status in (408, 429) or (e.status or 0) >= 500 or not e.status:
        return BackendUnavailable(text)
    return BackendError(text, retryable=False)


def from_settings(settings, *, clock: Clock, base_dir=None, rdma_default: bool = False) -> KubernetesBackend:
    """A backend from a topology entry's :class:`fedsched.topology.KubernetesSettings`
    (``kubeconfig`` relative to ``base_dir``)."""
    kubeconfig = settings.kubeconfig
    if kubeconfig and base_dir is not None and not os.path.isabs(kubeconfig):
        kubeconfig = os.path.join(str(base_dir), kubeconfig)
    return KubernetesBackend(KubeOptions(
        namespace=settings.namespace, kubeconfig=kubeconfig, context=settings.context,
        gpu_resources=tuple(settings.gpu_resources), card_model_label=settings.card_model_label,
        gpu_memory_label=settings.gpu_memory_label, rdma_label=settings.rdma_label, rdma_default=rdma_default,
        priority_classes=dict(settings.priority_classes), kueue_queue=settings.kueue_queue,
        image_pull_limit_s=settings.image_pull_limit_s, master_port=settings.master_port,
        request_timeout_s=settings.request_timeout_s), clock=clock)
