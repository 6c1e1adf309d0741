"""The agents of one process share their reads of the scheduler lease (issue 15): callers that
ask in the same pass of the event loop get one read, made after every one of them asked (what
fencing needs); a caller that asks once the read has started gets a read of its own."""

from __future__ import annotations

import asyncio

import pytest

from fedsched.errors import UnavailableError
from fedsched.lease import Tenure
from services.inventory.agent import SharedReads
from tests.builders import until


class _Lease:
    """A lease read whose request stays in flight until ``answer`` is set; each read returns the
    number of callers that had asked when it started."""

    def __init__(self) -> None:
        self.asked = 0
        self.started: list[int] = []
        self.answer = asyncio.Event()
        self.fail = False

    async def read(self) -> Tenure | None:
        mine = self.asked
        self.started.append(mine)
        await self.answer.wait()
        if self.fail:
            raise UnavailableError("lease unreadable")
        return Tenure(mine, 0.0, "scheduler-a")


async def _ask(lease: _Lease, reads: SharedReads) -> Tenure | None:
    lease.asked += 1
    return await reads(lease.read)


async def test_callers_in_one_pass_share_one_read_made_after_all_of_them_asked():
    lease = _Lease()
    reads = SharedReads()
    lease.answer.set()
    got = await asyncio.gather(*(_ask(lease, reads) for _ in range(6)))
    assert reads.calls == 1 and reads.joined == 5
    assert lease.started == [6] and {t.token for t in got} == {6}


async def test_a_caller_after_the_read_started_gets_a_new_read():
    lease = _Lease()
    reads = SharedReads()
    first = asyncio.create_task(_ask(lease, reads))
    assert await until(lambda: lease.started == [1], timeout=2)  # in flight: its request is out
    second = asyncio.create_task(_ask(lease, reads))
    assert await until(lambda: len(lease.started) == 2, timeout=2)
    lease.answer.set()
    assert ((await first).token, (await second).token) == (1, 2)
    assert reads.calls == 2 and reads.joined == 0


async def test_a_failed_read_fails_every_caller_sharing_it_and_the_next_call_reads_again():
    lease = _Lease()
    reads = SharedReads()
    lease.fail = True
    lease.answer.set()
    results = await asyncio.gather(*(_ask(lease, reads) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, UnavailableError) for r in results) and reads.calls == 1
    lease.fail = False
    assert (await _ask(lease, reads)).token == 4 and reads.calls == 2


async def test_a_cancelled_caller_does_not_cancel_the_read_of_the_others():
    lease = _Lease()
    reads = SharedReads()
    a = asyncio.create_task(_ask(lease, reads))
    b = asyncio.create_task(_ask(lease, reads))
    assert await until(lambda: lease.started == [2], timeout=2)
    a.cancel()
    lease.answer.set()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert (await b).token == 2


def test_reads_are_shared_per_connection_never_across_two():
    """Two federations in one process with the default prefix: each connection's agents share
    their reads; an agent never joins a read made on the other connection."""
    import nats

    from fedsched.bus import Bus
    from services.inventory.agent import shared_tenure_reads

    one, other = nats.NATS(), nats.NATS()  # never connected: only their identity matters here
    a, a_again, b = Bus(one), Bus(one, name="agent-2"), Bus(other)
    assert a.prefix == b.prefix and a.js_domain == b.js_domain
    assert shared_tenure_reads(a) is shared_tenure_reads(a_again)
    assert shared_tenure_reads(a) is not shared_tenure_reads(b)
    assert shared_tenure_reads(Bus(one, "fed2")) is not shared_tenure_reads(a)


async def test_agents_given_one_shared_reads_share_a_read_across_their_connections(monkeypatch):
    """A runtime's agents (one federation, a connection each) share their reads: callers in one
    pass get one read, made on the connection of the one that asked first."""
    import nats

    from fedsched.bus import Bus
    from services.inventory import agent as agent_module

    made_on: list[Bus] = []

    async def read_tenure(bus):
        made_on.append(bus)
        return Tenure(7, 0.0, "scheduler-a")

    monkeypatch.setattr(agent_module, "read_tenure", read_tenure)
    reads = SharedReads()
    first, second = Bus(nats.NATS(), name="agent-1"), Bus(nats.NATS(), name="agent-2")
    readers = [agent_module.shared_lease_reader(reads, first), agent_module.shared_lease_reader(reads, second)]
    got = await asyncio.gather(*(read() for read in readers))
    assert [t.token for t in got] == [7, 7] and reads.calls == 1 and reads.joined == 1 and made_on == [first]
    assert (await readers[1]()).token == 7 and made_on == [first, second]  # a later call reads on its own
