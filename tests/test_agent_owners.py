"""GPU owners from the kubelet's pod-resources API (a stand-in kubelet serving the real proto on a unix socket)
together with the jobs found in process environments."""
import pytest

from gpuwatch.agent.jobs import JobInfo
from gpuwatch.agent.kubelet import PodOwner, PodResourcesClient
from gpuwatch.agent.owners import GpuOwner, OwnerTracker
from gpuwatch.core import events as ev
from kubelet_standin import StandInKubelet, pod

UUIDS = {0: "GPU-aaaa", 1: "GPU-bbbb", 2: "GPU-cccc"}
GPU = "nvidia.com/gpu"


@pytest.fixture
def kubelet():
    with StandInKubelet() as k:
        yield k


def _owners(tracker, jobs=None):
    events = tracker.refresh(jobs or {})
    assert all(e.kind == ev.GPU_OWNER for e in events)
    return {e.gpu_index: (e.attrs["namespace"], e.attrs["pod"], e.attrs["container"]) for e in events}


def test_pods_come_and_go_and_a_gpu_moves_between_pods(kubelet):
    kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, ["GPU-aaaa", "GPU-bbbb"])),
                     pod("kube-system", "dns", ("coredns", "cpu", [])))
    tracker = OwnerTracker(UUIDS, PodResourcesClient(kubelet.socket))
    # the first refresh reports every GPU, owned or not, so whatever an earlier run left open is closed
    assert _owners(tracker, {0: JobInfo("job-7", 0, 0)}) == {
        0: ("ml", "train-0", "trainer"), 1: ("ml", "train-0", "trainer"), 2: ("", "", "")}
    assert tracker.owner(0) == GpuOwner("ml", "train-0", "trainer", "job-7", 0)
    assert tracker.refresh({0: JobInfo("job-7", 0, 0)}) == []  # nothing changed: nothing sent

    kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, ["GPU-aaaa"])),
                     pod("research", "notebook", ("jupyter", GPU, ["GPU-bbbb"])))
    assert _owners(tracker, {0: JobInfo("job-7", 0, 0)}) == {1: ("research", "notebook", "jupyter")}

    kubelet.set_pods()  # every pod ended
    assert _owners(tracker) == {0: ("", "", ""), 1: ("", "", "")}
    assert tracker.kubelet_error is None


def test_mig_instances_time_slicing_replicas_and_index_ids(kubelet):
    kubelet.set_pods(pod("ml", "small", ("w", "nvidia.com/mig-1g.10gb", ["MIG-1111"])),
                     pod("ml", "shared", ("w", GPU, ["GPU-bbbb::0", "GPU-bbbb::3"])),
                     pod("ml", "by-index", ("w", GPU, ["2"])))
    tracker = OwnerTracker(UUIDS, PodResourcesClient(kubelet.socket), mig_parents={"MIG-1111": 0, "MIG-2222": 0})
    events = {e.gpu_index: e.attrs for e in tracker.refresh({})}
    assert (events[0]["pod"], events[0]["mig"], events[0]["uuid"]) == ("small", "MIG-1111", "GPU-aaaa")
    assert events[1]["pod"] == "shared" and events[2]["pod"] == "by-index"


def test_socket_vanishing_falls_back_to_process_environments_and_recovers(kubelet):
    kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, ["GPU-aaaa"])))
    tracker = OwnerTracker(UUIDS, PodResourcesClient(kubelet.socket))
    jobs = {0: JobInfo("4242", 3, 1)}
    tracker.refresh(jobs)
    assert tracker.owner(0).pod == "train-0"

    kubelet.stop()  # the kubelet restarts: its socket is gone for a while
    assert _owners(tracker, jobs) == {0: ("", "", "")}
    assert tracker.owner(0) == GpuOwner(job_id="4242", rank=3)  # the environment still names the job
    assert "does not exist" in (tracker.kubelet_error or "")

    kubelet.start()
    assert _owners(tracker, jobs) == {0: ("ml", "train-0", "trainer")}
    assert tracker.kubelet_error is None


def test_get_names_one_pods_devices(kubelet):
    kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, ["GPU-aaaa"]), ("side", "example.com/fpga", ["f0"])))
    client = PodResourcesClient(kubelet.socket)
    assert client.pod_devices("ml", "train-0") == {"GPU-aaaa": PodOwner("ml", "train-0", "trainer")}
    assert client.pod_devices("ml", "gone") == {}
    client.close()


def test_every_owner_is_announced_again_after_reannounce_s():
    clock = [0.0]
    tracker = OwnerTracker(UUIDS, reannounce_s=100.0, clock=lambda: clock[0])
    assert len(tracker.refresh({1: JobInfo("77", 1, 1)})) == 3
    clock[0] = 99.0
    assert tracker.refresh({1: JobInfo("77", 1, 1)}) == []
    clock[0] = 100.0
    assert [e.gpu_index for e in tracker.refresh({1: JobInfo("77", 1, 1)})] == [0, 1, 2]


def test_without_a_kubelet_owners_come_from_the_environment_alone():
    tracker = OwnerTracker(UUIDS)
    tracker.refresh({1: JobInfo("77", 1, 1)})
    assert tracker.owner(1) == GpuOwner(job_id="77", rank=1) and tracker.kubelet_error is None


def test_the_agent_sends_owner_changes_as_events_beside_its_samples(tmp_path, sink, kubelet):
    from gpuwatch.agent.daemon import AgentConfig
    from gpuwatch.apps.agent_cli import simulated_agent
    from gpuwatch.simulator.node import SimulatedNode

    server, address = sink
    cfg = AgentConfig(collector=address, node="k1", interval=0.02, batch_interval=0.1, slow_interval=0.02,
                      spool=tmp_path, kubelet_socket=kubelet.socket)
    with SimulatedNode(2, node="k1") as sim:
        agent = simulated_agent(cfg, sim)
        uuid1 = sim.fleet.gpus[1].uuid
        kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, [uuid1])))
        agent.run(ticks=6)
    owners = [e for b in server.store.batches.values() for e in b.events if e.kind == ev.GPU_OWNER]
    # one event per GPU on the first slow tick; owners did not change afterwards
    assert sorted((e.gpu_index, e.attrs["pod"], e.attrs["job_id"]) for e in owners) == [
        (0, "", "sim-k1"), (1, "train-0", "sim-k1")]
    assert kubelet.lists >= 2  # refreshed on the slow cadence


def test_owner_info_series_on_the_agent_and_the_collector_follow_a_gpu_between_pods(tmp_path, kubelet):
    from gpuwatch.agent.daemon import AgentConfig
    from gpuwatch.collector.assembly import start_collector
    from gpuwatch.collector.snapshot import MetricsService
    from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
    from helpers import poll, running_simulated_agent
    from test_agent_node_metrics import _scrape

    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path / "c.duckdb"),
                                          "metrics_listen": "127.0.0.1:0"}, env={})
    collector = start_collector(cfg.build(CollectorSettings))
    agent_cfg = AgentConfig(collector=collector.address, node="k2", interval=0.05, slow_interval=0.05,
                            batch_interval=0.1, spool=tmp_path / "spool", metrics_listen="127.0.0.1:0",
                            kubelet_socket=kubelet.socket)
    try:
        with running_simulated_agent(agent_cfg, 2) as (agent, fleet):
            uuid = fleet.gpus[0].uuid
            kubelet.set_pods(pod("ml", "train-0", ("trainer", GPU, [uuid])))
            poll(lambda: agent.metrics_server is not None, 30, "the agent's metrics endpoint")
            (service,) = [s for s in collector.services if isinstance(s, MetricsService)]
            held = 'gpuwatch_gpu_owner_info{container="trainer",gpu="0",job="sim-k2",namespace="ml",node="k2",'
            poll(lambda: held in _scrape(agent.metrics_server.url), 30, "train-0 on the agent's endpoint")
            poll(lambda: held in _scrape(service.server.url), 30, "train-0 on the collector's endpoint")

            kubelet.set_pods(pod("ml", "eval-0", ("evaluator", GPU, [uuid])))
            moved = 'pod="eval-0"'
            text = poll(lambda: (lambda t: moved in t and t)(_scrape(agent.metrics_server.url)), 30, "eval-0")
            assert 'pod="train-0"' not in text  # one info series per GPU: the old owner's is gone
            poll(lambda: moved in _scrape(service.server.url), 30, "eval-0 on the collector's endpoint")
    finally:
        collector.stop()


def test_mig_instances_on_the_simulated_nvml_are_matched_to_their_gpu(kubelet):
    from gpuwatch.agent.nvml import NvmlSampler
    from gpuwatch.simulator.fleet import SimulatedFleet

    with SimulatedFleet(3, node="m1") as fleet:
        migs = fleet.partition_mig(1, 3)
        sampler = NvmlSampler()
        devices = sampler.open()
        parents = sampler.mig_parents()
        sampler.close()
        uuids = {d.index: d.uuid for d in devices}
    assert parents == {m: 1 for m in migs} and len(set(migs) | set(uuids.values())) == 6
    kubelet.set_pods(pod("ml", "small-b", ("w", "nvidia.com/mig-1g.10gb", [migs[2]])),
                     pod("ml", "small-a", ("w", "nvidia.com/mig-1g.10gb", [migs[0]])))
    tracker = OwnerTracker(uuids, PodResourcesClient(kubelet.socket), parents)
    tracker.refresh({})
    assert (tracker.owner(1).pod, tracker.owner(1).mig) == ("small-a", migs[0])  # the first pod by name
    assert tracker.owner(0).pod == "" and tracker.owner(2).pod == ""


def test_time_sliced_pods_get_their_own_utilization_from_per_process_nvml(tmp_path, sink, kubelet):
    """Two pods time-slicing one GPU (replica ids ``<uuid>::0/1``): NVML's per-process samples (the
    simulated nvmlDeviceGetProcessUtilization beneath pynvml) split the GPU's utilisation between them, 3:1 as
    their processes' weights; no PID leaves the node."""
    import json

    from gpuwatch.agent.daemon import AgentConfig
    from gpuwatch.apps.agent_cli import simulated_agent
    from gpuwatch.simulator.node import SimulatedNode

    server, address = sink
    cfg = AgentConfig(collector=address, node="ts1", interval=0.02, batch_interval=0.1, slow_interval=0.02,
                      spool=tmp_path, kubelet_socket=kubelet.socket)
    with SimulatedNode(2, node="ts1") as sim:
        gpu = sim.fleet.gpus[1]
        gpu.processes.clear()
        sim.fleet.start_job(1, "big", 0, 0, pod="big-0", weight=3.0)
        sim.fleet.start_job(1, "small", 0, 0, pod="small-0", weight=1.0)
        kubelet.set_pods(pod("ml", "big-0", ("w", GPU, [f"{gpu.uuid}::0"])),
                         pod("ml", "small-0", ("w", GPU, [f"{gpu.uuid}::1"])))
        agent = simulated_agent(cfg, sim)
        agent.run(ticks=8)
    events = [e for b in server.store.batches.values() for e in b.events if e.kind == ev.GPU_PROCESSES]
    shared = [json.loads(e.attrs["owners"]) for e in events if e.gpu_index == 1]
    assert shared, "no gpu_processes event for the time-sliced GPU"
    sampled = [o for o in shared if all(x["sm_util"] is not None for x in o)]
    assert sampled, "no per-process utilisation sample"
    owners = {x["pod"]: x for x in sampled[-1]}
    assert set(owners) == {"big-0", "small-0"}
    assert owners["big-0"]["job_id"] == "big" and owners["small-0"]["job_id"] == "small"
    big, small = owners["big-0"]["sm_util"], owners["small-0"]["sm_util"]
    assert big > small > 0 and abs(big - 3 * small) <= 0.02  # NVML reports whole percent per process
    assert all("pid" not in x for o in shared for x in o) and owners["big-0"]["memory_bytes"] > 0


def test_mig_instances_are_sampled_as_devices_with_gpm_and_attributed_to_their_pods(tmp_path, sink, kubelet):
    """A GPU in MIG mode with two instances, one busy and one at a quarter of its activity, each held by a pod:
    the agent's mig_instances events carry each instance's memory slice and GPM activity
    (nvmlGpmMigSampleGet on the simulated NVML) and the pod holding it."""
    import json

    from gpuwatch.agent.daemon import AgentConfig
    from gpuwatch.apps.agent_cli import simulated_agent
    from gpuwatch.simulator.node import SimulatedNode

    server, address = sink
    cfg = AgentConfig(collector=address, node="mig1", interval=0.02, batch_interval=0.1, slow_interval=0.02,
                      spool=tmp_path, kubelet_socket=kubelet.socket)
    with SimulatedNode(2, node="mig1") as sim:
        migs = sim.fleet.partition_mig(1, 2)
        sim.fleet.gpus[1].mig_loads = [1.0, 0.25]
        kubelet.set_pods(pod("ml", "infer-a", ("w", "nvidia.com/mig-3g.40gb", [migs[0]])),
                         pod("ml", "infer-b", ("w", "nvidia.com/mig-3g.40gb", [migs[1]])))
        total = sim.fleet.gpus[1].model.memory_bytes
        agent = simulated_agent(cfg, sim)
        agent.run(ticks=10)
    events = [e for b in server.store.batches.values() for e in b.events if e.kind == ev.MIG_INSTANCES]
    assert {e.gpu_index for e in events} == {1}  # GPU 0 is not in MIG mode
    sampled = [json.loads(e.attrs["instances"]) for e in events]
    with_gpm = [s for s in sampled if all("sm_active" in i for i in s)]
    assert with_gpm, "no GPM sample per MIG instance"
    a, b = with_gpm[-1]
    assert (a["uuid"], a["pod"], b["uuid"], b["pod"]) == (migs[0], "infer-a", migs[1], "infer-b")
    assert a["memory_total_bytes"] == b["memory_total_bytes"] == total // 2
    assert a["sm_active"] > 0 and b["sm_active"] == pytest.approx(a["sm_active"] / 4, abs=0.01)


def test_per_tick_owner_events_are_paced_per_gpu_unless_their_owners_change():
    from gpuwatch.agent.processes import EventPacing

    now = [0.0]
    pacing = EventPacing(lambda: now[0], shared_s=60.0, single_s=240.0)
    sent = []
    for tick in range(0, 600, 10):  # a slow tick every 10 s for 10 minutes
        now[0] = float(tick)
        owners = ("a",) if tick < 300 else ("b",)  # the single owner changes at 300 s
        sent += [("single", tick)] if pacing.due(0, owners, shared=False) else []
        sent += [("shared", tick)] if pacing.due(1, ("a", "b"), shared=True) else []
    assert [t for kind, t in sent if kind == "single"] == [0, 240, 300, 540]
    assert [t for kind, t in sent if kind == "shared"] == list(range(0, 600, 60))
