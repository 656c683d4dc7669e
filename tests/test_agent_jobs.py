"""Job discovery: GPU -> processes -> job id and rank from the process environment."""
import os

from gpuwatch.agent.jobs import JobInfo, JobResolver, job_from_environ, read_proc_environ
from gpuwatch.agent.nvml import NvmlSampler
from gpuwatch.simulator.fleet import SimulatedFleet


def test_launcher_variables_and_the_job_label_variable():
    assert job_from_environ({"SLURM_JOB_ID": "42", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}) == JobInfo("42", 9, 1)
    assert job_from_environ({"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "LOCAL_RANK": "x"}) == JobInfo("r", 3, -1)
    assert job_from_environ({"MY_JOB": "train-7", "RANK": "2"}, job_label="MY_JOB") == JobInfo("train-7", 2, -1)
    assert job_from_environ({"SLURM_JOB_ID": "42", "MY_JOB": "x"}, job_label="MY_JOB") == JobInfo("42")
    assert job_from_environ({"PATH": "/bin"}, job_label="MY_JOB") == JobInfo()
    assert job_from_environ({}) == JobInfo()


def test_simulated_fleet_processes_resolve_to_their_job_through_nvml():
    with SimulatedFleet(4, node="n9", launcher="torchelastic") as fleet:
        fleet.stop_job(3)
        sampler = NvmlSampler()
        sampler.open()
        resolver = JobResolver(fleet.environ)
        jobs = resolver.refresh(sampler.running_pids())
        sampler.close()
    assert [jobs[g] for g in range(3)] == [JobInfo("sim-n9", g, g) for g in range(3)]
    assert jobs[3] == JobInfo() and resolver.job(99) == JobInfo()


def test_environ_is_read_once_per_pid():
    calls = []

    def reader(pid):
        calls.append(pid)
        return {"SLURM_JOB_ID": "7", "SLURM_PROCID": str(pid % 10)}

    resolver = JobResolver(reader)
    resolver.refresh({0: [101], 1: [102]})
    resolver.refresh({0: [101], 1: [102]})
    assert calls == [101, 102] and resolver.job(1) == JobInfo("7", 2, -1)


def test_reads_a_real_proc_environ():
    env = read_proc_environ(os.getpid())
    assert env is not None and env.get("PATH") == os.environ.get("PATH")
    assert read_proc_environ(2**22 + 12345) is None


def _proc(root, pid, cgroup=None, environ=None):
    """A /proc-like entry: its cgroup file, and an environ file only when given (else unreadable, as for
    another user's process)."""
    d = root / str(pid)
    d.mkdir(parents=True)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    if environ is not None:
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")


def test_slurm_jobs_from_cgroup_paths_when_the_environment_is_unreadable(tmp_path):
    import functools

    from gpuwatch.agent.jobs import job_from_cgroup, read_proc_cgroup

    root = tmp_path / "proc"
    # cgroup v2 (Slurm's cgroup/v2 plugin): one unified line
    _proc(root, 101, "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_3\n")
    # cgroup v1: one line per controller; the uid names the user
    _proc(root, 102, "12:pids:/slurm/uid_0/job_77/step_batch/task_0\n11:memory:/slurm/uid_0/job_77/step_batch\n"
                     "1:name=systemd:/user.slice\n")
    _proc(root, 103, "0::/user.slice/user-1000.slice/session-3.scope\n")  # not a Slurm job
    _proc(root, 104, "0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_1\n",
          environ={"SLURM_JOB_ID": "9", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                   "SLURM_JOB_USER": "alice"})
    resolver = JobResolver(functools.partial(read_proc_environ, proc_root=str(root)),
                           cgroup_reader=functools.partial(read_proc_cgroup, proc_root=str(root)))
    jobs = resolver.refresh({0: [101], 1: [102], 2: [103], 3: [104], 4: [999]})
    assert jobs[0] == JobInfo("4242", -1, 3, "0")
    assert jobs[1] == JobInfo("77", -1, 0, "batch", "root")
    assert jobs[2] == JobInfo() and jobs[4] == JobInfo()  # no Slurm path; a process gone
    assert jobs[3] == JobInfo("9", 5, 1, "0", "alice")  # a readable environment wins (it has the rank)
    assert job_from_cgroup("0::/slurm/job_5\n") == JobInfo("5")
