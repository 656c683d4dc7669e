"""The prior `gpuwatch train` learns from beside a site's own data: simulated fleets of randomized configurations.

A site's month holds a handful of faults, too few to learn a ranking from (docs/failure-model.md §6: retrained
on its own first period, a held-out fleet got 0.00 recall, PR AUC 0.002), while models trained on simulated
fleets of randomized knobs transferred to fleets nobody tuned them to. So `train` learns from both: these
fleets, and the site's rows weighted up (models/train.py). The fleets are small and fast to simulate, so they
are generated on the fly into a temporary directory, each time the same (seeds fixed): no cache to go stale
when the simulator changes.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwatch.simulator.failing_fleet import randomized_config, simulate_fleet

if TYPE_CHECKING:  # the CLI reads PRIORS at start-up; the feature code loads only when training
    from gpuwatch.models.dataset import Dataset

#: What `gpuwatch train --prior` accepts; the first is the default.
PRIORS = ("simulated", "none")
PRIOR_FLEETS = 12
PRIOR_SEED = 7100
PRIOR_NODES, PRIOR_GPUS, PRIOR_DAYS, PRIOR_RESOLUTION_S = 4, 8, 14.0, 300.0
#: The real GPU fault rate scaled so that each prior fleet holds tens of faults to learn from.
PRIOR_FAULT_RATE_MULTIPLIER = 600.0


def describe_prior() -> str:
    """The prior as the model's training record names it."""
    return (f"simulated: {PRIOR_FLEETS} fleets of randomized configurations (simulator.failing_fleet."
            f"randomized_config, seeds {PRIOR_SEED}..{PRIOR_SEED + PRIOR_FLEETS - 1}), each {PRIOR_NODES}x"
            f"{PRIOR_GPUS} GPUs x {PRIOR_DAYS:g} days at {PRIOR_RESOLUTION_S:g} s, fault rate "
            f"x{PRIOR_FAULT_RATE_MULTIPLIER:g}")


def prior_datasets(*, horizon_s: float, warning_s: float, step_s: int) -> list[Dataset]:
    """The prior fleets' features and labels at the site's time scales (every call the same)."""
    from gpuwatch.models.dataset import build_dataset

    sets = []
    with tempfile.TemporaryDirectory(prefix="gpuwatch-prior-") as tmp:
        for k in range(PRIOR_FLEETS):
            out = Path(tmp) / f"fleet-{k}"
            cfg = replace(randomized_config(PRIOR_SEED + k), nodes=PRIOR_NODES, gpus_per_node=PRIOR_GPUS,
                          days=PRIOR_DAYS, resolution_s=PRIOR_RESOLUTION_S,
                          fault_rate_multiplier=PRIOR_FAULT_RATE_MULTIPLIER)
            simulate_fleet(cfg, out, quiet=True)
            sets.append(build_dataset(out, horizon_s=horizon_s, warning_s=warning_s, step_s=step_s, quiet=True))
    return sets
