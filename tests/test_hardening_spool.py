"""The spool under damage: drop totals that survive their own batches,
a really full disk, a lost state.json, damaged records, private files."""
import errno
import json
import os
import stat

import pytest

from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.agent.spool import Spool, SpoolFull, encode_record
from gpuwatch.apps.agent_cli import simulated_agent
from gpuwatch.core import events as ev
from gpuwatch.agent.uplink import Uplink
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import T0_MS, fill_disk, small_filesystem


def _batch(spool: Spool, seq: int, agent: str | None = None, payload: int = 0) -> bytes:
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), agent or spool.agent_id, [pb.GpuInfo(index=0)])
    builder.add_gpu_row(0, T0_MS + 1000 * seq, {"gpu_power_watts": float(seq)})
    if payload:
        builder.add_event("agent_start", T0_MS, message="x" * payload)
    return builder.build(seq).SerializeToString()


def _spool(spool: Spool, n: int, payload: int = 0) -> list[int]:
    seqs = []
    for _ in range(n):
        seq = spool.next_sequence()
        spool.append(seq, _batch(spool, seq, payload=payload))
        seqs.append(seq)
    return seqs


# ---- point 4: drop counts are durable running totals ----------------------------------------------
def test_drop_totals_survive_reports_restarts_and_their_own_batches(tmp_path):
    spool = Spool(tmp_path, max_bytes=3000)
    _spool(spool, 10, payload=900)
    first = spool.take_dropped()
    assert first.batches == first.total_batches > 0
    _spool(spool, 10, payload=900)  # the batch that carried the first report is dropped too
    again = Spool(tmp_path, max_bytes=3000)  # and the agent restarts before it reports the rest
    second = again.take_dropped()
    assert second.total_batches == first.batches + second.batches == 20 - len(again.pending())
    assert json.loads((tmp_path / "state.json").read_text())["dropped_batches_total"] == second.total_batches


# ---- point 5: a full disk degrades, never crashes -------------------------------------------------
def test_a_full_disk_drops_oldest_counts_and_recovers(tmp_path):
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk / "spool")  # the default 256 MiB bound is far above this disk
        _spool(spool, 3, payload=20_000)
        filler = fill_disk(disk)
        stored = []
        for _ in range(6):  # the disk stays full: each new batch takes the place of the oldest
            try:
                stored += _spool(spool, 1, payload=20_000)
            except SpoolFull:
                pass
        assert spool.take_dropped().total_batches >= 6 - len(stored)
        assert len(spool.pending()) <= 3
        filler.unlink()  # space returns
        assert len(_spool(spool, 3, payload=20_000)) == 3 and len(spool.pending()) >= 3
        assert Spool(disk / "spool").agent_id == spool.agent_id  # and a restart reads its state back


def test_an_agent_starts_on_a_full_disk(tmp_path):
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        Spool(disk / "spool")
        fill_disk(disk)
        spool = Spool(disk / "spool")  # no crash at start
        with pytest.raises(SpoolFull):
            _spool(spool, 1)
        assert spool.take_dropped().total_batches == 1


def test_a_drop_on_a_full_disk_is_on_disk_at_once_in_the_room_it_freed(tmp_path):
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk / "spool")
        _spool(spool, 3, payload=20_000)
        seq = spool.next_sequence()
        filler = fill_disk(disk)  # between numbering a batch and writing it
        try:
            spool.append(seq, _batch(spool, seq, payload=20_000))  # takes the oldest batch's place
        finally:
            filler.unlink()
        # before any report is cut: an agent whose last batch this was still has the drop on disk
        assert json.loads((disk / "spool" / "state.json").read_text())["dropped_batches_total"] == 1
        assert spool.pending() == [2, 3, 4]


# ---- a batch that has left the agent is never dropped, so a counted drop is a batch the collector lacks ----
def test_the_size_bound_drops_the_oldest_batch_not_yet_sent(tmp_path):
    spool = Spool(tmp_path, max_bytes=3000)
    sent = _spool(spool, 2, payload=900)
    for seq in sent:
        spool.mark_sent(seq)  # the uplink has them on the wire: they may be stored by now
    later = _spool(spool, 6, payload=900)
    assert spool.pending()[:2] == sent and spool.pending()[-1] == later[-1]
    assert spool.take_dropped().batches == len(sent + later) - len(spool.pending()) > 0
    spool.ack(sent[0])
    _spool(spool, 2, payload=900)  # acknowledged batches are gone; the other sent one is still kept
    assert spool.pending()[0] == sent[1]


def test_a_full_disk_drops_the_new_batch_when_every_spooled_one_was_sent(tmp_path):
    with small_filesystem(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk / "spool")
        sent = _spool(spool, 3, payload=20_000)
        for seq in sent:
            spool.mark_sent(seq)
        filler = fill_disk(disk)
        try:
            with pytest.raises(SpoolFull):
                _spool(spool, 1, payload=20_000)
        finally:
            filler.unlink()
        assert spool.pending() == sent and spool.take_dropped().batches == 1


def test_a_drop_while_the_agent_spools_its_last_batch_is_still_reported(tmp_path, sink, monkeypatch):
    """The batch cut at the end (with the agent's stop event) finds the disk full: one more batch reports the
    drop, so the collector's count is exact although no further sample follows."""
    server, address = sink
    cfg = AgentConfig(collector=address, node="n1", interval=0.02, batch_interval=0.1, spool=tmp_path)
    write = Spool._write_record

    def full_for_the_last_batch(self, sequence, record):
        if sequence == 3:  # ticks 1-5 and 6-10 are batches 1 and 2; 3 holds the stop event
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, sequence, record)

    monkeypatch.setattr(Spool, "_write_record", full_for_the_last_batch)
    with SimulatedNode(2, node="n1") as sim:
        simulated_agent(cfg, sim).run(ticks=10)
    agent_id = json.loads((tmp_path / "state.json").read_text())["agent_id"]
    stored = server.store.sequences(agent_id)
    assert stored[-1] == 4 and 3 not in stored  # (2 too may have made room for 3, if it was not sent yet)
    (report,) = [e for e in server.store.batches[(agent_id, 4)].events if e.kind == ev.SPOOL_DROPPED]
    assert report.attrs["dropped_total"] == str(4 - len(stored))


# ---- point 6: a moved-away state.json ---------------------------------------------------------------
def test_a_lost_state_takes_the_agent_id_and_sequences_from_the_spooled_batches(tmp_path, sink):
    server, address = sink
    spool = Spool(tmp_path)
    _spool(spool, 40)  # more than the uplink's window of 32
    (tmp_path / "state.json").rename(tmp_path / "state.json.bad")
    again = Spool(tmp_path)
    assert again.agent_id == spool.agent_id
    assert json.loads((tmp_path / "state.json").read_text())["next_sequence"] == 41
    uplink = Uplink(again, address, window=32)
    uplink.start()
    try:
        _spool(again, 5)
        uplink.notify()
        assert uplink.wait_drained(30)
    finally:
        uplink.stop()
    assert server.store.sequences(spool.agent_id) == list(range(1, 46))


def test_acks_for_spooled_batches_of_an_older_agent_id_still_drain_the_spool(tmp_path, sink):
    server, address = sink
    spool = Spool(tmp_path)
    for _ in range(40):
        seq = spool.next_sequence()
        spool.append(seq, _batch(spool, seq, agent="older-id"))
    uplink = Uplink(spool, address, window=32)
    uplink.start()
    try:
        assert uplink.wait_drained(30)
    finally:
        uplink.stop()
    assert server.store.sequences("older-id") == list(range(1, 41))


# ---- point 8: checksums ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-7], "truncated"),
    (lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:], "checksum"),
    (lambda data: b"", "empty file"),
    (lambda data: data[12:], "not a spool record"),
])
def test_damaged_records_go_to_rejected_with_a_reason_and_are_never_sent(tmp_path, damage, reason):
    spool = Spool(tmp_path)
    _spool(spool, 3)
    path = tmp_path / "batches" / f"{2:020d}.pb"
    path.write_bytes(damage(path.read_bytes()))
    assert spool.read(1) is not None and spool.read(2) is None and spool.read(3) is not None
    assert spool.pending() == [1, 3] and spool.rejected() == [2]
    assert reason in (tmp_path / "rejected" / f"{2:020d}.reason.txt").read_text()


def test_a_record_is_its_payload_behind_a_crc32c_header():
    record = encode_record(b"123456789")
    assert record[:4] == b"GWS1" and int.from_bytes(record[4:8], "big") == 9
    assert int.from_bytes(record[8:12], "big") == 0xE3069283  # the CRC32C check value of "123456789"


# ---- point 11: private files --------------------------------------------------------------------------
def test_spool_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        spool = Spool(tmp_path / "spool")
        _spool(spool, 2)
        spool.quarantine(1, "refused")
    finally:
        os.umask(old)
    root = tmp_path / "spool"
    for d in (root, root / "batches", root / "rejected"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (root / "state.json", *root.glob("*/*.pb"), *root.glob("rejected/*.txt")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_the_store_file_is_private_whatever_the_umask(tmp_path):
    from gpuwatch.collector.store.duckdb import DuckDBStore

    old = os.umask(0o022)
    try:
        store = DuckDBStore(str(tmp_path / "c.duckdb"))
        store.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c.duckdb").stat().st_mode) == 0o600


def test_the_chdb_store_directory_is_private_whatever_the_umask(tmp_path):
    from gpuwatch.collector.store import open_store

    old = os.umask(0o022)
    try:
        store = open_store(f"chdb://{tmp_path / 'ch'}")
        store.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ch").stat().st_mode) == 0o700
