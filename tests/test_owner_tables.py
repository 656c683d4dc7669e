"""The owner_intervals table (collector/store/owner_tables.py) on both engines: the maintained table answers what
folding the gpu_owner events gives, whatever order the batches came in, resent or not; its rows outlive the
events' retention."""
import numpy as np
import pandas as pd
import pytest

from gpuwatch.collector.owners import current_owners, owner_intervals, usage
from gpuwatch.collector.store import open_store
from gpuwatch.collector.store import owner_tables
from gpuwatch.core import events as ev
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import STORE_KINDS, T0, store_url

HOUR = 3_600_000
GPUS = 3


def _owner_event(gpu, ts_ms, pod, job=""):
    return dict(kind=ev.GPU_OWNER, ts_ms=ts_ms, gpu_index=gpu, message="owner",
                attrs={"namespace": "ml" if pod else "", "pod": pod, "container": "c" if pod else "",
                       "job_id": job, "rank": "0" if job else "-1", "mig": "", "user": "", "uuid": f"GPU-{gpu}"})


def _events():
    """(gpu, ts_ms, pod, job) over 20 hours, announced hourly: GPU 0 moves from pod a to pod b and back to a;
    GPU 1 keeps pod c but its agent is silent for five hours; GPU 2 changes owner within minutes, then is free."""
    out = []
    for h in range(20):
        out.append((0, T0 + h * HOUR, "a" if h < 6 or h >= 13 else "b", ""))
        if not 7 <= h <= 11:
            out.append((1, T0 + h * HOUR + 7_000, "c", "j1"))
        out.append((2, T0 + h * HOUR + 11_000, "d" if h < 4 else "", "j2" if h < 4 else ""))
    out += [(2, T0 + 2 * HOUR + 60_000, "e", ""), (2, T0 + 2 * HOUR + 120_000, "d", "j2"),  # a brief other owner
            (0, T0 + 9 * HOUR + 1_800_000, "b", "")]  # an announcement between the hourly ones
    return out


def _batch(events, seq, agent="agent-1"):
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), agent,
                           [pb.GpuInfo(index=i, uuid=f"GPU-{i}", name="H100") for i in range(GPUS)])
    for gpu, ts, pod, job in events:
        builder.add_event(**_owner_event(gpu, ts, pod, job))
    newest = max(ts for _, ts, _, _ in events)
    for gpu in range(GPUS):  # a sample at the batch's newest time (what usage and current_owners look at)
        builder.add_gpu_row(gpu, newest, {"gpu_utilization_ratio": 0.5})
    return builder.build(seq)


def _folded(store, since_ms=None):
    """What owner_intervals answered before the table: the events from twice the re-announcement before
    ``since_ms`` folded (a re-announcement continues its interval)."""
    start = None if since_ms is None else max(0, since_ms - owner_tables.LOOKBACK_MS)
    df = store.event_attrs(ev.GPU_OWNER, owner_tables.SAME, since_ms=start)
    df = df.rename(columns={"ts_ms": "from_ms"}).astype({"gpu_index": int, "from_ms": np.int64})
    df = df.sort_values(["node", "gpu_index", "from_ms"], kind="stable").reset_index(drop=True)
    same = ["node", "gpu_index", *owner_tables.SAME]
    df = df[df[same].ne(df[same].shift()).any(axis=1)].reset_index(drop=True)
    following = df.groupby(["node", "gpu_index"])["from_ms"].shift(-1)
    df["to_ms"] = following.astype(object).where(following.notna(), None)
    df["rank"] = pd.to_numeric(df["rank"], errors="coerce").fillna(-1).astype(int)
    return df[["node", "gpu_index", "from_ms", "to_ms", *owner_tables.SAME]]


def _records(df):
    return [tuple(None if v is None else (int(v) if isinstance(v, (int, np.integer)) else v) for v in r)
            for r in df.astype(object).itertuples(index=False)]


def _holders(df, times):
    """(gpu, time) -> pod holding it then (None: nobody) for every GPU and time in ``times``."""
    out = {}
    for gpu in range(GPUS):
        rows = df[df["gpu_index"] == gpu].sort_values("from_ms")
        for t in times:
            held = rows[(rows["from_ms"] <= t) & rows["to_ms"].map(lambda to, t=t: to is None or to > t)]
            out[(gpu, t)] = held["pod"].iloc[-1] if len(held) else None
    return out


def _table(store):
    """The stored rows themselves, in key order."""
    rows = store.query_df(f"SELECT * FROM {owner_tables.TABLE}")
    rows = rows[rows["is_deleted"] == 0] if "is_deleted" in rows else rows
    rows = rows[owner_tables.ROW_COLUMNS].astype({"gpu_index": int, "from_ms": np.int64, "last_ms": np.int64})
    rows["to_ms"] = pd.Series([None if pd.isna(v) else int(v) for v in rows["to_ms"]], rows.index, dtype=object)
    return _records(rows.sort_values(["node", "gpu_index", "from_ms"]).reset_index(drop=True))


def _check_same_as_events(store):
    assert _records(owner_intervals(store)) == _records(_folded(store))
    for since in (T0 + 3 * HOUR, T0 + 10 * HOUR + 5, T0 + 12 * HOUR, T0 + 19 * HOUR):
        ours, theirs = owner_intervals(store, since), _folded(store, since)
        times = list(range(since, T0 + 21 * HOUR, 600_000))
        assert _holders(ours, times) == _holders(theirs, times), since
        # the intervals starting inside the look-back are the events' change points: the events' answer
        # starts each GPU's first interval at its first announcement there instead of when its owner took it
        inside = {r for r in _records(ours) if r[2] >= since - owner_tables.LOOKBACK_MS}
        folded = _records(theirs)
        firsts = {min((r for r in folded if r[1] == gpu), key=lambda r: r[2]) for gpu in {r[1] for r in folded}}
        assert set(folded) - firsts <= inside <= set(folded), since


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_table_equals_the_folded_events_in_order_out_of_order_and_resent(tmp_path, kind):
    events = _events()
    events.sort(key=lambda e: e[1])
    chunks = [events[i:i + 7] for i in range(0, len(events), 7)]
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    try:
        # in order, the table maintained after every other batch: answers never wait for it
        for seq, chunk in enumerate(chunks[:6], 1):
            store.write(_batch(chunk, seq))
            if seq % 2:
                store.build_owner_intervals()
            _check_same_as_events(store)
        store.build_owner_intervals()
        assert store._owner_table.mark() is not None and _table(store)
        # a spool delivers the newest batch before the older ones; one batch comes again (a resend) and
        # another under a new sequence (a replay): the same events twice
        late = chunks[6:]
        for seq, chunk in reversed(list(enumerate(late, 7))):
            store.write(_batch(chunk, seq))
            _check_same_as_events(store)
            store.build_owner_intervals()
            _check_same_as_events(store)
        assert store.write(_batch(late[0], 7)).duplicate
        store.write(_batch(chunks[2], 500))
        store.build_owner_intervals()
        _check_same_as_events(store)

        # the stored rows are those a first build from all the events at once writes
        everything = owner_tables.refold(pd.DataFrame(columns=owner_tables.ROW_COLUMNS),
                                         store.event_attrs(ev.GPU_OWNER, owner_tables.SAME), None)
        assert _table(store) == _records(everything.astype({"gpu_index": int}).sort_values(
            ["node", "gpu_index", "from_ms"]).reset_index(drop=True))
        assert len(everything) == 9  # GPU 0: a, b, a; GPU 1: c, c after the silence; GPU 2: d, e, d, none
    finally:
        store.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_gpu_moving_between_pods_is_one_row_per_hold_and_usage_is_unchanged(tmp_path, kind):
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    try:
        store.write(_batch(_events(), 1))
        before = {by: usage(store, by, T0, T0 + 20 * HOUR) for by in ("pod", "job")}
        owners_before = current_owners(store)
        store.build_owner_intervals()
        rows = [r for r in _table(store) if r[1] == 0]
        # pod a, then b (the extra announcement inside its hold continues it), then a again: three rows
        assert [(r[2], r[3], r[-5]) for r in rows] == [
            (T0, T0 + 6 * HOUR, "a"), (T0 + 6 * HOUR, T0 + 13 * HOUR, "b"), (T0 + 13 * HOUR, None, "a")]
        assert rows[1][4] == T0 + 12 * HOUR  # its last announcement
        # GPU 1's five silent hours split its hold: a window starting in the silence sees no owner until the
        # agent speaks again, as the events alone say
        gpu1 = [(r[2], r[3]) for r in _table(store) if r[1] == 1]
        assert gpu1 == [(T0 + 7_000, T0 + 12 * HOUR + 7_000), (T0 + 12 * HOUR + 7_000, None)]
        assert {by: usage(store, by, T0, T0 + 20 * HOUR) for by in ("pod", "job")} == before
        assert current_owners(store) == owners_before
    finally:
        store.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_intervals_outlive_the_events_until_the_rollup_retention(tmp_path, kind):
    first = open_store(store_url(kind, tmp_path))  # written before the retention is set: ClickHouse's TTL
    first.write(_batch(_events(), 1))                # would drop these old test events at once
    first.build_owner_intervals()
    whole = owner_intervals(first)
    first.close()
    store = open_store(store_url(kind, tmp_path), retention_days=0.5, raw_retention_s=3600,
                       rollup_retention_s=14 * 3600)
    try:
        now = T0 + 20 * HOUR
        deleted = store.apply_retention(now_ms=now)
        assert deleted["events"] > 0 and deleted[owner_tables.TABLE] > 0, deleted
        # the events before now - 12 h are gone; the intervals that ended before now - 14 h too, the rest remain
        assert store.event_attrs(ev.GPU_OWNER, ("pod",))["ts_ms"].min() >= now - 12 * HOUR
        kept = whole[whole["to_ms"].map(lambda to: to is None or to >= now - 14 * HOUR)]
        assert _records(owner_intervals(store)) == _records(kept.reset_index(drop=True))
        assert (owner_intervals(store)["from_ms"] < now - 12 * HOUR).any()
        store.build_owner_intervals()  # a maintenance after the events expired keeps them
        assert _records(owner_intervals(store)) == _records(kept.reset_index(drop=True))
    finally:
        store.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_events_stored_before_a_restart_are_folded_after_it(tmp_path, kind):
    events = sorted(_events(), key=lambda e: e[1])
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    store.write(_batch(events[:20], 1))
    store.build_owner_intervals()
    store.write(_batch(events[20:], 2))  # committed, then the collector stops before its next maintenance
    store.close()
    store = open_store(store_url(kind, tmp_path), retention_days=3650)
    try:
        _check_same_as_events(store)  # answered from the table and the events it lacks
        store.build_owner_intervals()
        assert store._owner_table.mark() == events[-1][1] + 1
        _check_same_as_events(store)
        assert len(_table(store)) == 9
    finally:
        store.close()
