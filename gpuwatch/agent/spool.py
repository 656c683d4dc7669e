"""Durable spool: every batch is on disk (fsynced) before it is sent and deleted only when acknowledged.

Layout of the spool directory (0700; files 0600: telemetry names jobs and hosts):
  state.json            agent_id, next sequence number, running totals of dropped batches (durable)
  state.reserve         the same state in two fixed-size slots allocated while the disk had room, rewritten in
                        place (no new block needed) when state.json cannot be replaced for a full disk
  batches/<seq>.pb      one record per file: ``GWS1``, payload length and CRC32C (big-endian u32 each), then
                        the serialized TelemetryBatch, named by its zero-padded sequence
  rejected/<seq>.pb     batches the collector refused and records that failed their checksum, each with a
                        ``.reason.txt`` (kept for a human; never retried)

The sequence number is persisted before a batch file is written, so sequences are never reused across
restarts, even on a full disk: state.reserve takes the state when state.json cannot be written, and the
newer of the two (by a generation count) is read at start, so drops counted and sequences used while the
disk was full survive a restart before space returns. When the batches exceed ``max_bytes``, or the disk
is full, the oldest batches not yet sent are dropped (a batch sent and not yet acknowledged may already be
stored: counting it as lost would be wrong, and if the disk has no room for anything else the new batch is
dropped instead); a disk-full episode is logged once when it starts and once when it ends. The running totals are
persisted and :meth:`Spool.take_dropped` hands them to the agent, which sends them in its next batch
(totals, not increments, so a report lost with a dropped batch is made good by the next one). A lost
or moved-away ``state.json`` is rebuilt from the batches still spooled (their agent id and sequences), so
they stay sendable and acknowledgeable.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
from google.protobuf.message import DecodeError

from gpuwatch.core.errors import UserError
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

_SUFFIX = ".pb"
_MAGIC = b"GWS1"
_HEADER = struct.Struct(">4sII")  # magic, payload length, CRC32C of the payload
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_SLOT_MAGIC = b"GWSS"
_SLOT_BYTES = 2048  # one slot of state.reserve: header and the state's JSON, zero-padded


@dataclass(frozen=True)
class Dropped:
    """Batches (and their bytes) the spool dropped: since the last report, and in total since it was created."""

    batches: int
    bytes: int
    total_batches: int = 0
    total_bytes: int = 0


class SpoolFull(OSError):
    """The disk has no room for a batch even after every older batch was dropped; this one is dropped too."""


def encode_record(payload: bytes) -> bytes:
    """One spool record: header (magic, length, CRC32C) and payload."""
    return _HEADER.pack(_MAGIC, len(payload), google_crc32c.value(payload)) + payload


def decode_record(data: bytes) -> bytes:
    """The payload of one spool record; ValueError naming what is wrong with a damaged one."""
    if not data:
        raise ValueError("empty file (the disk was full or the agent stopped while writing it)")
    if len(data) < _HEADER.size or data[:4] != _MAGIC:
        raise ValueError(f"not a spool record ({len(data)} bytes without the {_MAGIC.decode()} header)")
    _, length, crc = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise ValueError(f"truncated: {len(payload)} of {length} payload bytes")
    if google_crc32c.value(payload) != crc:
        raise ValueError("CRC32C checksum mismatch (the file was damaged after it was written)")
    return payload

class Spool:
    """Thread-safe: the sampler thread appends, the uplink thread reads, acknowledges and quarantines."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 256 * 2**20) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self._batches = self.dir / "batches"
        self._rejected = self.dir / "rejected"
        self._state_path = self.dir / "state.json"
        self._reserve_path = self.dir / "state.reserve"
        self._lock = threading.RLock()  # re-entered when a full disk interrupts a state write
        self._disk_full = False  # warn once per episode, not once per batch
        try:
            for d in (self.dir, self._batches, self._rejected):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)
        except OSError as exc:
            raise UserError(f"spool directory {self.dir}: cannot create it ({exc.strerror})") from exc
        # sequence -> payload size, in sequence order (appends are in order; the dict keeps insertion order)
        self._sizes: dict[int, int] = {}
        self._sent: set[int] = set()  # pending sequences handed to the uplink (maybe stored by now): not dropped
        for path in sorted(self._batches.glob("*" + _SUFFIX)):
            try:
                self._sizes[int(path.stem)] = max(0, path.stat().st_size - _HEADER.size)
            except ValueError:
                log.warning("spool: ignoring stray file %s", path)
        for tmp in self._batches.glob("*.tmp"):  # a write interrupted by a crash: never acknowledged, never sent
            tmp.unlink(missing_ok=True)
        state = self._load_state()
        self._generation = int(state.get("generation", 0))
        self.agent_id: str = state.get("agent_id") or self._agent_id_from_batches() or uuid.uuid4().hex
        newest = max([*self._sizes, *self.rejected()], default=0)
        self._next_sequence = max(int(state.get("next_sequence", 1)), newest + 1)
        total = Dropped(0, 0, int(state.get("dropped_batches_total", 0)), int(state.get("dropped_bytes_total", 0)))
        # state written by an older agent holds only the unreported drops
        unreported = Dropped(int(state.get("dropped_batches", 0)), int(state.get("dropped_bytes", 0)))
        self._dropped = Dropped(unreported.batches, unreported.bytes, max(total.total_batches, unreported.batches),
                                max(total.total_bytes, unreported.bytes))
        self.identity_conflict: str = state.get("identity_conflict", "")
        self._allocate_reserve()
        try:
            self._make_room(self._save_state)
        except SpoolFull:  # a full disk at start: batches are dropped (and counted) until it has room again
            pass

    # --- writing -----------------------------------------------------------------------------------
    def next_sequence(self) -> int:
        """Reserve the next sequence number (persisted before it is used); SpoolFull when even that cannot be
        written (the batch is then counted as dropped)."""
        with self._lock:
            seq = self._next_sequence
            self._next_sequence += 1
            try:
                self._make_room(self._save_state)
            except SpoolFull:
                self._count_dropped(1, 0)
                raise
            return seq

    def append(self, sequence: int, data: bytes) -> None:
        """Write one serialized batch durably, then enforce the size bound (oldest dropped first).

        On a full disk the oldest batches are dropped (counted) until this one fits; if none is left to drop,
        this one is dropped and counted instead, and SpoolFull is raised. Sampling goes on either way."""
        record = encode_record(data)
        try:
            had_room = self._make_room(lambda: self._write_record(sequence, record), sequence)
        except SpoolFull:
            with self._lock:
                self._count_dropped(1, len(data))
                self._try_save_state()
            raise
        with self._lock:
            self._sizes[sequence] = len(data)
            self._enforce_bound(keep=sequence)
        if self._disk_full and had_room:  # written without dropping anything: the episode is over
            self._disk_full = False
            log.warning("spool %s: the disk has room again; spooling normally", self.dir)

    def _write_record(self, sequence: int, record: bytes) -> None:
        path = self._path(sequence)
        tmp = path.with_suffix(".tmp")
        try:
            write_durably(tmp, record)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self._batches)

    def _make_room(self, write: Callable[[], object], keep: int | None = None) -> bool:
        """Run ``write``; while it fails for a full disk, drop the oldest spooled batch and try again.
        True when it succeeded at once (the disk had room), False when batches were dropped for it."""
        first = True
        while True:
            try:
                write()
                return first
            except OSError as exc:
                first = False
                if exc.errno not in _DISK_FULL:
                    raise
                with self._lock:
                    oldest = next(self._unsent(keep), None)
                    if oldest is None:
                        self._warn_disk_full("nothing left to drop: this batch is dropped")
                        raise SpoolFull(exc.errno, f"spool {self.dir}: disk full") from exc
                    size = self._sizes.pop(oldest)
                    self._path(oldest).unlink(missing_ok=True)
                    self._count_dropped(1, size)
                    self._try_save_state()  # in the room just freed: the agent may have no batch left to cut
                    self._warn_disk_full("dropping the oldest batches")

    def _unsent(self, keep: int | None) -> Iterator[int]:
        """Pending sequences never handed to the uplink, oldest first, except ``keep``: the ones to drop."""
        return (s for s in self._sizes if s != keep and s not in self._sent)

    def _warn_disk_full(self, action: str) -> None:
        if not self._disk_full:
            self._disk_full = True
            log.warning("spool %s: the disk is full (%s); sampling goes on, drops are counted", self.dir, action)

    def _enforce_bound(self, keep: int) -> None:
        total = sum(self._sizes.values())
        dropped_batches = dropped_bytes = 0
        for seq in list(self._unsent(keep)):
            if total <= self.max_bytes:
                break
            size = self._sizes.pop(seq)
            self._path(seq).unlink(missing_ok=True)
            total -= size
            dropped_batches += 1
            dropped_bytes += size
        if dropped_batches:
            log.warning("spool over %d bytes: dropped the %d oldest batches (%d bytes)",
                        self.max_bytes, dropped_batches, dropped_bytes)
            self._count_dropped(dropped_batches, dropped_bytes)
            self._try_save_state()

    def _count_dropped(self, batches: int, size: int) -> None:
        d = self._dropped
        self._dropped = Dropped(d.batches + batches, d.bytes + size, d.total_batches + batches, d.total_bytes + size)

    def unreported_drops(self) -> int:
        """Batches dropped since the last :meth:`take_dropped`."""
        with self._lock:
            return self._dropped.batches

    def take_dropped(self) -> Dropped:
        """Drops since the last call (batches, bytes) with the running totals; resets the former (persisted)."""
        with self._lock:
            dropped = self._dropped
            self._dropped = Dropped(0, 0, dropped.total_batches, dropped.total_bytes)
            if dropped.batches:
                self._try_save_state()
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
        """The batch's bytes, or None when it was acknowledged or dropped meanwhile, or is damaged (then it is
        moved to rejected/ with what is wrong)."""
        try:
            data = self._path(sequence).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode_record(data)
        except ValueError as exc:
            path = self.quarantine(sequence, f"spool record {sequence} is damaged: {exc}")
            log.error("spool record %d is damaged (%s); moved to %s", sequence, exc, path)
            return None

    def mark_sent(self, sequence: int) -> None:
        """The uplink is sending this batch: from now on it may be stored, so it is no longer dropped to make
        room (until this process restarts: the spool does not remember what an earlier run sent)."""
        with self._lock:
            if sequence in self._sizes:
                self._sent.add(sequence)

    def ack(self, sequence: int) -> None:
        with self._lock:
            self._sizes.pop(sequence, None)
            self._sent.discard(sequence)
        self._path(sequence).unlink(missing_ok=True)

    def quarantine(self, sequence: int, reason: str) -> Path:
        """Move a refused or damaged batch to rejected/ with the reason next to it; it is never sent again."""
        target = self._rejected / self._path(sequence).name
        with self._lock:
            self._sizes.pop(sequence, None)
            self._sent.discard(sequence)
            try:
                os.replace(self._path(sequence), target)
            except FileNotFoundError:
                pass
        try:
            write_durably(target.with_suffix(".reason.txt"), (reason + "\n").encode())
        except OSError as exc:
            log.error("spool: cannot write the reason for %s (%s): %s", target, exc.strerror, reason)
        return target

    def rejected(self) -> list[int]:
        return sorted(int(p.stem) for p in self._rejected.glob("*" + _SUFFIX) if p.stem.isdigit())

    # --- identity ----------------------------------------------------------------------------------
    def record_identity_conflict(self, message: str) -> None:
        """The collector says another running agent uses this agent id; kept for `gpuwatch agent --check`."""
        with self._lock:
            if message != self.identity_conflict:
                self.identity_conflict = message
                self._try_save_state()

    def renew_identity(self) -> str:
        """Give this spool a new agent id (it was copied from another agent's): every unsent batch is rewritten
        under the new id with fresh sequences, so none is lost or taken for the other agent's. Returns the id."""
        with self._lock:
            self.agent_id = uuid.uuid4().hex
            self.identity_conflict = ""
            old = list(self._sizes)
            self._sizes.clear()
            self._sent.clear()  # every batch gets a new sequence and is sent afresh
            self._next_sequence = 1
            self._save_state()
            for seq in old:
                path = self._path(seq)
                try:
                    batch = pb.TelemetryBatch.FromString(decode_record(path.read_bytes()))
                except (OSError, ValueError, DecodeError) as exc:
                    self._sizes[seq] = 0  # quarantine() below takes it out again
                    self.quarantine(seq, f"spool record {seq} is damaged: {exc}")
                    continue
                batch.agent_id, batch.sequence = self.agent_id, self._next_sequence
                self._next_sequence += 1
                self._save_state()
                data = batch.SerializeToString()
                self._write_record(batch.sequence, encode_record(data))
                self._sizes[batch.sequence] = len(data)
                if batch.sequence != seq:
                    path.unlink(missing_ok=True)
            return self.agent_id

    # --- state -------------------------------------------------------------------------------------
    def _path(self, sequence: int) -> Path:
        return self._batches / f"{sequence:020d}{_SUFFIX}"

    def _load_state(self) -> dict:
        """The newest of state.json and the reserve's slots (the reserve is newer after a full disk)."""
        try:
            saved = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            saved = {}
        except (OSError, ValueError) as exc:
            raise UserError(f"spool state {self._state_path}: unreadable ({exc}); move it away to start afresh "
                            "(the agent id is taken from the batches still spooled, else a new one is made)") from exc
        return max([saved, *self._reserved_states()], key=lambda state: int(state.get("generation", 0)))

    def _reserved_states(self) -> list[dict]:
        """The intact slots of state.reserve (a slot torn by a crash fails its checksum; the other one holds)."""
        try:
            data = self._reserve_path.read_bytes()
        except FileNotFoundError:
            return []
        states = []
        for offset in range(0, len(data) - _HEADER.size + 1, _SLOT_BYTES):
            magic, length, crc = _HEADER.unpack_from(data, offset)
            payload = data[offset + _HEADER.size:offset + _HEADER.size + length]
            if magic != _SLOT_MAGIC or len(payload) != length or google_crc32c.value(payload) != crc:
                continue
            try:
                state = json.loads(payload)
            except ValueError:
                continue
            if isinstance(state, dict):
                states.append(state)
        return states

    def _allocate_reserve(self) -> None:
        """Create state.reserve's two slots while the disk has room, so a full disk can still take the state."""
        if self._reserve_path.exists():
            return
        tmp = self._reserve_path.with_suffix(".tmp")
        try:
            write_durably(tmp, bytes(2 * _SLOT_BYTES))
            os.replace(tmp, self._reserve_path)
            _fsync_dir(self.dir)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno not in _DISK_FULL:
                raise
            log.warning("spool %s: no room for %s; until there is, a restart on a full disk may forget drops",
                        self.dir, self._reserve_path.name)

    def _save_reserved(self, payload: bytes) -> None:
        """Rewrite one slot of state.reserve in place (the older one: a torn write leaves the newer intact)."""
        if len(payload) > _SLOT_BYTES - _HEADER.size:
            raise ValueError(f"spool state of {len(payload)} bytes does not fit a reserve slot")
        slot = _HEADER.pack(_SLOT_MAGIC, len(payload), google_crc32c.value(payload)) + payload
        fd = os.open(self._reserve_path, os.O_WRONLY)  # no O_CREAT: only blocks allocated with room are used
        try:
            os.pwrite(fd, slot.ljust(_SLOT_BYTES, b"\0"), (self._generation % 2) * _SLOT_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _agent_id_from_batches(self) -> str | None:
        """The agent id of the newest readable spooled batch: a lost state.json must not orphan its batches."""
        for seq in reversed(self._sizes):
            try:
                batch = pb.TelemetryBatch.FromString(decode_record(self._path(seq).read_bytes()))
            except (OSError, ValueError, DecodeError):
                continue
            if batch.agent_id:
                log.warning("spool %s: no state.json; the agent id %s is taken from spooled batch %d",
                            self.dir, batch.agent_id, seq)
                return batch.agent_id
        return None

    def _save_state(self) -> None:
        """Replace state.json; on a full disk write state.reserve in place instead (OSError if neither can)."""
        d = self._dropped
        self._generation += 1
        state = {"agent_id": self.agent_id, "next_sequence": self._next_sequence, "generation": self._generation,
                 "dropped_batches": d.batches, "dropped_bytes": d.bytes,
                 "dropped_batches_total": d.total_batches, "dropped_bytes_total": d.total_bytes}
        conflict = {"identity_conflict": self.identity_conflict} if self.identity_conflict else {}
        tmp = self._state_path.with_suffix(".tmp")
        try:
            write_durably(tmp, json.dumps({**state, **conflict}).encode())
            os.replace(tmp, self._state_path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno not in _DISK_FULL or not self._reserve_path.exists():
                raise
            self._save_reserved(json.dumps(state).encode())  # no identity conflict: the collector tells it again
            return
        _fsync_dir(self.dir)

    def _try_save_state(self) -> None:
        """Persist the drop counts if the disk allows; they stay in memory and go out with the next batch."""
        try:
            self._save_state()
        except OSError as exc:
            if exc.errno not in _DISK_FULL:
                raise


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new private file (0600) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
