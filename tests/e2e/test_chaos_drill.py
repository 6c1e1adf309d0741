"""The chaos drill (``bench/chaos.py``, issue 14 "Tests that must exist"): one short loop.

Real processes throughout: a three-node NATS cluster and ``fedsched service`` processes for
admission, two scheduler replicas, the agents and the writers (audit + billing). A clean run gives
the reference; the chaos run kill -9s a NATS node, the active scheduler, the agents process and the
writers process between submissions, each brought back. Required: every job succeeded with one
attempt, zero lost (stream messages = audit rows), zero doubled (rows = distinct event ids), and
the same cost as the clean run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def _chaos_module():
    spec = importlib.util.spec_from_file_location("fedsched_bench_chaos", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


async def test_one_chaos_loop_loses_nothing_doubles_nothing_and_costs_what_a_clean_run_costs(tmp_path) -> None:
    chaos = _chaos_module()
    # the writers process killed with a batch in hand: redelivered after 5 s, not the default 60 s
    # the clean run (the reference) and the chaos run are independent (own NATS cluster, data dir,
    # ports and prefix each): they run at once
    clean, run = await asyncio.gather(
        chaos.run_once(tmp_path / "clean", kinds=(), jobs=6, runtime_s=15, writer_ack_wait_s=5),
        chaos.run_once(tmp_path / "chaos", kinds=chaos.KINDS, jobs=6, runtime_s=15, loop=1, writer_ack_wait_s=5))
    print("\n" + chaos._line("clean", clean, None) + "\n" + chaos._line("chaos", run, clean))
    assert len(run.kills) == len(chaos.KINDS)  # each kind was killed once
    for r in (clean, run):
        assert r.succeeded == r.jobs == 6 and r.attempts == 6
        assert r.lost == 0 and r.doubled == 0
        assert r.stream_messages > 0
    assert run.cost == clean.cost > 0
