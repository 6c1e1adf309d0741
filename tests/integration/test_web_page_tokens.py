"""The console's API client against a real admission: a page token admission refuses comes back
as INVALID_ARGUMENT naming the field ``page_token`` (its ``fedsched-field`` trailer), which is
what the console's 400 page for a bad paging link keys on (fedapp/web/app.py)."""

from __future__ import annotations

import grpc
import pytest

from fedapp.web.api import Api, ApiConfig, ApiError
from fedsched.api.v1 import jobs_pb2 as pb
from tests.builders import TOKENS, running_admission


async def test_a_refused_page_token_names_its_field(bus):
    async with running_admission(bus) as svc:
        api = Api(ApiConfig(f"127.0.0.1:{svc.port}"))
        try:
            with pytest.raises(ApiError) as jobs:
                await api.list_jobs(TOKENS["root"], pb.ListJobsRequest(page_token="not-a-token"))
            with pytest.raises(ApiError) as approvals:
                await api.list_approvals(TOKENS["root"], page_token="not-a-token")
            with pytest.raises(ApiError) as other:  # a refusal of another field names that one
                await api.list_jobs(TOKENS["root"], pb.ListJobsRequest(page_size=5000))
        finally:
            await api.close()
    for e in (jobs.value, approvals.value):
        assert (e.code, e.field, e.http_status) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token", 400)
        assert e.message.startswith("page_token: not a token returned by")
    assert other.value.code == grpc.StatusCode.INVALID_ARGUMENT and other.value.field != "page_token"
