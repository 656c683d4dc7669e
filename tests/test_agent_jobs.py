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
