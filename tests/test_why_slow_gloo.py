"""A real multi-process torch.distributed (gloo) job with the probe, one rank's data loader made slow part way:
the slow rank is found from the probe's own spans with its onset, and the ranks that only wait are never
blamed (no GPU here: its cause is `unknown`, saying no GPU samples were there to check)."""
from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("torch")

from gloo_jobs import LOADER_ONSET, LOADER_SLOW_RANK, run_job, slow_loader_worker  # noqa: E402
from gpuwatch.collector.slow_evidence import rank_intervals  # noqa: E402
from gpuwatch.collector.why_slow import find_slow_ranks  # noqa: E402


def test_a_rank_with_a_slow_data_loader_is_found_with_its_onset_and_its_peers_are_not_blamed(tmp_path):
    _, rows = run_job(slow_loader_worker, 3, tmp_path)
    spans = pd.DataFrame(rows)
    intervals = rank_intervals(spans[spans["job_id"] == "dp-loader"])
    assert set(intervals["rank"]) == {0, 1, 2}
    (slow,) = find_slow_ranks(intervals, lambda since_us: {})
    assert slow.rank == LOADER_SLOW_RANK and slow.cause == "unknown" and "no GPU samples" in slow.evidence
    steps = spans[(spans["kind"] == "step") & (spans["rank"] == LOADER_SLOW_RANK)].set_index("step")["start_us"]
    # the onset within two steps of it: on a loaded machine each step's own work is noisy around the change
    assert steps[LOADER_ONSET - 2] <= slow.since_us <= steps[LOADER_ONSET + 2]
    assert slow.speedup_without > 0.5  # a second more per step: the job would run far faster without it
