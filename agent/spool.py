"""Durable spool: every batch is on disk (fsynced) before it is sent and deleted only when acknowledged.

Layout of the spool directory:
  state.json            agent_id, next sequence number, dropped batches not yet reported
  batches/<seq>.pb      one serialized TelemetryBatch per file, named by its zero-padded sequence
  rejected/<seq>.pb     batches the collector refused (kept for a human; never retried)

The sequence number is persisted before a batch file is written, so sequences are never reused across
restarts. When the batches exceed ``max_bytes`` the oldest are dropped; the count is persisted and handed
back by :meth:`Spool.take_dropped` so the agent reports it in a later batch.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.errors import UserError

log = logging.getLogger(__name__)

_SUFFIX = ".pb"


@dataclass(frozen=True)
class Dropped:
    batches: int
    bytes: int


class Spool:
    """Thread-safe: the sampler thread appends, the uplink thread reads, acknowledges and quarantines."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 256 * 2**20) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self._batches = self.dir / "batches"
        self._rejected = self.dir / "rejected"
        self._state_path = self.dir / "state.json"
        self._lock = threading.Lock()
        try:
            self._batches.mkdir(parents=True, exist_ok=True)
            self._rejected.mkdir(exist_ok=True)
        except OSError as exc:
            raise UserError(f"spool directory {self.dir}: cannot create it ({exc.strerror})") from exc
        # sequence -> size, in sequence order (appends are in order; the dict keeps insertion order)
        self._sizes: dict[int, int] = {}
        for path in sorted(self._batches.glob("*" + _SUFFIX)):
            try:
                self._sizes[int(path.stem)] = path.stat().st_size
            except ValueError:
                log.warning("spool: ignoring stray file %s", path)
        for tmp in self._batches.glob("*.tmp"):  # a write interrupted by a crash: never acknowledged, never sent
            tmp.unlink(missing_ok=True)
        state = self._load_state()
        self.agent_id: str = state.get("agent_id") or uuid.uuid4().hex
        self._next_sequence = max(int(state.get("next_sequence", 1)), max(self._sizes, default=0) + 1)
        self._dropped = Dropped(int(state.get("dropped_batches", 0)), int(state.get("dropped_bytes", 0)))
        self._save_state()

    # --- writing -----------------------------------------------------------------------------------
    def next_sequence(self) -> int:
        """Reserve the next sequence number (persisted before it is used)."""
        with self._lock:
            seq = self._next_sequence
            self._next_sequence += 1
            self._save_state()
            return seq

    def append(self, sequence: int, data: bytes) -> None:
        """Write one serialized batch durably, then enforce the size bound (oldest dropped first)."""
        path = self._path(sequence)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self._batches)
        with self._lock:
            self._sizes[sequence] = len(data)
            self._enforce_bound(keep=sequence)

    def _enforce_bound(self, keep: int) -> None:
        total = sum(self._sizes.values())
        dropped_batches = dropped_bytes = 0
        for seq in list(self._sizes):
            if total <= self.max_bytes or seq == keep:
                break
            size = self._sizes.pop(seq)
            self._path(seq).unlink(missing_ok=True)
            total -= size
            dropped_batches += 1
            dropped_bytes += size
        if dropped_batches:
            log.warning("spool over %d bytes: dropped the %d oldest batches (%d bytes)",
                        self.max_bytes, dropped_batches, dropped_bytes)
            self._dropped = Dropped(self._dropped.batches + dropped_batches, self._dropped.bytes + dropped_bytes)
            self._save_state()

    def take_dropped(self) -> Dropped:
        """Dropped batches not yet reported; resets the count (persisted)."""
        with self._lock:
            dropped, self._dropped = self._dropped, Dropped(0, 0)
            if dropped.batches:
                self._save_state()
            return dropped

    # --- draining ----------------------------------------------------------------------------------
    def pending(self) -> list[int]:
        """Sequences waiting for an acknowledgement, oldest first."""
        with self._lock:
            return list(self._sizes)

    def next_after(self, sequence: int) -> int | None:
        """The oldest pending sequence above ``sequence`` (cheap: it walks only the in-flight ones before it)."""
        with self._lock:
            return next((s for s in self._sizes if s > sequence), None)

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def read(self, sequence: int) -> bytes | None:
        """The batch's bytes, or None when it was acknowledged or dropped meanwhile."""
        try:
            return self._path(sequence).read_bytes()
        except FileNotFoundError:
            return None

    def ack(self, sequence: int) -> None:
        with self._lock:
            self._sizes.pop(sequence, None)
        self._path(sequence).unlink(missing_ok=True)

    def quarantine(self, sequence: int, reason: str) -> Path:
        """Move a refused batch to rejected/ with the reason next to it; it is never sent again."""
        target = self._rejected / self._path(sequence).name
        with self._lock:
            self._sizes.pop(sequence, None)
            try:
                os.replace(self._path(sequence), target)
            except FileNotFoundError:
                pass
        target.with_suffix(".reason.txt").write_text(reason + "\n")
        return target

    def rejected(self) -> list[int]:
        return sorted(int(p.stem) for p in self._rejected.glob("*" + _SUFFIX))

    # --- state -------------------------------------------------------------------------------------
    def _path(self, sequence: int) -> Path:
        return self._batches / f"{sequence:020d}{_SUFFIX}"

    def _load_state(self) -> dict:
        try:
            return json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise UserError(f"spool state {self._state_path}: unreadable ({exc}); move it away to start afresh "
                            "(a new agent id will be used)") from exc

    def _save_state(self) -> None:
        state = {"agent_id": self.agent_id, "next_sequence": self._next_sequence,
                 "dropped_batches": self._dropped.batches, "dropped_bytes": self._dropped.bytes}
        tmp = self._state_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._state_path)
        _fsync_dir(self.dir)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
