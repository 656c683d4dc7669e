"""Fault scripting on a simulated node: XIDs, ECC errors, row remapping, PCIe and NVLink errors, a lost GPU.

:class:`FaultScripting` is the part of :class:`~gpuwatch.simulator.fleet.SimulatedFleet` a test or a scenario
calls to break a GPU: each helper changes the :class:`~gpuwatch.simulator.gpu.SimGpu` counters the agent reads
through NVML, and the events a real driver raises (XID, double-bit ECC) go to the NVML event sets of the fake
library and, for XIDs, to the simulated kernel log. Faults that unfold over time (``--sim-fault``) are drivers
attached with :meth:`FaultScripting.drive`; :mod:`gpuwatch.simulator.degrade` builds them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pynvml as N

from gpuwatch.core.xids import FATAL as FATAL_XIDS

if TYPE_CHECKING:
    from gpuwatch.simulator.gpu import SimGpu
    from gpuwatch.simulator.nvml_lib import FakeNvmlLib

#: ``driver(fleet, now)``: moves a scripted fault forward to simulated time ``now``
FaultDriver = Callable[["FaultScripting", float], None]


class FaultScripting:
    """Fault helpers over ``self.gpus``; mixed into SimulatedFleet, which provides the attributes below."""

    gpus: list[SimGpu]
    kernel_log: list[str]  # the NVRM lines a real node would print to /dev/kmsg
    clock: Callable[[], float]
    _library: FakeNvmlLib | None  # the fake NVML library while installed beneath pynvml
    _drivers: dict[int, list[FaultDriver]]

    def inject_xid(self, gpu: int, code: int, message: str = "") -> None:
        """Deliver an XID through the NVML event sets and print it to the simulated kernel log."""
        g = self.gpus[gpu]
        self.kernel_log.append(
            f"NVRM: Xid (PCI:0000:{g.pci_bus:02x}:00): {code}, pid=<unknown>, name=<unknown>, {message or 'simulated'}"
        )
        if code in FATAL_XIDS:
            g.failed_xid = code
        self._deliver(gpu, N.nvmlEventTypeXidCriticalError, code)

    def reset_gpu(self, gpu: int) -> None:
        """What `nvidia-smi -r` does to a failed simulated GPU: it runs its work again."""
        self.gpus[gpu].failed_xid = 0

    def add_ecc(self, gpu: int, sbe: int = 0, dbe: int = 0) -> None:
        g = self.gpus[gpu]
        g.ecc_sbe_volatile += sbe
        g.ecc_sbe_aggregate += sbe
        g.ecc_dbe_volatile += dbe
        g.ecc_dbe_aggregate += dbe
        if dbe:
            self._deliver(gpu, N.nvmlEventTypeDoubleBitEccError, 0)

    def set_remap(self, gpu: int, correctable: int | None = None, uncorrectable: int | None = None,
                  pending: bool | None = None, failure: bool | None = None) -> None:
        g = self.gpus[gpu]
        if correctable is not None:
            g.remapped_correctable = correctable
        if uncorrectable is not None:
            g.remapped_uncorrectable = uncorrectable
        if pending is not None:
            g.remap_pending = int(pending)
        if failure is not None:
            g.remap_failure = int(failure)

    def add_pcie_replays(self, gpu: int, n: int) -> None:
        self.gpus[gpu].pcie_replays += n

    def set_pcie_link(self, gpu: int, gen: int, width: int) -> None:
        """Downtrain (or restore) the PCIe link: a width below the maximum is a fault of its own
        (gpuwatch.models.faults)."""
        self.gpus[gpu].pcie_gen, self.gpus[gpu].pcie_width = gen, width

    def add_nvlink_errors(self, gpu: int, crc_flit: int = 0, crc_data: int = 0, replay: int = 0,
                          recovery: int = 0) -> None:
        g = self.gpus[gpu]
        g.nvlink_crc_flit += crc_flit
        g.nvlink_crc_data += crc_data
        g.nvlink_replay += replay
        g.nvlink_recovery += recovery

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: XID 79, then every call on its handle returns GPU_IS_LOST."""
        self.inject_xid(gpu, 79, "GPU has fallen off the bus.")
        self.gpus[gpu].lost = True

    def drive(self, gpu: int, driver: FaultDriver) -> None:
        """Call ``driver(fleet, now)`` before each NVML call on ``gpu`` (a failure process ticking its counters)."""
        if not 0 <= gpu < len(self.gpus):
            raise ValueError(f"GPU {gpu}: this simulated node has GPUs 0-{len(self.gpus) - 1}")
        self._drivers.setdefault(gpu, []).append(driver)

    def apply_faults(self, gpu: int) -> None:
        """Run the drivers attached to ``gpu`` up to now (the fake library calls this before each NVML call)."""
        for driver in self._drivers.get(gpu, ()):
            driver(self, self.clock())

    def _deliver(self, gpu: int, event_type: int, data: int) -> None:
        """Raise an NVML event on ``gpu``; nobody can wait for one while the fleet is not installed."""
        if self._library is not None:
            self._library.deliver(gpu, event_type, data)
