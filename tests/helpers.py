"""Helpers shared by the test files (no tests here): waiting with a deadline, free ports, a collector
process, test batches and simulated telemetry. Fixtures live in conftest.py."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pty
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import numpy as np
import pandas as pd
import pytest

from gpuwatch.core.batches import BatchBuilder
from gpuwatch.core.fields import GPU_FIELD_NAMES
from gpuwatch.core.batch_tables import frames_batches, inventory_table
from gpuwatch.core.recording import RecordingWriter, ts_ms
from gpuwatch.v1 import telemetry_pb2 as pb

T = TypeVar("T")
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
PROMETHEUS = "/usr/bin/prometheus"
TOKEN = "s3cret-token"  # the bearer token of the security tests
T0 = 1_767_225_600_000  # 2026-01-01T00:00Z: where recorded and simulated test telemetry starts
MIN = 60_000
#: The real Kineto traces of the shared test data: ../shared beside the repository, or where the project's
#: machines mount it (a clone elsewhere, as CI's, has no ../shared).
KINETO_DATA = next((path for path in (os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "kineto"),
                                      "/work/shared/data/kineto") if os.path.isdir(path)), "/work/shared/data/kineto")
#: Two ranks of a real 128-rank Kineto trace (shared test data).
KINETO_SAMPLED = os.path.join(KINETO_DATA, "sampled_2ranks_of128")


# ------------------------------------------------------------------------------------------ waiting
def poll(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """Call ``predicate`` until it returns something truthy and return that; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: its wait() is the pause between polls
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        pause.wait(every)


def get_json(url: str) -> Any:
    """The JSON document at an http:// URL."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def alertmanager_alerts(url: str, alertname: str, active: bool = True) -> list[dict]:
    """The alerts named ``alertname`` that the Alertmanager at ``url`` holds (active, or else resolved)."""
    alerts = get_json(f"{url}/api/v2/alerts?active={str(active).lower()}")
    return [a for a in alerts if a["labels"].get("alertname") == alertname]


STORE_KINDS = ("duckdb", "chdb")  # the store engines the store and end-to-end tests run against


def store_url(kind: str, folder: Path, name: str = "store") -> str:
    """A --store URL of engine ``kind`` in ``folder``: a DuckDB file, or a chdb (in-process ClickHouse) directory."""
    return str(folder / f"{name}.duckdb") if kind == "duckdb" else f"chdb://{folder / (name + '-chdb')}"


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for servers that must know their port up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_alertmanager(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A real Alertmanager on a free loopback port with its files under ``workdir``: (process, base URL)."""
    if not shutil.which(ALERTMANAGER):
        pytest.skip(f"{ALERTMANAGER} is not installed (Debian package prometheus-alertmanager)")
    config = workdir / "alertmanager.yml"
    config.write_text("route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n")
    port = free_port()
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", f"--storage.path={workdir / 'data'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"alertmanager exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            return get_json(url + "/api/v2/status")
        except OSError:
            return None

    poll(ready, 20, "alertmanager to start")
    return proc, url


def run_on_terminal(*argv: str, timeout: float = 300.0) -> tuple[int, str, str]:
    """Run ``gpuwatch *argv`` with stderr on a pseudo-terminal (where progress lines draw); return the exit
    status, stdout and everything the terminal showed."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", *argv], stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        shown = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed its end
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        out = proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
        return proc.returncode, out.decode(), shown.decode(errors="replace")
    finally:
        os.close(master)


# ----------------------------------------------------------------------------- in-process collector
def serving(store: str, *, query_handlers: Mapping[str, Any] | None = None, **changes: Any) -> Iterator[Any]:
    """A collector in this process over ``store`` (:func:`~gpuwatch.core.settings.local_collector` settings
    with ``changes``) for a fixture to ``yield from``; stopped when the fixture ends. conftest's ``channel``
    fixture connects to the module's ``collector`` fixture made this way."""
    from gpuwatch.collector.server import serve
    from gpuwatch.core.settings import local_collector

    server = serve(local_collector(store, **changes), query_handlers=query_handlers)
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------------- collector process
class CollectorProcess:
    """`gpuwatch collector` as a child process on loopback (port 0: a free one), restartable on the same
    port and store; its stderr goes to ``<db>.stderr`` and is shown when it fails to start. ``db`` is a
    DuckDB file (``--db``) or a ``chdb://`` store URL (``--store``)."""

    def __init__(self, db: str | Path, port: int = 0) -> None:
        self.db, self.port = str(db), port
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def _chdb_dir(self) -> str | None:
        return self.db.removeprefix("chdb://") if self.db.startswith("chdb://") else None

    def start(self, timeout_s: float = 60.0, *extra: str) -> CollectorProcess:
        stderr_path = Path(f"{self._chdb_dir or self.db}.stderr")
        # ClickHouse drops rows past the TTL at insert: test batches carry 2023 times, so no TTL there
        store = ["--store", self.db, "--retention-days", "0"] if self._chdb_dir else ["--db", self.db]
        with stderr_path.open("a") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuwatch", "collector", "--listen", self.address, *store,
                 "--log-level", "warning", *extra], stdout=subprocess.PIPE, stderr=stderr, text=True)
        with selectors.DefaultSelector() as waiting:  # poll, not select(): the suite may hold over 1,024 fds
            waiting.register(self.proc.stdout, selectors.EVENT_READ)
            ready = waiting.select(timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on " not in line:
            self.proc.kill()
            raise AssertionError(f"collector did not start: {line!r}, stderr: {stderr_path.read_text()[-2000:]}")
        self.port = int(line.split("listening on ", 1)[1].split(",", 1)[0].rpartition(":")[2])
        return self

    def kill(self) -> int:
        """SIGKILL: no chance to commit what is queued."""
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM: commit what is queued and exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(60) == 0

    def rows(self, sql: str) -> list[tuple]:
        """Query the store after stop() (DuckDB lets one process write or several read). ClickHouse is read as
        the collector reads it, with ``final`` (rows of one key stored twice count once: see store/clickhouse.py)."""
        if self._chdb_dir:
            import clickhouse_connect

            client = clickhouse_connect.get_client(dsn=self.db, database="gpuwatch", settings={"final": 1})
            try:
                return [tuple(r) for r in client.query(sql).result_rows]
            finally:
                client.close()
        con = duckdb.connect(self.db, read_only=True)
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()


# ------------------------------------------------------------------------------------ test batches
T0_MS = 1_700_000_000_000
GPUS = 2
TICKS = 3
ROWS_PER_BATCH = GPUS * TICKS


def make_batch(seq: int, agent: str = "agent-1", node: str = "node-1", t0_ms: int = T0_MS) -> pb.TelemetryBatch:
    """GPUS x TICKS GPU rows (power varies, memory temperature only on the first tick), one host row, one event."""
    builder = BatchBuilder(pb.NodeIdentity(node=node), agent,
                           [pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="H100") for i in range(GPUS)])
    for tick in range(TICKS):
        ts = t0_ms + 1000 * (seq * TICKS + tick)
        for gpu in range(GPUS):
            values = {"gpu_power_watts": 100.0 * gpu + seq + tick / 10, "gpu_utilization_ratio": 0.5}
            if tick == 0:
                values["gpu_memory_temperature_celsius"] = 60.0 + seq
            builder.add_gpu_row(gpu, ts, values, job_id="job-7" if gpu == 1 else "", rank=gpu if gpu == 1 else -1)
    builder.add_host_row(t0_ms + 1000 * seq * TICKS, {"host_load1": 1.5})
    builder.add_event("xid", t0_ms + 1000 * seq * TICKS, gpu_index=1, code=79, message="GPU fell off the bus",
                      attrs={"seq": str(seq)})
    return builder.build(seq)


# ------------------------------------------------------------------------------ simulated telemetry
def sim_batches(gpu: pd.DataFrame, events: pd.DataFrame, agent: str = "agent-sim") -> list[pb.TelemetryBatch]:
    """The batches an agent of the simulated node in ``gpu``/``events`` (recording tables) would send; its
    GPUs are named GPU-<node>-<index>."""
    node = str(gpu["node"].iloc[0])
    inventory = inventory_table(node, [pb.GpuInfo(index=int(i), uuid=f"GPU-{node}-{int(i)}",
                                                  name="NVIDIA H100 80GB HBM3")
                                       for i in sorted(gpu["gpu_index"].unique())])
    return [tb.batch for tb in frames_batches(node, agent, gpu_samples=gpu, events=events, gpus=inventory)]


def degrading_node(start_ms: int, hours: float, fault_after_h: float, failing_gpu: int = 1, gpus: int = 4,
                   node: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(gpu_samples, events) of one simulated node (models.failsim, 1-minute ticks, one job throughout) whose
    GPU ``failing_gpu`` has HBM degrading for 8 h before it faults at ``fault_after_h``; the rest stay healthy."""
    from gpuwatch.simulator import failing_fleet as failsim

    cfg = failsim.FleetConfig(nodes=1, gpus_per_node=gpus, days=hours / 24, seed=3, start_ms=start_ms)
    ts = np.arange(start_ms + 60_000, start_ms + int(hours * failsim.HOUR_MS) + 1, 60_000, dtype=np.int64)
    fault = start_ms + int(fault_after_h * failsim.HOUR_MS)
    plan = failsim.FaultPlan(failsim.node_name(node), failing_gpu, "memory", fault - 8 * failsim.HOUR_MS, fault,
                             fault + 4 * failsim.HOUR_MS, 48, seed=7)
    gpu, _host, events = failsim.simulate_node(cfg, node, ts, np.full(len(ts), 5), np.full(len(ts), 0.9), [plan],
                                               np.random.default_rng(1))
    return gpu, events


# ---------------------------------------------------------------------------- model test frames
def event_rows(*rows: tuple[str, int, int, str, int]) -> pd.DataFrame:
    """An events table from (node, gpu_index, ts_ms, kind, code) rows."""
    return pd.DataFrame([{"node": n, "gpu_index": g, "ts": pd.Timestamp(t, unit="ms", tz="UTC"), "kind": k,
                          "code": c, "message": "", "attrs": "{}"} for n, g, t, k, c in rows],
                        columns=["node", "gpu_index", "ts", "kind", "code", "message", "attrs"])


def minute_samples(node: str, gpu: int, minutes: int, **series: Any) -> pd.DataFrame:
    """``minutes`` one-minute gpu_samples rows from T0: every field 0 (PCIe link x16 of x16) except ``series``
    (field name -> values)."""
    df = pd.DataFrame({"node": node, "gpu_index": gpu,
                       "ts": pd.to_datetime(T0 + MIN * np.arange(minutes), unit="ms", utc=True),
                       "job_id": "", "rank": -1, "local_rank": -1})
    for f in GPU_FIELD_NAMES:
        df[f] = 0.0
    df["gpu_pcie_link_width"] = df["gpu_pcie_link_width_max"] = 16.0
    for name, values in series.items():
        df[name] = values
    return df


# --------------------------------------------------------------------------------- recordings
def sorted_samples(df: pd.DataFrame) -> pd.DataFrame:
    """gpu_samples rows (from a recording or a store) in one comparable shape: ts as epoch ms, NULL job/rank
    as ""/-1, sorted by node, GPU and time."""
    df = df.assign(ts=ts_ms(df["ts"]), job_id=df["job_id"].fillna(""), rank=df["rank"].fillna(-1).astype(int))
    return df[["node", "gpu_index", "ts", "job_id", "rank", *GPU_FIELD_NAMES]].sort_values(
        ["node", "gpu_index", "ts"]).reset_index(drop=True)


def write_small_recording(path: str | Path, spans: pd.DataFrame | None = None) -> None:
    """Node n1: 2 GPUs x 5 ticks 1 s apart from T0; GPU power never sampled, temperature only on even
    ticks; one XID at tick 3."""
    rows = []
    for t in range(5):
        for g in range(2):
            rows.append({"node": "n1", "gpu_index": g, "ts": T0 + t * 1000, "gpu_utilization_ratio": 0.1 * t,
                         "gpu_temperature_celsius": 40.0 + t if t % 2 == 0 else np.nan,
                         "job_id": "j1" if g == 0 else "", "rank": 0 if g == 0 else -1})
    with RecordingWriter(path, source="test", resolution_s=1.0) as w:
        w.append("gpu_samples", pd.DataFrame(rows))
        w.append("events", pd.DataFrame([{"node": "n1", "gpu_index": 1, "ts": T0 + 3000, "kind": "xid",
                                          "code": 79, "attrs": {"pid": "42"}}]))
        w.append("gpus", inventory_table("n1", [pb.GpuInfo(index=g, uuid=f"GPU-{g}", name="H100",
                                                           memory_total_bytes=80 << 30, architecture="hopper",
                                                           gpm_supported=True) for g in range(2)]))
        if spans is not None:
            w.append("spans", spans)


def two_rank_spans() -> pd.DataFrame:
    """Job J on node n1, 2 ranks x 3 10-ms steps, one all_reduce per step that rank 1 reaches 2 ms late;
    rank 1's collectives have no node."""
    rows = []
    for rank in (0, 1):
        for step in range(3):
            t0 = T0 * 1000.0 + step * 10_000
            late = 2_000.0 * rank
            rows.append(("J", rank, step, "step", "", t0, 10_000.0, "", -1, -1, 2, "n1", -1))
            rows.append(("J", rank, step, "collective", "all_reduce", t0 + 6_000 + late, 3_000.0 - late, "pg0", step,
                         1 << 20, 2, "n1" if rank == 0 else "", -1))
    return pd.DataFrame(rows, columns=["job_id", "rank", "step", "kind", "name", "start_us", "dur_us",
                                       "process_group", "seq", "bytes", "world_size", "node", "peer"])


# ----------------------------------------------------------------------------------- job spans
SPAN_FIELDS = tuple(pb.SpanTable.DESCRIPTOR.fields_by_name)
WORLD = 4
STEP_US = 100_000.0


def span_row(job: str, rank: int, step: int, kind: str, name: str, start: float, dur: float, seq: int = -1) -> tuple:
    """One span row (SPAN_FIELDS order) of rank ``rank`` of a WORLD-rank job, two ranks per node."""
    return (job, rank, step, kind, name, float(start), float(dur), "0" if kind == "collective" else "", seq,
            1024 if kind == "collective" else -1, WORLD, f"node-{rank // 2}", -1)


def data_parallel_job(job: str, end_us: float, steps: int = 20, slow_rank: int | None = None,
                      seed: int = 0) -> list[tuple]:
    """Span rows (SPAN_FIELDS order) of a 4-rank job: per step a 100 ms step span and one all_reduce;
    ``slow_rank`` computes 30 ms longer, so it arrives last and the others wait for it. Without one,
    arrivals jitter at random."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(steps):
        t = end_us - (steps - s) * STEP_US
        arrivals = 50_000 + rng.uniform(0, 2_000, WORLD)
        if slow_rank is not None:
            arrivals[slow_rank] += 30_000
        done = t + arrivals.max() + 5_000
        for rank in range(WORLD):
            rows.append(span_row(job, rank, s, "step", "step", t, STEP_US))
            rows.append(span_row(job, rank, s, "collective", "all_reduce", t + arrivals[rank],
                              done - t - arrivals[rank], seq=s))
    return rows


def write_spans(store: Any, rows: list[tuple], seq: int, agent: str = "agent-spans") -> None:
    """Span rows (SPAN_FIELDS order) into ``store`` as one batch of node-0."""
    builder = BatchBuilder(pb.NodeIdentity(node="node-0"), agent)
    columns = list(zip(*rows))
    builder.add_spans(pb.SpanTable(**{name: list(values) for name, values in zip(SPAN_FIELDS, columns)}))
    store.write(builder.build(seq))


# ------------------------------------------------------------------------------------ full disks
@contextlib.contextmanager
def running_simulated_agent(cfg: Any, gpus: int, **node: Any):
    """The agent of ``cfg`` on ``gpus`` simulated GPUs (a SimulatedNode named cfg.node, ``node`` its other
    arguments, installed beneath pynvml meanwhile) running in a thread; yields (agent, fleet), then stops it."""
    from gpuwatch.apps.agent_cli import simulated_agent
    from gpuwatch.simulator.node import SimulatedNode

    with SimulatedNode(gpus, node=cfg.node, **node) as sim:
        agent = simulated_agent(cfg, sim)
        runner = threading.Thread(target=agent.run)
        runner.start()
        try:
            yield agent, sim.fleet
        finally:
            agent.stop()
            runner.join(60)
    assert not runner.is_alive(), "the agent did not stop within 60 s"


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "4m"):
    """A real, small tmpfs mounted at ``path`` for filling up and freeing (needs root: skipped elsewhere)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(directory: Path) -> Path:
    """Write zeros into ``directory``/filler until its filesystem is full; return the filler (delete it to free)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler
