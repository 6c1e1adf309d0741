"""request_what_if never fails a dry run (review item 10): a bus error other than a timeout or
no responders (the connection closed or draining, a slow consumer...) answers None, as its
docstring says."""

from __future__ import annotations

import nats.errors
import pytest

from fedsched.whatif import WhatIfRequest, request_what_if
from tests.builders import spec


class _FailingConnection:
    """A connection whose request fails with ``error`` (as nats-py raises it)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.asked = 0

    async def request(self, subject, payload, timeout):
        self.asked += 1
        raise self.error


@pytest.mark.parametrize("error", [nats.errors.ConnectionClosedError(), nats.errors.ConnectionDrainingError(),
                                   nats.errors.NoServersError()])
async def test_a_bus_error_answers_none(error):
    nc = _FailingConnection(error)
    reply = await request_what_if(nc, "t", WhatIfRequest(spec=spec(), submitted_at=1_700_000_000.0), timeout_s=0.5)
    assert reply is None and nc.asked == 1
