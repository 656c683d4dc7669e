"""GPU ownership as intervals, joined with the samples at query time (never a label on every stored sample).

The agents send a ``gpu_owner`` event whenever a GPU's owner changes (pod, namespace, container from the
kubelet; job and rank from the launcher's environment). Those change points are the stored intervals: an
owner holds a GPU from its event until the next ``gpu_owner`` event of that GPU (the open one until now).
This module reads them through the store interface (so DuckDB and ClickHouse answer alike), says who holds
each GPU now (``gpuwatch gpus``), and rolls per-minute samples up per owner (``gpuwatch usage``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pandas as pd

from gpuwatch.collector.store.base import EventQueries, SampleQueries
from gpuwatch.core import events as ev
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import ts_ms
from gpuwatch.v1 import query_pb2 as q

OWNER_KEYS = ("namespace", "pod", "container", "job_id", "rank", "user")
#: What ``usage --by`` groups on: the owner columns that name each group.
USAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "pod": ("namespace", "pod"), "namespace": ("namespace",), "job": ("job_id",), "user": ("user",)}
_MINUTE_S = 60.0
_UTILIZATION = "gpu_utilization_ratio"
_ENERGY = "gpu_energy_joules_total"
_J_PER_KWH = 3.6e6


class OwnerReads(SampleQueries, EventQueries, Protocol):
    """What owners and usage read: owner events and per-minute samples."""


def owner_intervals(store: EventQueries, since_ms: int | None = None) -> pd.DataFrame:
    """node, gpu_index, from_ms, to_ms (None: still open), uuid and the owner columns, in time order: the
    intervals that hold any time after ``since_ms`` (None: all). Agents announce every owner again each
    GPU_OWNER_REANNOUNCE_S, so the change points of twice that before ``since_ms`` are all that is read."""
    start = None if since_ms is None else max(0, int(since_ms - 2 * ev.GPU_OWNER_REANNOUNCE_S * 1000))
    rows = [{"node": e["node"], "gpu_index": int(e["gpu_index"]), "from_ms": int(e["ts_ms"]),
             "uuid": e["attrs"].get("uuid", ""), **{k: e["attrs"].get(k, "") for k in OWNER_KEYS}}
            for e in store.events(kind=ev.GPU_OWNER, since_ms=start or None)]
    columns = ["node", "gpu_index", "from_ms", "to_ms", "uuid", *OWNER_KEYS]
    if not rows:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(rows).sort_values(["node", "gpu_index", "from_ms"], kind="stable").reset_index(drop=True)
    following = df.groupby(["node", "gpu_index"])["from_ms"].shift(-1)
    df["to_ms"] = following.astype(object).where(following.notna(), None)
    df["rank"] = pd.to_numeric(df["rank"], errors="coerce").fillna(-1).astype(int)
    return df[columns]


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
    owned = owned[owned[list(keys)].astype(str).ne("").all(axis=1)]
    if owned.empty:
        return []
    util = owned[_UTILIZATION].astype(float)
    known = util.notna()
    owned = owned.assign(busy_s=(owned["held_s"] * util).where(known, 0.0),
                         known_s=owned["held_s"].where(known, 0.0))
    out = []
    for group, g in owned.groupby(list(keys), sort=True):
        values = group if isinstance(group, tuple) else (group,)
        known_s = float(g["known_s"].sum())
        mean = float(g["busy_s"].sum()) / known_s if known_s else None
        out.append({**dict(zip(keys, values)), "gpu_seconds": round(float(g["held_s"].sum()), 3),
                    "lost_gpu_seconds": round(known_s - float(g["busy_s"].sum()), 3),
                    "mean_utilization": None if mean is None else round(mean, 4),
                    "energy_kwh": round(float(g["energy_j"].sum()) / _J_PER_KWH, 6)})
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


def usage_rpc(request: q.UsageRequest, store: OwnerReads) -> q.JsonResponse:
    """The ``Usage`` RPC: :func:`usage` as JSON; until 0 means up to the newest sample."""
    if request.by not in USAGE_GROUPS:
        raise UserError(f"--by {request.by!r}: expected one of {', '.join(USAGE_GROUPS)}")
    until_ms = request.until_ms or store.newest_sample_ms() or 0
    rows = usage(store, request.by, request.since_ms, until_ms)
    return q.JsonResponse(json=json.dumps(rows))


def owner_columns(owner: dict[str, Any] | None, keys: Sequence[str] = ("namespace", "pod", "container")
                  ) -> dict[str, str]:
    """The owner's ``keys`` (empty strings without an owner), for replies that carry them beside a GPU."""
    return {k: str(owner.get(k, "")) if owner else "" for k in keys}
