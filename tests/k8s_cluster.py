"""An emulated Kubernetes cluster for the ``kubernetes`` backend's tests: an API server over real
HTTP and a fake kubelet/Job controller that acts on the cluster through that same HTTP API.

Why not kmock alone: ``kmock`` 0.8 (by the author of Kopf; ``KubernetesEmulator``) keeps objects
in memory and serves them over HTTP, but with the official client it does not recognise
``?watch=True`` (``kubernetes_asyncio`` sends ``True``; kmock serves a LIST instead of a stream),
ignores ``labelSelector``, stamps no ``resourceVersion``/``uid``/``namespace``, has no watch
history (a watch replays everything as ADDED), no ``410 Gone``, no ``pods/log`` (it returns the
pod's JSON), no garbage collection of a Job's pods and no controllers. Each of these is what the
backend under test depends on, so this module serves the API itself on ``aiohttp`` (kmock's own
HTTP layer) with those semantics, and the cluster's behaviour (pods of Jobs, phases) is a client
of it.

:class:`ApiServer` -- what it emulates of the Kubernetes API (core/v1 nodes, pods, services;
batch/v1 jobs):

* create (409 AlreadyExists), get (404), list with ``labelSelector`` (``k``, ``!k``, ``k=v``,
  ``k==v``, ``k!=v``), JSON merge-patch (also for ``/status``), replace, delete with
  ``propagationPolicy`` (Foreground: ``deletionTimestamp`` first, dependents by ownerReference,
  then the owner; Background/Orphan: the owner first; dependents are deleted for both);
* ``metadata.resourceVersion`` (one global counter), ``uid``, ``creationTimestamp`` (from the
  cluster clock), ``namespace``;
* watches from a ``resourceVersion``: the events after it from a bounded history, then live ones,
  ``timeoutSeconds``; a version older than the history -> ``ERROR`` event with code 410;
  :meth:`ApiServer.expire` compacts the history and ends every open watch (as an API server
  restart does);
* ``pods/<name>/log`` (plain text; ``follow=true`` streams until the pod ends);
* injected faults: HTTP status errors and delays for a method and resource (:meth:`ApiServer.fail`).

Not emulated (what a real cluster adds): authentication/RBAC (every request is allowed unless a
fault says 403), admission (validation of the manifests, quotas, LimitRanges, priority classes,
Kueue), the scheduler (the fake kubelet puts index ``i`` on the node the Job's annotation names,
ignoring affinity, taints and resources), strategic-merge patch, field selectors, server-side
apply, bookmarks, pagination (``limit``/``continue``), real containers and images (the fake
kubelet reads ``sleep N``/``exit C``/``oom`` from the argv), the node lifecycle controller
(NotReady nodes are not tainted, their pods are not evicted), pod replacement by the Job
controller.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone

from aiohttp import web

RESOURCES = {("api/v1", "nodes"): False, ("api/v1", "pods"): True, ("api/v1", "services"): True,
             ("apis/batch/v1", "jobs"): True}
KINDS = {"nodes": "Node", "pods": "Pod", "services": "Service", "jobs": "Job"}
_PATH = re.compile(r"^/(api/v1|apis/batch/v1)(?:/namespaces/([^/]+))?/([a-z]+)(?:/([^/]+))?(?:/(status|log))?$")


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (returns the merged value)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def selector_matches(selector: str, labels: dict) -> bool:
    """A ``labelSelector`` (equality and existence forms) against ``labels``."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class Fault:
    """An injected failure: the next ``count`` requests of ``method`` (GET, LIST, WATCH, POST,
    PATCH, PUT, DELETE; ``*`` any) on ``resource`` (``*`` any) wait ``delay_s`` then answer
    HTTP ``status`` (0 = after the delay, serve normally)."""

    method: str
    resource: str
    status: int
    count: int = 1
    delay_s: float = 0.0


class ApiServer:
    """The emulated API server (module docstring). ``clock()`` gives POSIX seconds for the
    timestamps it stamps; ``history`` bounds the watch history (events)."""

    def __init__(self, clock, *, history: int = 2000) -> None:
        self.clock = clock
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.rv = 1
        self.history: deque[tuple[int, str, dict]] = deque(maxlen=history)
        self.compacted = 0
        self.watchers: set[asyncio.Queue] = set()
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        for q in list(self.watchers):
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # ---------------------------------------------------------------- test controls
    def fail(self, method: str, resource: str, status: int, *, count: int = 1, delay_s: float = 0.0) -> None:
        """Inject a :class:`Fault`."""
        self.faults.append(Fault(method.upper(), resource, status, count, delay_s))

    def expire(self) -> None:
        """Compact the watch history to now and end every open watch (clients must re-list)."""
        self.compacted = self.rv
        self.history.clear()
        for q in list(self.watchers):
            q.put_nowait(None)

    def get(self, res: str, ns: str, name: str) -> dict | None:
        return self.objects.get((res, ns, name))

    def items(self, res: str) -> list[dict]:
        return [o for (r, _, _), o in self.objects.items() if r == res]

    # ---------------------------------------------------------------- storage (sync: usable by drills)
    def _event(self, res: str, kind: str, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        ev = (self.rv, res, {"type": kind, "object": copy.deepcopy(obj)})
        self.history.append(ev)
        if len(self.history) == self.history.maxlen:
            self.compacted = self.history[0][0] - 1
        for q in list(self.watchers):
            q.put_nowait(ev)
        self.changed.set()

    def create(self, res: str, ns: str, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (res, ns, meta["name"])
        if key in self.objects:
            raise _Status(409, "AlreadyExists", f'{res} "{meta["name"]}" already exists')
        if ns:
            meta["namespace"] = ns
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=rfc3339(self.clock()), generation=1)
        obj.setdefault("kind", KINDS[res])
        obj.setdefault("status", {})
        self.objects[key] = obj
        self._event(res, "ADDED", obj)
        return obj

    def patch(self, res: str, ns: str, name: str, patch: dict) -> dict:
        key = (res, ns, name)
        if key not in self.objects:
            raise _Status(404, "NotFound", f'{res} "{name}" not found')
        patch = dict(patch)
        (patch.get("metadata") or {}).pop("resourceVersion", None)
        obj = merge_patch(self.objects[key], patch)
        self.objects[key] = obj
        self._event(res, "MODIFIED", obj)
        return obj

    def delete(self, res: str, ns: str, name: str, policy: str = "Background") -> dict:
        key = (res, ns, name)
        obj = self.objects.get(key)
        if obj is None:
            raise _Status(404, "NotFound", f'{res} "{name}" not found')
        uid = obj["metadata"]["uid"]
        dependents = [k for k, o in self.objects.items()
                      if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]
        if policy == "Foreground":
            obj = self.patch(res, ns, name, {"metadata": {"deletionTimestamp": rfc3339(self.clock()),
                                                         "finalizers": ["foregroundDeletion"]}})
            for k in dependents:
                if k in self.objects:
                    self.delete(*k)
        gone = self.objects.pop(key)
        self._event(res, "DELETED", gone)
        if policy != "Foreground":
            for k in dependents:
                if k in self.objects:
                    self.delete(*k)
        return gone

    # ---------------------------------------------------------------- HTTP
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        m = _PATH.match(request.path)
        if m is None:
            return _status(404, "NotFound", f"no route {request.path}")
        group, ns, res, name, sub = m.groups()
        ns = ns or ""
        if (group, res) not in RESOURCES:
            return _status(404, "NotFound", f"unknown resource {group}/{res}")
        watch = request.query.get("watch", "").lower() in ("true", "1")
        verb = request.method if request.method != "GET" else ("WATCH" if watch else "GET" if name else "LIST")
        internal = request.headers.get("User-Agent", "").startswith("fake-kubelet")
        if not internal:  # what the backend under test asked (the fake kubelet's passes are not)
            self.requests.append((verb, request.path_qs))
        for f in [] if internal else list(self.faults):
            if f.count > 0 and f.method in (verb, "*") and f.resource in (res, "*"):
                f.count -= 1
                if f.count == 0:
                    self.faults.remove(f)
                if f.delay_s:
                    await asyncio.sleep(f.delay_s)
                if f.status:
                    return _status(f.status, {403: "Forbidden", 409: "AlreadyExists", 500: "InternalError",
                                              429: "TooManyRequests"}.get(f.status, "Failure"), "injected fault")
                break
        try:
            if verb == "WATCH":
                return await self._watch(request, res, ns)
            if verb == "LIST":
                sel = request.query.get("labelSelector", "")
                items = [o for (r, n, _), o in sorted(self.objects.items())
                         if r == res and (not ns or n == ns) and selector_matches(sel, o["metadata"].get("labels") or {})]
                return web.json_response({"kind": KINDS[res] + "List", "apiVersion": group.split("/", 1)[1],
                                          "metadata": {"resourceVersion": str(self.rv)}, "items": items})
            if verb == "GET" and sub == "log":
                return await self._log(request, ns, name)
            if verb == "GET":
                obj = self.objects.get((res, ns, name))
                if obj is None:
                    raise _Status(404, "NotFound", f'{res} "{name}" not found')
                return web.json_response(obj)
            body = await request.json() if request.can_read_body else {}
            if verb == "POST":
                return web.json_response(self.create(res, ns, body), status=201)
            if verb == "PATCH":
                return web.json_response(self.patch(res, ns, name, body))
            if verb == "PUT":
                self.objects.pop((res, ns, name), None)
                obj = body
                self.objects[(res, ns, name)] = obj
                self._event(res, "MODIFIED", obj)
                return web.json_response(obj)
            if verb == "DELETE":
                policy = request.query.get("propagationPolicy") or (body or {}).get("propagationPolicy") or "Background"
                return web.json_response(self.delete(res, ns, name, policy))
        except _Status as s:
            return _status(s.code, s.reason, s.message)
        return _status(405, "MethodNotAllowed", verb)

    async def _watch(self, request: web.Request, res: str, ns: str) -> web.StreamResponse:
        sel = request.query.get("labelSelector", "")
        rv = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        async def send(ev: dict) -> None:
            await resp.write(json.dumps(ev).encode() + b"\n")

        if rv and rv < self.compacted:
            await send({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                    "code": 410, "reason": "Expired",
                                                    "message": f"too old resource version: {rv} ({self.compacted})"}})
            return resp

        def wanted(r: int, rres: str, ev: dict) -> bool:
            meta = ev["object"]["metadata"]
            return (r > rv and rres == res and (not ns or meta.get("namespace") == ns)
                    and selector_matches(sel, meta.get("labels") or {}))

        q: asyncio.Queue = asyncio.Queue()
        self.watchers.add(q)
        try:
            if not rv:  # no version: the current state as ADDED, then changes
                for (r, n, _), o in sorted(self.objects.items()):
                    if r == res and (not ns or n == ns) and selector_matches(sel, o["metadata"].get("labels") or {}):
                        await send({"type": "ADDED", "object": o})
                rv = self.rv
            for r, rres, ev in list(self.history):
                if wanted(r, rres, ev):
                    await send(ev)
            async with asyncio.timeout(timeout):
                while True:
                    item = await q.get()
                    if item is None:
                        break
                    if wanted(*item):
                        await send(item[2])
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            self.watchers.discard(q)
        return resp

    async def _log(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        if ("pods", ns, name) not in self.objects:
            raise _Status(404, "NotFound", f'pods "{name}" not found')
        if request.query.get("follow", "").lower() not in ("true", "1"):
            return web.Response(text="".join(line + "\n" for line in self.logs.get((ns, name), [])))
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        sent = 0
        while True:
            lines = self.logs.get((ns, name), [])
            for line in lines[sent:]:
                await resp.write(line.encode() + b"\n")
            sent = len(lines)
            pod = self.objects.get(("pods", ns, name))
            if pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return resp
            self.changed.clear()
            try:
                async with asyncio.timeout(0.5):
                    await self.changed.wait()
            except TimeoutError:
                pass


class _Status(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


# ------------------------------------------------------------------------------- the cluster's behaviour


def gpu_node(name: str, *, gpus: int = 8, product: str = "Tesla-T4", zone: str = "cn-north-1a",
             rdma: bool = False, resource: str = "nvidia.com/gpu", cpu: str = "64", memory: str = "512Gi") -> dict:
    """A ``v1.Node`` as GPU feature discovery and the device plugin leave it (Ready)."""
    labels = {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": zone, "nvidia.com/gpu.product": product,
              "nvidia.com/gpu.count": str(gpus)}
    if rdma:
        labels["feature.node.kubernetes.io/rdma.capable"] = "true"
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {}, "status": {"allocatable": {"cpu": cpu, "memory": memory, resource: str(gpus), "pods": "110"},
                                   "capacity": {"cpu": cpu, "memory": memory, resource: str(gpus)},
                                   "conditions": [{"type": "Ready", "status": "True"},
                                                  {"type": "MemoryPressure", "status": "False"}]}}


class FakeKubelet:
    """The Job controller, scheduler and kubelets of the emulated cluster, acting only through
    the API server's HTTP API with its own ``kubernetes_asyncio`` client (raw JSON).

    * a Job (not suspended) gets one pod per completion index (``<job>-<i>-<rand>``, owner
      reference to the Job, index label/annotation, ``hostname`` ``<job>-<i>``), placed on the
      node its ``fedsched.io/nodes`` annotation names for index ``i``; a deleted pod is not
      replaced;
    * a Pending pod on a Ready node runs (``startedAt`` = the cluster clock) unless its image
      contains ``doesnotexist`` (then ``waiting: ImagePullBackOff``);
    * a Running pod ends ``sleep N`` seconds (from its argv; else the trace runtime the backend
      carried as annotation ``fedsched.io/trace.runtime_s``) after it started, with exit code
      ``C`` from ``exit C`` (``Completed``/``Error``; else 1 if ``fedsched.io/trace.outcome`` is
      ``failed``), or 137 ``OOMKilled`` if the argv says ``oom``;
    * the Job gets ``Complete`` when every index succeeded, ``Failed`` (BackoffLimitExceeded)
      when a pod failed, and then its active pods are deleted (``backoffLimit: 0``);
    * every pod writes two log lines.

    :meth:`sync` does one pass; :meth:`run` passes whenever the cluster changed (and every 0.1 s).
    """

    def __init__(self, server: ApiServer, clock) -> None:
        self.server = server
        self.clock = clock
        self._api = None
        self._task: asyncio.Task | None = None
        self._created: set[tuple[str, int]] = set()
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        from kubernetes_asyncio import client

        self._api = client.ApiClient(client.Configuration(host=self.server.url))
        self._api.user_agent = "fake-kubelet"  # injected faults are the backend's, not the cluster's
        self.core, self.batch = client.CoreV1Api(self._api), client.BatchV1Api(self._api)
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._api is not None:
            await self._api.close()

    async def run(self) -> None:
        while True:
            self.server.changed.clear()
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - an injected fault hit the kubelet: next pass
                pass
            try:
                async with asyncio.timeout(0.1):
                    await self.server.changed.wait()
            except TimeoutError:
                pass

    async def _list(self, fn, *args) -> list[dict]:
        r = await fn(*args, _preload_content=False)
        return json.loads(await r.read())["items"]

    async def sync(self) -> None:
        """One pass of the controller and kubelets (see the class docstring)."""
        async with self._lock:
            now = self.clock()
            nodes = {n["metadata"]["name"]: n for n in await self._list(self.core.list_node)}
            jobs = await self._list(self.batch.list_job_for_all_namespaces)
            pods = await self._list(self.core.list_pod_for_all_namespaces)
            for job in jobs:
                meta, spec = job["metadata"], job["spec"]
                if meta.get("deletionTimestamp") or spec.get("suspend"):
                    continue
                bound = [n for n in (meta.get("annotations") or {}).get("fedsched.io/nodes", "").split(",") if n]
                for i in range(int(spec.get("completions") or 1)):
                    if (meta["uid"], i) in self._created:
                        continue
                    self._created.add((meta["uid"], i))
                    await self._create_pod(job, i, bound[i] if i < len(bound) else None)
            for pod in pods:
                await self._kubelet(pod, nodes, now)
            pods = await self._list(self.core.list_pod_for_all_namespaces)
            for job in jobs:
                await self._job_status(job, pods)

    async def _create_pod(self, job: dict, i: int, node: str | None) -> None:
        meta, tmpl = job["metadata"], job["spec"]["template"]
        name = meta["name"]
        labels = {**(tmpl.get("metadata", {}).get("labels") or {}), "job-name": name,
                  "batch.kubernetes.io/job-name": name, "controller-uid": meta["uid"],
                  "batch.kubernetes.io/job-completion-index": str(i)}
        ann = {**(tmpl.get("metadata", {}).get("annotations") or {}), "batch.kubernetes.io/job-completion-index": str(i)}
        spec = copy.deepcopy(tmpl["spec"])
        spec["hostname"] = f"{name}-{i}"
        if node:
            spec["nodeName"] = node
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-{i}-{uuid.uuid4().hex[:5]}", "labels": labels, "annotations": ann,
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                 "uid": meta["uid"], "controller": True}]},
               "spec": spec, "status": {"phase": "Pending"}}
        try:
            await self.core.create_namespaced_pod(meta["namespace"], pod, _preload_content=False)
        except Exception:  # noqa: BLE001 - retried at the next pass
            self._created.discard((meta["uid"], i))

    async def _kubelet(self, pod: dict, nodes: dict, now: float) -> None:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        node = nodes.get(spec.get("nodeName") or "")
        if node is None or meta.get("deletionTimestamp") or "fedsched.io/job-id" not in (meta.get("labels") or {}):
            return
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])
        c = spec["containers"][0]
        argv = " ".join((c.get("command") or []) + (c.get("args") or []))
        phase = status.get("phase")
        patch = None
        if phase == "Pending" and ready:
            if "doesnotexist" in c.get("image", ""):
                if not status.get("containerStatuses"):
                    patch = {"containerStatuses": [{"name": c["name"], "ready": False, "state": {"waiting": {
                        "reason": "ImagePullBackOff", "message": f'Back-off pulling image "{c["image"]}"'}}}]}
            else:
                patch = {"phase": "Running", "startTime": rfc3339(now), "containerStatuses": [{
                    "name": c["name"], "ready": True, "state": {"running": {"startedAt": rfc3339(now)}}}]}
                self.server.logs[(meta["namespace"], meta["name"])] = [
                    f"worker {meta['labels'].get('batch.kubernetes.io/job-completion-index')} of {meta['labels'].get('job-name')} starting",
                    f"argv: {argv}"]
        elif phase == "Running":
            started = datetime.fromisoformat(
                status["containerStatuses"][0]["state"]["running"]["startedAt"].replace("Z", "+00:00")).timestamp()
            ann = meta.get("annotations") or {}
            m = re.search(r"sleep (\d+(?:\.\d+)?)", argv)
            runtime = float(m.group(1)) if m else float(ann.get("fedsched.io/trace.runtime_s") or 0.0)
            if now >= started + runtime:
                m = re.search(r"exit (\d+)", argv)
                code = int(m.group(1)) if m else int(ann.get("fedsched.io/trace.outcome") == "failed")
                reason = "Completed" if code == 0 else "Error"
                if "oom" in argv.split():
                    code, reason = 137, "OOMKilled"
                end = started + runtime
                patch = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
                    "name": c["name"], "ready": False, "state": {"terminated": {
                        "exitCode": code, "reason": reason, "startedAt": rfc3339(started), "finishedAt": rfc3339(end)}}}]}
                self.server.logs.setdefault((meta["namespace"], meta["name"]), []).append(f"exit {code}")
        if patch is not None:
            try:
                await self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": patch},
                                                            _preload_content=False)
            except Exception:  # noqa: BLE001 - next pass
                pass

    async def _job_status(self, job: dict, pods: list[dict]) -> None:
        meta, status = job["metadata"], job.get("status") or {}
        if status.get("conditions") or meta.get("deletionTimestamp"):
            return
        mine = [p for p in pods if p["metadata"].get("labels", {}).get("controller-uid") == meta["uid"]]
        phases = [p.get("status", {}).get("phase") for p in mine]
        n = int(job["spec"].get("completions") or 1)
        cond = None
        if "Failed" in phases:
            cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit"}
        elif phases.count("Succeeded") == n:
            cond = {"type": "Complete", "status": "True"}
        upd = {"active": phases.count("Running") + phases.count("Pending"), "succeeded": phases.count("Succeeded"),
               "failed": phases.count("Failed")}
        if cond:
            cond["lastTransitionTime"] = rfc3339(self.clock())
            upd["conditions"] = [cond]
        if cond and cond["type"] == "Failed":  # backoffLimit exceeded: the active pods are ended
            for p in mine:
                if p.get("status", {}).get("phase") in ("Running", "Pending"):
                    try:
                        await self.core.delete_namespaced_pod(p["metadata"]["name"], p["metadata"]["namespace"],
                                                              _preload_content=False)
                    except Exception:  # noqa: BLE001 - next pass
                        pass
        if any(status.get(k) != v for k, v in upd.items()):
            try:
                await self.batch.patch_namespaced_job_status(meta["name"], meta["namespace"], {"status": upd},
                                                             _preload_content=False)
            except Exception:  # noqa: BLE001 - next pass
                pass


class EmulatedCluster:
    """An :class:`ApiServer` with a :class:`FakeKubelet` and GPU nodes, on ``clock``.

    Use ``async with``; :meth:`configuration` gives the client configuration of its URL."""

    def __init__(self, clock, nodes: list[dict]) -> None:
        self.clock = clock
        self.server = ApiServer(clock)
        self.kubelet = FakeKubelet(self.server, clock)
        self._nodes = nodes

    async def __aenter__(self) -> "EmulatedCluster":
        await self.server.start()
        for n in self._nodes:
            self.server.create("nodes", "", n)
        await self.kubelet.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kubelet.stop()
        await self.server.stop()

    def configuration(self):
        from kubernetes_asyncio import client

        return client.Configuration(host=self.server.url)

    def set_ready(self, node: str, ready: bool) -> None:
        """Node condition Ready True/False (as the node lifecycle controller writes it)."""
        conds = [c for c in self.server.get("nodes", "", node)["status"]["conditions"] if c["type"] != "Ready"]
        conds.append({"type": "Ready", "status": "True" if ready else "False",
                      "reason": "KubeletReady" if ready else "NodeStatusUnknown"})
        self.server.patch("nodes", "", node, {"status": {"conditions": conds}})
