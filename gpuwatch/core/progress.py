"""A one-line progress report on stderr for long work (replay, import, export, train, large traces).

It only draws on a terminal: piped or captured output (CI logs, ``--json`` consumers) stays clean, and
``quiet=True`` (the commands' ``--quiet``) silences it on a terminal too. Redraws are throttled so the
report costs nothing next to the work it reports on.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``label: done/total unit  rate/s  ETA m:ss``, redrawn in place at most every ``interval_s``."""

    def __init__(self, label: str, total: int | None = None, unit: str = "rows", *, quiet: bool = False,
                 stream: TextIO | None = None, interval_s: float = 0.5) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and _is_terminal(self._stream)
        self._interval_s = interval_s
        self._started = time.monotonic()
        self._last_draw = float("-inf")

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done; redraw when the last redraw is old enough."""
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self._interval_s:
            self._last_draw = now
            self._draw(now, end="")

    def close(self) -> None:
        """Draw the final line and end it, so later output starts on a fresh line."""
        if self.enabled:
            self._draw(time.monotonic(), end="\n")

    def line(self, now: float | None = None) -> str:
        """The report as text (what is drawn)."""
        elapsed = max((time.monotonic() if now is None else now) - self._started, 1e-9)
        rate = self.done / elapsed
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        text = f"{self.label}: {count} {self.unit}  {rate:,.0f}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f"  ETA {_clock((self.total - self.done) / rate)}"
        return text

    def _draw(self, now: float, end: str) -> None:
        self._stream.write("\r\x1b[K" + self.line(now) + end)
        self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
