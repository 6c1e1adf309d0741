"""The embedded nats-server must be 2.11 or newer (review item 2): budgeted submissions rely on
``Nats-Expected-Last-Subject-Sequence-Subject``. An older binary (here a stand-in script that
prints an old version, as a user's PATH could give) is refused with a clear error before it
starts; the bundled one passes."""

from __future__ import annotations

import pytest

from fedsched import natsd
from fedsched.errors import UnavailableError


def _binary(tmp_path, version: str):
    path = tmp_path / f"nats-server-{version}"
    path.write_text(f"#!/bin/sh\necho 'nats-server: v{version}'\n")
    path.chmod(0o755)
    return str(path)


def test_an_older_nats_server_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(UnavailableError, match=r"nats-server 2\.10\.24; fedsched needs 2\.11\.0 or newer"):
        natsd.check_nats_server(_binary(tmp_path, "2.10.24"))
    assert natsd.check_nats_server(_binary(tmp_path, "2.11.0")).endswith("2.11.0")


def test_the_embedded_server_does_not_start_an_older_binary(tmp_path, monkeypatch):
    old = _binary(tmp_path, "2.9.25")
    monkeypatch.setattr(natsd, "find_nats_server", lambda: old)
    server = natsd.EmbeddedNats(tmp_path / "store")
    with pytest.raises(UnavailableError, match="needs 2.11.0"):
        server.spawn()
    assert not server.running


def test_the_bundled_nats_server_is_new_enough():
    assert natsd.nats_server_version(natsd.find_nats_server()) >= natsd.MIN_NATS_SERVER
