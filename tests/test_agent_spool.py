"""The durable spool: order, restarts, the size bound and sequence persistence, on a real directory."""
import json

import pytest

from gpuwatch.agent.spool import Spool
from gpuwatch.core.errors import UserError


def _fill(spool, n, size=100):
    seqs = []
    for _ in range(n):
        seq = spool.next_sequence()
        spool.append(seq, bytes([seq % 256]) * size)
        seqs.append(seq)
    return seqs


def test_batches_drain_in_order_and_ack_deletes(tmp_path):
    spool = Spool(tmp_path)
    assert _fill(spool, 5) == [1, 2, 3, 4, 5]
    assert spool.pending() == [1, 2, 3, 4, 5] and spool.next_after(2) == 3
    spool.ack(1)
    spool.ack(3)
    assert spool.pending() == [2, 4, 5] and spool.read(3) is None and spool.read(2) == bytes([2]) * 100
    assert sorted(p.name for p in (tmp_path / "batches").iterdir())[0] == f"{2:020d}.pb"


def test_restart_keeps_agent_id_pending_batches_and_never_reuses_sequences(tmp_path):
    spool = Spool(tmp_path)
    _fill(spool, 3)
    for seq in (1, 2, 3):
        spool.ack(seq)  # everything sent: no batch file left to infer the sequence from
    again = Spool(tmp_path)
    assert again.agent_id == spool.agent_id and again.pending() == []
    assert again.next_sequence() == 4
    again.append(4, b"x")
    (tmp_path / "batches" / "junk.tmp").write_bytes(b"half-written")
    third = Spool(tmp_path)
    assert third.pending() == [4] and third.read(4) == b"x" and third.next_sequence() == 5
    assert not (tmp_path / "batches" / "junk.tmp").exists()


def test_size_bound_drops_oldest_and_counts_them_across_a_restart(tmp_path):
    spool = Spool(tmp_path, max_bytes=350)
    _fill(spool, 5, size=100)
    assert spool.pending() == [3, 4, 5]
    again = Spool(tmp_path, max_bytes=350)  # the count survives a crash before it was reported
    dropped = again.take_dropped()
    assert (dropped.batches, dropped.bytes) == (2, 200)
    assert again.take_dropped().batches == 0 and Spool(tmp_path).take_dropped().batches == 0


def test_a_single_batch_over_the_bound_is_kept(tmp_path):
    spool = Spool(tmp_path, max_bytes=10)
    _fill(spool, 1, size=100)
    assert spool.pending() == [1]


def test_quarantine_moves_the_batch_with_its_reason(tmp_path):
    spool = Spool(tmp_path)
    _fill(spool, 2)
    path = spool.quarantine(1, "INVALID_ARGUMENT: unknown field")
    assert spool.pending() == [2] and spool.rejected() == [1] and path.exists()
    assert "unknown field" in path.with_suffix(".reason.txt").read_text()


def test_corrupt_state_is_a_clear_error(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(UserError, match="state.json.*unreadable"):
        Spool(tmp_path)


def test_state_file_names_the_next_sequence(tmp_path):
    spool = Spool(tmp_path)
    _fill(spool, 2)
    assert json.loads((tmp_path / "state.json").read_text())["next_sequence"] == 3
