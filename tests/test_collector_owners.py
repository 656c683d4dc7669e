"""GPU owners stored as gpu_owner change points (intervals) and joined at query time: `gpuwatch gpus` and
`gpuwatch usage` through a collector's Query API, on both store engines."""
import json

import grpc
import pytest

from gpuwatch.apps import cli
from gpuwatch.collector import client
from gpuwatch.apps.commandline import json_text
from gpuwatch.collector.owners import USAGE_GROUPS, current_owners, owner_intervals, usage, usage_rpc
from gpuwatch.collector.query_documents import usage_documents
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.core import events as ev
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import query_pb2_grpc
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import STORE_KINDS, T0, store_url

T0_MS = T0  # minute-aligned: the per-minute rows below start at a minute

TICK_MS = 10_000
MINUTES = 10
ENERGY_W = 10.0  # each GPU draws 10 W: 600 J a minute


def _owner(gpu, ts_ms, namespace="", pod="", container="", job_id="", rank=-1, user=""):
    return dict(kind=ev.GPU_OWNER, ts_ms=ts_ms, gpu_index=gpu, message="owner",
                attrs={"namespace": namespace, "pod": pod, "container": container, "job_id": job_id,
                       "rank": str(rank), "mig": "", "user": user, "uuid": f"GPU-n1-{gpu}"})


def _batches():
    """Two GPUs sampled every 10 s for 10 minutes; GPU 0 moves from pod train-0 to pod eval-0 after 5 minutes
    (counter values at 75 % utilisation), GPU 1 is held by no pod (a Slurm job only)."""
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), "agent-1",
                           [pb.GpuInfo(index=i, uuid=f"GPU-n1-{i}", name="H100") for i in range(2)])
    batches, seq = [], 0
    builder.add_event(**_owner(0, T0_MS, "ml", "train-0", "trainer", "j1", 0))
    builder.add_event(**_owner(1, T0_MS, job_id="slurm-5", rank=0, user="alice"))
    for tick in range(MINUTES * 60_000 // TICK_MS):
        ts = T0_MS + tick * TICK_MS
        if ts == T0_MS + 300_000:
            builder.add_event(**_owner(0, ts, "ml", "eval-0", "evaluator"))
        for gpu in range(2):
            builder.add_gpu_row(gpu, ts, {"gpu_utilization_ratio": 0.75 if gpu == 0 else 0.25,
                                          "gpu_energy_joules_total": 1e6 + ENERGY_W * (ts - T0_MS) / 1000})
        if tick % 6 == 5:
            seq += 1
            batches.append(builder.build(seq))
    return batches


@pytest.fixture(params=STORE_KINDS)
def collector(request, tmp_path):
    server = serve(local_collector(store_url(request.param, tmp_path)))
    channel = client.channel(server.address)
    list(client.stream_batches(channel, _batches()))
    channel.close()
    yield server
    server.stop()


def _json(capsys, address, *argv):
    assert cli.main([*argv, "--collector", address, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_gpus_show_the_pod_holding_each_gpu_now_and_usage_sums_per_pod(collector, capsys):
    address = collector.address
    gpus = {g["index"]: g for g in _json(capsys, address, "gpus")}
    assert (gpus[0]["namespace"], gpus[0]["pod"], gpus[0]["container"]) == ("ml", "eval-0", "evaluator")
    assert (gpus[1]["pod"], gpus[1]["namespace"], gpus[1]["container"]) == (None, None, None)

    # per-minute rows: the last sample of minute k is at 50 s + 60 k; each row holds the 60 s since the previous
    # one (the first none). Rows 1-4 fall in train-0's interval, rows 5-9 in eval-0's.
    pods = _json(capsys, address, "usage", "--by", "pod")
    no_processes = {"process_utilization": None, "process_memory_bytes": None}  # no gpu_processes events
    assert pods == [
        {"namespace": "ml", "pod": "eval-0", "gpu_seconds": 300.0, "lost_gpu_seconds": 75.0,
         "mean_utilization": 0.75, "energy_kwh": round(5 * 600 / 3.6e6, 6), **no_processes},
        {"namespace": "ml", "pod": "train-0", "gpu_seconds": 240.0, "lost_gpu_seconds": 60.0,
         "mean_utilization": 0.75, "energy_kwh": round(4 * 600 / 3.6e6, 6), **no_processes}]
    namespaces = _json(capsys, address, "usage", "--by", "namespace")
    assert [(r["namespace"], r["gpu_seconds"]) for r in namespaces] == [("ml", 540.0)]
    jobs = {r["job_id"]: r for r in _json(capsys, address, "usage", "--by", "job")}
    assert set(jobs) == {"slurm-5", "j1"} and jobs["slurm-5"]["gpu_seconds"] == 540.0
    assert jobs["slurm-5"]["mean_utilization"] == 0.25 and jobs["j1"]["gpu_seconds"] == 240.0
    assert cli.main(["usage", "--collector", address]) == 0  # the table: one row per pod, its columns named
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["namespace", "pod", "gpu_seconds"] and table[1].split()[:2] == ["ml", "eval-0"]
    users = _json(capsys, address, "usage", "--by", "user")
    assert [(r["user"], r["gpu_seconds"], r["lost_gpu_seconds"]) for r in users] == [("alice", 540.0, 405.0)]
    store = collector.store
    for by in USAGE_GROUPS:  # the typed Usage reply prints the rows the collector computed, keys and numbers alike
        rows = usage(store, by, 0, store.newest_sample_ms())
        assert rows and json_text(usage_documents(usage_rpc(q.UsageRequest(by=by), store))) == json_text(rows)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_owner_changes_become_closed_and_open_intervals(tmp_path, kind):
    from gpuwatch.collector.store import open_store

    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    for batch in _batches():
        store.write(batch)
    intervals = owner_intervals(store)
    gpu0 = intervals[intervals["gpu_index"] == 0]
    assert list(gpu0["pod"]) == ["train-0", "eval-0"]
    assert list(gpu0["from_ms"]) == [T0_MS, T0_MS + 300_000]
    assert gpu0["to_ms"].iloc[0] == T0_MS + 300_000 and gpu0["to_ms"].iloc[1] is None
    assert current_owners(store)[("n1", 0)]["pod"] == "eval-0"

    # three hours on, with no owner announced again (agents do every hour): nothing is known of now
    later = BatchBuilder(pb.NodeIdentity(node="n1"), "agent-1", [pb.GpuInfo(index=0, uuid="GPU-n1-0", name="H100")])
    later.add_gpu_row(0, T0_MS + 3 * 3_600_000, {"gpu_utilization_ratio": 0.5})
    store.write(later.build(100))
    assert current_owners(store) == {}
    store.close()


def test_usage_names_a_bad_grouping(collector, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["usage", "--by", "rack", "--collector", collector.address])
    assert exit_.value.code == 2 and "invalid choice: 'rack'" in capsys.readouterr().err
    channel = client.channel(collector.address)
    with pytest.raises(grpc.RpcError) as err:
        query_pb2_grpc.QueryStub(channel).Usage(q.UsageRequest(by="rack"))
    channel.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--by 'rack'" in err.value.details()


def _processes(gpu, ts_ms, *owners):
    return dict(kind=ev.GPU_PROCESSES, ts_ms=ts_ms, gpu_index=gpu, message="processes",
                attrs={"owners": json.dumps([{"namespace": "ml", "pod": p, "container": "w", "job_id": j, "user": "",
                                              "sm_util": u, "mem_util": None, "memory_bytes": m, "processes": 1}
                                             for p, j, u, m in owners])})


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_time_sliced_pods_each_get_their_own_utilization_and_share_of_energy(tmp_path, kind):
    """One GPU at 80 % that two pods time-slice (per-process SM 60 % and 20 %, as the agent's gpu_processes
    events say): each pod holds it the whole time at its own utilisation, and the energy splits 3:1."""
    from gpuwatch.collector.owners import usage
    from gpuwatch.collector.store import open_store

    builder = BatchBuilder(pb.NodeIdentity(node="n1"), "agent-1", [pb.GpuInfo(index=0, uuid="GPU-n1-0", name="H100")])
    builder.add_event(**_owner(0, T0_MS, "ml", "big-0", "w"))  # the tracker names the first pod only
    for tick in range(MINUTES * 60_000 // TICK_MS):
        ts = T0_MS + tick * TICK_MS
        if tick % 3 == 0:  # the slow cadence: every 30 s
            builder.add_event(**_processes(0, ts, ("big-0", "big", 0.6, 30 * 2**30), ("small-0", "small", 0.2, 2**30)))
        builder.add_gpu_row(0, ts, {"gpu_utilization_ratio": 0.8,
                                    "gpu_energy_joules_total": 1e6 + ENERGY_W * (ts - T0_MS) / 1000})
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    store.write(builder.build(1))
    rows = {r["pod"]: r for r in usage(store, "pod", T0_MS, T0_MS + MINUTES * 60_000)}
    store.close()
    assert set(rows) == {"big-0", "small-0"}
    big, small = rows["big-0"], rows["small-0"]
    assert big["gpu_seconds"] == small["gpu_seconds"] == 540.0
    assert (big["mean_utilization"], small["mean_utilization"]) == (0.6, 0.2)
    assert (big["lost_gpu_seconds"], small["lost_gpu_seconds"]) == (216.0, 432.0)
    kwh = 9 * 600 / 3.6e6  # nine held minutes at 10 W
    assert (big["energy_kwh"], small["energy_kwh"]) == (round(kwh * 0.75, 6), round(kwh * 0.25, 6))
    assert (big["process_utilization"], big["process_memory_bytes"]) == (0.6, 30 * 2**30)


def _mig(gpu, ts_ms, *instances):
    return dict(kind=ev.MIG_INSTANCES, ts_ms=ts_ms, gpu_index=gpu, message="mig",
                attrs={"instances": json.dumps([{"uuid": f"MIG-{i}", "gpu_instance_id": i, "namespace": "ml",
                                                 "pod": p, "container": "w", "sm_active": u,
                                                 "memory_used_bytes": 2**30, "memory_total_bytes": size}
                                                for i, (p, u, size) in enumerate(instances)])})


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_mig_instances_count_as_devices_of_their_own_weighed_by_their_slice(tmp_path, kind):
    """A GPU split 3:1 by memory into two MIG instances held by two pods at 80 % and 20 % of their own slices:
    each pod's GPU-seconds are its slice of the GPU's, at its own activity, with that slice of the energy; a
    processes event of the same tick does not count twice."""
    from gpuwatch.collector.owners import usage
    from gpuwatch.collector.store import open_store

    builder = BatchBuilder(pb.NodeIdentity(node="n1"), "agent-1", [pb.GpuInfo(index=0, uuid="GPU-n1-0", name="H100")])
    builder.add_event(**_owner(0, T0_MS, "ml", "infer-a", "w", "j1"))
    for tick in range(MINUTES * 60_000 // TICK_MS):
        ts = T0_MS + tick * TICK_MS
        if tick % 3 == 0:
            builder.add_event(**_mig(0, ts, ("infer-a", 0.8, 60 * 2**30), ("infer-b", 0.2, 20 * 2**30)))
            builder.add_event(**_processes(0, ts, ("infer-a", "j1", 0.5, 2**30), ("infer-b", "j1", 0.1, 2**30)))
        builder.add_gpu_row(0, ts, {"gpu_utilization_ratio": 0.65,
                                    "gpu_energy_joules_total": 1e6 + ENERGY_W * (ts - T0_MS) / 1000})
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    store.write(builder.build(1))
    rows = {r["pod"]: r for r in usage(store, "pod", T0_MS, T0_MS + MINUTES * 60_000)}
    jobs = usage(store, "job", T0_MS, T0_MS + MINUTES * 60_000)
    store.close()
    a, b = rows["infer-a"], rows["infer-b"]
    assert (a["gpu_seconds"], b["gpu_seconds"]) == (405.0, 135.0)  # nine held minutes, 3:1
    assert (a["mean_utilization"], b["mean_utilization"]) == (0.8, 0.2)
    assert (a["lost_gpu_seconds"], b["lost_gpu_seconds"]) == (81.0, 108.0)
    kwh = 9 * 600 / 3.6e6
    assert (a["energy_kwh"], b["energy_kwh"]) == (round(kwh * 0.75, 6), round(kwh * 0.25, 6))
    assert a["process_utilization"] is None  # instance activity, not per-process data
    assert [(r["job_id"], r["gpu_seconds"]) for r in jobs] == [("j1", 540.0)]  # the GPU's job, counted once
