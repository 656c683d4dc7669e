"""Configuration precedence (flags > env > file > defaults) and errors naming key, source and problem."""
from __future__ import annotations

import argparse

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


def test_collector_defaults_match_the_components():
    from gpuwatch.collector import alerts, jobs, scoring, server

    assert config.DEFAULT_COLLECTOR_PORT == server.DEFAULT_PORT
    assert config.DEFAULT_SCORE_INTERVAL_S == scoring.DEFAULT_INTERVAL_S
    assert (config.DEFAULT_JOBS_INTERVAL_S, config.DEFAULT_JOBS_WINDOW_S, config.DEFAULT_HANG_S) == \
        (jobs.DEFAULT_INTERVAL_S, jobs.DEFAULT_WINDOW_S, jobs.DEFAULT_HANG_S)
    assert (config.DEFAULT_JOB_GPUS, config.DEFAULT_CHECKPOINT_COST_S) == \
        (alerts.DEFAULT_JOB_GPUS, alerts.DEFAULT_CHECKPOINT_COST_S)
    from gpuwatch.collector.store import base
    assert (config.DEFAULT_MEMORY_LIMIT, config.DEFAULT_SPAN_RETENTION_S) == \
        (base.DEFAULT_MEMORY_LIMIT, base.DEFAULT_SPAN_RETENTION_S)


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
