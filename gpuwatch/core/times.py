"""Epoch milliseconds <-> ISO 8601 UTC text, the one spelling every query, alert and report uses; durations."""
from __future__ import annotations

import datetime as dt
import re


def iso_utc(ms: int) -> str | None:
    """Epoch ms as ISO 8601 UTC ("2024-05-01T12:00:00.000Z"); None for 0 (never)."""
    if not ms:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def iso_ms(text: str) -> int:
    """Epoch ms of an ISO 8601 UTC time as the alert documents write it ("2026-01-01T00:00:00.000Z")."""
    return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


_DURATION = re.compile(r"\s*(\d*\.?\d+)\s*(s|min|m|h|d)?\s*")
_SECONDS_PER_UNIT = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``5m`` (or ``5min``), ``1.5h``, ``2d`` -> seconds; ValueError naming the text otherwise.
    The one duration syntax of flags (``--horizon 1h``), fault scripts (``after=5m``) and ``--since 15m``."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 5m, 1.5h, 2d)")
    return float(m.group(1)) * _SECONDS_PER_UNIT[m.group(2) or "s"]
