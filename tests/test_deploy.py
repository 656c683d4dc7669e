"""Deployment files: example configs load under the CLI schemas, systemd units verify, manifests are sane."""
from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuwatch.core.settings import AGENT_OPTIONS, COLLECTOR_OPTIONS, load_config, split_address

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SCHEMAS = {"agent": AGENT_OPTIONS, "collector": COLLECTOR_OPTIONS}


def _k8s(name: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"{name}: one object per kind expected"
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"], doc
    return by_kind


def _embedded_config(tmp_path: Path, manifest: dict, component: str):
    path = tmp_path / f"{component}.toml"
    path.write_text(manifest["ConfigMap"]["data"][f"{component}.toml"])
    return load_config(SCHEMAS[component], None, env={}, path=path)


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("component", ["agent", "collector"])
def test_example_config_loads_with_every_key_set_on_purpose(component):
    cfg = load_config(SCHEMAS[component], None, env={}, path=DEPLOY / f"{component}.toml")
    from_file = {key for key in cfg if cfg.source(key).startswith("config file")}
    assert {"tls_cert", "tls_key", "token_file"} <= from_file
    assert len(from_file) >= 10


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)  # DeviceAllow= repeats
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(DEPLOY / name)
    return parser


def test_agent_unit_cannot_starve_training_jobs():
    service = _unit("gpuwatch-agent.service")["Service"]
    assert service["Restart"] == "always"
    assert int(service["CPUQuota"].rstrip("%")) <= 25
    assert service["MemoryMax"].endswith("M") and int(service["MemoryMax"][:-1]) <= 512
    assert int(service["Nice"]) > 0 and service["IOSchedulingClass"] == "idle"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert "--config /etc/gpuwatch/agent.toml" in service["ExecStart"]


def test_collector_unit():
    unit = _unit("gpuwatch-collector.service")
    service = unit["Service"]
    assert service["Restart"] == "always" and service["DynamicUser"] == "yes"
    assert service["StateDirectory"] == "gpuwatch" and service["CapabilityBoundingSet"] == ""
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not shutil.which("gpuwatch"),
                    reason="systemd-analyze or the gpuwatch entry point not installed")
@pytest.mark.parametrize("name", ["gpuwatch-agent.service", "gpuwatch-collector.service"])
def test_systemd_analyze_verify(tmp_path, name):
    # verify wants ExecStart to exist: point it at this installation's entry point
    text = (DEPLOY / name).read_text().replace("/usr/local/bin/gpuwatch", shutil.which("gpuwatch"))
    (tmp_path / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_agent_daemonset(tmp_path):
    objects = _k8s("agent-daemonset.yaml")
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    container = _container(objects["DaemonSet"])
    limits = container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(limits) and "nvidia.com/gpu" not in limits
    assert container["securityContext"]["privileged"] is False
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev/kmsg"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/kmsg"]["name"]]["hostPath"]["path"] == "/dev/kmsg"
    assert all(m["name"] in volumes for m in container["volumeMounts"])
    cfg = _embedded_config(tmp_path, objects, "agent")
    spool_mount = next(p for p in mounts if cfg.spool.startswith(p + "/"))
    assert "hostPath" in volumes[mounts[spool_mount]["name"]], "the spool must survive pod restarts"
    assert any(cfg.tls_ca.startswith(p + "/") for p in mounts)


def test_collector_manifest_matches_its_config(tmp_path):
    objects = _k8s("collector.yaml")
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = _container(deployment)
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    cfg = _embedded_config(tmp_path, objects, "collector")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == split_address(cfg.listen)[1]
    assert ports["metrics"] == split_address(cfg.metrics_listen)[1]
    # beyond loopback, the config must bring its own protection (the collector refuses otherwise)
    assert cfg.tls_cert and cfg.token_file and cfg.metrics_token_file
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    db_mount = next(p for p in mounts if cfg.db.startswith(p + "/"))
    claim = volumes[mounts[db_mount]]["persistentVolumeClaim"]["claimName"]
    assert claim == objects["PersistentVolumeClaim"]["metadata"]["name"]
    service_ports = {p["name"]: p for p in objects["Service"]["spec"]["ports"]}
    assert set(service_ports) == set(ports)
    selector = objects["Service"]["spec"]["selector"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_agent_daemonset_points_at_the_collector_service(tmp_path):
    agent_cfg = _embedded_config(tmp_path, _k8s("agent-daemonset.yaml"), "agent")
    service = _k8s("collector.yaml")["Service"]
    host, port = split_address(agent_cfg.collector)
    assert host.startswith(f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc")
    assert port in {p["port"] for p in service["spec"]["ports"]}
