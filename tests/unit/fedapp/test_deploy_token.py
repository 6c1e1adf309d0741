"""The bootstrap admin token survives restarts in both deployments: compose keeps it on a named
volume, Kubernetes in a Secret admission mounts; the docs say how to read it (files parsed)."""

from __future__ import annotations

from pathlib import PurePosixPath
from pathlib import Path

import yaml

from fedsched.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_compose_keeps_the_admin_token_on_a_named_volume():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    admission = compose["services"]["admission"]
    token_file = PurePosixPath(admission["environment"]["FEDSCHED_ADMIN_TOKEN_FILE"])
    mounts = dict(v.split(":")[:2][::-1] for v in admission["volumes"])  # container path -> source
    source = mounts[str(token_file.parent)]
    assert source in compose["volumes"], "the token's directory must be a named volume (not a bind, not the image)"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"install -d -o fedsched -g fedsched -m 0700 {token_file.parent}" in dockerfile  # writable by uid 10001


def test_kubernetes_mounts_the_admin_token_secret_into_admission():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "admission.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "admission")
    token_file = PurePosixPath(_env(container)["FEDSCHED_ADMIN_TOKEN_FILE"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]
    assert secret["secretName"] == "fedsched-admin-token"
    assert {"key": "admin.token", "path": token_file.name} in secret["items"]
    example = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "secrets.example.yaml").read_text()) if d]
    made = next(d for d in example if d["metadata"]["name"] == "fedsched-admin-token")
    assert made["kind"] == "Secret" and "admin.token" in made["stringData"]


def test_the_setting_names_the_token_file(monkeypatch):
    monkeypatch.setenv("FEDSCHED_ADMIN_TOKEN_FILE", "/var/run/secrets/fedsched/admin.token")
    assert Settings().admin_token_path == Path("/var/run/secrets/fedsched/admin.token")
    monkeypatch.delenv("FEDSCHED_ADMIN_TOKEN_FILE")
    assert Settings(data_dir="/d").admin_token_path == Path("/d/admin.token")


def test_the_docs_say_how_to_read_the_token():
    for doc in (ROOT / "README.md", DEPLOY / "README.md"):
        text = doc.read_text()
        assert "exec admission cat /var/lib/fedsched/data/admin.token" in text, doc
        assert "get secret fedsched-admin-token -o jsonpath='{.data.admin\\.token}' | base64 -d" in text, doc
