"""Online failure scoring: every GPU, at a fixed cadence, with the loaded model, into the alert path.

Each round reads the last ``HISTORY_S`` of every GPU from the store at one-minute resolution (the
resolution the model is trained on: last value of counters and levels, mean of gauges, min/max of PCIe
link state; minutes are aggregated once and kept, see :class:`MinuteHistory`), computes the feature rows
with :func:`gpuwatch.models.features.features` (the function training and evaluation call), scores them,
explains them with the top signals, derives the rule-based health state, and hands one
:class:`RiskObservation` per GPU to the :class:`AlertHub`. Without a model the health states are still
computed, and no risk alerts are raised.
The alert threshold follows the operator's false-alarm budget: before each round the
:class:`~gpuwatch.models.calibration.BudgetCalibrator` gives the threshold from the rounds before it (the
model's saved threshold is only its start value), and the round's scores are shown to it afterwards; fatal
XIDs tell it which GPUs failed. `gpuwatch score` replays a recording through the same calibrator and policy.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import pandas as pd

from gpuwatch.core import events as event_kinds
from gpuwatch.collector.alert_hub import AlertHub
from gpuwatch.collector.alerts import RiskObservation
from gpuwatch.collector.failed import Failure, failed_gpus, failure_timeline
from gpuwatch.collector.periodic import PeriodicService
from gpuwatch.collector.store.arrivals import SampleArrivals
from gpuwatch.collector.store.base import EventQueries, IngestStats, Inventory, SampleQueries
from gpuwatch.collector.store.dialect import ms_to_datetime
from gpuwatch.models import features as feature_module
from gpuwatch.models import rules
from gpuwatch.models.calibration import BudgetCalibrator
from gpuwatch.models.faults import FATAL_XIDS
from gpuwatch.models.history import LOOKBACK_S as FAULT_LOOKBACK_S
from gpuwatch.models.model import FailureModel
from gpuwatch.core.recording import ts_ms
from gpuwatch.core.settings import DEFAULT_FALSE_ALARM_BUDGET
from gpuwatch.core.vocabulary import FAIL
from gpuwatch.core.settings import DEFAULT_SCORE_INTERVAL_S as DEFAULT_INTERVAL_S

log = logging.getLogger(__name__)


class ScoringReads(IngestStats, Inventory, SampleQueries, EventQueries, Protocol):
    """What a scoring round reads: per-minute samples (incrementally, after the writer's counters), XID and
    failure evidence, owners, the GPUs' UUIDs."""


TOP_SIGNALS = 3
_LAST = sorted(set(feature_module.SAMPLE_COLUMNS) - set(feature_module.MEANS.values())
               - {"gpu_pcie_link_width", "gpu_pcie_link_gen", "gpu_pcie_link_width_max", "gpu_pcie_link_gen_max"})


_LINK_MINS = ("gpu_pcie_link_width", "gpu_pcie_link_gen")
_LINK_MAXS = ("gpu_pcie_link_width_max", "gpu_pcie_link_gen_max")
_MINUTE_MS = 60_000
#: Minutes re-aggregated every round even without late data (a batch in flight during the last round).
REREAD_S = 120.0


class MinuteHistory:
    """Every GPU's samples per minute over the last ``history_s``, kept between rounds so that a round
    aggregates only the recent minutes instead of the whole window of raw samples. When the store committed
    samples older than that (an agent replaying its spool, a replay), the whole window is read again."""

    def __init__(self, history_s: float = feature_module.HISTORY_S) -> None:
        self.history_s = history_s
        self._rows: pd.DataFrame | None = None
        self._until_ms = 0

    def samples(self, store: ScoringReads, until_ms: int) -> pd.DataFrame:
        """Per-minute rows (node, gpu_index, minute, ts, job_id, rank, the feature inputs) up to ``until_ms``."""
        since_ms = int(until_ms - self.history_s * 1000)
        start_ms = max(since_ms, (int(self._until_ms - REREAD_S * 1000) // _MINUTE_MS) * _MINUTE_MS)
        oldest_new = store.counters.take_oldest_sample_ms()
        if self._rows is None or until_ms < self._until_ms or (oldest_new is not None and oldest_new < start_ms):
            rows = _minutes(store, since_ms, until_ms)
        else:
            old = self._rows
            kept = old[(old["minute"] < ms_to_datetime(start_ms)) & (old["ts"] >= ms_to_datetime(since_ms))]
            rows = pd.concat([kept, _minutes(store, start_ms, until_ms)], ignore_index=True).sort_values(
                ["node", "gpu_index", "ts"], kind="stable")
        self._rows, self._until_ms = rows.reset_index(drop=True), until_ms
        return self._rows


def _minutes(store: SampleQueries, since_ms: int, until_ms: int) -> pd.DataFrame:
    return store.gpu_minutes(since_ms, until_ms, last=_LAST, means=list(feature_module.MEANS.values()),
                             mins=_LINK_MINS, maxs=_LINK_MAXS)


def xid_events(store: EventQueries, until_ms: int, history_s: float = feature_module.HISTORY_S) -> pd.DataFrame:
    """XID events of the ``history_s`` before ``until_ms`` (what the event features read)."""
    return store.event_rows([event_kinds.XID], int(until_ms - history_s * 1000), until_ms)


def fatal_xids(store: EventQueries, until_ms: int, history_s: float = feature_module.HISTORY_S) -> pd.DataFrame:
    """Fatal XIDs (node, gpu_index, t_ms) of the ``history_s`` before ``until_ms``: fault evidence for the
    budget calibrator."""
    xid = xid_events(store, until_ms, history_s)
    xid = xid[xid["code"].isin(FATAL_XIDS)]
    return pd.DataFrame({"node": xid["node"].to_numpy(), "gpu_index": xid["gpu_index"].to_numpy(),
                         "t_ms": ts_ms(xid["ts"])})


def score_gpus(store: ScoringReads, model: FailureModel | None, now_ms: int, history: MinuteHistory | None = None
               ) -> list[dict[str, Any]]:
    """One dict per GPU with samples in the window: identity, job and rank, risk (None without a model),
    top signals, health state, the rules' reasons, and ``failed`` (collector/failed.py) when it has failed."""
    history = history or MinuteHistory()
    samples = history.samples(store, now_ms)
    events = xid_events(store, now_ms, max(history.history_s, FAULT_LOOKBACK_S))  # fault history: weeks
    if samples.empty:
        return []
    step_s = model.step_s if model else feature_module.DEFAULT_STEP_S
    feats = feature_module.features(samples, events, at=now_ms, step_s=step_s).reset_index(drop=True)
    last = samples.groupby(["node", "gpu_index"])[["job_id", "rank"]].last()
    owners = last.reindex(pd.MultiIndex.from_arrays([feats["node"], feats["gpu_index"].astype(int)]))
    return _scored_rows(store, model, feats, owners, failed_gpus(store, now_ms))


def score_history(store: ScoringReads, model: FailureModel | None, start_ms: int, end_ms: int
                  ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Every GPU scored at every step of the model in (start_ms, end_ms]: (time, :func:`score_gpus` rows).

    For recorded data (``replay --offline``): one read of the store and one vectorised feature pass over the
    whole range, with bins ending at multiples of the model's step, which is how the evaluation scores, instead
    of re-reading a day of history per round. A GPU is scored at the steps where it has samples.
    """
    step_s = model.step_s if model else feature_module.DEFAULT_STEP_S
    history_s = feature_module.HISTORY_S
    samples = _minutes(store, int(start_ms - history_s * 1000), end_ms)
    if samples.empty:
        return
    events = xid_events(store, end_ms, (end_ms - start_ms) / 1000 + max(history_s, FAULT_LOOKBACK_S))
    feats = feature_module.features(samples, events, step_s=step_s)
    feats = feats[(feats["t_ms"] > start_ms) & (feats["t_ms"] <= end_ms)].sort_values("t_ms", kind="stable")
    feats = feats.reset_index(drop=True)
    owners = pd.merge_asof(  # job and rank of each GPU at each step: its last minute row up to then
        # (node as plain objects on both sides: the engines' frames carry different string dtypes)
        feats[["t_ms", "node", "gpu_index"]].assign(gpu_index=feats["gpu_index"].astype(int),
                                                    node=feats["node"].astype(object)),
        samples.assign(t_ms=ts_ms(samples["ts"]), gpu_index=samples["gpu_index"].astype(int),
                       node=samples["node"].astype(object))
        .sort_values("t_ms")[["t_ms", "node", "gpu_index", "job_id", "rank"]],
        on="t_ms", by=["node", "gpu_index"])
    rows = _scored_rows(store, model, feats, owners, {})
    timeline = failure_timeline(store, end_ms)
    for t, index in feats.groupby("t_ms", sort=True).indices.items():
        failures = timeline.at(int(t))
        yield int(t), [_with_failure(rows[i], failures.get((rows[i]["node"], rows[i]["gpu_index"]))) for i in index]


def _scored_rows(store: Inventory, model: FailureModel | None, feats: pd.DataFrame, owners: pd.DataFrame,
                 failures: Mapping[tuple[str, int], Failure]) -> list[dict[str, Any]]:
    """The :func:`score_gpus` rows of feature rows ``feats``; ``owners`` holds each row's job_id and rank."""
    health = rules.states(feats)
    risks = model.risk(feats) if model else [None] * len(feats)
    signals = model.top_signals(feats, TOP_SIGNALS) if model else [[] for _ in range(len(feats))]
    identities = store.gpu_identities()
    jobs, ranks = owners["job_id"].to_numpy(), owners["rank"].to_numpy()
    out = []
    for i, (node, gpu) in enumerate(zip(feats["node"], feats["gpu_index"].astype(int))):
        key = (node, int(gpu))
        row = {
            "node": node, "gpu_index": key[1], "gpu_uuid": identities.get(key, {}).get("uuid") or f"{node}/{key[1]}",
            "job_id": jobs[i] if isinstance(jobs[i], str) and jobs[i] else None,
            "rank": int(ranks[i]) if pd.notna(ranks[i]) else None,
            "risk": None if (risk := risks[i]) is None else float(risk), "signals": signals[i],
            "health": str(health.at[i, "state"]), "reasons": list(health.at[i, "reasons"]), "failed": None,
        }
        out.append(_with_failure(row, failures.get(key)))
    return out


def _with_failure(row: dict[str, Any], failure: Failure | None) -> dict[str, Any]:
    """A failed GPU is "fail", with the failure first among the reasons, however old the evidence."""
    if failure is None:
        return row if row["failed"] is None else {**row, "failed": None}
    reason = failure.reason
    return {**row, "health": FAIL, "reasons": [reason] + [r for r in row["reasons"] if r != reason],
            "failed": {"since_ms": failure.since_ms, "kind": failure.kind, "code": failure.code, "reason": reason}}


def observation(gpu: Mapping[str, Any], now_ms: int) -> RiskObservation:
    """The alert engine's view of one scored GPU."""
    return RiskObservation(
        gpu_uuid=gpu["gpu_uuid"], gpu_index=gpu["gpu_index"], node=gpu["node"], risk=gpu["risk"],
        jobs=(gpu["job_id"],) if gpu["job_id"] else (), ranks=(gpu["rank"],) if gpu["rank"] is not None else (),
        signals=tuple(gpu["signals"]), ts_ms=now_ms,
        failed=(gpu.get("failed") or {}).get("reason"))


WALL, DATA, AUTO = "wall", "data", "auto"
#: On the auto clock, a newest sample further than this from the wall clock means simulated or replayed time.
AUTO_SKEW_S = 900.0
#: On the data clock, the most data time one round scores step by step when data arrived faster than rounds.
CATCH_UP_S = 2 * 86_400.0


def newest_sample_ms(store: SampleQueries) -> int | None:
    """The time of the newest stored GPU sample (epoch ms), None before the first."""
    return store.newest_sample_ms()


class Scorer(PeriodicService["ScoringReads"]):
    """Collector service: scores every GPU every ``interval_s`` and feeds the alert hub.

    A round scores "now": the wall clock, or with ``clock="data"`` the newest stored sample time, for
    telemetry on simulated or replayed time (agents with ``--sim-speed``, replays), where the wall clock would
    put every GPU hours before or after its data. ``clock="auto"`` scores on the wall clock until the newest
    sample is more than ``AUTO_SKEW_S`` away from it, then on the data clock, and logs why. On either clock a
    round first catches up data that arrived in bulk since the scorer was bound (see :meth:`_catch_up`).

    With ``load_model`` (instead of ``model``) the model is loaded on a thread of its own when the service
    starts, so the collector answers while it loads (seconds); rounds begin once it is loaded, the hub then
    gets the model's alert policy, and :attr:`ready` is set. A model that fails to load is logged and
    scoring gives health states only."""

    name = "gpu-scorer"

    def __init__(self, model: FailureModel | None, hub: AlertHub | None = None, *,
                 interval_s: float = DEFAULT_INTERVAL_S, history_s: float = feature_module.HISTORY_S, clock: str = WALL,
                 load_model: Callable[[], FailureModel | None] | None = None,
                 false_alarm_budget: float = DEFAULT_FALSE_ALARM_BUDGET) -> None:
        if clock not in (WALL, DATA, AUTO):
            raise ValueError(f"clock {clock!r}: expected {WALL!r}, {DATA!r} or {AUTO!r}")
        super().__init__(interval_s)
        self.model = model
        self.false_alarm_budget = false_alarm_budget
        self.calibrator: BudgetCalibrator | None = None
        self.threshold: float | None = None
        self._use_model_threshold()
        self._faults_told: set[tuple[str, int, int]] = set()
        self._on_data_clock = clock == DATA
        self.ready = threading.Event()
        self._load_model = load_model
        self.hub = hub
        self.clock = clock
        self.history = MinuteHistory(history_s)
        self.rounds = 0
        self.scored_at_ms: int | None = None  # the "now" of the last round
        # per GPU, its newest sample time when the catch-up last looked at it
        self._caught_up_ms: dict[tuple[str, int], int] = {}
        self._arrivals = SampleArrivals()
        self._latest: dict[tuple[str, int], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def bind(self, store: ScoringReads) -> None:
        """Use ``store``; what it already holds counts as scored (by an earlier collector, or not at all), so
        the catch-up covers only data that arrives from now on, not, after a restart, two days of history."""
        super().bind(store)
        self._arrivals = SampleArrivals()
        self._caught_up_ms = self._newly_stored(store)

    def start(self, store: ScoringReads) -> Mapping[str, Any]:
        if self._load_model is None:
            self.ready.set()
            return super().start(store)
        self.bind(store)
        threading.Thread(target=self._load_then_begin, name="model-loader", daemon=True).start()
        return self.handlers()

    def _load_then_begin(self) -> None:
        started = time.perf_counter()
        assert self._load_model is not None, "start() loads in the background only with a loader"
        try:
            self.model = self._load_model()
        except Exception as exc:  # a bad model file must not take ingest and queries down with it
            log.error("the failure model cannot be loaded (%s): GPUs get health states, no failure risk", exc)
        self._use_model_threshold()
        if self.model is not None and self.hub is not None:
            self.hub.use_policy(self.model.alert_policy())
        log.info("failure model %s in %.1f s; scoring every %g s", "loaded" if self.model else "not loaded",
                 time.perf_counter() - started, self.interval_s)
        self.ready.set()
        self.begin_rounds()

    def _use_model_threshold(self) -> None:
        """The budget calibrator of the (now) loaded model, starting from its saved threshold."""
        if self.model is None:
            return
        model = self.model
        self.calibrator = BudgetCalibrator(self.false_alarm_budget, model.threshold, step_s=model.step_s,
                                           keep_firing_for_s=model.alert_policy().keep_firing_for_s,
                                           horizon_s=model.horizon_s)
        self.threshold = model.threshold

    def run_round(self) -> object:
        return self.score_once()

    def score_once(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """Score every GPU at ``now_ms`` (default: now on the scorer's clock), feed the alerts, keep the result
        for metrics. On the data clock before any sample is stored there is nothing to score: []."""
        now = self._now_ms() if now_ms is None else now_ms
        if now is None:
            return []
        started = time.perf_counter()
        if now_ms is None:
            self._catch_up(now)
        gpus = score_gpus(self.bound_store, self.model, now, self.history)
        if self.calibrator is not None:
            self._tell_faults(now)
            self.threshold = self.calibrator.threshold(now)
        if self.hub is not None and self.model is not None:
            if self.hub.engine is not None and self.threshold is not None:
                self.hub.engine.policy = self.hub.engine.policy.with_threshold(self.threshold)
            self.hub.observe_risk([observation(g, now) for g in gpus], now_ms=now)
        if self.calibrator is not None and gpus:
            self.calibrator.observe(now, [(g["node"], g["gpu_index"]) for g in gpus],
                                    np.array([g["risk"] for g in gpus], dtype=float))
        with self._lock:
            self._latest = {(g["node"], g["gpu_index"]): g for g in gpus}
            self.rounds += 1
            self.scored_at_ms = now
        log.debug("scored %d GPUs in %.3f s", len(gpus), time.perf_counter() - started)
        return gpus

    def _catch_up(self, now_ms: int) -> None:
        """Data can arrive far faster than rounds run: a recording streamed into the collector, agents on
        --sim-speed, an agent's spool of hours drained after an outage of the collector or the network. A round
        would jump from before a GPU's risk rose to after it failed, and no alert would ever fire. So the steps
        of the model that each GPU's newly arrived samples cover (at most ``CATCH_UP_S`` of data time) are
        scored first, in one vectorised pass, and the alerts see each step as they would live, as
        ``replay --offline`` does. Data that keeps up with the rounds costs nothing here.

        What is new is judged per GPU, by its newest sample against the one seen at its last catch-up, not by
        the newest time in the store: one node's recording may arrive after another's has already carried the
        data clock past all of its times. Only what arrived since the last look is read
        (:mod:`~gpuwatch.collector.store.arrivals`): about one round of samples, not the whole raw tier."""
        store = self._store
        if self.hub is None or self.model is None or store is None:
            return  # nothing scored (the model may still be loading): the next round starts from the same place
        floor = now_ms - int(CATCH_UP_S * 1000)
        newest = self._newly_stored(store, floor)
        keeps_up_ms = max(self.model.step_s * 1000, int(self.interval_s * 1000))
        # the GPUs whose new data this round's live score at ``now_ms`` does not cover (more of it than a step,
        # or behind the data clock), and where their new data starts
        since: dict[tuple[str, int], int] = {}
        for key, t in newest.items():
            seen = max(self._caught_up_ms.get(key, floor), floor)
            if t > seen and (t - seen > keeps_up_ms or now_ms - t > keeps_up_ms):
                since[key] = seen
            self._caught_up_ms[key] = max(t, self._caught_up_ms.get(key, t))
        if not since:
            return  # rounds keep up with the data
        start, end = min(since.values()), min(now_ms - 1, max(newest[key] for key in since))
        if self.hub.engine is not None and self.threshold is not None:
            self.hub.engine.policy = self.hub.engine.policy.with_threshold(self.threshold)
        self.hub.observe_risk_rounds(
            (t, [observation(g, t) for g in gpus if g["risk"] is not None
                 and t > since.get((g["node"], g["gpu_index"]), now_ms)])
            for t, gpus in score_history(store, self.model, start, end))

    def _newly_stored(self, store: ScoringReads, floor_ms: int | None = None) -> dict[tuple[str, int], int]:
        """The newest sample time of each GPU with samples stored since the last look (the first: all of them)."""
        after, nodes = self._arrivals.where(store, floor_ms)
        newest = store.newest_samples(after, nodes)
        self._arrivals.saw(newest, nodes)
        return newest

    def _tell_faults(self, now_ms: int) -> None:
        """Fatal XIDs since the last round: the GPUs' recent scores were true alarms, not false ones."""
        assert self.calibrator is not None, "told only to a calibrator"
        recent = fatal_xids(self.bound_store, now_ms, self.history.history_s)
        self._faults_told = {k for k in self._faults_told if k[2] > now_ms - self.history.history_s * 1000}
        for ev in recent.itertuples():
            key = (ev.node, int(ev.gpu_index), int(ev.t_ms))
            if key not in self._faults_told:
                self._faults_told.add(key)
                self.calibrator.fault((ev.node, int(ev.gpu_index)), int(ev.t_ms))

    def _now_ms(self) -> int | None:
        wall = int(time.time() * 1000)
        if self.clock == WALL:
            return wall
        newest = newest_sample_ms(self.bound_store)
        if self.clock == DATA or newest is None:
            return newest
        if not self._on_data_clock and abs(newest - wall) > AUTO_SKEW_S * 1000:
            self._on_data_clock = True
            log.warning("scoring on the data clock: the newest sample is %.1f h from the wall clock (agents on "
                        "simulated time, e.g. --sim-speed, or a replay)", (newest - wall) / 3.6e6)
        return newest if self._on_data_clock else wall

    def latest(self) -> dict[tuple[str, int], dict[str, Any]]:
        """The last round's result per (node, GPU index)."""
        with self._lock:
            return dict(self._latest)
