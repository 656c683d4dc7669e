"""The agent's end of the probe socket: receive span datagrams from training processes on this node.

A background thread decodes datagrams into a bounded buffer; the agent calls `drain()` when it cuts a batch,
so probe rows travel through the spool like every other sample. Malformed datagrams are counted and dropped.
"""
from __future__ import annotations

import os
import socket
import stat
import threading
from collections import deque

from gpuwatch.probe.wire import ROW_FIELDS, SpanRow, decode_datagram
from gpuwatch.v1 import telemetry_pb2

MAX_DATAGRAM = 256 * 1024
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
HEADER_COLUMNS = {"job_id": "job", "rank": "rank", "world_size": "ws", "node": "node"}


class ProbeListener:
    """Bind `path` (creating its directory, replacing a stale socket) and collect probe rows in the background."""

    def __init__(self, path: str, *, capacity: int = 500_000, mode: int = 0o660) -> None:
        self.path = path
        self.datagrams = 0
        self.malformed = 0
        self.dropped = 0
        self.last_error = ""
        self._rows: deque[tuple[dict, SpanRow]] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self._closed = threading.Event()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._remove_stale(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            self._sock.bind(path)
            os.chmod(path, mode)
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"probe socket {path}: {exc.strerror}") from None
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._receive_loop, name="gpuwatch-probe-listener", daemon=True)
        self._thread.start()

    @staticmethod
    def _remove_stale(path: str) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
            else:
                raise FileExistsError(f"probe socket {path}: exists and is not a socket")
        except FileNotFoundError:
            pass

    def _receive_loop(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                continue
            self._accept(data)

    def _accept(self, data: bytes) -> None:
        self.datagrams += 1
        try:
            header, rows = decode_datagram(data)
        except ValueError as exc:
            self.malformed += 1
            self.last_error = str(exc)
            return
        with self._lock:
            room = self._capacity - len(self._rows)
            self._rows.extend((header, row) for row in rows[:max(room, 0)])
            self.dropped += max(len(rows) - max(room, 0), 0)

    def pending(self) -> int:
        return len(self._rows)

    def drain(self) -> telemetry_pb2.SpanTable:
        """Everything received since the last drain, as one columnar SpanTable."""
        with self._lock:
            received = list(self._rows)
            self._rows.clear()
        table = telemetry_pb2.SpanTable()
        for column, key in HEADER_COLUMNS.items():
            getattr(table, column).extend(header[key] for header, _ in received)
        for column in ROW_FIELDS:  # SpanRow fields are named like the SpanTable columns
            getattr(table, column).extend(getattr(row, column) for _, row in received)
        return table

    def stats(self) -> dict[str, int]:
        return {"datagrams": self.datagrams, "malformed": self.malformed, "dropped": self.dropped,
                "pending": len(self._rows)}

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
