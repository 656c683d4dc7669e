"""Non-blocking datagram sends to the agent's Unix socket. A missing or busy agent costs a failed syscall."""
from __future__ import annotations

import socket


class DatagramSender:
    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, datagram: bytes) -> bool:
        """True when the kernel accepted the datagram; False when nobody listens or the agent's queue is full."""
        try:
            self._sock.sendto(datagram, self.path)
            return True
        except OSError:  # ENOENT, ECONNREFUSED (no agent), EAGAIN (agent behind), EMSGSIZE
            return False

    def close(self) -> None:
        self._sock.close()
