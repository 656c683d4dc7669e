"""Which job (and rank) owns each GPU: GPU -> compute processes (NVML) -> job id from the process environment.

Launchers leave the job in every rank's environment: SLURM (SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID) and
torchrun / TorchElastic (TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK). Other schedulers are covered by the configured
``job_label``: the name of one more environment variable that holds the job id (ranks from RANK/LOCAL_RANK).
The environ reader is injectable so the simulated fleet can provide its fake PIDs'
environments. Processes change rarely, so the daemon refreshes this on the slow cadence and caches per PID.

When a process's environment cannot be read (another user's process, hidepid), Slurm still names its job in the
process's cgroup path: ``.../job_<id>/step_<step>/task_<local id>`` under cgroup v2, and under cgroup v1
``/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>`` (the uid names the user there).
"""
from __future__ import annotations

import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

EnvironReader = Callable[[int], "Mapping[str, str] | None"]
CgroupReader = Callable[[int], "str | None"]

# (job id variable, rank variable, local rank variable), first match wins
_LAUNCHERS = (
    ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID"),
    ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK"),
)


@dataclass(frozen=True)
class JobInfo:
    job_id: str = ""
    rank: int = -1
    local_rank: int = -1
    step: str = ""  # Slurm's step id ("0", "batch", "extern"), from the environment or the cgroup path
    user: str = ""  # who runs the job (SLURM_JOB_USER, or the uid in a cgroup v1 path)


NO_JOB = JobInfo()


def read_proc_environ(pid: int, proc_root: str = "/proc") -> dict[str, str] | None:
    """The environment of a process from /proc/<pid>/environ; None when gone or not readable."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def read_proc_cgroup(pid: int, proc_root: str = "/proc") -> str | None:
    """The cgroup membership of a process (/proc/<pid>/cgroup: readable when its environment is not)."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def job_from_environ(env: Mapping[str, str], job_label: str = "") -> JobInfo:
    """Job id and ranks named by a launcher's variables, else by the ``job_label`` variable (if configured)."""
    launchers = (*_LAUNCHERS, (job_label, "RANK", "LOCAL_RANK")) if job_label else _LAUNCHERS
    for job_var, rank_var, local_var in launchers:
        if env.get(job_var):
            job = JobInfo(env[job_var], _int(env.get(rank_var)), _int(env.get(local_var)))
            if job_var == "SLURM_JOB_ID":
                job = replace(job, step=env.get("SLURM_STEP_ID", ""), user=env.get("SLURM_JOB_USER", ""))
            return job
    return NO_JOB


_SLURM_CGROUP = re.compile(r"(?:/uid_(?P<uid>\d+))?/job_(?P<job>\d+)(?:/step_(?P<step>[^/\s]+))?"
                           r"(?:/(?:user/)?task_(?P<task>\d+))?")


def job_from_cgroup(cgroup: str) -> JobInfo:
    """The Slurm job (step, local task as local rank, user) in a /proc/<pid>/cgroup text, v1 or v2 layout."""
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        match = _SLURM_CGROUP.search(path)
        if match:
            uid = match["uid"]
            return JobInfo(match["job"], -1, _int(match["task"]), match["step"] or "", _user(uid) if uid else "")
    return NO_JOB


def _user(uid: str) -> str:
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError):
        return uid


class JobResolver:
    """Maps GPU index -> JobInfo from the PIDs running on each GPU, caching each PID's answer."""

    def __init__(self, environ_reader: EnvironReader = read_proc_environ, job_label: str = "",
                 cgroup_reader: CgroupReader = read_proc_cgroup) -> None:
        self.environ_reader = environ_reader
        self.cgroup_reader = cgroup_reader
        self.job_label = job_label
        self._by_pid: dict[int, JobInfo] = {}
        self.by_gpu: dict[int, JobInfo] = {}

    def refresh(self, pids_by_gpu: Mapping[int, list[int]]) -> dict[int, JobInfo]:
        live = {pid for pids in pids_by_gpu.values() for pid in pids}
        self._by_pid = {pid: job for pid, job in self._by_pid.items() if pid in live}
        self.by_gpu = {gpu: self._job_of(pids) for gpu, pids in pids_by_gpu.items()}
        return self.by_gpu

    def job(self, gpu_index: int) -> JobInfo:
        return self.by_gpu.get(gpu_index, NO_JOB)

    def job_of_pid(self, pid: int) -> JobInfo:
        """One process's job (cached per PID until it leaves the GPUs)."""
        job = self._by_pid.get(pid)
        if job is None:
            env = self.environ_reader(pid)
            if env is None:  # not readable (or gone): Slurm's cgroup path may still name the job
                job = self._by_pid[pid] = job_from_cgroup(self.cgroup_reader(pid) or "")
            else:
                job = self._by_pid[pid] = job_from_environ(env, self.job_label)
        return job

    def _job_of(self, pids: list[int]) -> JobInfo:
        """The first process that names a job wins (a GPU shared by several jobs reports the first)."""
        fallback = NO_JOB
        for pid in pids:
            job = self.job_of_pid(pid)
            if job.rank >= 0:
                return job
            if job.job_id and fallback is NO_JOB:
                fallback = job
        return fallback


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1
