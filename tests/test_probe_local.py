"""The probe in one process: lightness, no agent, wire format, the agent-side listener, Flight Recorder rows."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import types

import pytest

from gpuwatch.agent.probe_socket import ProbeListener
from gpuwatch.probe.endpoint import default_endpoint
from gpuwatch.probe.flight_recorder import (FlightRecorderHarvester, FlightRecorders, entry_to_row, find_dump_functions,
                                            flight_recorder_enabled)
from gpuwatch.probe.identity import identity_from_environment
from gpuwatch.probe.sender import DatagramSender
from gpuwatch.probe.wire import SpanRow, decode_datagram, encode_datagrams
from helpers import poll

HEADER = {"job": "j1", "rank": 3, "ws": 8, "node": "n1"}


def _row(i: int) -> SpanRow:
    return SpanRow(i, "collective", "all_reduce", 1.7e15 + i, 12.5, "0", i, 4096, -1)


def test_importing_the_probe_pulls_in_nothing_heavy():
    code = ("import sys, gpuwatch.probe; heavy = ('grpc', 'duckdb', 'pandas', 'sklearn', 'torch', 'numpy');"
            "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith('gpuwatch.collector')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_identity_and_endpoint_come_from_the_environment():
    ident = identity_from_environment(env={"TORCHELASTIC_RUN_ID": "te-1", "RANK": "5", "LOCAL_RANK": "1",
                                           "WORLD_SIZE": "16", "GPUWATCH_NODE": "gpu-007"})
    assert (ident.job_id, ident.rank, ident.local_rank, ident.world_size, ident.node) == ("te-1", 5, 1, 16, "gpu-007")
    slurm = identity_from_environment(job="override",
                                      env={"SLURM_JOB_ID": "99", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"})
    assert (slurm.job_id, slurm.rank, slurm.world_size) == ("override", 2, 4)
    assert identity_from_environment(env={"SLURM_JOB_ID": "99"}).job_id == "99"
    assert default_endpoint({"GPUWATCH_PROBE_SOCKET": "/x/y.sock"}) == "/x/y.sock"
    assert default_endpoint({"XDG_RUNTIME_DIR": "/run/user/7"}) in ("/run/user/7/gpuwatch-probe.sock",
                                                                     "/run/gpuwatch/probe.sock")


def test_wire_round_trip_and_datagram_size_limit():
    rows = [_row(i) for i in range(2000)]
    datagrams = encode_datagrams(HEADER, rows, max_bytes=8192)
    assert len(datagrams) > 1 and all(len(d) <= 8192 for d, _ in datagrams)
    decoded = []
    for data, count in datagrams:
        header, got = decode_datagram(data)
        assert header == HEADER and len(got) == count
        decoded += got
    assert decoded == rows


@pytest.mark.parametrize("data, problem", [
    (b"\xff\xfe", "not JSON"),
    (b'{"v": 2}', "version-1"),
    (b'{"v": 1, "job": "j", "rank": "0", "ws": 1, "node": "n", "rows": []}', "header"),
    (b'{"v": 1, "job": "j", "rank": 0, "ws": 1, "node": "n", "rows": [[1, "step"]]}', "row 0"),
])
def test_malformed_datagrams_are_rejected_with_the_problem(data, problem):
    with pytest.raises(ValueError, match=problem):
        decode_datagram(data)


def test_listener_survives_garbage_and_drains_a_span_table(tmp_path):
    path = str(tmp_path / "sub" / "probe.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    os.makedirs(os.path.dirname(path))
    stale.bind(path)
    stale.close()  # leaves a stale socket file behind, as a crashed agent would
    listener = ProbeListener(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        sender = DatagramSender(path)
        assert sender.send(b"garbage")
        for data, _ in encode_datagrams(HEADER, [_row(i) for i in range(5)]):
            assert sender.send(data)
        poll(lambda: listener.pending() == 5 and listener.malformed == 1, 5, "5 rows and 1 malformed datagram")
        table = listener.drain()
        assert list(table.step) == list(range(5)) and set(table.job_id) == {"j1"} and set(table.rank) == {3}
        assert set(table.node) == {"n1"} and set(table.world_size) == {8} and list(table.bytes) == [4096] * 5
        assert len(listener.drain().step) == 0
        assert "not JSON" in listener.last_error
    finally:
        listener.close()
    assert not os.path.exists(path)


def test_listener_refuses_to_replace_a_regular_file(tmp_path):
    path = tmp_path / "probe.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        ProbeListener(str(path))


def test_without_an_agent_the_job_runs_on_and_drops_are_counted(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import gpuwatch.probe

    original = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        probe = gpuwatch.probe.start(job="lonely", endpoint=str(tmp_path / "nobody.sock"))
        assert dist.all_reduce is not original
        total = torch.zeros(1)
        for _ in range(20):
            t = torch.ones(1)
            dist.all_reduce(t)
            total += t
            probe.step()
        probe.close()
    finally:
        dist.destroy_process_group()
    stats = probe.stats()
    assert total.item() == 20 and stats["steps"] == 20 and stats["errors"] == 0
    assert stats["sent"] == 0 and stats["dropped"] == stats["records"] == 20 + 20 + 1  # steps, ops, end marker
    assert dist.all_reduce is original


def test_probe_start_is_idempotent_and_step_scope_times_the_body(tmp_path):
    import gpuwatch.probe

    listener = ProbeListener(str(tmp_path / "p.sock"))
    try:
        probe = gpuwatch.probe.start(job="scoped", endpoint=listener.path)
        assert gpuwatch.probe.start() is probe
        for _ in range(3):
            with probe.step_scope():
                time.sleep(0.01)  # the "training step" being timed
        probe.close()
        poll(lambda: listener.pending() == 4, 5, "4 rows")
        table = listener.drain()
    finally:
        listener.close()
    steps = [d for k, d in zip(table.kind, table.dur_us) if k == "step"]
    assert len(steps) == 3 and all(10_000 <= d < 200_000 for d in steps)
    assert list(table.kind).count("end") == 1
    assert gpuwatch.probe.start(endpoint=listener.path) is not probe
    gpuwatch.probe.start().close()


FR_ENTRY = {
    "record_id": 7, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 12, "p2p_seq_id": 0,
    "op_id": 12, "profiling_name": "nccl:all_reduce", "time_created_ns": 1_700_000_000_000_000_000,
    "time_discovered_started_ns": 1_700_000_000_000_100_000, "time_discovered_completed_ns": 1_700_000_000_002_100_000,
    "input_sizes": [[1024, 1024]], "input_dtypes": ["BFloat16"], "state": "completed", "duration_ms": 1.5,
    "is_p2p": False,
}


def test_flight_recorder_entries_become_rows_once():
    assert flight_recorder_enabled({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert not flight_recorder_enabled({"TORCH_FR_BUFFER_SIZE": "0"})
    row = entry_to_row(FR_ENTRY, step=4)
    assert row == SpanRow(4, "collective", "all_reduce", 1_700_000_000_000_100.0, 1500.0, "0", 12, 2 * 1024 * 1024, -1)
    untimed = dict(FR_ENTRY, duration_ms=None)
    assert entry_to_row(untimed, 0).dur_us == 2000.0
    send = dict(FR_ENTRY, record_id=8, profiling_name="nccl:send 1->2", is_p2p=True, p2p_seq_id=3)
    assert entry_to_row(send, 0)[1:] == ("p2p", "send", 1_700_000_000_000_100.0, 1500.0, "0", 3, 2 * 1024 * 1024, 2)
    running = dict(FR_ENTRY, record_id=9, state="started")
    assert entry_to_row(running, 0) is None
    harvester = FlightRecorderHarvester(lambda *_: json.dumps({"entries": [FR_ENTRY, send, running]}))
    assert [r.name for r in harvester.harvest(lambda _: 0)] == ["all_reduce", "send"]
    assert harvester.harvest(lambda _: 0) == []


def test_flight_recorder_harvester_of_a_restarted_probe_skips_the_earlier_probes_entries():
    """The ring buffer outlives a probe: a probe started again in the process must not resend old entries."""
    later = dict(FR_ENTRY, record_id=10, collective_seq_id=13)
    entries = [FR_ENTRY]
    dump = lambda *_: json.dumps({"entries": entries})  # noqa: E731
    harvester = FlightRecorderHarvester.starting_now(dump)
    assert harvester.harvest(lambda _: 0) == []
    entries.append(later)
    assert [r.seq for r in harvester.harvest(lambda _: 0)] == [13]
    assert [r.seq for r in FlightRecorderHarvester(dump).harvest(lambda _: 0)] == [12, 13]  # no baseline: all


def test_a_retired_entry_is_finished_whatever_its_state_says():
    """The watchdog retires an entry after freeing its events; its state can stay 'scheduled' or 'started'."""
    retired = dict(FR_ENTRY, state="scheduled", retired=True, time_discovered_started_ns=0,
                   time_discovered_completed_ns=0)
    assert entry_to_row(retired, 3).dur_us == 1500.0  # duration_ms (TORCH_NCCL_ENABLE_TIMING=1)
    gloo_like = dict(retired, duration_ms=None)
    assert entry_to_row(gloo_like, 3) is None  # finished, but nothing says how long it took
    harvester = FlightRecorderHarvester(lambda *_: json.dumps({"entries": [gloo_like]}))
    assert harvester.harvest(lambda _: 0) == [] and harvester.untimed == 1
    assert harvester.harvest(lambda _: 0) == [] and harvester.untimed == 1  # counted once


def test_every_recorder_is_read_and_an_op_seen_twice_is_sent_once():
    """NCCL's recorder and the generic one are separate dumps on a CUDA build; some builds show one op in both."""
    nccl = [FR_ENTRY, dict(FR_ENTRY, record_id=8, collective_seq_id=13)]
    generic = [dict(FR_ENTRY, record_id=0, pg_id=1, process_group=["1", "gloo_pg"], profiling_name="gloo:barrier"),
               dict(FR_ENTRY, record_id=1, collective_seq_id=13)]  # the same op as nccl's record 8
    recorders = FlightRecorders([FlightRecorderHarvester(lambda *_: json.dumps({"entries": nccl})),
                                 FlightRecorderHarvester(lambda *_: json.dumps({"entries": generic}))])
    rows = recorders.harvest(lambda _: 0)
    assert sorted((r.process_group, r.name, r.seq) for r in rows) == [("0", "all_reduce", 12), ("0", "all_reduce", 13),
                                                              ("1", "barrier", 12)]
    assert recorders.harvest(lambda _: 0) == []
    assert find_dump_functions(types.SimpleNamespace(_dump_fr_trace_json=len, _dump_nccl_trace_json=min)) == [len, min]


_REAL_FLIGHT_RECORDER_JOB = """
import json, os, sys
import torch, torch.distributed as dist
from gpuwatch.probe.flight_recorder import FlightRecorders, entry_finished, find_dump_functions
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
dumps = find_dump_functions(torch._C._distributed_c10d)
recorders = FlightRecorders.starting_now(dumps)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
for _ in range(4):
    model(torch.randn(2, 8)).sum().backward()
entries = [e for dump in dumps for e in json.loads(dump(True, False))["entries"]]
rows = recorders.harvest(lambda _: 0)
print(json.dumps({"finished": sum(map(entry_finished, entries)), "states": sorted({e["state"] for e in entries}),
                  "rows": len(rows), "untimed": recorders.untimed, "entries": len(entries)}))
dist.destroy_process_group()
"""


def test_the_real_flight_recorder_of_a_gloo_job_is_read(tmp_path):
    """torch's own recorder, world size 1: its entries are retired but stay 'scheduled', with no timing on gloo."""
    pytest.importorskip("torch")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"}
    run = subprocess.run([sys.executable, "-c", _REAL_FLIGHT_RECORDER_JOB, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["entries"] >= 4 and seen["finished"] >= 4, seen  # one all-reduce a step at least
    assert seen["rows"] + seen["untimed"] >= 4, seen  # every finished entry after the start is accounted for


def test_profiler_window_ships_compact_span_rows(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import gpuwatch.probe

    listener = ProbeListener(str(tmp_path / "p.sock"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        probe = gpuwatch.probe.start(job="prof", endpoint=listener.path, profile_every_s=0.0, profile_steps=2)
        a = torch.randn(64, 64)
        for _ in range(4):  # step 0 opens the window, steps 1-2 are profiled, the window closes at step 2's end
            dist.all_reduce(a @ a)
            probe.step()
        probe.close()
        kinds, names, steps = [], [], []

        def received_end() -> bool:
            table = listener.drain()
            kinds.extend(table.kind), names.extend(table.name), steps.extend(table.step)
            return "end" in kinds

        poll(received_end, 5, "the end row")
    finally:
        dist.destroy_process_group()
        listener.close()
    assert probe.stats()["errors"] == 0
    profiled = [(k, n, s) for k, n, s in zip(kinds, names, steps)
                if k in ("compute", "collective") and n != "all_reduce"]
    assert {k for k, _, _ in profiled} == {"compute", "collective"}
    assert any(n.startswith("aten::") for _, n, _ in profiled) and any("allreduce" in n for _, n, _ in profiled)
    assert {s for _, _, s in profiled} == {1, 2}


def test_torchrun_without_rdzv_id_is_no_job_id():
    """torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none: that is no job, so SLURM's id wins."""
    assert identity_from_environment(env={"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}).job_id == "77"
    assert identity_from_environment(env={"TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": "78"}).job_id == "78"
    assert identity_from_environment(env={"TORCHELASTIC_RUN_ID": "none"}).job_id == "unknown"
    assert identity_from_environment(env={"GPUWATCH_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "none"}).job_id == "mine"
    assert identity_from_environment(env={"TORCHELASTIC_RUN_ID": "te-9", "SLURM_JOB_ID": "77"}).job_id == "te-9"
