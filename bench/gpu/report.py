"""The validation's results as Markdown for docs/gpu-validation.md: machine, every number, every failure.

Works on partial results (a step that failed or was skipped leaves its section saying so), because the
report is most needed exactly when something went wrong on the GPU machine.
"""
from __future__ import annotations

from collections.abc import Iterable

from gpuwatch.core.fields import BY_NAME

GPM_COLUMNS = (("gpu_sm_active_ratio", "SM active"), ("gpu_sm_occupancy_ratio", "SM occupancy"),
               ("gpu_tensor_active_ratio", "tensor active"), ("gpu_dram_bandwidth_utilization_ratio", "DRAM BW"),
               ("gpu_utilization_ratio", "util"))


def render(results: dict) -> str:
    steps = results.get("steps", {})
    lines = ["# GPU validation", ""]
    if results.get("mode") == "simulated":
        lines += ["> **Simulated run, no GPU.** The GPUs below are gpuwatch's simulated fleet and the training ran",
                  "> on the CPU: this exercises the kit, it measures no GPU. Never quote these numbers as GPU results.",
                  ""]
    lines += [f"Written by `python bench/gpu/validate.py` ({results.get('started', '?')} to "
              f"{results.get('finished', '?')} UTC, {results.get('elapsed_s', 0):.0f} s of a "
              f"{results.get('budget_s', 0):.0f} s budget).", ""]
    lines += _machine(results.get("machine", {}))
    lines += ["## Summary", "", *_table(["step", "status", "seconds", "failed checks"], [
        [name, step.get("status", "?"), f"{step.get('seconds', 0):.0f}",
         "; ".join(c["name"] for c in step.get("result", {}).get("checks", []) if not c["ok"]) or step.get("error", "")]
        for name, step in steps.items()]), ""]
    sections = (("nvml_agent", "1. The agent on the GPU under load", _nvml_agent),
                ("nvml_latency", "1b. NVML latency per field tier (the agent's sampler, direct calls)", _latency),
                ("capability", "2. XID thread, `agent --check --json`, MIG and permissions", _capability),
                ("probe", "3. The probe on CUDA with NCCL", _probe),
                ("trace", "4. A real profiler trace through `gpuwatch analyze`", _trace))
    for key, title, body in sections:
        step = steps.get(key)
        lines += [f"## {title}", ""]
        if step is None:
            lines += ["Not run.", ""]
            continue
        if step.get("error"):
            lines += [f"**Error:** `{step['error']}`", ""]
        if step.get("status") == "skipped":
            lines += [f"Skipped: {step.get('reason', '')}", ""]
        result = step.get("result")
        if result:
            lines += body(result)
            lines += _checks(result.get("checks", []))
    return "\n".join(lines).rstrip() + "\n"


def _machine(info: dict) -> list[str]:
    simulated = " (simulated fleet, not real GPUs)" if info.get("simulated_gpus") else ""
    rows = [["GPU", (", ".join(info.get("gpus") or []) or info.get("nvml_error", "none")) + simulated],
            ["torch sees", info.get("torch_gpu", "no CUDA device")],
            ["driver (CUDA of the driver)", f"{info.get('driver', '?')} ({info.get('driver_cuda', '?')})"],
            ["torch (its CUDA), NCCL",
             f"{info.get('torch_version')} ({info.get('torch_cuda')}), {info.get('nccl', '-')}"],
            ["nvidia-ml-py, python, kernel",
             f"{info.get('nvidia-ml-py_version')}, {info.get('python')}, {info.get('kernel')}"],
            ["CPUs", str(info.get("cpus"))],
            ["gpuwatch commit",
             f"{info.get('gpuwatch_commit')}{' (with local changes)' if info.get('gpuwatch_dirty') else ''}"]]
    return ["## Machine", "", *_table(["", ""], rows), ""]


def _nvml_agent(r: dict) -> list[str]:
    lines = [f"`{r.get('agent_command', '')}` (recording, analysed below) and `{r.get('streaming_command', '')}` "
             f"(streaming to an Ingest sink on loopback: {r.get('streaming_batches_acknowledged')} batches "
             "acknowledged) while `bench/gpu/loads.py` ran the phases below.", ""]
    rows = [[name, _num(a.get("cpu_s_per_node_s") and 100 * a["cpu_s_per_node_s"], 2), _num(a.get("cpu_window_s"), 0),
             _num(a.get("rss_mib_peak"), 1), str(a.get("threads")), str(a.get("exit_code"))]
            for name, a in r.get("agents", {}).items()]
    if rows:
        lines += ["Agent cost, side by side in one run:", "",
                  *_table(["agent", "CPU % of one core (CPU s per node-second)", "over s", "RSS peak MiB", "threads",
                           "exit"], rows), ""]
    fields = r.get("fields")
    if fields:
        rows = []
        for tier, got in fields["tiers"].items():
            refused = sorted({u["field"] for u in fields["unsupported"] if _tier_of(u["field"]) == tier})
            rows.append([tier, ", ".join(got["returned"]) or "-", ", ".join(refused) or "-",
                         ", ".join(got["never_returned_unreported"]) or "-"])
        other = sorted({u["field"] for u in fields["unsupported"] if _tier_of(u["field"]) is None})
        lines += [f"{fields['rows']} sample rows from {fields['gpus']} GPU(s); events: {fields['event_kinds']}.", "",
                  *_table(["tier", "returned values", "reported unsupported", "never returned, not reported"], rows),
                  ""]
        if other:
            lines += [f"Unsupported NVML calls outside the field tiers: {', '.join(other)}.", ""]
    if r.get("per_phase"):
        rows = []
        for p in r["per_phase"]:
            m = p["median"]
            achieved = (f"{p['tflops']:.0f} TFLOP/s" if "tflops" in p
                        else f"{p['gb_per_s']:.0f} GB/s" if "gb_per_s" in p else "-")
            rows.append([p["kind"], str(p["rows"]), *[_num(m.get(k)) for k, _ in GPM_COLUMNS],
                         _num(m.get("gpu_power_watts"), 0), _num(_scaled(m.get("gpu_sm_clock_hertz"), 1e-6), 0),
                         achieved])
        header = ["phase", "rows", *[label for _, label in GPM_COLUMNS], "power W", "SM MHz", "load achieved"]
        lines += ["Medians per phase (edges trimmed):", "", *_table(header, rows), ""]
    return lines


def _tier_of(field: str) -> str | None:
    f = BY_NAME.get(field)
    return f.tier.value if f is not None else None


def _latency(r: dict) -> list[str]:
    rows = []
    for tier, t in r.get("tiers", {}).items():
        call, tick = t["per_call"], t["per_gpu_tick"]
        rows.append([tier, str(call["count"]), _num(call["median_us"], 1), _num(call["p99_us"], 1),
                     _num(tick["median_us"], 1), _num(tick["p99_us"], 1)])
    lines = [f"{r.get('ticks')} ticks {r.get('spacing_s', 0):.2f} s apart on {r.get('gpus')} GPU(s).", "",
             *_table(["tier", "NVML calls", "per call median µs", "per call p99 µs", "tier per GPU median µs",
                      "tier per GPU p99 µs"], rows), ""]
    per_function = [[tier, name, str(s["count"]), _num(s["median_us"], 1), _num(s["p99_us"], 1)]
                    for tier, t in r.get("tiers", {}).items() for name, s in t["per_function"].items()]
    if per_function:
        lines += ["Per NVML function:", "",
                  *_table(["tier", "function", "calls", "median µs", "p99 µs"], per_function), ""]
    fields = r.get("fields")
    if fields:
        batched = [[tier, str(s["count"]), _num(s["median_us"], 1), _num(s["p99_us"], 1)]
                   for tier, s in fields["batched"].items()]
        alone = [[name, f["tier"], str(f["nvml_return"]), str(f["count"]), _num(f["median_us"], 1),
                  _num(f["p99_us"], 1)] for name, f in sorted(fields["fields"].items(),
                                                             key=lambda kv: -(kv[1]["median_us"] or 0))]
        lines += ["nvmlDeviceGetFieldValues: each tier's batch, then each field read alone (slowest first):", "",
                  *_table(["tier", "calls", "median µs", "p99 µs"], batched), "",
                  *_table(["field", "tier", "NVML return", "calls", "median µs", "p99 µs"], alone), ""]
    return lines


def _capability(r: dict) -> list[str]:
    lines = []
    x = r.get("xid")
    if x:
        cpu = ", ".join(f"{k} {v:.3f} %" for k, v in x["thread_cpu_pct_of_core"].items())
        lines += [f"XID watcher for {x['seconds']:.0f} s on {x['gpus']} GPU(s): threads "
                  f"{', '.join(x['threads']) or 'none'}; "
                  f"{x['event_waits']} `nvmlEventSetWait` calls ({x['event_wait_timeouts']} timeouts, "
                  f"{x['event_waits_per_s']:.2f}/s at {x['wait_ms']} ms each); {len(x['events'])} events; "
                  f"thread CPU (% of one core): {cpu or '-'}.", ""]
    for key, label in (("check", "`agent --check --json`"), ("check_as_nobody", "the same as user nobody")):
        c = r.get(key) or {}
        if "skipped" in c:
            lines += [f"{label}: not run ({c['skipped']}).", ""]
            continue
        report = c.get("report") or {}
        items = "; ".join(f"{i['name']}: {'ok' if i['ok'] else 'FAIL'} ({i['detail']})"
                          for i in report.get("checks", []))
        gpus = "; ".join(f"GPU {g['index']} {g['name']}: {len(g['fields'])} fields, GPM {'yes' if g['gpm'] else 'no'}, "
                         f"unsupported: {', '.join(g['unsupported']) or 'none'}" for g in report.get("gpus", []))
        said = items or c.get("error") or c.get("stderr_tail", "")
        lines += [f"{label} ({c.get('as', '?')}): exit {c.get('exit_code')}; {said}",
                  "", f"  {gpus}" if gpus else "", ""]
    diff = r.get("permission_difference")
    if diff:
        lines += ["Fields only a privileged agent gets: " + "; ".join(
            f"GPU {i}: {', '.join(d['only_privileged']) or 'none'}" for i, d in diff.items()), ""]
    mig = r.get("mig")
    if mig:
        lines += ["MIG (read only): " + "; ".join(
            f"GPU {m['gpu']}: " + (m["error"] if "error" in m else f"current {m['current']}, pending {m['pending']}"
                                   + (f", devices {m.get('mig_devices')}" if m.get("mig_devices") else ""))
            for m in mig), ""]
    return lines


def _probe(r: dict) -> list[str]:
    rows = []
    for name in ("flight_recorder", "cuda_events", "ab", "world2_one_gpu"):
        run = r.get(name)
        if run is None:
            continue
        env, got = run.get("environment", {}), run.get("received", {})
        exits = ", ".join(str(p["exit_code"]) + (" (timed out)" if p["timed_out"] else "")
                          for p in run.get("processes", []))
        rows.append([name, env.get("probe_gpu_timing", "-"), str(env.get("world_size", "-")), exits or "-",
                     _num(run.get("median_step_s") and 1000 * run["median_step_s"], 2), str(got.get("by_kind", {})),
                     str(got.get("collective_names", {})), _num(got.get("collective_dur_us_median"), 1),
                     str(run.get("probe_stats", {})), run.get("error", "")])
    lines = [*_table(["run", "GPU timing", "world", "exit", "median step ms", "rows received", "collectives",
                      "median collective µs", "probe stats", "error"], rows), ""]
    overhead = r.get("ab", {}).get("overhead", {})
    if "t_ci_pct" in overhead:
        lines += [f"Step-time A/B, {overhead['rounds']} interleaved rounds of {r['ab'].get('block_steps')} steps "
                  "per variant "
                  f"(Flight Recorder on in both): mean step {1000 * overhead['mean_step_s_without']:.3f} ms without, "
                  f"{1000 * overhead['mean_step_s_with']:.3f} ms with the probe; overhead "
                  f"**{overhead['overhead_pct_mean']:+.2f} %** (median {overhead['overhead_pct_median']:+.2f} %), "
                  f"95 % t interval [{overhead['t_ci_pct'][0]:+.2f}, {overhead['t_ci_pct'][1]:+.2f}] %, bootstrap "
                  f"[{overhead['bootstrap_ci_pct'][0]:+.2f}, {overhead['bootstrap_ci_pct'][1]:+.2f}] %; "
                  f"resolves 1 %: {'yes' if overhead['resolves_1pct'] else 'no'}.", ""]
    elif overhead:
        lines += [f"Step-time A/B: {overhead.get('error')}", ""]
    return lines


def _trace(r: dict) -> list[str]:
    lines = []
    if "trace_file" in r:
        lines += [f"Trace `{r['trace_file']}`: {r['trace_gz_bytes']} bytes gzip "
                  f"({r['profile'].get('raw_bytes', 0)} raw), {r['profile'].get('active_steps')} profiled steps; "
                  f"small enough for test data: {'yes' if r['small_enough_for_test_data'] else 'no'}.", ""]
    a = r.get("analyze", {})
    if a.get("exit_code") == 0:
        lines += ["`gpuwatch analyze` (job, % of the window "
                  f"{a['window_us'] / 1000:.1f} ms, {a['steps']} steps):", "",
                  *_table(list(a["breakdown_pct"]), [[f"{v:.2f}" for v in a["breakdown_pct"].values()]]), "",
                  f"Short kernels: {a['short_kernels']['count']} taking "
                  f"{a['short_kernels']['time_us'] / 1000:.2f} ms.", ""]
    elif a:
        lines += [f"`gpuwatch analyze`: exit {a.get('exit_code')}: {a.get('error')}", ""]
    hta = r.get("hta", {})
    agree = hta.get("agreement")
    if agree:
        lines += [f"HTA's temporal breakdown beside gpuwatch over HTA's window ({agree['window_us'] / 1000:.1f} ms): "
                  f"compute {agree['hta_compute_pct']:.2f} % vs {agree['gpuwatch_compute_pct']:.2f} %, idle "
                  f"{agree['hta_idle_pct']:.2f} % vs {agree['gpuwatch_idle_pct']:.2f} %; differences "
                  f"{agree['compute_diff_pct_of_window']:.3f} % and {agree['idle_diff_pct_of_window']:.3f} % "
                  "of the window.", ""]
    elif hta.get("available"):
        why = hta.get("hta_error") or hta.get("gpuwatch_same_window_error")
        lines += [f"HTA ran but gave no comparison: {why}", ""]
    elif hta:
        lines += [f"HTA not run: {hta.get('reason')}", ""]
    return lines


def _checks(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    return ["Checks:", "", *(f"- {'ok' if c['ok'] else '**FAILED**'}: {c['name']} ({c['detail']})" for c in checks), ""]


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    clean = lambda cell: str(cell).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(map(clean, header)) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(clean, row)) + " |" for row in rows)]


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _scaled(value, factor: float):
    return None if value is None else value * factor
