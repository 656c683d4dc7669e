"""Collective timing without code in the training job: NCCL's inspector profiler plugin's dump files as spans.

NCCL >= 2.23 loads the inspector (``NCCL_PROFILER_PLUGIN=.../libnccl-profiler-inspector.so``,
``NCCL_INSPECTOR_ENABLE=1``; source in NVIDIA/nccl ``ext-profiler/inspector``, later ``plugins/profiler/inspector``).
Each training process appends one JSON object per line to ``<NCCL_INSPECTOR_DUMP_DIR>/<hostname>-pid<pid>.log``,
one per completed collective (``coll_perf``) or point-to-point op (``p2p_perf``) of each communicator::

    {"header": {"id": "0x7f8c496ae9f661", "comm_name": "...", "rank": 2, "n_ranks": 8, "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "dump_timestamp_us": 1748030377748202,
                  "hostname": "...", "pid": 1639453, ...},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                   "coll_exec_time_us": 61974, "coll_timing_source": "kernel_gpu", ...,
                   "event_trace_ts": {"coll_start_ts": ..., "kernel_events": [{"kernel_start_ts": ...}, ...]}}}

:class:`InspectorReader` tails every such file under the directory and turns new records into span rows
(kind ``collective`` or ``p2p``, process group the communicator id, seq its ``coll_sn``/``p2p_sn``), which the
agent sends like a probe's. A record's start is its first kernel's start when the dump is verbose
(``NCCL_INSPECTOR_DUMP_VERBOSE=1``, ``event_trace_ts``), else its dump time minus its execution time: exact
only with a short ``NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS`` (the default dumps at teardown only).
The job and global rank come from the writing process's environment (its pid, as for GPU processes), the
communicator's own rank where the process is gone or names no job. Lines that are not such records are
counted in ``malformed`` and skipped; a line still being written waits for its newline.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuwatch.agent.jobs import JobInfo, job_from_environ, read_proc_environ
from gpuwatch.core.spans import SPAN_COLUMN_NAMES, SPAN_UNSET
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

#: NCCL's function names -> the probe's op names
OP_NAMES = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
            "Broadcast": "broadcast", "Reduce": "reduce", "AllToAll": "all_to_all", "Send": "send", "Recv": "recv"}
_SLURM_DIR = re.compile(r"nccl-inspector-(?!unknown-jobid$)(.+)$")  # the plugin's default directory name
MAX_READ_BYTES = 16 * 2**20  # per file and drain, so one huge backlog cannot stall a tick


class InspectorReader:
    """Reads new inspector records under ``directory`` on each :meth:`drain`; ``environ`` reads a process's
    environment by pid (the job and rank), ``job_label`` as the agent's."""

    def __init__(self, directory: str | Path, environ: Callable[[int], Mapping[str, str] | None] = read_proc_environ,
                 job_label: str = "") -> None:
        self.directory = Path(directory)
        self.environ, self.job_label = environ, job_label
        self.malformed = 0
        self._offsets: dict[Path, int] = {}
        self._jobs: dict[int, JobInfo] = {}

    def drain(self) -> pb.SpanTable:
        """Span rows of every complete record written since the last call."""
        rows: dict[str, list[Any]] = {name: [] for name in SPAN_COLUMN_NAMES}
        for path in sorted(self.directory.rglob("*.log")) if self.directory.is_dir() else []:
            for line in self._new_lines(path):
                try:
                    row = self._row(json.loads(line), path)
                except (ValueError, KeyError, TypeError) as exc:
                    self.malformed += 1
                    if self.malformed == 1:
                        log.warning("NCCL inspector file %s: skipped a line that is not an inspector record (%s)",
                                    path, exc)
                    continue
                if row is not None:
                    for name in SPAN_COLUMN_NAMES:
                        rows[name].append(row.get(name, SPAN_UNSET[name]))
        return pb.SpanTable(**rows)

    def _new_lines(self, path: Path) -> list[bytes]:
        """Complete lines past the file's offset (from the start again if the file was truncated or replaced)."""
        try:
            size = path.stat().st_size
            offset = self._offsets.get(path, 0)
            if size < offset:
                offset = 0
            if size == offset:
                return []
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(min(size - offset, MAX_READ_BYTES))
        except OSError as exc:
            log.warning("NCCL inspector file %s: cannot read it: %s", path, exc)
            return []
        end = chunk.rfind(b"\n") + 1
        self._offsets[path] = offset + end
        return [line for line in chunk[:end].splitlines() if line.strip()]

    def _row(self, record: dict[str, Any], path: Path) -> dict[str, Any] | None:
        header, meta = record["header"], record["metadata"]
        if "coll_perf" in record:
            perf, prefix, kind = record["coll_perf"], "coll", "collective"
        elif "p2p_perf" in record:
            perf, prefix, kind = record["p2p_perf"], "p2p", "p2p"
        else:
            raise KeyError("coll_perf or p2p_perf")
        dur = float(perf[f"{prefix}_exec_time_us"])
        start = _start_us(perf.get("event_trace_ts") or {}, prefix)
        if start is None:
            start = float(meta["dump_timestamp_us"]) - dur
        job = self._job(int(meta["pid"]))
        return {"job_id": job.job_id or _job_from_dir(path), "rank": job.rank if job.rank >= 0 else int(header["rank"]),
                "kind": kind, "name": OP_NAMES.get(perf[prefix], str(perf[prefix]).lower()), "start_us": start,
                "dur_us": dur, "process_group": str(header["id"]), "seq": int(perf[f"{prefix}_sn"]),
                "bytes": int(perf[f"{prefix}_msg_size_bytes"]),
                "peer": int(perf["p2p_peer"]) if kind == "p2p" else -1}

    def _job(self, pid: int) -> JobInfo:
        """The job of a writing process, read once (the file outlives the process: its last answer is kept)."""
        if pid not in self._jobs:
            self._jobs[pid] = job_from_environ(self.environ(pid) or {}, self.job_label)
        return self._jobs[pid]


def _start_us(trace: Mapping[str, Any], prefix: str) -> float | None:
    """A verbose record's start: its first kernel's start, else the op's start callback; None when not verbose."""
    kernels = [k["kernel_start_ts"] for k in trace.get("kernel_events", ()) if k.get("kernel_start_ts")]
    if kernels:
        return float(min(kernels))
    start = trace.get(f"{prefix}_start_ts")
    return float(start) if start else None


def _job_from_dir(path: Path) -> str:
    """The SLURM job id of the plugin's default directory name (``nccl-inspector-<jobid>``), else ""."""
    for part in reversed(path.parent.parts):
        match = _SLURM_DIR.match(part)
        if match:
            return match.group(1)
    return ""
