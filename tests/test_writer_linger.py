"""The store writer's linger (writer.py ``linger_s``): under load it commits what arrives meanwhile as one
group; a lone batch, a task or the stop is never held. Progress is tied to the writer's commits, not to time:
the linger is made far longer than any wait here, so a held write would time out."""
import threading

from gpuwatch.collector.store.duckdb import DuckDBStore
from helpers import make_batch, poll

LONG = 600.0  # a linger no test waits out: a write it held would fail its result(timeout)
WAIT = 120.0


def _recording_store(tmp_path, gate: threading.Event) -> tuple[DuckDBStore, list[int]]:
    """A store whose writer lingers LONG and records each group's size; its first commit waits for ``gate``."""
    store = DuckDBStore(str(tmp_path / "linger.duckdb"))
    store.linger_s = LONG
    sizes: list[int] = []
    commit = store._commit

    def recorded(batches):
        if not sizes:
            gate.wait(WAIT)
        sizes.append(len(batches))
        commit(batches)

    store._commit = recorded  # type: ignore[method-assign]
    return store, sizes


def test_under_load_what_arrives_while_lingering_is_one_group_and_a_task_ends_the_linger(tmp_path):
    gate = threading.Event()
    store, sizes = _recording_store(tmp_path, gate)
    try:
        first = store.submit(make_batch(1))
        poll(lambda: store.queue_depth() == 0, WAIT, "the writer to take batch 1 (it waits in its commit)")
        queued = [store.submit(make_batch(seq)) for seq in (2, 3, 4)]
        gate.set()
        for f in [first, *queued]:
            f.result(WAIT)
        assert sizes == [1, 3]
        # the previous group was 3 batches (load): the writer lingers, these arrive one by one into one group
        later = [store.submit(make_batch(5))]
        poll(lambda: store.queue_depth() == 0, WAIT, "the writer to take batch 5 (without a linger: alone)")
        later.append(store.submit(make_batch(6)))
        store.flush(WAIT)  # a task ends the linger at once: the batches before it commit, then the task runs
        assert all(f.result(WAIT).duplicate is False for f in later)
        assert sizes == [1, 3, 2]
        assert store.count("ingested") == 6
    finally:
        store.close()


def test_a_lone_batch_is_committed_at_once(tmp_path):
    gate = threading.Event()
    gate.set()
    store, sizes = _recording_store(tmp_path, gate)
    try:
        for seq in (1, 2, 3):  # one at a time: each group is one batch, never held
            store.write(make_batch(seq), timeout=WAIT)
        assert sizes == [1, 1, 1]
    finally:
        store.close()
