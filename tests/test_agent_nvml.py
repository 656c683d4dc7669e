"""The NVML sampler and XID sources, run through real pynvml against the simulated fleet beneath it."""
import ctypes.util
import subprocess
import sys
import time

import pandas as pd
import pytest

from gpuwatch.core import fields
from gpuwatch.core import events as ev
from gpuwatch.agent.nvml import NoGpuDriverError, NvmlSampler
from gpuwatch.simulator.degrade import Degradation, parse_fault_spec
from gpuwatch.simulator.fleet import SimulatedFleet
from gpuwatch.agent.xid import XidDeduper, XidWatcher, normalize_bus_id, parse_kmsg_line
from gpuwatch.models.faults import fault_events
from helpers import T0, poll


class Clock:
    """Simulated time shared by the fleet and the sampler, so GPM spacing needs no waiting."""

    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


@pytest.fixture
def rig(request):
    model = getattr(request, "param", "H100")
    clock = Clock()
    with SimulatedFleet(8, model=model, seed=1, node="n1", clock=clock) as fleet:
        sampler = NvmlSampler(slow_interval=30.0, clock=clock)
        sampler.open()
        yield fleet, sampler, clock
        sampler.close()


def _ticks(sampler, clock, n, step=1.0):
    out = []
    for _ in range(n):
        out.append(sampler.sample())
        clock.t += step
    return out


def _power_trace(node, seed=0, n=5):
    clock = Clock()
    with SimulatedFleet(2, node=node, seed=seed, clock=clock):
        sampler = NvmlSampler(clock=clock)
        sampler.open()
        try:
            return [round(t.rows[g]["gpu_power_watts"], 3) for t in _ticks(sampler, clock, n) for g in (0, 1)]
        finally:
            sampler.close()


def test_simulated_values_vary_by_node_and_repeat_for_the_same_node_and_seed():
    a, b = _power_trace("node-a"), _power_trace("node-b")
    assert a == _power_trace("node-a")
    assert a != b and a != _power_trace("node-a", seed=1)
    assert a[0::2] != a[1::2]  # the two GPUs of a node differ too


def test_h100_values_are_in_range_and_units(rig):
    fleet, sampler, clock = rig
    first, second = _ticks(sampler, clock, 2)
    assert first.slow and not second.slow
    assert sorted(second.rows) == list(range(8))
    for tick in (first, second):
        for values in tick.rows.values():
            assert set(values) <= set(fields.GPU_FIELD_NAMES)
    v = second.rows[0]
    for name in ("gpu_utilization_ratio", "gpu_memory_utilization_ratio", "gpu_sm_active_ratio",
                 "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio", "gpu_dram_bandwidth_utilization_ratio"):
        assert 0.0 <= v[name] <= 1.0, name
    assert v["gpu_utilization_ratio"] > 0.5  # a training job is running
    assert v["gpu_memory_total_bytes"] == 80 * 2**30 and 0 < v["gpu_memory_used_bytes"] < v["gpu_memory_total_bytes"]
    assert 50 <= v["gpu_power_watts"] <= 700 and v["gpu_power_limit_watts"] == 700
    assert 20 <= v["gpu_temperature_celsius"] <= 95
    assert 1.0e9 < v["gpu_sm_clock_hertz"] <= 1.98e9
    assert second.rows[0]["gpu_energy_joules_total"] > first.rows[0]["gpu_energy_joules_total"]
    assert v["gpu_nvlink_tx_bytes_per_second"] > 1e9  # MiB/s from GPM scaled to bytes/s
    slow = first.rows[0]
    assert slow["gpu_ecc_dbe_volatile_total"] == 0 and slow["gpu_pcie_link_gen"] == 5 == slow["gpu_pcie_link_gen_max"]
    assert "gpu_ecc_sbe_volatile_total" not in v  # slow tier only every slow_interval
    assert "gpu_sm_active_ratio" not in first.rows[0]  # GPM needs two samples
    assert all(d.gpm_supported and d.architecture == "hopper" for d in sampler.devices)


@pytest.mark.parametrize("rig", ["A100"], indirect=True)
def test_a100_has_no_gpm_and_reports_unsupported_fields_once(rig):
    fleet, sampler, clock = rig
    ticks = _ticks(sampler, clock, 3, step=20.0)  # slow tier at t=0 and t=40
    assert ticks[0].slow and ticks[2].slow
    assert not any(d.gpm_supported for d in sampler.devices)
    assert not any("gpu_sm_active_ratio" in v for t in ticks for v in t.rows.values())
    unsupported = [e for t in ticks for e in t.events if e.kind == ev.FIELD_UNSUPPORTED]
    per_gpu0 = sorted(e.attrs["field"] for e in unsupported if e.gpu_index == 0)
    assert per_gpu0 == ["gpu_retired_pages_dbe", "gpu_retired_pages_pending", "gpu_retired_pages_sbe"]
    assert len(unsupported) == 3 * 8  # once per GPU and field, not again at the second slow tick
    assert all(e in ticks[0].events for e in unsupported)
    assert ticks[2].rows[0]["gpu_remapped_rows_pending"] == 0  # Ampere: remapped rows instead


def test_unsupported_call_is_recorded_once_and_never_polled_again(rig):
    fleet, sampler, clock = rig
    fleet.gpus[2].unsupported.add("nvmlDeviceGetPowerUsage")
    first = sampler.sample()
    calls = [e for e in first.events if e.kind == ev.FIELD_UNSUPPORTED and not e.attrs["nvml"].startswith("field")]
    assert [(e.gpu_index, e.attrs["nvml"]) for e in calls] == [(2, "nvmlDeviceGetPowerUsage")]
    fleet.gpus[2].unsupported.discard("nvmlDeviceGetPowerUsage")  # would answer now, if it were asked
    clock.t += 1
    later = _ticks(sampler, clock, 3)
    assert not any(t.events for t in later)
    assert all("gpu_power_watts" not in t.rows[2] and "gpu_power_watts" in t.rows[3] for t in later)


def test_lost_gpu_is_reported_once_and_the_others_keep_sampling(rig):
    fleet, sampler, clock = rig
    _ticks(sampler, clock, 1)
    fleet.lose_gpu(3)
    after = _ticks(sampler, clock, 3)
    lost = [e for t in after for e in t.events if e.kind == ev.GPU_LOST]
    assert [e.gpu_index for e in lost] == [3]
    for t in after:
        assert sorted(t.rows) == [0, 1, 2, 4, 5, 6, 7]
        assert all(v["gpu_utilization_ratio"] > 0 for v in t.rows.values())


def test_faults_show_in_the_slow_tier(rig):
    fleet, sampler, clock = rig
    fleet.add_ecc(1, sbe=5, dbe=1)
    fleet.set_remap(1, correctable=2, pending=True)
    fleet.add_pcie_replays(1, 7)
    fleet.add_nvlink_errors(1, crc_flit=3, replay=1)
    fleet.set_pcie_link(1, gen=3, width=8)
    v = sampler.sample().rows[1]
    assert (v["gpu_ecc_sbe_volatile_total"], v["gpu_ecc_dbe_aggregate_total"]) == (5, 1)
    assert (v["gpu_remapped_rows_correctable"], v["gpu_remapped_rows_pending"]) == (2, 1)
    assert (v["gpu_pcie_replay_total"], v["gpu_nvlink_crc_flit_errors_total"],
            v["gpu_nvlink_replay_errors_total"]) == (7, 3, 1)
    assert (v["gpu_pcie_link_gen"], v["gpu_pcie_link_width"], v["gpu_pcie_link_width_max"]) == (3, 8, 16)


def test_xid_arrives_through_nvml_event_wait_and_kmsg_copy_is_deduplicated(rig):
    fleet, sampler, clock = rig
    got = []
    watcher = XidWatcher(sampler.devices, got.append, kmsg_path=None, wait_ms=100)
    watcher.start()
    try:
        fleet.inject_xid(2, 48, "DBE")
        poll(lambda: got, 5, "the XID event")
        [xid] = got
        assert (xid.kind, xid.gpu_index, xid.code, xid.attrs["source"]) == (ev.XID, 2, 48, "nvml")
        # named from NVIDIA's catalog with its action, not "NVML event 0x8 data 48"
        assert xid.message.startswith("XID 48 (Double bit ECC error (uncorrectable memory error)); action: drain")
        watcher.kmsg_line(fleet.kernel_log[-1])  # the same XID from the kernel log: not reported twice
        fleet.lose_gpu(5)
        poll(lambda: len(got) == 2, 5, "the gpu_lost XID")
        assert (got[1].gpu_index, got[1].code) == (5, 79)
    finally:
        watcher.stop()


def test_kmsg_source_reads_new_lines_from_a_log_file(rig, tmp_path):
    fleet, sampler, clock = rig
    log_file = tmp_path / "kmsg"
    log_file.write_text("6,1,1,-;NVRM: Xid (PCI:0000:18:00): 13, old history line\n")
    got = []
    watcher = XidWatcher(sampler.devices, got.append, kmsg_path=str(log_file), wait_ms=100)
    watcher.start()
    try:
        with open(log_file, "a") as f:
            f.write("4,2,2,-;NVRM: Xid (PCI:0000:28:00): 94, pid=1234, Contained: SM (0x1).\n")
        poll(lambda: got, 5, "the XID event")
        assert [(e.gpu_index, e.code, e.attrs["source"]) for e in got] == [(1, 94, "kmsg")]
        assert "Contained" in got[0].message and got[0].message.startswith("XID 94 (Contained ECC error")
    finally:
        watcher.stop()


def test_parse_kmsg_lines():
    x = parse_kmsg_line("3,1203,98834121,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2471, name=python, "
                        "GPU has fallen off the bus.")
    assert (x.pci_bus_id, x.code) == ("0000:3b:00", 79) and x.message.startswith("pid=2471")
    x = parse_kmsg_line("[ 1234.5] NVRM: Xid (PCI:0000:B7:00): 48, An uncorrectable double bit error")
    assert (x.pci_bus_id, x.code) == ("0000:b7:00", 48)
    assert parse_kmsg_line("NVRM: GPU at PCI:0000:3b:00: GPU-1234") is None
    assert parse_kmsg_line("usb 1-1: new high-speed USB device") is None
    assert normalize_bus_id("00000000:3B:00.0") == normalize_bus_id("0000:3b:00") == "0000:3b:00"


def test_deduper_merges_across_sources_but_keeps_bursts():
    now = [0.0]
    d = XidDeduper(window_s=5.0, clock=lambda: now[0])
    assert d.first_report("nvml", 0, 13) and d.first_report("nvml", 0, 13)  # a burst: both count
    assert not d.first_report("kmsg", 0, 13) and not d.first_report("kmsg", 0, 13)  # their kernel copies
    assert d.first_report("kmsg", 0, 13)  # a third sighting has no twin
    now[0] = 10.0
    assert d.first_report("nvml", 0, 13)  # outside the window: a new XID


def test_no_driver_is_a_clear_error():
    with SimulatedFleet(2, driver_loaded=False):
        with pytest.raises(NoGpuDriverError, match="no NVIDIA driver.*--simulate"):
            NvmlSampler().open()


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver")
def test_cli_without_driver_prints_one_line_and_fails(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--collector", "127.0.0.1:1", "--ticks", "1",
                           "--spool", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no NVIDIA driver" in proc.stderr


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is None, reason="needs an NVIDIA driver")
def test_real_gpus_sample_through_the_same_code():
    sampler = NvmlSampler()
    try:
        devices = sampler.open()
    except NoGpuDriverError as exc:
        pytest.skip(str(exc))
    try:
        tick = sampler.sample()
    finally:
        sampler.close()
    assert devices and sorted(tick.rows) == [d.index for d in devices if not d.lost]
    for values in tick.rows.values():
        assert set(values) <= set(fields.GPU_FIELD_NAMES)
        assert 0.0 <= values["gpu_utilization_ratio"] <= 1.0 and values["gpu_memory_total_bytes"] > 0


# ---- scripted degradation (--sim-fault) through the sampler's normal code path ---------------------------


def _degrade(rig, spec, minutes, step=60.0):
    """Drive ``spec`` on the rig's fleet for ``minutes`` simulated minutes; return the ticks and XID events."""
    fleet, sampler, clock = rig
    fleet.drive(parse_fault_spec(spec).gpu, Degradation.from_spec(parse_fault_spec(spec), "n1", clock.t))
    sampler.slow_interval = step  # every tick reads the reliability counters
    seen = []
    watcher = XidWatcher(sampler.devices, seen.append, kmsg_path=None, wait_ms=50)
    watcher.start()
    try:
        ticks = _ticks(sampler, clock, minutes, step=step)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e.code in (48, 79) for e in seen):
            time.sleep(0.02)  # polling the XID thread with a deadline
    finally:
        watcher.stop()
    return ticks, seen


def test_ecc_degradation_grows_counters_sets_remap_pending_and_ends_in_xid_48(rig):
    ticks, xids = _degrade(rig, "gpu=2,kind=ecc,after=10m,fail=3h,xid=48", 200)
    before, late = ticks[5].rows[2], ticks[170].rows[2]
    assert before["gpu_ecc_sbe_volatile_total"] == 0 and before["gpu_remapped_rows_pending"] == 0
    assert late["gpu_ecc_sbe_volatile_total"] > 50 and late["gpu_remapped_rows_pending"] == 1
    assert ticks[-1].rows[2]["gpu_ecc_dbe_volatile_total"] >= 1  # the uncorrectable error at the fault
    assert all(t.rows[g]["gpu_ecc_sbe_volatile_total"] == 0 for t in ticks for g in (0, 1, 3))  # others healthy
    codes = [e.code for e in xids if e.gpu_index == 2]
    assert 48 in codes and 63 in codes  # the fault XID and remap XIDs on the way
    assert not [e for e in xids if e.gpu_index != 2]


def test_pcie_degradation_ends_with_the_gpu_lost(rig):
    ticks, xids = _degrade(rig, "gpu=5,kind=pcie,after=0m,fail=2h", 130)
    assert ticks[100].rows[5]["gpu_pcie_replay_total"] > 100
    assert 5 not in ticks[-1].rows and 4 in ticks[-1].rows  # lost; its neighbours keep sampling
    lost = [e for t in ticks for e in t.events if e.kind == ev.GPU_LOST]
    assert [e.gpu_index for e in lost] == [5]
    assert any(e.code == 79 and e.gpu_index == 5 for e in xids)


def test_pcie_width_degradation_narrows_the_link_at_the_fault_and_the_gpu_stays(rig):
    """A width drop is a fault without an XID: the agent reads the narrower link through NVML."""
    ticks, xids = _degrade(rig, "gpu=5,kind=pcie_width,after=0m,fail=2h", 130)
    assert ticks[100].rows[5]["gpu_pcie_replay_total"] > 100 and ticks[100].rows[5]["gpu_pcie_link_width"] == 16
    assert ticks[-1].rows[5]["gpu_pcie_link_width"] < ticks[-1].rows[5]["gpu_pcie_link_width_max"] == 16
    assert not [e for e in xids if e.gpu_index == 5]
    samples = pd.DataFrame([{"node": "n1", "gpu_index": 5, "ts": pd.Timestamp(T0 + 60_000 * i, unit="ms", tz="UTC"),
                             **t.rows[5]} for i, t in enumerate(ticks)])
    assert fault_events(pd.DataFrame(columns=["node", "gpu_index", "ts", "kind", "code"]), samples)["kind"].tolist(
    ) == ["pcie"]


@pytest.mark.parametrize("spec, problem", [
    ("gpu=1,kind=pcie_width,fail=1h,xid=79", "raises no XID"),
    ("gpu=1,kind=ecc", "missing fail"),
    ("gpu=x,kind=ecc,fail=1h", "GPU index"),
    ("gpu=1,kind=disk,fail=1h", "kind=disk"),
    ("gpu=1,kind=ecc,after=2h,fail=1h", "must come after"),
    ("gpu=1,kind=ecc,fail=soon", "not a duration"),
    ("gpu=1,kind=ecc,fail=1h,xid=79", "XID 48 or 64"),
    ("gpu=1,kind=ecc,fail=1h,when=now", "expected one of"),
])
def test_bad_fault_spec_says_what_is_wrong(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_fault_spec(spec)


@pytest.mark.parametrize("kind, xid", [("ecc", 48), ("remap", 64), ("pcie", 79)])
def test_a_scripted_fault_reports_its_xid_once(kind, xid):
    """One fault, one fault XID: tick by tick across the fault, as Degradation drives a live GPU."""
    from gpuwatch.simulator.failing_fleet import plan_effects

    spec = parse_fault_spec(f"gpu=0,kind={kind},after=10m,fail=1h,xid={xid}" if kind != "pcie"
                            else f"gpu=0,kind={kind},after=10m,fail=1h")
    plan = Degradation.from_spec(spec, "n1", clock_start_s=0.0).plan
    codes = [code for t in range(plan.fault_ms - 10_000, plan.fault_ms + 60_000, 1000)
             for _, kind_, code, _ in plan_effects(plan, [t], 1.0).events if kind_ == "xid"]
    assert codes.count(xid) == 1, codes
