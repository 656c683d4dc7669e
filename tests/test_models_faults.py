"""Fault taxonomy: XID classes, evidence from events and counters, coalescing into episodes, precursor flags."""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.core import xids
from gpuwatch.models.faults import FATAL_XIDS, PRECURSOR_XIDS, fault_events, xid_class
from helpers import MIN, T0, event_rows, minute_samples

def test_xid_classes_follow_the_catalog():
    assert [xid_class(c) for c in (48, 64, 74, 79, 94, 119, 120, 95)] == ["fatal"] * 8  # 94 kills the job
    assert [xid_class(c) for c in (63, 92)] == ["precursor"] * 2
    assert [xid_class(c) for c in (13, 31, 43, 45)] == ["application"] * 4
    assert xid_class(99999) == "unknown"
    assert xids.FATAL <= FATAL_XIDS and not FATAL_XIDS & PRECURSOR_XIDS  # every catalogue fatal XID has a kind


def test_fatal_xids_coalesce_per_gpu_and_application_xids_are_not_faults():
    ev = event_rows(("n1", 0, T0, "xid", 79), ("n1", 0, T0 + 1000, "gpu_lost", 0), ("n1", 0, T0 + 40 * MIN, "xid", 79),
                ("n1", 0, T0 + 200 * MIN, "xid", 48),  # > 1 h later: a new episode
                ("n1", 1, T0, "xid", 13), ("n1", 1, T0, "xid", 43),  # application: features only
                ("n2", 0, T0, "xid", 74))
    ep = fault_events(ev, minute_samples("n1", 0, 1))
    assert list(zip(ep["node"], ep["gpu_index"], ep["start_ms"])) == [
        ("n1", 0, T0), ("n1", 0, T0 + 200 * MIN), ("n2", 0, T0)]
    assert ep["kinds"].tolist() == ["gpu_lost,xid_79", "xid_48", "xid_74"]
    assert ep["kind"].tolist() == ["bus", "memory", "nvlink"]
    assert ep["end_ms"].iloc[0] == T0 + 40 * MIN and ep["n_evidence"].iloc[0] == 3


def test_counter_evidence_dbe_and_remap_failure():
    dbe = np.r_[np.zeros(30), np.ones(30)]
    failure = np.r_[np.zeros(45), np.ones(15)]
    s = pd.concat([minute_samples("n1", 0, 60, gpu_ecc_dbe_volatile_total=dbe),
                   minute_samples("n1", 1, 60, gpu_remapped_rows_failure=failure)])
    ep = fault_events(event_rows(), s)
    assert ep[["gpu_index", "start_ms", "kinds"]].values.tolist() == [[0, T0 + 30 * MIN, "dbe"],
                                                                      [1, T0 + 45 * MIN, "remap_failure"]]


def test_had_precursor_separates_warned_from_sudden_faults():
    sbe = np.r_[np.zeros(100), np.cumsum(np.arange(140))]  # rising correctable errors before the fault
    s = pd.concat([minute_samples("n1", 0, 240, gpu_ecc_sbe_volatile_total=sbe), minute_samples("n1", 1, 240)])
    ev = event_rows(("n1", 0, T0 + 240 * MIN, "xid", 48), ("n1", 1, T0 + 240 * MIN, "xid", 119))
    ep = fault_events(ev, s)
    assert ep.set_index("gpu_index")["had_precursor"].to_dict() == {0: True, 1: False}


def test_a_pcie_link_falling_below_its_width_is_a_fault_of_its_own():
    """StepFun's "PCIe link width low" (16 % of its GPU faults) drains the node: a fault of kind pcie, found on the
    slow tier's samples too (the gauges missing between them), and only when the link fell: a GPU already
    narrow in its first sample, or one whose link generation drops (idle power saving), has none."""
    every_20 = np.arange(60) % 20 == 0
    slow = np.where(every_20, np.r_[np.full(40, 16.0), np.full(20, 4.0)], np.nan)
    s = pd.concat([minute_samples("n1", 0, 60, gpu_pcie_link_width=np.r_[np.full(45, 16.0), np.full(15, 8.0)]),
                   minute_samples("n1", 1, 60, gpu_pcie_link_width=slow,
                                  gpu_pcie_link_width_max=np.where(every_20, 16.0, np.nan)),
                   minute_samples("n1", 2, 60, gpu_pcie_link_width=8.0),
                   minute_samples("n1", 3, 60, gpu_pcie_link_gen=np.r_[np.full(30, 5.0), np.full(30, 1.0)],
                                  gpu_pcie_link_gen_max=5.0)])
    ep = fault_events(event_rows(), s)
    assert ep[["gpu_index", "start_ms", "kinds", "kind"]].values.tolist() == [
        [0, T0 + 45 * MIN, "pcie_width", "pcie"], [1, T0 + 40 * MIN, "pcie_width", "pcie"]]
