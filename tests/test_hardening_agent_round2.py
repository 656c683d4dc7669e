"""The agent and its recordings when things go wrong: drops on a full
spool disk that survive a restart, one disk-full warning per episode, token files readable by others, a
plaintext entry in a collector list, an agent whose every batch was refused, a recording agent killed
mid-run, and recordings with parts missing or empty."""
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pandas as pd
import pytest

from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.agent.spool import Spool, SpoolFull
from gpuwatch.agent.uplink import Uplink, make_channel
from gpuwatch.apps.agent_cli import simulated_agent
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import RecordingWriter, open_recording
from gpuwatch.core.security import read_token
from gpuwatch.core.settings import ClientSecurity
from gpuwatch.simulator.collector_sink import IngestSink
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import T0_MS, fill_disk, poll, small_filesystem


def _batch(spool: Spool, seq: int, payload: int = 0) -> bytes:
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), spool.agent_id, [pb.GpuInfo(index=0)])
    builder.add_gpu_row(0, T0_MS + 1000 * seq, {"gpu_power_watts": float(seq)})
    if payload:
        builder.add_event("agent_start", T0_MS, message="x" * payload)
    return builder.build(seq).SerializeToString()


def _spool_one(spool: Spool, payload: int = 0) -> int | None:
    """Number and spool one batch; None when the full disk dropped it."""
    try:
        seq = spool.next_sequence()
        spool.append(seq, _batch(spool, seq, payload))
    except SpoolFull:
        return None
    return seq


# ---- point 8: drops and sequences on a 100 % full disk survive a restart before space returns ----------
def test_drops_and_sequences_on_a_full_disk_survive_a_restart_while_it_stays_full(tmp_path):
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk / "spool")
        used = [_spool_one(spool) for _ in range(3)]
        for seq in used:
            spool.ack(seq)  # all delivered: nothing is left to drop when the disk fills
        fill_disk(disk)
        assert [_spool_one(spool) for _ in range(60)] == [None] * 60
        again = Spool(disk / "spool")  # the agent restarts; the disk is still 100 % full
        dropped = again.take_dropped()
        assert dropped.total_batches == dropped.batches == 60
        assert again.next_sequence() > 3 + 60  # the dropped batches' numbers are a gap, never reused


# ---- point 9: one warning when the disk fills, one line when it has room again -----------------------------
def test_a_full_disk_warns_once_per_episode_not_once_per_batch(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gpuwatch.agent.spool")
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk / "spool")
        for _ in range(3):
            _spool_one(spool, payload=20_000)
        filler = fill_disk(disk)
        for _ in range(20):  # each new batch takes the oldest one's place
            _spool_one(spool, payload=20_000)
        assert spool.take_dropped().total_batches >= 20
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "disk is full" in lines[0], lines
        filler.unlink()
        for _ in range(3):
            assert _spool_one(spool, payload=20_000) is not None
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "room again" in lines[1], lines


# ---- point 10: a token file others may read is refused, as ssh refuses such a key ----------------------------
def _gpuwatch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_may_read_is_refused_by_agent_and_collector(tmp_path, mode):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    agent = _gpuwatch("agent", "--collector", "127.0.0.1:1", "--token-file", str(token), "--simulate", "1",
                      "--ticks", "1", "--spool", str(tmp_path / "spool"))
    collector = _gpuwatch("collector", "--db", str(tmp_path / "c.duckdb"), "--listen", "127.0.0.1:0",
                          "--token-file", str(token))
    for result in (agent, collector):
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert f"token file {token}: permissions {mode:04o} are too open" in result.stderr
        assert f"chmod 600 {token}" in result.stderr
    assert not (tmp_path / "c.duckdb").exists()


def test_a_private_token_file_and_a_root_owned_group_secret_are_accepted(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    assert read_token(token) == "s3cret"
    token.chmod(0o440)  # a Kubernetes secret mounted with fsGroup: owned by root, readable by our group
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(token).st_uid + 1)
    assert read_token(token) == "s3cret"
    token.chmod(0o444)  # but never one anybody may read
    with pytest.raises(UserError, match="permissions 0444 are too open"):
        read_token(token)


# ---- point 11: every collector of a list is checked at start; nothing ends the uplink thread ----------------
def test_a_plaintext_token_to_any_listed_collector_is_refused_at_start(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    with pytest.raises(UserError, match=r"refusing to send a bearer token to localhost\.:7700 without TLS"):
        Uplink(Spool(tmp_path / "spool"), "127.0.0.1:7700,localhost.:7700",
               channel_security=ClientSecurity(token_file=str(token)))
    agent = _gpuwatch("agent", "--collector", "127.0.0.1:7700,localhost.:7700", "--token-file", str(token),
                      "--simulate", "1", "--ticks", "1", "--spool", str(tmp_path / "spool"))
    assert agent.returncode == 2 and agent.stderr.count("\n") == 1, agent.stderr
    assert "localhost.:7700" in agent.stderr and "Traceback" not in agent.stderr


def test_an_error_at_a_fail_over_does_not_end_the_uplink_thread(tmp_path, sink):
    server, address = sink
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    opened = []

    def channel(target: str) -> grpc.Channel:
        opened.append(target)
        if target == "broken:1":
            raise RuntimeError("cannot build this channel")
        return make_channel(target, reconnect_max_s=0.2)

    spool = Spool(tmp_path / "spool")
    uplink = Uplink(spool, f"127.0.0.1:{dead.getsockname()[1]},broken:1,{address}", backoff_initial_s=0.01,
                    backoff_max_s=0.05, channel_factory=channel)
    uplink.start()
    try:
        for _ in range(3):
            _spool_one(spool)
        uplink.notify()
        assert uplink.wait_drained(60)
    finally:
        uplink.stop()
        dead.close()
    assert "broken:1" in opened and server.store.sequences(spool.agent_id) == [1, 2, 3]


# ---- point 14: --ticks exits non-zero when the collector refused what the agent made ------------------------
@pytest.mark.parametrize("refuse_all", [True, False])
def test_an_agent_whose_batches_were_refused_says_so_and_fails(tmp_path, refuse_all):
    sink = IngestSink(refuse=lambda b: "no batch is welcome" if refuse_all or b.sequence == 2 else None)
    port = sink.start()
    cfg = AgentConfig(collector=f"127.0.0.1:{port}", node="n1", interval=0.02, batch_interval=0.1,
                      spool=tmp_path / "spool", drain_timeout=60)
    try:
        with SimulatedNode(2, node="n1") as sim, pytest.raises(UserError) as refused:
            simulated_agent(cfg, sim).run(ticks=10)
    finally:
        sink.stop()
    stored = sink.store.sequences()
    assert (stored == []) if refuse_all else (stored and 2 not in stored)
    rejected = Spool(tmp_path / "spool").rejected()
    assert rejected == ([1, 2, 3] if refuse_all else [2])
    message = str(refused.value)
    assert f"refused {len(rejected)} batches" in message and "no batch is welcome" in message
    assert str(tmp_path / "spool" / "rejected") in message


# ---- point 17: an agent killed while recording leaves a recording replay reads and its restart continues ----
def _checksums(rec: Path) -> dict[str, str]:
    return {str(p.relative_to(rec)): hashlib.sha256(p.read_bytes()).hexdigest() for p in rec.glob("*/part-*")}


def test_a_recording_agent_killed_leaves_a_readable_recording_that_its_restart_continues(tmp_path, caplog):
    rec = tmp_path / "R"
    argv = ["agent", "--simulate", "2", "--node", "n1", "--interval", "0.02", "--batch-interval", "0.02",
            "--record", str(rec), "--log-level", "warning"]
    agent = subprocess.Popen([sys.executable, "-m", "gpuwatch", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:  # 12 batches of one tick per part: two parts are 48 GPU samples at least
        poll(lambda: len(list((rec / "gpu_samples").glob("part-*.parquet"))) >= 2, 120, "two recorded parts")
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    before = _checksums(rec)
    parts = len(list((rec / "gpu_samples").glob("part-*.parquet")))
    killed = open_recording(rec)
    assert killed.manifest["tables"]["gpu_samples"] == parts and killed.manifest["nodes"] == ["n1"]
    rows = len(killed.table("gpu_samples"))
    assert rows >= 48

    (rec / "manifest.json").unlink()  # as a writer killed before its first manifest leaves it
    caplog.set_level(logging.WARNING, logger="gpuwatch.core.recording")
    unlisted = open_recording(rec)
    assert any("no manifest.json" in r.getMessage() for r in caplog.records)
    assert len(unlisted.table("gpu_samples")) == rows and unlisted.manifest["nodes"] == ["n1"]

    again = _gpuwatch(*argv, "--ticks", "24")
    assert again.returncode == 0, again.stderr
    after = _checksums(rec)
    assert {k: after[k] for k in before} == before  # no part of the killed run was written over
    continued = open_recording(rec)
    assert continued.manifest["tables"]["gpu_samples"] == len(list((rec / "gpu_samples").glob("part-*"))) > parts
    assert len(continued.table("gpu_samples")) == rows + 2 * 24


# ---- point 19: a recording lacking parts, or with an empty part, is a one-line error ----------------------
def _recording(path: Path) -> None:
    with RecordingWriter(path, source="test", resolution_s=1.0) as writer:
        for i in range(4):
            writer.append("gpu_samples", pd.DataFrame({"node": ["n1"], "gpu_index": [0], "ts": [T0_MS + 1000 * i]}))
            writer.append("events", pd.DataFrame({"node": ["n1"], "gpu_index": [0], "ts": [T0_MS + 1000 * i],
                                                  "kind": ["agent_start"], "code": [0]}))


def test_replay_of_a_recording_lacking_its_gpu_samples_says_what_is_missing(tmp_path):
    _recording(tmp_path / "R")
    shutil.rmtree(tmp_path / "R" / "gpu_samples")
    result = _gpuwatch("replay", str(tmp_path / "R"), "--offline", "--quiet")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "gpu_samples/ lacks 4 of its 4 part files" in result.stderr


@pytest.mark.parametrize("damage, what", [(b"", "is empty (0 bytes)"),
                                          (b"not parquet at all", "is not a readable Parquet file")])
def test_replay_of_a_recording_with_an_empty_or_damaged_part_is_one_line(tmp_path, damage, what):
    _recording(tmp_path / "R")
    (tmp_path / "R" / "gpu_samples" / "part-00002.parquet").write_bytes(damage)
    result = _gpuwatch("replay", str(tmp_path / "R"), "--offline", "--quiet")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"part {Path('gpu_samples') / 'part-00002.parquet'} {what}" in result.stderr
    assert "Traceback" not in result.stderr


def test_parts_written_after_the_last_manifest_are_read_and_never_written_over(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gpuwatch.core.recording")
    writer = RecordingWriter(tmp_path / "R", source="test")
    writer.append("gpu_samples", pd.DataFrame({"node": ["n1"], "gpu_index": [0], "ts": [T0_MS]}))
    writer.write_manifest()
    late = writer.append("gpu_samples", pd.DataFrame({"node": ["n2"], "gpu_index": [0], "ts": [T0_MS + 5000]}))
    checksum = hashlib.sha256(late.read_bytes()).hexdigest()  # the writer is killed here: no manifest update
    rec = open_recording(tmp_path / "R")
    assert rec.manifest["nodes"] == ["n1", "n2"] and rec.manifest["end_ms"] == T0_MS + 5000
    assert len(rec.table("gpu_samples")) == 2 and "1 part files are not in manifest.json" in caplog.text
    with RecordingWriter(tmp_path / "R", source="test") as again:
        assert again.append("gpu_samples", pd.DataFrame({"node": ["n1"], "gpu_index": [0], "ts": [T0_MS]})).name \
            == "part-00002.parquet"
    assert hashlib.sha256(late.read_bytes()).hexdigest() == checksum
    assert open_recording(tmp_path / "R").manifest["tables"]["gpu_samples"] == 3
