"""Simulated time: a clock that runs faster than the wall clock, shared by the agents of a demo fleet."""
from __future__ import annotations

import time


class SimClock:
    """Simulated time that runs ``speed`` times faster than the wall clock.

    Reads ``start`` (epoch seconds) at the wall-clock instant ``origin`` and advances ``speed`` simulated
    seconds per real second from there, so agents given the same ``start`` and ``origin`` share one clock
    however far apart they were started. Defaults: both are the wall time when the clock is made.
    """

    def __init__(self, speed: float = 1.0, start: float | None = None, origin: float | None = None) -> None:
        if not speed > 0:
            raise ValueError(f"simulated speed {speed}: must be > 0")
        self.speed = speed
        self.origin = time.time() if origin is None else origin
        self.start = self.origin if start is None else start

    def __call__(self) -> float:
        return self.from_wall(time.time())

    def from_wall(self, wall_s: float) -> float:
        """The simulated time at wall-clock time ``wall_s`` (e.g. when a thread stamped an event)."""
        return self.start + (wall_s - self.origin) * self.speed

