"""How `fedsched sql` / `report` find the running system that holds a data dir's embedded store:
the record it writes (no credentials in it), ignored once its process is gone."""

from __future__ import annotations

import json
import subprocess
import sys

from fedapp.client import STORE_ENDPOINT_FILE, running_store, write_store_endpoint
from fedapp.cli.sql import running_system


def test_the_record_names_this_process_without_credentials(tmp_path):
    path = write_store_endpoint(tmp_path, "nats://ops:s3cret@127.0.0.1:4333,nats://127.0.0.1:4334", "fedx")
    assert path == tmp_path / STORE_ENDPOINT_FILE and "s3cret" not in path.read_text()
    endpoint = running_store(tmp_path)
    assert endpoint is not None and endpoint.nats_url == "nats://127.0.0.1:4333" and endpoint.subject_prefix == "fedx"


def test_the_data_dirs_credentials_and_token_are_used(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDSCHED_TOKEN", raising=False)
    write_store_endpoint(tmp_path, "nats://127.0.0.1:4333", "fed")
    (tmp_path / "nats.users").write_text(json.dumps({"ops": "pw"}))
    (tmp_path / "admin.token").write_text("tok-admin\n")
    url, prefix, token = running_system(tmp_path, None)
    assert (url, prefix, token) == ("nats://ops:pw@127.0.0.1:4333", "fed", "tok-admin")
    assert running_system(tmp_path, "explicit")[2] == "explicit"


def test_no_record_a_bad_one_or_a_dead_process_means_open_the_store(tmp_path):
    assert running_store(tmp_path) is None and running_system(tmp_path, None) is None
    (tmp_path / STORE_ENDPOINT_FILE).write_text("{not json")
    assert running_store(tmp_path) is None
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"pid": int(gone.stdout), "nats_url": "nats://127.0.0.1:4333", "subject_prefix": "fed"}
    (tmp_path / STORE_ENDPOINT_FILE).write_text(json.dumps(record))  # a crashed `up` leaves its record behind
    assert running_store(tmp_path) is None
