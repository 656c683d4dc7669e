"""The GPU validation kit (bench/gpu/) without a GPU: every part that can run on the simulated fleet
beneath pynvml or on CPU torch runs here; the run on a real GPU is skipped unless torch sees CUDA."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pynvml
import pytest

from gpuwatch.simulator.fleet import SimulatedFleet
from gpuwatch.core.recording import open_recording
from helpers import KINETO_SAMPLED

KIT = Path(__file__).resolve().parent.parent / "bench" / "gpu"
sys.path.insert(0, str(KIT))  # the kit's modules import each other by name, as validate.py run as a script does

import capability  # noqa: E402
import loads  # noqa: E402
import machine  # noqa: E402
import nvml_latency  # noqa: E402
import nvml_step  # noqa: E402
import report  # noqa: E402
import stats  # noqa: E402

NO_GPU = machine.find_gpu()


def _validate(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KIT / "validate.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------------------- A/B statistics
def _rounds(overhead: float, rounds: int = 40, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-round step times with drift shared by both variants and 0.3 % noise each, `with` slower by
    `overhead` (a fraction)."""
    rng = np.random.default_rng(seed)
    drift = 0.050 * (1 + 0.05 * np.sin(np.arange(rounds) / 3))  # the machine speeds up and slows down
    without = drift * (1 + rng.normal(0, 0.003, rounds))
    with_probe = drift * (1 + overhead) * (1 + rng.normal(0, 0.003, rounds))
    return without, with_probe


def test_paired_overhead_recovers_a_known_overhead():
    result = stats.paired_overhead(*_rounds(0.02))
    assert result["rounds"] == 40
    assert result["overhead_pct_mean"] == pytest.approx(2.0, abs=0.3)
    for low, high in (result["t_ci_pct"], result["bootstrap_ci_pct"]):
        assert low < 2.0 < high and low > 0  # the true 2 % inside, no overhead excluded
    assert result["resolves_1pct"] and result["ci_width_pct"] <= 1.0


def test_paired_overhead_of_identical_variants_includes_zero():
    without, _ = _rounds(0.0, seed=2)
    _, with_probe = _rounds(0.0, seed=3)
    low, high = stats.paired_overhead(without, with_probe * (without.mean() / with_probe.mean()))["t_ci_pct"]
    assert low < 0 < high


def test_few_noisy_rounds_do_not_resolve_one_percent():
    without, with_probe = _rounds(0.02, rounds=6, seed=4)
    noisy = with_probe * (1 + np.random.default_rng(5).normal(0, 0.05, 6))
    assert not stats.paired_overhead(without, noisy)["resolves_1pct"]
    precise = _rounds(0.02)
    assert stats.paired_overhead(precise[0][:10], precise[1][:10])["resolves_1pct"]
    assert not stats.resolved(precise[0][:10], precise[1][:10])  # the stop rule waits for MIN_ROUNDS rounds
    assert stats.resolved(*precise)


@pytest.mark.parametrize("without, with_probe, problem", [([1, 1, 1], [1, 1], "pair"), ([1, 1], [1, 1], "at least 3"),
                                                           ([1, 0, 1], [1, 1, 1], "positive")])
def test_paired_overhead_refuses_bad_rounds(without, with_probe, problem):
    with pytest.raises(ValueError, match=problem):
        stats.paired_overhead(without, with_probe)


# --------------------------------------------------------------------------------------------- NVML latency
def test_nvml_latency_is_measured_through_the_agents_sampler():
    originals = {name: getattr(pynvml, name) for name in ("nvmlDeviceGetFieldValues", "nvmlGpmSampleGet")}
    with SimulatedFleet(2):
        result = nvml_latency.measure_latency(ticks=5)
    tiers = result["tiers"]
    assert result["gpus"] == 2
    assert tiers["fast"]["per_gpu_tick"]["count"] == tiers["slow"]["per_gpu_tick"]["count"] == 10  # 2 GPUs x 5
    assert {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetFieldValues"} <= set(tiers["fast"]["per_function"])
    assert {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetFieldValues"} <= set(tiers["slow"]["per_function"])
    samples = tiers["gpm"]["per_function"]["nvmlGpmSampleGet"]["count"]
    assert 4 <= samples == tiers["gpm"]["per_gpu_tick"]["count"] <= 10  # a late tick may find GPM not yet due
    assert tiers["gpm"]["per_function"]["nvmlGpmMetricsGet"]["count"] == samples - 2  # from each GPU's second on
    for tier in tiers.values():
        call = tier["per_call"]
        assert call["count"] > 0 and 0 < call["median_us"] <= call["p99_us"]
    assert "field 29" in result["unsupported_calls"]  # the simulated H100 has no retired-pages fields
    assert all(getattr(pynvml, name) is fn for name, fn in originals.items())  # pynvml restored


def test_each_field_is_timed_alone_beside_its_tiers_batch():
    """Which field makes the fast tier's batched call slow: every field read alone, per GPU, per tick."""
    with SimulatedFleet(2):
        result = nvml_latency.measure_field_latency(ticks=3)
    assert result["gpus"] == 2 and set(result["batched"]) == {"fast", "slow"}
    assert result["batched"]["fast"]["count"] == 6
    fields = result["fields"]
    assert {"gpu_energy_joules_total", "gpu_nvlink_tx_bytes_total", "gpu_ecc_dbe_volatile_total"} <= set(fields)
    assert all(f["count"] == 6 and f["median_us"] > 0 for f in fields.values())
    assert fields["gpu_energy_joules_total"]["tier"] == "fast" and fields["gpu_energy_joules_total"]["nvml_return"] == 0
    assert fields["gpu_retired_pages_dbe"]["nvml_return"] != 0  # the simulated H100 has no retired-pages fields
    text = "\n".join(report._latency({"ticks": 1, "gpus": 2, "tiers": {}, "fields": result}))
    assert "gpu_energy_joules_total" in text and "each field read alone" in text


# ---------------------------------------------------------------------------- XID thread, --check, MIG
def test_xid_watcher_on_a_healthy_gpu_waits_without_spinning():
    with SimulatedFleet(2):
        result = capability.xid_idle(1.0, kmsg_path=None, wait_ms=200)
    assert result["threads"] == ["gpuwatch-xid-nvml"] and result["events"] == []
    assert 1 <= result["event_waits"] <= result["seconds"] * 1000 / 200 + 2  # blocking waits, not a busy loop
    assert all(check["ok"] for check in result["checks"]), result["checks"]


def test_xid_watcher_check_fails_when_an_xid_arrives():
    with SimulatedFleet(2) as fleet:
        timer = threading.Timer(0.5, fleet.inject_xid, (1, 79))
        timer.start()
        result = capability.xid_idle(2.0, kmsg_path=None, wait_ms=200)
        timer.join()
    assert [(e["kind"], e["gpu"], e["code"]) for e in result["events"]] == [("xid", 1, 79)]
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    assert failed == ["no events on a healthy GPU"]


def test_agent_check_json_on_a_simulated_node():
    result = capability.agent_check(simulate=2)
    assert result["exit_code"] == 0, result.get("stderr_tail")
    report_ = result["report"]
    assert report_["ok"] and [g["gpm"] for g in report_["gpus"]] == [True, True]
    assert "gpu_tensor_active_ratio" in report_["gpus"][0]["fields"]
    unprivileged = {"report": {"gpus": [{"index": 0, "fields": ["gpu_power_watts"]}]}}
    difference = capability.permission_difference(result, unprivileged)
    assert "gpu_tensor_active_ratio" in difference["0"]["only_privileged"]
    assert difference["1"]["only_privileged"] == sorted(report_["gpus"][1]["fields"])


def test_mig_state_reports_what_the_driver_refuses():
    with SimulatedFleet(1):
        state = capability.mig_state()
    assert state == [{"gpu": 0, "error": "Function Not Found"}]  # the simulated fleet has no MIG


# ------------------------------------------------------------------------------ the agent's recording
@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A recording of `gpuwatch agent --simulate 1` (8 ticks, 0.2 s apart)."""
    path = tmp_path_factory.mktemp("agent") / "rec"
    cmd = nvml_step.agent_command(path, "sim-node", simulate=1) + ["--ticks", "8", "--interval", "0.2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


def test_fields_by_tier_from_a_simulated_recording(recording):
    fields = nvml_step.fields_by_tier(recording)
    assert fields["gpus"] == 1 and fields["rows"] == 8 and fields["xid_events"] == 0
    assert fields["tiers"]["fast"]["returned"]["gpu_power_watts"] == 8
    assert "gpu_tensor_active_ratio" in fields["tiers"]["gpm"]["returned"]
    assert {u["field"] for u in fields["unsupported"]} == {"gpu_retired_pages_sbe", "gpu_retired_pages_dbe",
                                                          "gpu_retired_pages_pending"}
    assert all(not t["never_returned_unreported"] for t in fields["tiers"].values())
    assert fields["event_kinds"]["agent_start"] == 1


def test_phase_metrics_cut_the_recording_by_phase(recording):
    samples = open_recording(recording).table("gpu_samples")
    ts = ((samples["ts"] - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(milliseconds=1)).sort_values().tolist()
    phases = [{"kind": "idle", "start_ms": ts[0], "end_ms": ts[3]},
              {"kind": "copy", "start_ms": ts[4], "end_ms": ts[7], "gb_per_s": 1.0},
              {"kind": "matmul", "start_ms": ts[-1] + 10_000, "end_ms": ts[-1] + 20_000}]
    per_phase = nvml_step.phase_metrics(samples, phases, margin_s=0.0)
    assert [p["rows"] for p in per_phase] == [4, 4, 0]
    expected = samples.sort_values("ts")["gpu_power_watts"].iloc[:4].median()
    assert per_phase[0]["median"]["gpu_power_watts"] == pytest.approx(expected)
    assert per_phase[1]["gb_per_s"] == 1.0 and per_phase[2]["median"]["gpu_tensor_active_ratio"] is None


def _phase(kind: str, dram: float | None, tensor: float | None) -> dict:
    return {"kind": kind, "rows": 10, "median": {"gpu_dram_bandwidth_utilization_ratio": dram,
                                                 "gpu_tensor_active_ratio": tensor}}


@pytest.mark.parametrize("phases, expected", [
    ([_phase("idle", 0.01, 0.0), _phase("matmul", 0.30, 0.85), _phase("copy", 0.92, 0.0), _phase("idle", 0.02, 0.0)],
     [True, True]),
    ([_phase("idle", 0.40, 0.50), _phase("matmul", 0.42, 0.55), _phase("copy", 0.45, 0.50)], [False, False]),
    ([_phase("idle", None, None), _phase("matmul", None, 0.9), _phase("copy", 0.9, None)], [False, False]),
])
def test_gpm_checks_known_answers(phases, expected):
    assert [c["ok"] for c in nvml_step.gpm_checks(phases)] == expected


def test_load_phases_are_parsed_or_refused():
    assert loads.parse_phases("idle:30, matmul:4.5,copy:1") == [("idle", 30.0), ("matmul", 4.5), ("copy", 1.0)]
    for bad in ("", "idle", "idle:x", "spin:3", "copy:0"):
        with pytest.raises(ValueError):
            loads.parse_phases(bad)


# ---------------------------------------------------------------------------------------- the trace step
def test_trace_step_on_a_cpu_only_profiler_trace(tmp_path):
    pytest.importorskip("torch")
    import trace_step

    out = tmp_path / "out"
    out.mkdir()
    result = trace_step.run(tmp_path / "work", out, "cpu", "cpu", timeout_s=300)
    kept = out / "kineto_cpu_rank0.json.gz"
    assert result["trace_file"] == kept.name and result["trace_gz_bytes"] == kept.stat().st_size
    with gzip.open(kept) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in events)
    # a CPU-only trace has no GPU activity: analyze refuses it in one line, the step records that and goes on
    assert result["analyze"]["exit_code"] == 2 and "no GPU activity" in result["analyze"]["error"]
    assert [c["ok"] for c in result["checks"]] == [True, False]


def test_analyze_summary_of_a_real_kineto_trace():
    if not Path(KINETO_SAMPLED).is_dir():
        pytest.skip(f"shared Kineto traces not here ({KINETO_SAMPLED})")
    pytest.importorskip("torch")
    import trace_step

    trace = sorted(Path(KINETO_SAMPLED).glob("*.json*"))[0]
    result = trace_step.analyze_trace(trace, timeout_s=300)
    assert result["exit_code"] == 0
    assert sum(result["breakdown_pct"].values()) == pytest.approx(100.0, abs=1e-6)
    assert set(result["headline_pct"]) == {"compute", "small_kernel_overhead", "host_stall", "idle_other"}
    assert result["short_kernels"]["count"] > 0 and result["steps"] > 0


# -------------------------------------------------------------------------------------------- the report
def test_report_renders_partial_results():
    results = {"mode": "gpu", "started": "2026-01-01 00:00:00", "finished": "2026-01-01 00:05:00", "elapsed_s": 300,
               "budget_s": 480, "machine": {"gpus": ["NVIDIA H100 80GB HBM3"], "driver": "580.1"},
               "steps": {"machine": {"status": "ok", "seconds": 1, "result": {"checks": []}},
                         "nvml_agent": {"status": "error", "seconds": 3, "error": "RuntimeError: boom"},
                         "probe": {"status": "skipped", "reason": "time budget: 20 s left, needs 60 s"}}}
    text = report.render(results)
    assert "Simulated run" not in text and "NVIDIA H100 80GB HBM3" in text and "580.1" in text
    assert "**Error:** `RuntimeError: boom`" in text and "Skipped: time budget" in text
    assert text.count("Not run.") == 3  # nvml_latency, capability, trace
    assert "| nvml_agent | error | 3 | RuntimeError: boom |" in text


# ----------------------------------------------------------------------------------------- the entry point
@pytest.mark.skipif(NO_GPU is None, reason="this machine has a GPU")
def test_validate_without_a_gpu_says_so_in_one_line(tmp_path):
    done = _validate("--out", str(tmp_path / "out"), timeout=300)
    assert done.returncode == 3
    assert done.stderr.count("\n") == 1 and "no GPU on this machine" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, problem", [(["--only", "nvml,probe"], "unknown step"), (["--budget-s", "0"], "budget"),
                                           (["--simulate", "0"], "simulate")])
def test_validate_refuses_bad_arguments(tmp_path, args, problem):
    done = _validate("--out", str(tmp_path), *args, timeout=300)
    assert done.returncode == 2 and problem in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_validate_runs_every_step_on_the_simulated_fleet(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    done = _validate("--out", str(out), "--simulate", "1", "--quick", "--budget-s", "600")
    assert done.returncode in (0, 1), done.stderr
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    assert list(steps) == list(["machine", "nvml_latency", "capability", "nvml_agent", "trace", "probe"])
    assert {name: s["status"] for name, s in steps.items() if s["status"] not in ("ok", "checks_failed")} == {}
    assert {p.name for p in out.iterdir()} == {"results.json", "gpu-validation.md", "agent_recording.tar.gz",
                                               "kineto_simulated_rank0.json.gz"}
    agent = steps["nvml_agent"]["result"]
    assert [p["kind"] for p in agent["phases"]] == ["idle", "matmul", "copy", "idle"]
    assert agent["fields"]["tiers"]["fast"]["returned"]["gpu_power_watts"] > 0
    assert all(a["cpu_s_per_node_s"] > 0 and a["exit_code"] == 0 for a in agent["agents"].values())
    assert agent["streaming_batches_acknowledged"] > 0
    probe = steps["probe"]["result"]
    assert probe["flight_recorder"]["received"]["by_kind"]["step"] == 5
    assert probe["world2_one_gpu"]["received"]["by_kind"]["step"] == 6  # two ranks, three steps each
    assert "t_ci_pct" in probe["ab"]["overhead"] or "error" in probe["ab"]["overhead"]
    text = (out / "gpu-validation.md").read_text()
    assert text.startswith("# GPU validation\n\n> **Simulated run, no GPU.**")
    assert "simulated fleet, not real GPUs" in text


@pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU here ({NO_GPU})")
def test_validate_on_a_real_gpu(tmp_path):
    done = _validate("--out", str(tmp_path), "--quick", "--budget-s", "300")
    results = json.loads((tmp_path / "results.json").read_text())
    errors = {name: s.get("error") for name, s in results["steps"].items() if s["status"] == "error"}
    assert errors == {} and done.returncode in (0, 1)
    assert results["steps"]["nvml_latency"]["status"] == "ok"
