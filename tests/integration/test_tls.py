"""Optional mTLS on the gRPC port: with a client CA, only clients holding a certificate it signed
get through (and still need a token); plaintext and certificate-less clients are refused."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedapp.client import TlsClient, aio_channel
from fedsched.clock import SystemClock
from services.admission.service import AdmissionService, TlsFiles
from tests.builders import TOKENS, policy_doc, store_policy

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: Path, name: str, cn: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "1", "-subj", "/CN=fedsched-test-ca", cwd=d)
    _issue(d, "server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _issue(d, "client", "alice", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture
async def mtls_admission(bus, pki):
    await store_policy(bus, policy_doc())
    svc = AdmissionService(bus, SystemClock(), address="localhost:0",
                           tls=TlsFiles(pki / "server.pem", pki / "server.key", pki / "ca.pem"))
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    yield svc
    svc.stop()
    await task


async def _list(ch) -> grpc.StatusCode:
    try:
        await gpb_grpc.TenantServiceStub(ch).ListTenants(gpb.ListTenantsRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def test_mtls_needs_a_client_certificate_and_a_token(mtls_admission, pki):
    target = f"localhost:{mtls_admission.port}"
    full = TlsClient(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    async with aio_channel(target, TOKENS["alice"], tls=full) as ch:
        assert await _list(ch) == grpc.StatusCode.OK
    async with aio_channel(target, None, tls=full) as ch:
        assert await _list(ch) == grpc.StatusCode.UNAUTHENTICATED  # the certificate does not replace the token
    async with aio_channel(target, TOKENS["alice"], tls=TlsClient(pki / "ca.pem")) as ch:
        assert await _list(ch) == grpc.StatusCode.UNAVAILABLE  # no client certificate: the handshake fails
    async with aio_channel(target, TOKENS["alice"]) as ch:
        assert await _list(ch) == grpc.StatusCode.UNAVAILABLE  # plaintext
