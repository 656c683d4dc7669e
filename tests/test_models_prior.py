"""`gpuwatch train --prior`: a site with too few faults to learn a ranking from still gets one that ranks."""
from __future__ import annotations

import json

import pytest
from sklearn.metrics import average_precision_score

from gpuwatch.apps.cli import main
from gpuwatch.core.errors import UserError
from gpuwatch.models.dataset import build_dataset
from gpuwatch.models.model import load_model
from gpuwatch.models.train import train_model
from gpuwatch.simulator.failing_fleet import FleetConfig, simulate_fleet
from gpuwatch.simulator.prior import describe_prior, prior_datasets

#: A small site: about 8 faults in 8 days, so its first 60% holds a handful and its validation block one or none.
SITE = dict(nodes=4, gpus_per_node=8, days=8, resolution_s=600, fault_rate_multiplier=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    for name, seed in (("month", 21), ("no-validation-fault", 22), ("next", 23)):
        simulate_fleet(FleetConfig(seed=seed, **SITE), root / name, quiet=True)
    return root


@pytest.fixture(scope="module")
def prior(site):
    ds = build_dataset(site / "month", quiet=True)
    return prior_datasets(horizon_s=ds.horizon_s, warning_s=ds.warning_s, step_s=ds.step_s)


def held_out_ap(model, data) -> float:
    """Average precision of the model's scores against the labels of the uncensored rows of ``data``."""
    rows = data.rows[~data.rows["censored"].to_numpy()]
    return float(average_precision_score(rows["label"], model.risk(rows)))


def test_the_prior_ranks_the_next_period_better_than_the_site_alone(site, prior):
    month, nxt = build_dataset(site / "month", quiet=True), build_dataset(site / "next", quiet=True)
    alone = train_model(month, quiet=True)
    both = train_model(month, quiet=True, prior=prior, prior_name=describe_prior())
    base_rate = float(nxt.rows.loc[~nxt.rows["censored"], "label"].mean())
    ap_alone, ap_both = held_out_ap(alone, nxt), held_out_ap(both, nxt)
    assert ap_both > ap_alone and ap_both > 20 * base_rate, (ap_alone, ap_both, base_rate)
    assert both.training.prior.startswith("simulated") and both.training.site_weight > 1
    assert alone.training.prior == "none" and alone.training.site_weight == 1
    # the record names the site's data only, so `evaluate` on it still judges its test block alone
    assert both.training.fingerprint == month.source.fingerprint


def test_a_site_without_a_validation_fault_trains_only_with_the_prior(site, prior):
    ds = build_dataset(site / "no-validation-fault", quiet=True)
    with pytest.raises(UserError, match="too few faults"):
        train_model(ds, quiet=True)
    model = train_model(ds, quiet=True, prior=prior, prior_name=describe_prior())
    assert held_out_ap(model, build_dataset(site / "next", quiet=True)) > 0.1


def test_cli_prior_flag_and_training_record(site, tmp_path, capsys):
    out = tmp_path / "m.skops"
    assert main(["train", str(site / "no-validation-fault"), "--horizon", "1h", "-o", str(out), "--json",
                 "--quiet"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["prior"] == describe_prior() and training["site_weight"] > 1
    assert load_model(out).training.prior == describe_prior()
    assert main(["train", str(site / "no-validation-fault"), "--horizon", "1h", "-o", str(out), "--prior", "none",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "too few faults" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as bad:  # argparse: usage and one line naming the choices
        main(["train", str(site / "month"), "-o", str(out), "--prior", "uniform", "--quiet"])
    assert bad.value.code == 2 and "--prior" in capsys.readouterr().err
