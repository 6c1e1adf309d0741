"""Client side of the gRPC API: channels that carry the bearer token (and TLS, if asked).

* :func:`aio_channel` -- a ``grpc.aio`` channel whose every call carries
  ``authorization: Bearer <token>`` (an interceptor adds it), plaintext or TLS/mTLS;
* :func:`sync_channel` and :func:`call_metadata` -- the same for the blocking API (the CLI);
* :func:`resolve_token` -- the token to use: explicit (``--token``), else ``FEDSCHED_TOKEN``,
  else the embedded system's ``<data_dir>/admin.token`` (``FEDSCHED_DATA_DIR``, default
  ``.fedsched``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedsched.errors import AuthError

from fedsched.auth import METADATA_KEY, TOKEN_FILE, read_token_file


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates a call (empty without a token).

    Raises:
        AuthError: the token holds characters no token has (spaces, line breaks, non-ASCII):
            usually a pasted or wrongly read value.
    """
    if token and not all(33 <= ord(ch) < 127 for ch in token):
        raise AuthError("the token has spaces, line breaks or non-ASCII characters; tokens are one printable "
                        "ASCII word (check --token / FEDSCHED_TOKEN / admin.token)")
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


#: Where an older ``fedsched up`` kept its one shared NATS password (user ``fedsched``).
NATS_PASSWORD_FILE = "nats.password"

#: Where ``fedsched up`` keeps its NATS users' passwords (JSON, mode 0600; :mod:`fedapp.natsauth`).
NATS_USERS_FILE = "nats.users"


def with_local_credentials(url: str, data_dir: Path | str | None = None) -> str:
    """``url`` with the operator's credentials (user ``ops``) of the embedded NATS added, when it
    names a loopback server without credentials and ``data_dir`` (default
    ``$FEDSCHED_DATA_DIR`` or ``.fedsched``) holds the users of the system running there (an
    older data dir's shared ``nats.password`` is used likewise); else ``url`` unchanged."""
    import json
    from urllib.parse import urlparse

    u = urlparse(url)
    if "," in url or u.username or u.hostname not in ("127.0.0.1", "localhost", "::1") or not u.port:
        return url
    base = Path(data_dir or os.environ.get("FEDSCHED_DATA_DIR") or ".fedsched")
    try:
        password = str(json.loads((base / NATS_USERS_FILE).read_text()).get("ops") or "")
        user = "ops"
    except (OSError, ValueError, AttributeError):
        try:
            password, user = (base / NATS_PASSWORD_FILE).read_text().strip(), "fedsched"
        except OSError:
            return url
    return f"{u.scheme}://{user}:{password}@{u.hostname}:{u.port}" if password else url


def resolve_token(explicit: str | None = None, data_dir: Path | str | None = None) -> str | None:
    """The bearer token: ``explicit``, else ``$FEDSCHED_TOKEN``, else ``$FEDSCHED_ADMIN_TOKEN_FILE``
    (unless ``data_dir`` is given), else the token file in ``data_dir`` (default
    ``$FEDSCHED_DATA_DIR`` or ``.fedsched``); None if there is none."""
    if explicit:
        return explicit.strip()
    env = os.environ.get("FEDSCHED_TOKEN", "").strip()
    if env:
        return env
    if data_dir is None and os.environ.get("FEDSCHED_ADMIN_TOKEN_FILE"):  # where a deployment keeps it
        return read_token_file(Path(os.environ["FEDSCHED_ADMIN_TOKEN_FILE"]))
    base = Path(data_dir or os.environ.get("FEDSCHED_DATA_DIR") or ".fedsched")
    return read_token_file(base / TOKEN_FILE)


@dataclass(frozen=True)
class TlsClient:
    """TLS for a client: the CA that signed the server (None = system roots) and, for mTLS, the
    client's certificate and key (PEM files)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials (reads the files)."""
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca), private_key=read(self.key),
                                            certificate_chain=read(self.cert))


def _with_token(details: grpc.aio.ClientCallDetails, metadata) -> grpc.aio.ClientCallDetails:
    merged = grpc.aio.Metadata(*(details.metadata or ()), *metadata)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, merged, details.credentials,
                                      details.wait_for_ready)


class _BearerUnary(grpc.aio.UnaryUnaryClientInterceptor):
    # one object per call kind: grpc.aio files an interceptor under its first matching kind only
    def __init__(self, token: str) -> None:
        self.metadata = call_metadata(token)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.metadata), request)


class _BearerStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.metadata = call_metadata(token)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.metadata), request)


def aio_channel(target: str, token: str | None, *, tls: TlsClient | None = None,
                options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` whose calls carry ``token``."""
    interceptors = [_BearerUnary(token), _BearerStream(token)] if token else None
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def sync_channel(target: str, *, tls: TlsClient | None = None) -> grpc.Channel:
    """A blocking channel (pass :func:`call_metadata` with each call)."""
    if tls is not None:
        return grpc.secure_channel(target, tls.credentials())
    return grpc.insecure_channel(target)


#: Where the process holding an embedded store says how to reach its store query service
#: (``<p>.svc.store.query``) while it runs: JSON ``{"pid", "nats_url", "subject_prefix"}``,
#: the URL without credentials. ``fedsched sql`` / ``report`` read it (:func:`running_store`).
STORE_ENDPOINT_FILE = "store-query.json"


@dataclass(frozen=True, slots=True)
class StoreEndpoint:
    """How to ask a running system's store: its NATS (no credentials) and subject prefix, and
    the process id that answers."""

    pid: int
    nats_url: str
    subject_prefix: str


def write_store_endpoint(data_dir: Path | str, nats_url: str, subject_prefix: str) -> Path:
    """Record this process as the one answering store queries for ``data_dir`` (credentials are
    stripped from ``nats_url``; the CLI adds the data dir's own, :func:`with_local_credentials`).
    Returns the file written (remove it when the service stops)."""
    import json
    from urllib.parse import urlparse

    first = nats_url.split(",")[0]
    u = urlparse(first)
    bare = f"{u.scheme}://{u.hostname}:{u.port}" if u.hostname and u.port else first
    path = Path(data_dir) / STORE_ENDPOINT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "nats_url": bare, "subject_prefix": subject_prefix}))
    tmp.replace(path)
    return path


def running_store(data_dir: Path | str) -> StoreEndpoint | None:
    """The running system that holds ``data_dir``'s embedded store and answers queries for it,
    or None: no record, an unreadable one, or its process is gone (a crash leaves the file)."""
    import json

    try:
        doc = json.loads((Path(data_dir) / STORE_ENDPOINT_FILE).read_text())
        endpoint = StoreEndpoint(int(doc["pid"]), str(doc["nats_url"]), str(doc["subject_prefix"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(endpoint.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return endpoint
