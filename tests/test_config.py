"""Configuration precedence (flags > env > file > defaults) and errors naming key, source and problem."""
from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

import pytest

from gpuwatch.core import settings as config
from gpuwatch.core.settings import AGENT_OPTIONS, COLLECTOR_OPTIONS, Option, load_config
from gpuwatch.core.errors import UserError

SCHEMA = (
    Option("listen", str, "127.0.0.1:7700", "listen address", config.address),
    Option("interval", float, 1.0, "seconds", config.positive),
    Option("retries", int, 3, "count", config.non_negative),
    Option("insecure", bool, False, "allow plaintext"),
    Option("token_file", str, None, "token"),
)


def _parse(argv, schema=SCHEMA):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, schema)
    return parser.parse_args(argv)


def _toml(tmp_path, text):
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_given():
    cfg = load_config(SCHEMA, _parse([]), env={})
    assert dict(cfg) == {"listen": "127.0.0.1:7700", "interval": 1.0, "retries": 3, "insecure": False,
                         "token_file": None}
    assert cfg.interval == 1.0 and cfg.source("interval") == "default"


def test_precedence_flags_over_env_over_file(tmp_path):
    path = _toml(tmp_path, 'interval = 5\nretries = 7\nlisten = "0.0.0.0:1"\ninsecure = true\n')
    env = {"GPUWATCH_INTERVAL": "2.5", "GPUWATCH_RETRIES": "9", "GPUWATCH_UNRELATED": "x"}
    cfg = load_config(SCHEMA, _parse(["--config", str(path), "--interval", "0.5", "--no-insecure"]), env=env)
    assert cfg.interval == 0.5 and cfg.source("interval") == "flag --interval"
    assert cfg.retries == 9 and cfg.source("retries") == "environment variable GPUWATCH_RETRIES"
    assert cfg.listen == "0.0.0.0:1" and cfg.source("listen") == f"config file {path}"
    assert cfg.insecure is False and cfg.source("insecure") == "flag --insecure"
    assert isinstance(load_config(SCHEMA, None, env={}, path=path).interval, float)  # TOML int -> float


def test_config_path_from_environment(tmp_path):
    path = _toml(tmp_path, "retries = 1\n")
    assert load_config(SCHEMA, None, env={"GPUWATCH_CONFIG": str(path)}).retries == 1


@pytest.mark.parametrize(
    "toml_text, env, argv, message",
    [
        ("retires = 1\n", {}, [], r"config file .*gpuwatch.toml: unknown key 'retires' \(did you mean 'retries'\?\)"),
        ("zzz = 1\n", {}, [], r"unknown key 'zzz' \(known keys: listen, interval"),
        ('retries = "3"\n', {}, [], r"retries \(from config file .*\): expected an integer, got str '3'"),
        ("retries = true\n", {}, [], r"retries \(from config file .*\): expected an integer, got bool"),
        ("interval = -1\n", {}, [], r"interval \(from config file .*\): must be greater than 0, got -1"),
        ('listen = "nowhere"\n', {}, [], r"listen \(from config file .*\): 'nowhere' is not HOST:PORT"),
        ("[agent]\nretries = 1\n", {}, [], r"unknown key 'agent'"),
        ("retries = \n", {}, [], r"config file .*gpuwatch.toml: not valid TOML"),
        ("", {"GPUWATCH_RETRIES": "many"}, [], r"retries \(from environment variable GPUWATCH_RETRIES\): "
                                                r"expected an integer, got 'many'"),
        ("", {"GPUWATCH_INSECURE": "maybe"}, [], r"insecure \(from environment variable GPUWATCH_INSECURE\): "
                                                 r"expected true or false"),
        ("", {}, ["--retries", "-2"], r"retries \(from flag --retries\): must not be negative, got -2"),
        ("", {}, ["--listen", "10.0.0.1:99999"], r"listen \(from flag --listen\): .*port '99999' is not a number"),
        ("", {}, ["--listen", "::1:80"], r"write IPv6 addresses in brackets"),
    ],
)
def test_errors_name_key_source_and_problem(tmp_path, toml_text, env, argv, message):
    path = _toml(tmp_path, toml_text)
    with pytest.raises(UserError, match=message):
        load_config(SCHEMA, _parse(argv), env=env, path=path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"config file .*nope.toml: not found"):
        load_config(SCHEMA, None, env={}, path=tmp_path / "nope.toml")


def test_mapping_args_with_text_values_are_parsed():
    cfg = load_config(SCHEMA, {"interval": "0.25", "insecure": "yes", "unrelated": 1}, env={})
    assert cfg.interval == 0.25 and cfg.insecure is True


@pytest.mark.parametrize("text, expected", [("127.0.0.1:0", ("127.0.0.1", 0)), ("[::]:9400", ("::", 9400)),
                                            ("collector.example:7700", ("collector.example", 7700))])
def test_split_address(text, expected):
    assert config.split_address(text) == expected


@pytest.mark.parametrize("schema", [AGENT_OPTIONS, COLLECTOR_OPTIONS])
def test_component_schemas_build_flags_and_load_defaults(schema):
    keys = [o.key for o in schema]
    assert len(keys) == len(set(keys))
    cfg = load_config(schema, _parse([], schema), env={})
    assert set(cfg) == set(keys)


def test_collector_url_check():
    with pytest.raises(UserError, match=r"alertmanager_url \(from flag --alertmanager-url\): 'am:9093' is not"):
        load_config(COLLECTOR_OPTIONS, _parse(["--alertmanager-url", "am:9093"], COLLECTOR_OPTIONS), env={})


@dataclass(frozen=True)
class _Settings:
    poll_interval: float = config.setting(2.5, "seconds between polls", config.positive)
    target: str | None = config.setting(None, "where to send")
    run_only: int = 7  # not a setting: no flag, no variable, no file key


def test_one_declaration_gives_flag_env_file_key_default_and_help(tmp_path, capsys):
    (interval, target) = config.options(_Settings)
    assert (interval.key, interval.flag, interval.env_var, interval.type, interval.default) == \
        ("poll_interval", "--poll-interval", "GPUWATCH_POLL_INTERVAL", float, 2.5)
    assert (target.type, target.default) == (str, None)  # "str | None" is a str that may be unset
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, config.options(_Settings))
    help_text = " ".join(parser.format_help().split())
    assert "--poll-interval POLL_INTERVAL seconds between polls (default: 2.5; env GPUWATCH_POLL_INTERVAL)" \
        in help_text and "--run-only" not in help_text
    path = _toml(tmp_path, 'target = "here"\n')
    cfg = load_config(config.options(_Settings), parser.parse_args([]), env={"GPUWATCH_POLL_INTERVAL": "4"},
                      path=path)
    assert cfg.build(_Settings, run_only=1) == _Settings(poll_interval=4.0, target="here", run_only=1)
    with pytest.raises(UserError, match="poll_interval .*must be greater than 0") as bad:
        load_config(config.options(_Settings), {"poll_interval": 0.0}, env={})
    assert "\n" not in str(bad.value)


def test_an_unknown_key_is_one_line_naming_file_and_key(tmp_path):
    path = _toml(tmp_path, 'listen = "127.0.0.1:7700"\njob_gpu = 8\n')
    with pytest.raises(UserError) as unknown:
        load_config(COLLECTOR_OPTIONS, None, env={}, path=path)
    assert str(unknown.value) == f"config file {path}: unknown key 'job_gpu' (did you mean 'job_gpus'?)"


def test_the_agent_config_is_its_settings_plus_one_run():
    from gpuwatch.agent.daemon import AgentConfig

    setting_keys = [o.key for o in AGENT_OPTIONS]
    assert [o.key for o in config.options(AgentConfig)] == setting_keys  # declared once, in AgentSettings
    assert {"tls_ca", "tls_cert", "tls_key", "token_file", "insecure"} <= set(setting_keys)
    cfg = load_config(AGENT_OPTIONS, {"interval": 0.5, "tls_ca": "ca.pem"}, env={}).build(AgentConfig,
                                                                                         drain_timeout=2.0)
    assert (cfg.interval, cfg.drain_timeout, cfg.tls_ca, cfg.node) == (0.5, 2.0, "ca.pem", socket.gethostname())


def test_a_client_reads_no_config_file(tmp_path):
    path = _toml(tmp_path, "interval = 1.0\n")  # an agent's file in GPUWATCH_CONFIG is not the client's
    cfg = load_config(config.CONNECTION_OPTIONS, None, env={"GPUWATCH_CONFIG": str(path),
                                                            "GPUWATCH_TLS_CA": "ca.pem"}, config_file=False)
    assert (cfg.collector, cfg.tls_ca) == (config.DEFAULT_COLLECTOR_ADDRESS, "ca.pem")


def test_agent_takes_a_list_of_collectors_and_names_a_bad_entry():
    cfg = load_config(AGENT_OPTIONS, _parse(["--collector", "a:7700,b:7700"], AGENT_OPTIONS), env={})
    assert cfg.collector == "a:7700,b:7700"
    with pytest.raises(UserError, match=r"collector \(from flag --collector\): 'b' is not HOST:PORT"):
        load_config(AGENT_OPTIONS, _parse(["--collector", "a:7700,b"], AGENT_OPTIONS), env={})
    with pytest.raises(UserError, match="an empty address in the list"):
        load_config(AGENT_OPTIONS, _parse(["--collector", "a:7700,"], AGENT_OPTIONS), env={})


def test_retention_zero_keeps_everything_and_negative_is_refused():
    assert load_config(COLLECTOR_OPTIONS, {"retention_days": 0.0}, env={}).retention_days == 0.0
    with pytest.raises(UserError, match=r"retention_days \(from flag --retention-days\): must not be negative"):
        load_config(COLLECTOR_OPTIONS, {"retention_days": -1.0}, env={})


def test_an_empty_variable_counts_as_unset():
    cfg = load_config(SCHEMA, _parse(["--listen", "127.0.0.1:9"]), env={"GPUWATCH_LISTEN": "", "GPUWATCH_RETRIES": ""})
    assert (cfg.listen, cfg.retries, cfg.source("retries")) == ("127.0.0.1:9", 3, "default")
