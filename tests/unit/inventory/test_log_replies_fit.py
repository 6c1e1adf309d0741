"""An agent's log replies always fit the bus server's max_payload (issue 14 item 6): the chunk
size a caller asks for is capped at max_payload / 8, so even output JSON escapes 6-fold
(control characters) makes replies the server accepts; nothing is lost."""

from __future__ import annotations

from types import SimpleNamespace

from fedsched.events import Subjects
from fedsched.logs import LogReply, LogRequest
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
LINES = [f"{i:04d}" + "\x01" * 300 for i in range(200)]  # 61 KiB of output, 6x as JSON


class NoisyBackend(StaticBackend):
    async def logs(self, key, worker=None, follow=False):
        for line in LINES:
            yield line


class RecordingNC:
    """Core NATS publish, recorded (the agent answers log requests with it)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes = b"", **kw) -> None:
        self.sent.append((subject, payload))


async def test_log_replies_fit_a_small_max_payload_and_lose_nothing() -> None:
    clock = FakeClock()
    agent = ClusterAgent(None, clock, CLUSTER, NoisyBackend(nodes("n"), clock=clock), publisher=FakePublisher(),
                         subjects=SUBJECTS)
    env = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], at=clock.time())
    await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, clock.time())])
    nc = RecordingNC()
    agent.bus = SimpleNamespace(max_payload=4096, nc=nc)
    request = LogRequest(job_id="j1", attempt=1)  # asks for 64 KiB chunks
    await agent._answer_logs(SimpleNamespace(data=request.model_dump_json().encode(), reply="_INBOX.x"))
    assert len(nc.sent) > 10 and all(len(payload) <= 4096 for _, payload in nc.sent)
    replies = [LogReply.model_validate_json(payload) for _, payload in nc.sent]
    assert replies[-1].eof and "".join(r.data for r in replies) == "".join(line + "\n" for line in LINES)
