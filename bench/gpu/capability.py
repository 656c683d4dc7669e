"""Point 2 of the validation: the XID thread on a healthy GPU, `agent --check --json`, MIG and permissions.

* ``xid_idle``: the agent's own :class:`~gpuwatch.agent.xid.XidWatcher` waits on the GPUs' NVML event set
  (and reads ``/dev/kmsg`` where readable) for a while. On a healthy GPU it must see no events and must not
  spin: every ``nvmlEventSetWait`` is counted (each should block for the full wait) and each watcher
  thread's CPU time is read from ``/proc/self/task/TID/stat``.
* ``agent_check``: ``gpuwatch agent --check --json`` as the agent would run it, record-only so no
  collector is needed; as root it is run a second time as user ``nobody`` to show what an unprivileged
  agent loses (GPM and some fields may need privileges).
* ``mig_state``: MIG mode per GPU, read only (the card's settings are never changed).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pynvml

from gpuwatch.agent.nvml import NvmlSampler
from gpuwatch.agent.xid import XidWatcher

NOBODY = 65534
CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process (Linux /proc)."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of stat)


@contextlib.contextmanager
def _counting_event_waits(counts: dict) -> object:
    """Count pynvml.nvmlEventSetWait calls and their timeouts while the watcher runs; restore after."""
    original = pynvml.nvmlEventSetWait
    lock = threading.Lock()

    def counted(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except pynvml.NVMLError_Timeout:
            with lock:
                counts["timeouts"] += 1
            raise
        finally:
            with lock:
                counts["calls"] += 1

    pynvml.nvmlEventSetWait = counted
    try:
        yield
    finally:
        pynvml.nvmlEventSetWait = original


def xid_idle(seconds: float, kmsg_path: str | None = "/dev/kmsg", wait_ms: int = 1000) -> dict:
    """Run the XID watcher for ``seconds`` on the node's GPUs (real, or the simulated fleet installed)."""
    sampler = NvmlSampler()
    devices = sampler.open()
    events: list = []
    counts = {"calls": 0, "timeouts": 0}
    try:
        with _counting_event_waits(counts):
            watcher = XidWatcher(devices, events.append, kmsg_path=kmsg_path, wait_ms=wait_ms)
            watcher.start()
            threads = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("gpuwatch-xid")}
            cpu0 = {name: thread_cpu_s(tid) for name, tid in threads.items()}
            wall0 = time.monotonic()
            time.sleep(seconds)
            cpu1 = {name: thread_cpu_s(tid) for name, tid in threads.items()}
            wall = time.monotonic() - wall0
            watcher.stop()
    finally:
        sampler.close()
    waits_per_s = counts["calls"] / wall
    result = {
        "seconds": wall, "wait_ms": wait_ms, "gpus": len(devices), "threads": sorted(threads),
        "events": [{"kind": e.kind, "gpu": e.gpu_index, "code": e.code, "message": e.message} for e in events],
        "event_waits": counts["calls"], "event_wait_timeouts": counts["timeouts"], "event_waits_per_s": waits_per_s,
        "thread_cpu_pct_of_core": {name: 100 * (cpu1[name] - cpu0[name]) / wall for name in threads},
    }
    nvml_thread = "gpuwatch-xid-nvml" in threads
    result["checks"] = [
        {"name": "NVML event thread running", "ok": nvml_thread,
         "detail": "registered" if nvml_thread else "no GPU accepted event registration (XIDs from kmsg only)"},
        {"name": "no events on a healthy GPU", "ok": not events, "detail": f"{len(events)} events"},
        # a blocking wait returns about once per wait_ms; a busy loop returns far more often
        {"name": "event wait blocks (no busy loop)", "ok": nvml_thread and waits_per_s <= 2.0 * 1000 / wait_ms,
         "detail": f"{counts['calls']} waits in {wall:.1f} s ({counts['timeouts']} timeouts)"},
    ]
    return result


def agent_check(simulate: int | None, as_nobody: bool = False, timeout_s: float = 60.0) -> dict:
    """`gpuwatch agent --check --json`, record-only (no collector needed); optionally as user nobody."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-check-") as tmp:
        os.chmod(tmp, 0o777)  # nobody must be able to create the recording directory in it
        cmd = [sys.executable, "-m", "gpuwatch", "agent", "--check", "--json", "--record", f"{tmp}/rec",
               "--no-probe-socket"] + (["--simulate", str(simulate)] if simulate else [])
        kwargs = {}
        if as_nobody:
            kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": [],
                      "env": {**os.environ, "HOME": tmp, "XDG_RUNTIME_DIR": tmp}}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kwargs)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(cmd[1:]), "exit_code": None, "error": f"no answer within {timeout_s:g} s"}
        except (OSError, subprocess.SubprocessError) as exc:  # e.g. nobody may not execute this python
            return {"command": " ".join(cmd[1:]), "exit_code": None, "error": f"{type(exc).__name__}: {exc}"}
    result = {"command": " ".join(cmd[1:]), "as": "nobody" if as_nobody else f"uid {os.geteuid()}",
              "exit_code": done.returncode, "stderr_tail": done.stderr[-1500:]}
    try:
        result["report"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["stdout_tail"] = done.stdout[-1500:]
    return result


def permission_difference(root: dict, nobody: dict) -> dict:
    """Fields the privileged check reported per GPU that the unprivileged one did not, and vice versa."""
    def fields(check: dict) -> dict[int, set[str]]:
        return {g["index"]: set(g["fields"]) for g in (check.get("report") or {}).get("gpus", [])}

    mine, theirs = fields(root), fields(nobody)
    return {str(i): {"only_privileged": sorted(mine[i] - theirs.get(i, set())),
                     "only_unprivileged": sorted(theirs.get(i, set()) - mine[i])} for i in mine}


def mig_state() -> list[dict]:
    """MIG mode of every GPU (current, pending) and its MIG devices, or why it cannot be read."""
    pynvml.nvmlInit()
    try:
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            entry: dict = {"gpu": index}
            try:
                current, pending = pynvml.nvmlDeviceGetMigMode(handle)
                entry.update(current=int(current), pending=int(pending))
                if current == pynvml.NVML_DEVICE_MIG_ENABLE:
                    entry["mig_devices"] = _mig_devices(handle)
            except pynvml.NVMLError as exc:
                entry["error"] = str(exc)
            out.append(entry)
        return out
    finally:
        pynvml.nvmlShutdown()


def _mig_devices(handle) -> list[str]:
    names = []
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            names.append(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))
        except pynvml.NVMLError:
            continue
    return names


def _attempt(function, *args, **kwargs):
    """function(...), or {"error": ...} when it raises: one part failing must not lose the others."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def run(simulate: int | None, xid_seconds: float) -> dict:
    """All of point 2 that this machine reaches; what it cannot reach is said, not skipped silently."""
    result: dict = {"xid": _attempt(xid_idle, xid_seconds, kmsg_path=None if simulate else "/dev/kmsg")}
    result["check"] = agent_check(simulate)
    result["mig"] = _attempt(mig_state)
    privileged = os.geteuid() == 0 and not simulate
    if privileged:
        result["check_as_nobody"] = agent_check(simulate, as_nobody=True)
        result["permission_difference"] = permission_difference(result["check"], result["check_as_nobody"])
    else:
        result["check_as_nobody"] = {"skipped": "not root" if os.geteuid() else "simulated GPUs have no permissions"}
    report = result["check"].get("report") or {}
    xid_checks = result["xid"].get("checks") or [{"name": "XID watcher ran", "ok": False,
                                                  "detail": result["xid"].get("error", "")}]
    result["checks"] = xid_checks + [
        {"name": "agent --check --json passes", "ok": result["check"].get("exit_code") == 0 and bool(report.get("ok")),
         "detail": f"exit {result['check'].get('exit_code')}, "
                   + ", ".join(f"{c['name']}: {'ok' if c['ok'] else 'FAIL'}" for c in report.get("checks", []))},
    ]
    return result
