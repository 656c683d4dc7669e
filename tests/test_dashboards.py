"""Grafana dashboards and Prometheus rules: structure, PromQL that parses, metrics that exist, promtool."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from gpuwatch.agent.node_metrics import NodeMetrics
from gpuwatch.agent.spool import Spool
from gpuwatch.collector.snapshot import build_snapshot
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.core.metrics_catalogue import EXPORTED_METRICS
from helpers import make_batch

ROOT = Path(__file__).resolve().parent.parent / "dashboards"
DASHBOARD_FILES = sorted((ROOT / "grafana").glob("*.json"))
RULES, RULES_TEST = ROOT / "prometheus" / "rules.yml", ROOT / "prometheus" / "rules_test.yml"
PROMTOOL = shutil.which("promtool")
MIN_SCHEMA_VERSION = 36
DS_UID = "${datasource}"
# Grafana's built-in interval variables, then dashboard variables: substituted before parsing.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in DASHBOARD_FILES}


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # collapsed rows


def _substitute(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    return re.sub(r"\$\{?\w+(:\w+)?\}?", "x", expr)


def _metrics_in(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(_substitute(expr)), visit)
    return names


def _known(metric: str) -> bool:
    if metric in EXPORTED_METRICS:
        return True
    base, _, suffix = metric.rpartition("_")
    return suffix in ("bucket", "sum", "count") and EXPORTED_METRICS.get(base) == "histogram"


def test_dashboards_exist_and_match_their_generator():
    generator = _load_generator()
    assert {p.stem for p in DASHBOARD_FILES} == set(generator.DASHBOARDS)
    for path in DASHBOARD_FILES:
        assert path.read_text() == generator.render(path.stem), f"{path.name} is stale: run dashboards/generate.py"


def test_uids_ids_schema_and_datasource_variable():
    uids = []
    for name, dash in _dashboards().items():
        uids.append(dash["uid"])
        assert dash["schemaVersion"] >= MIN_SCHEMA_VERSION, name
        variables = dash["templating"]["list"]
        ds_vars = [v for v in variables if v["type"] == "datasource"]
        assert [v["name"] for v in ds_vars] == ["datasource"] and ds_vars[0]["query"] == "prometheus", name
        for var in variables:
            if var["type"] == "query":
                assert var["datasource"]["uid"] == DS_UID, (name, var["name"])
        ids = [p["id"] for p in _panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in _panels(dash):
            where = f"{name} panel {panel['title']!r}"
            assert panel["datasource"]["uid"] == DS_UID, where
            assert panel["targets"] and all(t["datasource"]["uid"] == DS_UID for t in panel["targets"]), where
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where
    assert len(uids) == len(set(uids)) == len(DASHBOARD_FILES)


def _dashboard_exprs():
    for name, dash in _dashboards().items():
        for panel in _panels(dash):
            for target in panel["targets"]:
                yield f"{name}: {panel['title']}", target["expr"]
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                query = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"]["query"])
                assert query, var
                yield f"{name}: variable {var['name']}", query.group(1)


def _rule_exprs():
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]


@pytest.mark.parametrize("where, expr", [*_dashboard_exprs(), *_rule_exprs()])
def test_expression_parses_and_uses_exported_metrics(where, expr):
    metrics = _metrics_in(expr)
    assert metrics, f"{where}: no metric in {expr!r}"
    unknown = sorted(m for m in metrics if not _known(m))
    assert not unknown, f"{where}: metrics not exported: {unknown}"


def _agent_families(snapshot: dict) -> set[str]:
    return {f"gpuwatch_agent_{key}" for agent in snapshot["agents"] for key in agent} & set(EXPORTED_METRICS)


@pytest.fixture(scope="module")
def agent_only_metrics(tmp_path_factory) -> set[str]:
    """Metrics only the agents' node-local /metrics export: the agents' series an agent fills from its spool
    less those the collector fills from its store (everything else an agent exports the collector does too)."""
    tmp = tmp_path_factory.mktemp("sources")
    store = DuckDBStore(str(tmp / "s.duckdb"))
    try:
        store.write(make_batch(1))
        collector = _agent_families(build_snapshot(store))
    finally:
        store.close()
    agent = _agent_families(NodeMetrics("n1", [], Spool(tmp / "spool")).snapshot())
    assert collector and agent
    return agent - collector


def test_dashboard_panels_read_what_the_collector_exports_or_say_they_need_the_agents(agent_only_metrics):
    """A panel on a series the collector never exports is empty where Prometheus scrapes only the collector."""
    generator = _load_generator()
    for name, dash in _dashboards().items():
        for panel in _panels(dash):
            used = set().union(*(_metrics_in(t["expr"]) for t in panel["targets"]))
            if used & agent_only_metrics:
                assert generator.AGENT_METRICS_NOTE in panel["description"], (
                    f"{name} panel {panel['title']!r} reads {sorted(used & agent_only_metrics)}, which only the "
                    "agents' /metrics export, and does not say so")


def test_rates_use_grafana_rate_interval():
    for where, expr in _dashboard_exprs():
        for window in re.findall(r"(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), f"{where}: fixed window [{window}]"


def test_rule_file_covers_the_operational_alerts():
    alerts = {name.removeprefix("rule ") for name, _ in _rule_exprs()}
    assert {"GpuFailureRiskHigh", "GpuHealthFail", "GpuXidFatal", "GpuXidRateHigh", "JobLostTimeHigh",
            "JobStragglerPresent", "CollectorIngestStalled", "AgentSpoolDropping"} <= alerts
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert alerts <= tested, f"alerts without a promtool unit test: {sorted(alerts - tested)}"


def test_provisioning_files():
    dashboards = yaml.safe_load((ROOT / "provisioning" / "dashboards" / "gpuwatch.yml").read_text())
    provider = dashboards["providers"][0]
    assert dashboards["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]
    datasources = yaml.safe_load((ROOT / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus')")
@pytest.mark.parametrize("command", [["check", "rules", str(RULES)], ["test", "rules", str(RULES_TEST)]])
def test_promtool(command):
    result = subprocess.run([PROMTOOL, *command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
