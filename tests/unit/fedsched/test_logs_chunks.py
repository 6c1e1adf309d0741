"""fedsched.logs.chunks: log lines joined into bounded chunks of whole lines."""

from __future__ import annotations

import pytest

from fedsched.logs import LogRequest, chunks


@pytest.mark.parametrize("lines, bound", [
    (["x" * 10] * 100, 256),
    (["é" * 300, "short", ""], 256),
    ([f"line {i}" for i in range(1000)], 1024),
    ([], 256),
])
def test_chunks_are_bounded_whole_lines_and_lose_nothing_but_overlong_tails(lines, bound):
    out = list(chunks(lines, bound))
    assert all(len(c.encode()) <= bound and c.endswith("\n") for c in out)
    got = "".join(out).split("\n")[:-1] if out else []
    assert len(got) == len(lines)
    for want, have in zip(lines, got):
        assert want.startswith(have) and (have == want or len((have + "\n").encode()) > bound - 4)


def test_a_request_refuses_a_chunk_bound_above_the_cap():
    with pytest.raises(ValueError):
        LogRequest(job_id="j1", attempt=1, max_chunk_bytes=10**7)
