"""Epoch milliseconds <-> ISO 8601 UTC text, the one spelling every query, alert and report uses."""
from __future__ import annotations

import datetime as dt


def iso_utc(ms: int) -> str | None:
    """Epoch ms as ISO 8601 UTC ("2024-05-01T12:00:00.000Z"); None for 0 (never)."""
    if not ms:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def iso_ms(text: str) -> int:
    """Epoch ms of an ISO 8601 UTC time as the alert documents write it ("2026-01-01T00:00:00.000Z")."""
    return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
