"""XID events from two sources: NVML's event set (a blocking wait in its own thread) and the kernel log.

NVML only sees events after registration and gives no text; ``/dev/kmsg`` has the driver's
``NVRM: Xid (PCI:<bdf>): <code>, ...`` lines when it is readable. Both feed one :class:`XidDeduper` so an
XID seen by both sources within a few seconds is reported once, while a real burst from one source is not
collapsed.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pynvml as N

from gpuwatch.core import events as ev
from gpuwatch.core import xids
from gpuwatch.core.events import Event
from gpuwatch.agent.nvml import GpuDevice

log = logging.getLogger(__name__)

# Event types worth a record (reference section 5); registered as far as each GPU supports them.
WANTED_EVENTS = (
    N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError | N.nvmlEventTypeSingleBitEccErrorStorm
    | N.nvmlEventTypeDramRetirementEvent | N.nvmlEventTypeDramRetirementFailure
    | N.nvmlEventTypeNonFatalPoisonError | N.nvmlEventTypeFatalPoisonError
    | N.nvmlEventTypeGpuUnavailableError | N.nvmlEventTypeGpuRecoveryAction
)
_KIND_BY_TYPE = {N.nvmlEventTypeXidCriticalError: ev.XID, N.nvmlEventTypeDoubleBitEccError: ev.ECC_DBE,
                 N.nvmlEventTypeSingleBitEccError: ev.ECC_SBE}

_XID_RE = re.compile(r"NVRM: Xid \(PCI:(?P<bdf>[0-9A-Fa-f:.]+)\): (?P<code>\d+)(?:, ?(?P<text>.*))?")


@dataclass(frozen=True)
class KmsgXid:
    pci_bus_id: str  # normalised by normalize_bus_id
    code: int
    message: str


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) and '0000:3b:00' (kernel log) both become '0000:3b:00'."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) < 3:
        return bus_id.strip().lower()
    domain, bus, device = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def parse_kmsg_line(line: str) -> KmsgXid | None:
    """The XID in one kernel-log line (a /dev/kmsg record or plain dmesg text), or None."""
    match = _XID_RE.search(line)
    if match is None:
        return None
    return KmsgXid(normalize_bus_id(match["bdf"]), int(match["code"]), (match["text"] or "").strip())


class XidDeduper:
    """Suppresses the second sighting of one XID when the other source reported it within ``window_s``."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._unmatched: deque[tuple[float, str, int, int]] = deque()
        self._lock = threading.Lock()

    def first_report(self, source: str, gpu_index: int, code: int) -> bool:
        now = self.clock()
        with self._lock:
            while self._unmatched and now - self._unmatched[0][0] > self.window_s:
                self._unmatched.popleft()
            for entry in self._unmatched:
                if entry[1] != source and entry[2:] == (gpu_index, code):
                    self._unmatched.remove(entry)
                    return False
            self._unmatched.append((now, source, gpu_index, code))
            return True


class XidWatcher:
    """Runs the NVML event thread and, when readable, the kernel-log thread; emits Event records."""

    def __init__(
        self,
        devices: Sequence[GpuDevice],
        emit: Callable[[Event], None],
        kmsg_path: str | None = "/dev/kmsg",
        wait_ms: int = 1000,
        dedup: XidDeduper | None = None,
    ) -> None:
        self.devices = list(devices)
        self.emit = emit
        self.kmsg_path = kmsg_path
        self.wait_ms = wait_ms
        self.dedup = dedup or XidDeduper()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._by_address = {_address(d.handle): d.index for d in self.devices}
        self._by_bus = {normalize_bus_id(d.pci_bus_id): d.index for d in self.devices if d.pci_bus_id}
        self._event_set = None

    def start(self) -> None:
        self._event_set = self._register()
        if self._event_set is not None:
            self._spawn(self._nvml_loop, "gpuwatch-xid-nvml")
        kmsg = self._open_kmsg()
        if kmsg is not None:
            self._spawn(lambda: self._kmsg_loop(kmsg), "gpuwatch-xid-kmsg")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.wait_ms / 1000.0 + 2.0)
        if self._event_set is not None:
            try:
                N.nvmlEventSetFree(self._event_set)
            except N.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # --- NVML events -------------------------------------------------------------------------------
    def _register(self):
        """One event set for all GPUs, each registered for the wanted types it supports; None if none."""
        event_set = N.nvmlEventSetCreate()
        registered = 0
        for dev in self.devices:
            if dev.lost:
                continue
            try:
                mask = N.nvmlDeviceGetSupportedEventTypes(dev.handle) & WANTED_EVENTS
                if mask:
                    N.nvmlDeviceRegisterEvents(dev.handle, mask, event_set)
                    registered += 1
            except N.NVMLError as exc:
                log.info("GPU %d: no NVML events (%s); XIDs only from the kernel log", dev.index, exc)
        if registered:
            return event_set
        N.nvmlEventSetFree(event_set)
        return None

    def _nvml_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = N.nvmlEventSetWait(self._event_set, self.wait_ms)
            except N.NVMLError_Timeout:
                continue
            except N.NVMLError as exc:  # GPU lost or driver trouble: the sampler reports it; keep waiting
                log.debug("nvmlEventSetWait: %s", exc)
                self._stop.wait(self.wait_ms / 1000.0)
                continue
            gpu = self._by_address.get(_address(data.device), -1)
            self._nvml_event(gpu, data.eventType, data.eventData)

    def _nvml_event(self, gpu: int, event_type: int, data: int) -> None:
        kind = _KIND_BY_TYPE.get(event_type, ev.NVML_EVENT)
        if kind == ev.XID and not self.dedup.first_report("nvml", gpu, data):
            return
        text = xids.message(data) if kind == ev.XID else f"NVML event 0x{event_type:x} data {data}"
        self.emit(Event(kind, gpu_index=gpu, code=int(data), message=text,
                        attrs={"source": "nvml", "event_type": f"0x{event_type:x}"}))

    # --- kernel log --------------------------------------------------------------------------------
    def _open_kmsg(self) -> int | None:
        if not self.kmsg_path:
            return None
        try:
            fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.info("kernel log %s not readable (%s); XIDs only from NVML events", self.kmsg_path, exc)
            return None
        try:
            os.lseek(fd, 0, os.SEEK_END)  # only new lines: history was reported by the agent that saw it
        except OSError:
            pass
        return fd

    def _kmsg_loop(self, fd: int) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([fd], [], [], 1.0)
                if not ready:
                    continue
                try:
                    chunk = os.read(fd, 8192)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # records overwritten before we read them
                        continue
                    raise
                if not chunk:
                    self._stop.wait(1.0)  # a regular file at its end: wait for more
                    continue
                for line in chunk.decode(errors="replace").splitlines():
                    self.kmsg_line(line)
        finally:
            os.close(fd)

    def kmsg_line(self, line: str) -> None:
        """Handle one kernel-log line: an XID becomes an event unless NVML already reported it."""
        xid = parse_kmsg_line(line)
        if xid is None:
            return
        gpu = self._by_bus.get(xid.pci_bus_id, -1)
        if not self.dedup.first_report("kmsg", gpu, xid.code):
            return
        self.emit(Event(ev.XID, gpu_index=gpu, code=xid.code, message=xids.message(xid.code, xid.message),
                        attrs={"source": "kmsg", "pci_bus_id": xid.pci_bus_id}))


def _address(ptr) -> int:
    return ctypes.cast(ptr, ctypes.c_void_p).value or 0
