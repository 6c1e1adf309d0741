"""Server mode: credentials, TLS and cluster come from settings (pure argument building)."""

import pytest

from fedsched.errors import ValidationError
from fedsched.settings import Settings
from fedsched.store import ServerOptions, http_client_args, open_store


@pytest.mark.parametrize("url,options,expected", [
    ("http://ch:8123", ServerOptions(), dict(host="ch", port=8123, username="default", password="", secure=False,
                                             verify=True)),
    ("https://ch", ServerOptions(user="fed", password="s3cret", ca_cert="/etc/ca.pem"),
     dict(host="ch", port=8443, username="fed", password="s3cret", secure=True, verify=True, ca_cert="/etc/ca.pem")),
    ("https://u%40x:p%2Fw@ch:9443?verify=false", ServerOptions(user="ignored", password="ignored"),
     dict(host="ch", port=9443, username="u@x", password="p/w", secure=True, verify=False)),
    ("https://ch:8443", ServerOptions(verify=False), dict(secure=True, verify=False)),
], ids=["plain", "tls-from-settings", "url-credentials-win", "no-verify"])
def test_http_client_args(url, options, expected):
    args = http_client_args(url, options)
    assert {k: args[k] for k in expected} == expected
    assert ("ca_cert" in args) == ("ca_cert" in expected)


def test_other_schemes_are_refused():
    with pytest.raises(ValidationError) as e:
        http_client_args("tcp://ch:9000")
    assert e.value.field == "clickhouse_url"


def test_settings_carry_server_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("FEDSCHED_CLICKHOUSE_PASSWORD", "pw")
    monkeypatch.setenv("FEDSCHED_CLICKHOUSE_TTL_DAYS", '{"events": 400}')
    s = Settings(clickhouse_user="fed", clickhouse_cluster="fedsched")
    assert s.clickhouse_password.get_secret_value() == "pw" and "pw" not in repr(s)
    assert s.clickhouse_ttl_days == {"events": 400} and s.clickhouse_cluster == "fedsched"
    with pytest.raises(ValueError):
        Settings(clickhouse_cluster="bad name")


def test_a_cluster_needs_a_server(tmp_path):
    with pytest.raises(ValidationError) as e:
        open_store(chdb_path=tmp_path / "ch", cluster="fedsched")
    assert e.value.field == "clickhouse_cluster"
