"""GPU ownership as intervals, joined with the samples at query time (never a label on every stored sample).

The agents send a ``gpu_owner`` event whenever a GPU's owner changes (pod, namespace, container from the
kubelet; job and rank from the launcher's environment); the collector folds them into the ``owner_intervals``
table: an owner holds a GPU from its event until the next ``gpu_owner`` event of that GPU (the open one until
now). This module reads them through the store interface (so DuckDB and ClickHouse answer alike), says who holds
each GPU now (``gpuwatch gpus``), and rolls per-minute samples up per owner (``gpuwatch usage``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pandas as pd

from gpuwatch.collector.store.base import EventQueries, SampleQueries
from gpuwatch.collector.store.owner_tables import OWNER_KEYS
from gpuwatch.core import events as ev
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import ts_ms
from gpuwatch.collector.query_documents import usage_response
from gpuwatch.v1 import query_pb2 as q

#: What ``usage --by`` groups on: the owner columns that name each group.
USAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "pod": ("namespace", "pod"), "namespace": ("namespace",), "job": ("job_id",), "user": ("user",)}
_MINUTE_S = 60.0
_UTILIZATION = "gpu_utilization_ratio"
_ENERGY = "gpu_energy_joules_total"
_J_PER_KWH = 3.6e6
#: The owner columns a ``gpu_processes`` event names per owner (no rank: processes of one job share one row);
#: a ``mig_instances`` event names the first three.
PROCESS_OWNER_KEYS = ("namespace", "pod", "container", "job_id", "user")
#: A GPU's processes or MIG event speaks for the minutes up to this long after it (agents send one per slow tick).
PROCESS_STALE_S = 300.0


class OwnerReads(SampleQueries, EventQueries, Protocol):
    """What owners and usage read: owner events and per-minute samples."""


def owner_intervals(store: EventQueries, since_ms: int | None = None) -> pd.DataFrame:
    """node, gpu_index, from_ms, to_ms (None: still open), uuid and the owner columns, in time order: the
    intervals that hold any time after ``since_ms`` (None: all), from the store's ``owner_intervals`` table and
    the ``gpu_owner`` events not folded into it yet (collector/store/owner_tables.py). Agents announce every
    owner again each GPU_OWNER_REANNOUNCE_S: an owner not announced within twice that before a time does not
    hold the GPU then."""
    return store.owner_intervals(since_ms)


def current_owners(store: OwnerReads) -> dict[tuple[str, int], dict[str, Any]]:
    """(node, gpu_index) -> the owner columns of its open interval (announced within the last two
    GPU_OWNER_REANNOUNCE_S before the newest sample: an agent silent longer says nothing of now)."""
    newest = store.newest_sample_ms()
    if newest is None:
        return {}
    df = owner_intervals(store, newest)
    current = df[df["to_ms"].isna()]
    return {(r["node"], int(r["gpu_index"])): {k: r[k] for k in ("uuid", *OWNER_KEYS)}
            for r in current.to_dict("records")}


def usage(store: OwnerReads, by: str, since_ms: int, until_ms: int) -> list[dict[str, Any]]:
    """GPU-seconds, lost GPU-seconds, mean utilisation and energy per owner group (``by``: USAGE_GROUPS).

    Per GPU and minute, the held seconds are the time since its previous sampled minute (at most a minute);
    the lost seconds the held seconds the GPU did not compute (x (1 - utilisation)); the energy the increase of
    the GPU's energy counter (a reset, e.g. a driver reload, counts from zero). Time no owner held is left out.
    """
    keys = USAGE_GROUPS[by]
    minutes = store.gpu_minutes(since_ms, until_ms, last=[_ENERGY], means=[_UTILIZATION], mins=[], maxs=[])
    if minutes.empty:
        return []
    minutes = minutes.assign(t_ms=ts_ms(minutes["ts"])).sort_values(["node", "gpu_index", "t_ms"], kind="stable")
    by_gpu = minutes.groupby(["node", "gpu_index"])
    held = by_gpu["t_ms"].diff().fillna(0).clip(upper=_MINUTE_S * 1000) / 1000.0
    energy_step = by_gpu[_ENERGY].diff()
    energy = energy_step.where(~(energy_step < 0), minutes[_ENERGY]).fillna(0.0)  # first minute: 0
    minutes = minutes.assign(held_s=held, energy_j=energy)
    owned = _join_owners(minutes, owner_intervals(store, since_ms))
    owned = _split_by_devices(owned, device_shares(store, since_ms, until_ms))
    owned = owned[owned[list(keys)].astype(str).ne("").all(axis=1)]
    if owned.empty:
        return []
    util = owned[_UTILIZATION].astype(float)
    known = util.notna()
    proc_known = owned["process_sm_util"].notna()
    owned = owned.assign(busy_s=(owned["held_s"] * util).where(known, 0.0),
                         known_s=owned["held_s"].where(known, 0.0),
                         proc_s=owned["held_s"].where(proc_known, 0.0),
                         proc_busy_s=(owned["held_s"] * owned["process_sm_util"]).where(proc_known, 0.0),
                         proc_mem=(owned["held_s"] * owned["process_memory_bytes"]).where(proc_known, 0.0))
    out = []
    for group, g in owned.groupby(list(keys), sort=True):
        values = group if isinstance(group, tuple) else (group,)
        known_s, proc_s = float(g["known_s"].sum()), float(g["proc_s"].sum())
        mean = float(g["busy_s"].sum()) / known_s if known_s else None
        out.append({**dict(zip(keys, values)), "gpu_seconds": round(float(g["held_s"].sum()), 3),
                    "lost_gpu_seconds": round(known_s - float(g["busy_s"].sum()), 3),
                    "mean_utilization": None if mean is None else round(mean, 4),
                    "energy_kwh": round(float(g["energy_j"].sum()) / _J_PER_KWH, 6),
                    "process_utilization": round(float(g["proc_busy_s"].sum()) / proc_s, 4) if proc_s else None,
                    "process_memory_bytes": int(float(g["proc_mem"].sum()) / proc_s) if proc_s else None})
    return sorted(out, key=lambda r: -r["gpu_seconds"])


def _join_owners(minutes: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """Each minute row with the owner whose interval holds its last sample (empty owner columns: none)."""
    blank = {k: (-1 if k == "rank" else "") for k in OWNER_KEYS}
    sampled_job = minutes["job_id"].fillna("").astype(str)
    minutes = minutes.drop(columns=["job_id", "rank"])
    if intervals.empty:
        return minutes.assign(**{**blank, "job_id": sampled_job})
    left = minutes.assign(_sampled_job=sampled_job, _t=minutes["t_ms"].astype(np.int64),
                          node=minutes["node"].astype(str), gpu_index=minutes["gpu_index"].astype(np.int64))
    left = left.sort_values("_t", kind="stable")
    right = intervals.assign(_t=intervals["from_ms"].astype(np.int64), node=intervals["node"].astype(str),
                             gpu_index=intervals["gpu_index"].astype(np.int64)).drop(columns=["to_ms", "uuid"])
    right = right.sort_values("_t", kind="stable")
    joined = pd.merge_asof(left, right.drop(columns=["from_ms"]), on="_t", by=["node", "gpu_index"],
                           direction="backward")
    for key, empty in blank.items():
        joined[key] = joined[key].fillna(empty)
    # a job the samples name where no owner event does (agents that send no gpu_owner events)
    joined["job_id"] = joined["job_id"].where(joined["job_id"] != "", joined.pop("_sampled_job"))
    return joined.drop(columns=["_t"])


def device_shares(store: OwnerReads, since_ms: int, until_ms: int) -> pd.DataFrame:
    """How the agents' slow ticks in the window (and PROCESS_STALE_S before it) divide each GPU among owners,
    one row per owner and tick: node, gpu_index, ts_ms, the owner columns, util (its utilisation), time_share and
    energy_share (of the GPU's minute and energy), memory_bytes, split (rows of their own, not an annotation of
    the GPU's owner) and process (from per-process data).

    ``gpu_processes``: each owner's processes' SM share of the GPU; with several owners (time-slicing) each holds
    the whole minute and the energy splits by SM share (evenly while all idle). ``mig_instances``: each instance
    is a device of its own, weighed by its memory slice of the GPU, at its own GPM activity; a MIG event
    wins over a processes event of the same tick.
    """
    columns = ["node", "gpu_index", "ts_ms", *PROCESS_OWNER_KEYS, "util", "time_share", "energy_share",
               "memory_bytes", "split", "process"]
    since = max(0, since_ms - int(PROCESS_STALE_S * 1000)) or None
    until = until_ms or None
    rows: list[dict[str, Any]] = []
    mig_ticks: set[tuple[str, int, int]] = set()
    for e in store.event_attrs(ev.MIG_INSTANCES, ("instances",), since, until).to_dict("records"):
        instances = _listed(e["instances"])
        slices = [float(i.get("memory_total_bytes") or 0) for i in instances]
        total = sum(slices)
        mig_ticks.add((e["node"], int(e["gpu_index"]), int(e["ts_ms"])))
        for inst, size in zip(instances, slices):
            share = size / total if total > 0 else 1.0 / len(instances)
            rows.append({**_tick(e), **{k: str(inst.get(k) or "") for k in ("namespace", "pod", "container")},
                         "job_id": None, "user": None, "util": inst.get("sm_active"), "time_share": share,
                         "energy_share": share, "memory_bytes": inst.get("memory_used_bytes"), "split": True,
                         "process": False})
    for e in store.event_attrs(ev.GPU_PROCESSES, ("owners",), since, until).to_dict("records"):
        owners = _listed(e["owners"])
        if (e["node"], int(e["gpu_index"]), int(e["ts_ms"])) in mig_ticks:
            continue
        sm = [owner.get("sm_util") for owner in owners]
        total = sum(u for u in sm if u is not None)
        for owner, util in zip(owners, sm):
            share = util / total if util is not None and total > 0 else 1.0 / len(owners)
            rows.append({**_tick(e), **{k: str(owner.get(k) or "") for k in PROCESS_OWNER_KEYS}, "util": util,
                         "time_share": 1.0, "energy_share": share, "memory_bytes": owner.get("memory_bytes"),
                         "split": len(owners) > 1, "process": True})
    return pd.DataFrame(rows, columns=columns)


def _tick(e: dict[str, Any]) -> dict[str, Any]:
    return {"node": e["node"], "gpu_index": int(e["gpu_index"]), "ts_ms": int(e["ts_ms"])}


def _listed(text: str) -> list[dict[str, Any]]:
    """The JSON list of an event's attribute; empty when cut (an over-long attribute) or not a list."""
    try:
        listed = json.loads(text or "[]")
    except ValueError:
        return []
    return [x for x in listed if isinstance(x, dict)] if isinstance(listed, list) else []


def _split_by_devices(minutes: pd.DataFrame, shares: pd.DataFrame) -> pd.DataFrame:
    """Each minute with its GPU's newest tick of :func:`device_shares` (at most PROCESS_STALE_S old): a split
    tick turns the minute into one row per owner (held seconds and energy times its shares, utilisation its
    own; a MIG instance with no job keeps the GPU's); a single-owner processes tick annotates the minute with that
    owner's process utilisation and memory."""
    minutes = minutes.assign(process_sm_util=np.nan, process_memory_bytes=np.nan).reset_index(drop=True)
    if shares.empty or minutes.empty:
        return minutes
    stamps = shares[["node", "gpu_index", "ts_ms"]].drop_duplicates()
    left = minutes.assign(_row=np.arange(len(minutes)), _t=minutes["t_ms"].astype(np.int64),
                          gpu_index=minutes["gpu_index"].astype(np.int64)).sort_values("_t", kind="stable")
    right = stamps.assign(_t=stamps["ts_ms"].astype(np.int64)).sort_values("_t", kind="stable")
    matched = pd.merge_asof(left[["_row", "_t", "node", "gpu_index"]], right, on="_t", by=["node", "gpu_index"],
                            direction="backward", tolerance=int(PROCESS_STALE_S * 1000))
    matched = matched.dropna(subset=["ts_ms"]).astype({"ts_ms": np.int64})
    per_owner = matched.merge(shares, on=["node", "gpu_index", "ts_ms"])
    if per_owner.empty:
        return minutes
    util = per_owner["util"].astype(float)
    memory = per_owner["memory_bytes"].astype(float)
    process = per_owner["process"].astype(bool).to_numpy()
    single = per_owner[~per_owner["split"].astype(bool).to_numpy() & process]
    minutes.loc[single["_row"], "process_sm_util"] = util[single.index].to_numpy()
    minutes.loc[single["_row"], "process_memory_bytes"] = memory[single.index].to_numpy()
    split_mask = per_owner["split"].astype(bool).to_numpy()
    shared = per_owner[split_mask].reset_index(drop=True)
    if shared.empty:
        return minutes
    split = minutes.loc[shared["_row"].to_numpy()].reset_index(drop=True)
    for key in PROCESS_OWNER_KEYS:
        split[key] = shared[key].where(shared[key].notna(), split[key])
    split["rank"] = np.where(shared["job_id"].isna(), split["rank"], -1)
    split["held_s"] = split["held_s"] * shared["time_share"].astype(float)
    split["energy_j"] = split["energy_j"] * shared["energy_share"].astype(float)
    split[_UTILIZATION] = shared["util"].astype(float)
    from_processes = shared["process"].astype(bool)
    split["process_sm_util"] = shared["util"].astype(float).where(from_processes)
    split["process_memory_bytes"] = shared["memory_bytes"].astype(float).where(from_processes)
    return pd.concat([minutes.drop(index=shared["_row"].unique()), split], ignore_index=True)


def usage_rpc(request: q.UsageRequest, store: OwnerReads) -> q.UsageResponse:
    """The ``Usage`` RPC: :func:`usage` rows; until 0 means up to the newest sample."""
    if request.by not in USAGE_GROUPS:
        raise UserError(f"--by {request.by!r}: expected one of {', '.join(USAGE_GROUPS)}")
    until_ms = request.until_ms or store.newest_sample_ms() or 0
    rows = usage(store, request.by, request.since_ms, until_ms)
    return usage_response(rows, USAGE_GROUPS[request.by])


def owner_columns(owner: dict[str, Any] | None, keys: Sequence[str] = ("namespace", "pod", "container")
                  ) -> dict[str, str]:
    """The owner's ``keys`` (empty strings without an owner), for replies that carry them beside a GPU."""
    return {k: str(owner.get(k, "")) if owner else "" for k in keys}
