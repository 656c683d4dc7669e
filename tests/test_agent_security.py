"""The agent's settings (file, environment, flags) and its TLS / mutual TLS / bearer-token channel."""
import argparse

import pytest

from gpuwatch.apps import agent_cli as cli
from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.apps.agent_cli import simulated_agent
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.simulator.collector_sink import IngestSink
from gpuwatch.core.errors import UserError
from helpers import TOKEN


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_beat_environment_beat_file(tmp_path, monkeypatch):
    conf = tmp_path / "agent.toml"
    conf.write_text('collector = "10.0.0.1:7700"\ninterval = 2.0\nslow_interval = 20.0\nnode = "from-file"\n'
                    f'spool = "{tmp_path / "spool"}"\njob_label = "MY_JOB"\n')
    monkeypatch.setenv("GPUWATCH_INTERVAL", "3")
    monkeypatch.setenv("GPUWATCH_NODE", "from-env")
    cfg = cli.config_from_args(_args("--config", str(conf), "--node", "from-flag", "--simulate", "2"))
    assert (cfg.collector, cfg.interval, cfg.slow_interval, cfg.node) == ("10.0.0.1:7700", 3.0, 20.0, "from-flag")
    assert cfg.spool_dir == tmp_path / "spool" and cfg.job_label == "MY_JOB"
    assert cfg.probe_socket is None  # simulated fleets do not listen for probes unless asked


def test_bad_values_name_the_key_and_where_it_came_from(tmp_path, monkeypatch):
    conf = tmp_path / "agent.toml"
    conf.write_text("intervall = 1.0\n")
    with pytest.raises(UserError, match=r"config file .*agent.toml: unknown key 'intervall' \(did you mean 'interval'"):
        cli.config_from_args(_args("--config", str(conf)))
    monkeypatch.setenv("GPUWATCH_BATCH_INTERVAL", "-1")
    with pytest.raises(UserError, match=r"batch_interval \(from environment variable GPUWATCH_BATCH_INTERVAL\)"):
        cli.config_from_args(_args())


def test_record_without_collector_is_record_only_and_probe_socket_flags(tmp_path):
    cfg = cli.config_from_args(_args("--record", str(tmp_path / "r"), "--probe-socket", str(tmp_path / "p.sock")))
    assert cfg.collector is None and cfg.probe_socket == str(tmp_path / "p.sock")
    cfg = cli.config_from_args(_args("--collector", "127.0.0.1:9", "--record", "r", "--no-probe-socket"))
    assert cfg.collector == "127.0.0.1:9" and cfg.probe_socket is None


def _run(tmp_path, address, drain_timeout=30.0, **client_security):
    cfg = AgentConfig(collector=address, node="tls-node", interval=0.02, spool=tmp_path / "spool",
                      drain_timeout=drain_timeout, **client_security)
    with SimulatedNode(2, node="tls-node") as sim:
        return simulated_agent(cfg, sim).run(ticks=2)


@pytest.fixture
def mtls_sink(pki):  # noqa: F811
    sink = IngestSink()
    port = sink.start("127.0.0.1:0", cert=pki["server"], key=pki["server_key"], client_ca=pki["ca"], token=TOKEN)
    yield sink, f"127.0.0.1:{port}"
    sink.stop()


def test_agent_sends_over_mutual_tls_with_a_token(tmp_path, pki, mtls_sink):  # noqa: F811
    sink, address = mtls_sink
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    summary = _run(tmp_path, address, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"],
                   token_file=str(token))
    assert summary.pending == 0
    assert sum(len(s.ts_ms) for b in sink.store.batches.values() for s in b.samples) == 2 * 2


def test_wrong_token_or_rogue_certificate_is_refused_and_data_kept(tmp_path, pki, mtls_sink):  # noqa: F811
    _, address = mtls_sink
    token = tmp_path / "token"
    token.write_text("not-the-token")
    token.chmod(0o600)
    with pytest.raises(UserError, match="UNAUTHENTICATED.*kept in the spool"):
        _run(tmp_path, address, 2.0, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"],
             token_file=str(token))
    with pytest.raises(UserError, match="did not acknowledge.*kept in the spool"):
        _run(tmp_path, address, 2.0, tls_ca=pki["ca"], tls_cert=pki["rogue_client"], tls_key=pki["rogue_client_key"])
    assert len(list((tmp_path / "spool" / "batches").iterdir())) == 2


def test_missing_token_file_is_one_line_before_sampling(tmp_path):
    with pytest.raises(UserError, match=r"token file .*nope: not found"):
        _run(tmp_path, "127.0.0.1:1", token_file=str(tmp_path / "nope"))
