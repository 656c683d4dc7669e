"""A simulated GPU node that sits beneath pynvml: N GPUs of one model, their processes, their faults.

``SimulatedFleet.install()`` puts the fake NVML library (:mod:`gpuwatch.simulator.nvml_lib`) beneath pynvml,
so the agent above cannot tell it from a node with GPUs. The fleet is the node's state that library reports:
the GPUs and their physics (:mod:`gpuwatch.simulator.gpu`, a training-like workload, see docs/simfleet.md),
the training processes on them with their launcher environment (what ``/proc/<pid>/environ`` holds on a real
node), the driver versions, and the kernel log; faults are scripted with the helpers of
:class:`~gpuwatch.simulator.faults.FaultScripting` (``inject_xid``, ``add_ecc``, ``lose_gpu``, ``drive``, ...).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from gpuwatch.simulator.faults import FaultDriver, FaultScripting
from gpuwatch.simulator.gpu import MODELS, WORKLOADS, SimGpu, SimProcess, Workload
from gpuwatch.simulator.nvml_lib import FakeNvmlLib

_PID_BASE = 100_000


class SimulatedFleet(FaultScripting):
    """N simulated GPUs of one model on one node, installable beneath pynvml.

    ``launcher`` picks the environment the fake training processes carry: "slurm" (SLURM_JOB_ID,
    SLURM_PROCID, SLURM_LOCALID) or "torchelastic" (TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK);
    ``job_id`` names their job (default ``sim-<node>``), so a synthetic job's spans can join the GPU rows.
    """

    def __init__(
        self,
        n_gpus: int,
        model: str = "H100",
        seed: int = 0,
        workload: str | Workload = "training",
        node: str = "sim",
        launcher: str = "slurm",
        clock: Callable[[], float] = time.time,
        driver_loaded: bool = True,
        job_id: str | None = None,
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown GPU model {model!r}; simulated models: {', '.join(MODELS)}")
        if isinstance(workload, str):
            if workload not in WORKLOADS:
                raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
            workload = WORKLOADS[workload]
        self.node = node
        self.clock = clock
        self.driver_loaded = driver_loaded
        self.driver_version = "570.133.20"
        self.cuda_version = 12080
        self.kernel_log: list[str] = []  # the NVRM lines a real node would print to /dev/kmsg
        self.gpus = [SimGpu(i, MODELS[model], workload, seed, node) for i in range(n_gpus)]
        if workload.busy_fraction > 0:
            for gpu in self.gpus:
                self.start_job(gpu.index, job_id or f"sim-{node}", rank=gpu.index, local_rank=gpu.index,
                               launcher=launcher)
        self._library: FakeNvmlLib | None = None
        self._drivers: dict[int, list[FaultDriver]] = {}

    # --- installing beneath pynvml -------------------------------------------------------------
    def install(self) -> SimulatedFleet:
        """Make pynvml talk to this fleet (through the fake NVML library) instead of libnvidia-ml.so."""
        if self._library is None:
            self._library = FakeNvmlLib(self).install()
        return self

    def uninstall(self) -> None:
        if self._library is not None:
            self._library.uninstall()
            self._library = None

    def __enter__(self) -> SimulatedFleet:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # --- jobs --------------------------------------------------------------------------------------
    def start_job(self, gpu: int, job_id: str, rank: int, local_rank: int, launcher: str = "slurm", *,
                  pod: str = "", weight: float = 1.0) -> int:
        """Put one training process of ``job_id`` on ``gpu``; returns its fake PID. ``pod`` names the
        Kubernetes pod it runs in (its HOSTNAME), ``weight`` its share of the GPU against the other
        processes on it (time-slicing)."""
        if launcher == "slurm":
            env = {"SLURM_JOB_ID": job_id, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank)}
        elif launcher == "torchelastic":
            env = {"TORCHELASTIC_RUN_ID": job_id, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
        else:
            raise ValueError(f"unknown launcher {launcher!r}; use 'slurm' or 'torchelastic'")
        if pod:
            env["HOSTNAME"] = pod
        g = self.gpus[gpu]
        pid = _PID_BASE + gpu * 100 + len(g.processes)
        g.processes.append(SimProcess(pid, env, int(g.model.memory_bytes * g.workload.memory_fraction), weight))
        return pid

    def stop_job(self, gpu: int) -> None:
        self.gpus[gpu].processes.clear()

    def partition_mig(self, gpu: int, instances: int) -> list[str]:
        """Put ``gpu`` in MIG mode with ``instances`` GPU instances (0: MIG off); returns their MIG UUIDs,
        derived from the GPU's UUID so a fleet rebuilt from the same seed names them alike."""
        g = self.gpus[gpu]
        g.mig_uuids = [f"MIG-{g.uuid.removeprefix('GPU-')[:-3]}{i:03x}" for i in range(instances)]
        g.mig_loads = [1.0] * instances
        return list(g.mig_uuids)

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment of a simulated process (what /proc/<pid>/environ holds on a real node)."""
        for g in self.gpus:
            for p in g.processes:
                if p.pid == pid:
                    return dict(p.environ)
        return None
