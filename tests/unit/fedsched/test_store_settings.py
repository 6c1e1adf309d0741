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


@pytest.mark.parametrize("text, read_only, kind", [
    ("Code: 62. DB::Exception: Syntax error: ... Unmatched parentheses: '(' is never closed. (SYNTAX_ERROR)", False,
     "ValidationError"),
    ("Code: 60. DB::Exception: Unknown table expression identifier 'nope'. (UNKNOWN_TABLE)", True, "ValidationError"),
    ("Code: 159. DB::Exception: Timeout exceeded: elapsed 55000 ms. (TIMEOUT_EXCEEDED)", True, "ValidationError"),
    ("Code: 159. DB::Exception: Timeout exceeded: elapsed 55000 ms. (TIMEOUT_EXCEEDED)", False, "UnavailableError"),
    ("Code: 241. DB::Exception: Query memory limit exceeded: would use 1.07 GiB. (MEMORY_LIMIT_EXCEEDED)", True,
     "ValidationError"),
    ("Code: 241. DB::Exception: Query memory limit exceeded: would use 1.07 GiB. (MEMORY_LIMIT_EXCEEDED)", False,
     "UnavailableError"),
    ("Code: 252. DB::Exception: Too many parts (300). (TOO_MANY_PARTS)", False, "UnavailableError"),
    ("The client has been closed", False, "UnavailableError"),
    ("HTTPConnectionPool: Max retries exceeded (Connection refused)", False, "UnavailableError"),
])
def test_engine_errors_are_told_apart_from_outages(text, read_only, kind):
    from fedsched.store import _translate

    assert type(_translate(RuntimeError(text), read_only=read_only)).__name__ == kind
