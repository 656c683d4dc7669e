"""Per-call NVML latency per field tier, measured through the agent's own sampler.

``TimedSampler`` is the agent's :class:`~gpuwatch.agent.nvml.NvmlSampler` with its three tier methods
(fast, GPM, slow) wrapped: while one runs, every ``pynvml.nvml*`` function the sampler calls is timed and
filed under that tier. So the numbers are the latency of the exact calls the agent makes, through
pynvml's real marshalling, on whatever lies beneath (the driver, or the simulated fleet in CI). The tier
methods are private to the sampler; the test suite runs this module so a rename there fails loudly.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from collections import defaultdict
from collections.abc import Iterator

import pynvml

from gpuwatch.agent.nvml import FAST_FIELD_VALUES, GPM_MIN_SPACING_S, SLOW_FIELD_VALUES, NvmlSampler
from stats import percentiles_us

TIERS = ("fast", "gpm", "slow")


class TimedSampler(NvmlSampler):
    """NvmlSampler whose tiers record their NVML calls' latencies (ns) into ``calls`` and ``tiers``."""

    def __init__(self) -> None:
        super().__init__(slow_interval=0.0)  # the slow tier runs every tick, so it gets as many samples
        self.tier: str | None = None
        self.calls: dict[str, dict[str, list[int]]] = {t: defaultdict(list) for t in TIERS}
        self.tiers: dict[str, list[int]] = {t: [] for t in TIERS}  # whole tier, one GPU, one tick

    def _timed_tier(self, tier: str, method, *args):
        self.tier = tier
        start = time.perf_counter_ns()
        try:
            return method(*args)
        finally:
            self.tiers[tier].append(time.perf_counter_ns() - start)
            self.tier = None

    def _fast(self, dev, out):
        return self._timed_tier("fast", super()._fast, dev, out)

    def _gpm(self, dev, now, out):
        before = dev.gpm_last_s
        result = self._timed_tier("gpm", super()._gpm, dev, now, out)
        if dev.gpm_last_s == before:  # spacing not reached: no NVML call was made, not a GPM sample
            self.tiers["gpm"].pop()
        return result

    def _slow(self, dev, out):
        return self._timed_tier("slow", super()._slow, dev, out)

    def record_call(self, name: str, elapsed_ns: int) -> None:
        if self.tier is not None:
            self.calls[self.tier][name].append(elapsed_ns)


@contextlib.contextmanager
def timing_pynvml(sampler: TimedSampler) -> Iterator[None]:
    """Wrap every pynvml.nvml* function so the outermost call's latency reaches ``sampler``; restore after."""
    originals = {name: fn for name, fn in vars(pynvml).items() if name.startswith("nvml") and inspect.isfunction(fn)}
    depth = [0]

    def wrap(name, fn):
        def timed(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    sampler.record_call(name, time.perf_counter_ns() - start)
        return timed

    for name, fn in originals.items():
        setattr(pynvml, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(pynvml, name, fn)


def measure_latency(ticks: int, spacing_s: float = GPM_MIN_SPACING_S * 1.2) -> dict:
    """Sample every GPU ``ticks`` times, ``spacing_s`` apart (GPM needs >= 100 ms), and summarise.

    Returns per tier: every NVML call pooled (count, median, p99 in µs), the whole tier per GPU per tick,
    and per NVML function; plus the GPU count and what was unsupported (events)."""
    sampler = TimedSampler()
    unsupported: set[str] = set()
    with timing_pynvml(sampler):
        devices = sampler.open()
        try:
            for _ in range(ticks):
                started = time.monotonic()  # each tick at least spacing_s after the last, even when one ran late
                tick = sampler.sample()
                unsupported.update(e.attrs.get("nvml", "") for e in tick.events if e.kind == "field_unsupported")
                time.sleep(max(0.0, started + spacing_s - time.monotonic()))
        finally:
            sampler.close()
    result = {"gpus": len(devices), "ticks": ticks, "spacing_s": spacing_s, "tiers": {},
              "unsupported_calls": sorted(unsupported)}
    for tier in TIERS:
        pooled = [ns for samples in sampler.calls[tier].values() for ns in samples]
        result["tiers"][tier] = {
            "per_call": percentiles_us(pooled),
            "per_gpu_tick": percentiles_us(sampler.tiers[tier]),
            "per_function": {name: percentiles_us(samples) for name, samples in sorted(sampler.calls[tier].items())},
        }
    return result


def measure_field_latency(ticks: int) -> dict:
    """Each field of the fast and slow tiers read alone, ``ticks`` times per GPU: which field makes the batched
    ``nvmlDeviceGetFieldValues`` call slow, so it can be split off or moved to a slower tier.

    Returns per field (the gpuwatch name): its tier, the NVML return code of the first read, and the latency
    of one single-field call (count, median, p99 in µs, pooled over GPUs); and the batched call per tier."""
    specs = [("fast", spec) for spec in FAST_FIELD_VALUES] + [("slow", spec) for spec in SLOW_FIELD_VALUES]
    alone: dict[str, list[int]] = defaultdict(list)
    batched: dict[str, list[int]] = defaultdict(list)
    codes: dict[str, int] = {}
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for _ in range(ticks):
            for handle in handles:
                for tier, group in (("fast", FAST_FIELD_VALUES), ("slow", SLOW_FIELD_VALUES)):
                    ids = [fid if scope is None else (fid, scope) for fid, scope, _, _ in group]
                    start = time.perf_counter_ns()
                    with contextlib.suppress(pynvml.NVMLError):
                        pynvml.nvmlDeviceGetFieldValues(handle, ids)
                    batched[tier].append(time.perf_counter_ns() - start)
                for _tier, (fid, scope, name, _scale) in specs:
                    start = time.perf_counter_ns()
                    try:
                        code = int(pynvml.nvmlDeviceGetFieldValues(
                            handle, [fid if scope is None else (fid, scope)])[0].nvmlReturn)
                    except pynvml.NVMLError as error:  # the whole call refused (a driver may answer so)
                        code = int(error.value)
                    alone[name].append(time.perf_counter_ns() - start)
                    codes.setdefault(name, code)
    finally:
        pynvml.nvmlShutdown()
    return {
        "ticks": ticks, "gpus": len(handles),
        "batched": {tier: percentiles_us(samples) for tier, samples in batched.items()},
        "fields": {name: {"tier": tier, "nvml_return": codes.get(name), **percentiles_us(alone[name])}
                   for tier, (_fid, _scope, name, _scale) in specs},
    }
