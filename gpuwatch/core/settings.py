"""Configuration for the long-running commands: TOML file, environment, flags.

Precedence is flags > environment (``GPUWATCH_<KEY>``) > file > defaults. Every value is checked when the
command starts, and a bad one stops it with one line naming the key, where the value came from (file path,
environment variable or flag) and what is wrong, so a typo in a config file never surfaces hours later.

A component declares its keys once as a tuple of :class:`Option`; :func:`add_arguments` turns them into
flags and :func:`load_config` merges and checks the sources. The agent and collector schemas live here so
that the example files in ``deploy/`` and the CLIs cannot drift apart.
"""
from __future__ import annotations

import argparse
import difflib
import ipaddress
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gpuwatch.core.errors import UserError

ENV_PREFIX = "GPUWATCH_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

Check = Callable[[Any], None]  # raises ValueError(problem) for a bad value


@dataclass(frozen=True)
class Option:
    """One configuration key: its type (str, int, float or bool), default, help and optional check."""

    key: str
    type: type
    default: Any
    help: str
    check: Check | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.key.upper()


# ---- value checks -------------------------------------------------------------------------------------

def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the problem otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} is not HOST:PORT (use 0.0.0.0:PORT for all interfaces)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{address!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"{address!r}: write IPv6 addresses in brackets, e.g. [::1]:{port_text}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{address!r}: port {port_text!r} is not a number from 0 to 65535")
    return host, int(port_text)


def address(value: str) -> None:
    split_address(value)


def addresses(value: str) -> None:
    """HOST:PORT, or several separated by commas."""
    parts = [a.strip() for a in value.split(",")]
    if not all(parts):
        raise ValueError(f"{value!r}: an empty address in the list (HOST:PORT[,HOST:PORT...])")
    for part in parts:
        split_address(part)


def positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")


def http_url(value: str) -> None:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{value!r} is not an http:// or https:// URL")


def one_of(*choices: str) -> Check:
    def check(value: str) -> None:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")

    return check


# ---- component schemas --------------------------------------------------------------------------------

DEFAULT_MEMORY_LIMIT = "1GB"  # gpuwatch.collector.store.base.DEFAULT_MEMORY_LIMIT
DEFAULT_SPAN_RETENTION_S = 1800.0  # gpuwatch.collector.store.base.DEFAULT_SPAN_RETENTION_S
DEFAULT_COLLECTOR_PORT = 7700  # gpuwatch.collector.server.DEFAULT_PORT
DEFAULT_SCORE_INTERVAL_S = 60.0  # gpuwatch.collector.scoring.DEFAULT_INTERVAL_S
DEFAULT_JOBS_INTERVAL_S = 30.0  # gpuwatch.collector.jobs.DEFAULT_INTERVAL_S
DEFAULT_JOBS_WINDOW_S = 300.0  # gpuwatch.collector.jobs.DEFAULT_WINDOW_S
DEFAULT_HANG_S = 300.0  # gpuwatch.collector.jobs.DEFAULT_HANG_S
DEFAULT_JOB_GPUS = 1024  # gpuwatch.collector.alerts.DEFAULT_JOB_GPUS
DEFAULT_CHECKPOINT_COST_S = 300.0  # gpuwatch.collector.alerts.DEFAULT_CHECKPOINT_COST_S
LOG_LEVEL = Option("log_level", str, "info", "log level", one_of("debug", "info", "warning", "error"))

AGENT_OPTIONS: tuple[Option, ...] = (
    Option("collector", str, f"127.0.0.1:{DEFAULT_COLLECTOR_PORT}",
           "collector address HOST:PORT, or several HOST:PORT,HOST:PORT sharing one store (failed over in turn)",
           addresses),
    Option("node", str, None, "node name (default: the hostname)"),
    Option("interval", float, 1.0, "fast-tier sampling interval in seconds", positive),
    Option("slow_interval", float, 30.0, "slow-tier (reliability counters) interval in seconds", positive),
    Option("batch_interval", float, 5.0, "how often a batch is cut and sent, seconds", positive),
    Option("spool", str, None, "spool directory (default /var/lib/gpuwatch/spool or ~/.cache/gpuwatch/spool)"),
    Option("spool_max_bytes", int, 256 * 1024 * 1024, "spool size bound; oldest batches dropped", positive),
    Option("probe_socket", str, None, "Unix socket the in-process training probe sends to"),
    Option("job_label", str, None, "environment variable naming the job (beyond SLURM/torchelastic)"),
    Option("metrics_listen", str, None, "optional node-local Prometheus endpoint HOST:PORT", address),
    Option("metrics_token_file", str, None, "bearer token Prometheus must send to the node-local endpoint"),
    Option("metrics_names", str, "gpuwatch",
           "metric names of the node-local endpoint: gpuwatch, or dcgm (dcgm-exporter's names and labels)",
           one_of("gpuwatch", "dcgm")),
    Option("tls_ca", str, None, "CA certificate (PEM) to verify the collector; enables TLS"),
    Option("tls_cert", str, None, "client certificate (PEM) for mutual TLS"),
    Option("tls_key", str, None, "client private key (PEM) for mutual TLS"),
    Option("token_file", str, None, "file holding the bearer token sent to the collector"),
    Option("insecure", bool, False,
           "allow a plaintext token to a non-loopback collector, and metrics beyond loopback without a token"),
    LOG_LEVEL,
)

COLLECTOR_OPTIONS: tuple[Option, ...] = (
    Option("listen", str, f"127.0.0.1:{DEFAULT_COLLECTOR_PORT}", "gRPC listen address HOST:PORT", address),
    Option("db", str, "gpuwatch.duckdb", "DuckDB database file (shorthand for --store PATH)"),
    Option("store", str, None, "store URL: PATH or duckdb:///PATH (embedded DuckDB), chdb:///DIR (in-process "
           "ClickHouse), clickhouse[s]://[USER:PASSWORD@]HOST:8123/DB (ClickHouse server); default --db"),
    Option("clickhouse_cluster", str, None, "ClickHouse cluster NAME: tables are ReplicatedMergeTree ON CLUSTER "
           "NAME behind Distributed tables (docs/scale.md)"),
    Option("memory_limit", str, DEFAULT_MEMORY_LIMIT, "the store engine's memory limit (e.g. 1GB)"),
    Option("span_retention", float, DEFAULT_SPAN_RETENTION_S, "seconds of raw probe spans kept per job (its own "
           "clock; per-step aggregates and step marks are kept for --retention-days; 0 keeps all)", non_negative),
    Option("retention_days", float, 30.0, "delete samples and events older than this (0 keeps everything)",
           non_negative),
    Option("max_workers", int, 16, "threads answering queries (ingest runs on the event loop, not on these)",
           positive),
    Option("max_in_flight", int, 4096, "batches received and not yet committed, all agents together; beyond it the "
           "collector stops reading streams until the store catches up", positive),
    Option("stream_idle_timeout", float, 300.0, "seconds an agent stream may send nothing before it is closed",
           positive),
    Option("max_ingest_streams", int, 20_000, "agent streams served at once; more are refused (RESOURCE_EXHAUSTED) "
           "and retry later", positive),
    Option("max_sample_age_days", float, 3650.0, "refuse batches with times further back than this", positive),
    Option("max_sample_ahead_days", float, 30.0, "refuse batches with times further ahead than this", positive),
    Option("metrics_listen", str, None, "Prometheus /metrics listen address HOST:PORT", address),
    Option("metrics_interval", float, 5.0, "seconds between /metrics renders (a scrape gets the last one)",
           positive),
    Option("metrics_token_file", str, None, "bearer token Prometheus must send to /metrics"),
    Option("metrics_gpu_telemetry", bool, True,
           "export per-GPU and host telemetry on /metrics; false when Prometheus scrapes the agents' own /metrics"),
    Option("tls_cert", str, None, "server certificate (PEM); enables TLS"),
    Option("tls_key", str, None, "server private key (PEM)"),
    Option("tls_client_ca", str, None, "CA (PEM) agents' client certificates must chain to (mutual TLS)"),
    Option("token_file", str, None, "file holding the bearer token agents and queries must send"),
    Option("insecure", bool, False, "allow listening on a non-loopback address without TLS"),
    Option("alertmanager_url", str, None, "Prometheus Alertmanager base URL", http_url),
    Option("webhook_url", str, None, "generic JSON webhook for alerts", http_url),
    Option("model", str, None, "failure model file (default: the bundled model)"),
    Option("score_interval", float, DEFAULT_SCORE_INTERVAL_S, "seconds between failure-scoring rounds", positive),
    Option("score_clock", str, "auto", "time failure scoring runs on: wall, data (the newest sample's time, for "
           "agents on simulated time or replays) or auto (data once the newest sample is over 15 min off the wall "
           "clock)", one_of("auto", "wall", "data")),
    Option("false_alarm_budget", float, 1.0, "failure alerts per 1,000 GPU-days accepted: the alert threshold is "
           "calibrated to it on the fleet's recent scores", positive),
    Option("jobs_interval", float, DEFAULT_JOBS_INTERVAL_S, "seconds between jobs-monitor rounds", positive),
    Option("jobs_window", float, DEFAULT_JOBS_WINDOW_S, "seconds of recent spans analysed per job", positive),
    Option("hang_threshold", float, DEFAULT_HANG_S,
           "seconds without a completed step or op before a job counts as hung", non_negative),
    Option("job_gpus", int, DEFAULT_JOB_GPUS, "GPUs of a typical job: sets its MTBF for the alerts' checkpoint advice",
           positive),
    Option("checkpoint_cost", float, DEFAULT_CHECKPOINT_COST_S,
           "seconds one checkpoint stalls a job: the alerts' checkpoint-now break-even", positive),
    LOG_LEVEL,
)


# ---- loading ------------------------------------------------------------------------------------------

class Config(Mapping[str, Any]):
    """The merged values, readable as ``cfg["key"]`` or ``cfg.key``; ``source(key)`` says where each came from."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str]) -> None:
        self._values = values
        self._sources = sources

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(key) from None

    def source(self, key: str) -> str:
        return self._sources[key]

    def __repr__(self) -> str:
        return f"Config({self._values!r})"


_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _from_text(option: Option, text: str) -> Any:
    """Environment variables and untyped flags arrive as text; parse them into the option's type."""
    if option.type is bool:
        word = text.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise ValueError(f"expected {_TYPE_WORDS[bool]} (1/0, yes/no, on/off), got {text!r}")
    if option.type in (int, float):
        try:
            return option.type(text.strip())
        except ValueError:
            raise ValueError(f"expected {_TYPE_WORDS[option.type]}, got {text!r}") from None
    return text


def _typed(option: Option, value: Any) -> Any:
    """Values from TOML or typed flags: accept the option's type (an int where a float is wanted)."""
    wanted = option.type
    ok = isinstance(value, wanted) and not (wanted is not bool and isinstance(value, bool))
    if wanted is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ValueError(f"expected {_TYPE_WORDS[wanted]}, got {type(value).__name__} {value!r}")
    return value


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"config file {path}: not found") from None
    except OSError as exc:
        raise UserError(f"config file {path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path}: not valid TOML: {exc}") from None


def _unknown_key(key: str, where: str, known: Sequence[str]) -> UserError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"
    return UserError(f"{where}: unknown key {key!r}{hint}")


def _flag_values(args: argparse.Namespace | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if args is None:
        return {}
    return vars(args) if isinstance(args, argparse.Namespace) else args


def load_config(
    schema: Sequence[Option],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] = os.environ,
    path: str | os.PathLike[str] | None = None,
) -> Config:
    """Merge defaults, the TOML file, ``GPUWATCH_<KEY>`` variables and flags (None = flag not given).

    The file is ``path``, else the ``config`` flag, else ``$GPUWATCH_CONFIG``, else none. Unknown keys in the
    file are errors; unrelated ``GPUWATCH_*`` variables are ignored because components share one environment.
    Raises :class:`UserError` naming key, source and problem.
    """
    flags = _flag_values(args)
    path = path or flags.get("config") or env.get(CONFIG_ENV)
    options = {o.key: o for o in schema}
    values = {o.key: o.default for o in schema}
    sources = {o.key: "default" for o in schema}

    def take(option: Option, raw: Any, where: str, parse: Callable[[Option, Any], Any]) -> None:
        try:
            value = parse(option, raw)
            if value is not None and option.check is not None:
                option.check(value)
        except ValueError as exc:
            raise UserError(f"{option.key} (from {where}): {exc}") from None
        values[option.key], sources[option.key] = value, where

    if path:
        file_path = Path(path)
        for key, raw in _read_file(file_path).items():
            if key not in options:
                raise _unknown_key(key, f"config file {file_path}", list(options))
            take(options[key], raw, f"config file {file_path}", _typed)
    for option in schema:
        if option.env_var in env:
            take(option, env[option.env_var], f"environment variable {option.env_var}", _from_text)
    for option in schema:
        raw = flags.get(option.key)
        if raw is not None:
            parse = _from_text if isinstance(raw, str) and option.type is not str else _typed
            take(option, raw, f"flag {option.flag}", parse)
    return Config(values, sources)


def add_arguments(parser: argparse.ArgumentParser, schema: Sequence[Option]) -> None:
    """Add ``--config`` and one flag per option; flags default to None so file and environment can apply."""
    parser.add_argument("--config", metavar="PATH", help=f"TOML config file (env {CONFIG_ENV})")
    for option in schema:
        shown = f"{option.help} (default: {option.default}; env {option.env_var})"
        if option.type is bool:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=shown)
        else:
            parser.add_argument(option.flag, type=option.type, default=None, metavar=option.key.upper(), help=shown)
