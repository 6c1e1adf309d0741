"""Business clocks: the time every event is stamped with.

Live, that is the system clock. A replay runs a trace of months on a *compressed* clock: trace
time advances at ``speed`` trace-seconds per wall-second from an anchor, and the replay driver
may *jump* it forward when nothing can happen before the next arrival or completion (a
discrete-event skip). The clock state is one small record, ``ClockState``, published by the
driver (NATS KV) and followed by every service, so all processes agree on "now".

Liveness (heartbeat age, consumer timeouts) never uses this clock: it uses ``time.monotonic``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Protocol

from pydantic import AfterValidator


class Clock(Protocol):
    """Source of business time."""

    def time(self) -> float:
        """Seconds since the Unix epoch (UTC) on this clock."""
        ...


def to_datetime(epoch_s: float) -> datetime:
    """Aware UTC datetime of ``epoch_s`` seconds since the Unix epoch."""
    return datetime.fromtimestamp(epoch_s, tz=UTC)


def as_utc(dt: datetime) -> datetime:
    """``dt`` as an aware UTC datetime, the same instant whatever the process's time zone: an
    aware value is converted (``+02:00`` -> UTC), a naive one is taken to be UTC already (our
    wire format and columns are UTC; the local zone is never consulted)."""
    if dt.tzinfo is UTC:  # already what is asked (the common case: checked first, issue 15)
        return dt
    return dt.astimezone(UTC) if dt.tzinfo is not None and dt.utcoffset() is not None else dt.replace(tzinfo=UTC)


#: The earliest business time an event, a payload or a job spec may carry (inclusive): the Unix
#: epoch (every clock here counts seconds from it; replays start their trace at a configurable
#: epoch, 2023-01-01 by default).
MIN_TIME = datetime(1970, 1, 1, tzinfo=UTC)
#: The first business time refused: 2200-01-01 (exclusive). Inside what the store's
#: ``DateTime64(3, 'UTC')`` columns hold (1900-01-01 .. 2299-12-31) and far from Python's
#: ``datetime`` limit (year 9999), so windows, deadlines and report ranges computed from a
#: stored time (plus days or years) never overflow (tryout: a ``job.finished`` at 9999-12-31 made
#: billing fail with ``year 10000 is out of range``).
MAX_TIME = datetime(2200, 1, 1, tzinfo=UTC)


def as_bounded_utc(dt: datetime) -> datetime:
    """``dt`` as aware UTC (:func:`as_utc`), refused outside [:data:`MIN_TIME`, :data:`MAX_TIME`).

    Raises:
        ValueError: out of range (pydantic reports it with the field's name).
    """
    dt = as_utc(dt)
    if not MIN_TIME <= dt < MAX_TIME:
        raise ValueError(f"{dt.isoformat()} is outside the supported time range "
                         f"[{MIN_TIME.date().isoformat()}, {MAX_TIME.date().isoformat()})")
    return dt


#: A pydantic ``datetime`` field that always holds aware UTC (see :func:`as_utc`) within the
#: supported range (:func:`as_bounded_utc`).
UtcDatetime = Annotated[datetime, AfterValidator(as_bounded_utc)]


class SystemClock:
    """Wall-clock time (the live default)."""

    def time(self) -> float:
        """Seconds since the Unix epoch, from ``time.time``."""
        return time.time()


@dataclass(frozen=True, slots=True)
class ClockState:
    """A piecewise-linear mapping from wall time to business time.

    business(w) = anchor_business + (w - anchor_wall) * speed, for wall time ``w`` (seconds
    since the Unix epoch from ``time.time``; all processes of a replay share one machine, or
    NTP-synchronised machines).

    Attributes:
        anchor_wall: wall time of the anchor (s).
        anchor_business: business time at the anchor (s since the Unix epoch).
        speed: business seconds per wall second (> 0; 1 = real time).
        generation: increases with every change, so followers keep the newest.
    """

    anchor_wall: float
    anchor_business: float
    speed: float
    generation: int = 0

    def at(self, wall: float) -> float:
        """Business time at wall time ``wall``."""
        return self.anchor_business + (wall - self.anchor_wall) * self.speed

    def wall_at(self, business: float) -> float:
        """Wall time at which business time reaches ``business``."""
        return self.anchor_wall + (business - self.anchor_business) / self.speed

    def to_json(self) -> dict[str, float | int]:
        """Wire form (for the clock KV bucket)."""
        return {"anchor_wall": self.anchor_wall, "anchor_business": self.anchor_business,
                "speed": self.speed, "generation": self.generation}

    @classmethod
    def from_json(cls, data: dict) -> "ClockState":
        """Parse the wire form; raises ValueError on a malformed record."""
        state = cls(float(data["anchor_wall"]), float(data["anchor_business"]), float(data["speed"]),
                    int(data.get("generation", 0)))
        if not state.speed > 0:
            raise ValueError("clock speed must be > 0")
        return state


class ReplayClock:
    """A clock that follows a :class:`ClockState` (compressed, jumpable).

    Args:
        state: the initial mapping.
        wall: wall-time source (injectable for tests).
    """

    def __init__(self, state: ClockState, wall=time.time) -> None:
        self._state = state
        self._wall = wall

    @property
    def state(self) -> ClockState:
        """The mapping in force."""
        return self._state

    def time(self) -> float:
        """Business seconds since the Unix epoch; never goes backwards."""
        return self._state.at(self._wall())

    def update(self, state: ClockState) -> bool:
        """Adopt ``state`` if it is newer (higher generation); return whether it was adopted."""
        if state.generation <= self._state.generation:
            return False
        self._state = state
        return True

    def jump_to(self, business: float) -> ClockState:
        """Move business time forward to ``business`` now (never backwards); return the new state."""
        wall = self._wall()
        target = max(business, self._state.at(wall))
        self._state = ClockState(wall, target, self._state.speed, self._state.generation + 1)
        return self._state
