"""Sharing a replay clock over NATS KV (bucket ``<prefix>_clock``, key ``state``).

The replay driver owns the clock and :func:`publish_clock`s every change; each service runs
:class:`ClockFollower`, which keeps its :class:`~fedsched.clock.ReplayClock` on the newest state.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fedsched.bus import Bus
from fedsched.clock import ClockState, ReplayClock

log = logging.getLogger(__name__)

BUCKET = "clock"
KEY = "state"


async def publish_clock(bus: Bus, state: ClockState) -> None:
    """Store ``state`` as the federation's clock."""
    kv = await bus.key_value(BUCKET)
    await kv.put(KEY, json.dumps(state.to_json()).encode())


async def read_clock(bus: Bus) -> ClockState | None:
    """The stored clock state, or None if no replay clock is set."""
    kv = await bus.key_value(BUCKET)
    try:
        entry = await kv.get(KEY)
    except Exception:  # noqa: BLE001 - key not found
        return None
    return ClockState.from_json(json.loads(entry.value)) if entry and entry.value else None


class ClockFollower:
    """Keeps ``clock`` on the newest published state until stopped."""

    def __init__(self, bus: Bus, clock: ReplayClock) -> None:
        self.bus = bus
        self.clock = clock
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    async def run(self) -> None:
        """Watch the KV key; survives reconnects by re-watching."""
        while not self._stop.is_set():
            try:
                kv = await self.bus.key_value(BUCKET)
                watcher = await kv.watch(KEY)
                while not self._stop.is_set():
                    try:
                        entry = await watcher.updates(timeout=1.0)
                    except asyncio.TimeoutError:
                        continue
                    except Exception:  # noqa: BLE001 - nats TimeoutError
                        continue
                    if entry is None or not entry.value:
                        continue
                    try:
                        self.clock.update(ClockState.from_json(json.loads(entry.value)))
                    except (ValueError, KeyError, TypeError) as e:
                        log.warning("ignoring malformed clock state: %s", e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.info("clock watch: %r; retrying", e)
                await asyncio.sleep(0.5)
