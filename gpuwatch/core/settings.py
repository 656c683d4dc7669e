"""Configuration for the long-running commands: TOML file, environment, flags.

Precedence is flags > environment (``GPUWATCH_<KEY>``) > file > defaults. Every value is checked when the
command starts, and a bad one stops it with one line naming the key, where the value came from (file path,
environment variable or flag) and what is wrong, so a typo in a config file never surfaces hours later.

A component declares each setting once, as a :func:`setting` field of a dataclass (name = config-file key,
``--flag`` and ``GPUWATCH_`` variable; annotation = type; default, help text, check): :class:`AgentSettings`,
:class:`CollectorSettings` and :class:`ClientSecurity` (TLS and token of every client of the collector).
:func:`options` lists them as :class:`Option` records, :func:`add_arguments` turns those into flags,
:func:`load_config` merges and checks the sources and :meth:`Config.build` makes the settings object (the
agent's :class:`~gpuwatch.agent.daemon.AgentConfig` is an :class:`AgentSettings` with more fields). The
defaults the components also use (ports, intervals, limits) are named here and imported by them, so the
example files in ``deploy/``, the CLIs and the components cannot drift apart.
"""
from __future__ import annotations

import argparse
import difflib
import ipaddress
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gpuwatch.core.errors import UserError

ENV_PREFIX = "GPUWATCH_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

Check = Callable[[Any], None]  # raises ValueError(problem) for a bad value
T = typing.TypeVar("T")


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


def size_bytes(text: str) -> int:
    """'1GB', '512MiB', '2G' or a byte count as bytes (DuckDB's spelling of a memory limit); ValueError else."""
    upper = text.strip().upper().replace("IB", "B")
    for suffix, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10), ("T", 2**40), ("G", 2**30),
                          ("M", 2**20), ("K", 2**10), ("B", 1)):
        if upper.endswith(suffix) and upper[:-len(suffix)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[:-len(suffix)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"{text!r} is not a size such as 1GB or 512MB")


def memory_size(value: str) -> None:
    size_bytes(value)


def positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")


def duration(value: str) -> None:
    """A duration such as 90s, 5m, 1.5h, 2d (gpuwatch.core.times.parse_duration)."""
    from gpuwatch.core.times import parse_duration

    parse_duration(value)


def http_url(value: str) -> None:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{value!r} is not an http:// or https:// URL")


def one_of(*choices: str) -> Check:
    def check(value: str) -> None:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")

    return check


# ---- declaring settings -------------------------------------------------------------------------------

def setting(default: Any, help: str, check: Check | None = None) -> Any:
    """One field of a settings class: its default, help text and optional check. The field's name is the
    config-file key, ``--name-with-dashes`` the flag and ``GPUWATCH_NAME`` the environment variable; its
    annotation (str, int, float or bool, optionally ``| None``) the type."""
    return field(default=default, metadata={"help": help, "check": check})


def options(settings_class: type) -> tuple[Option, ...]:
    """The :class:`Option` of every :func:`setting` field of a settings dataclass, in declaration order."""
    hints = typing.get_type_hints(settings_class)
    found = []
    for f in fields(settings_class):
        if "help" not in f.metadata:
            continue  # a field the class adds beyond its settings (a run flag, a test hook)
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        found.append(Option(f.name, kind, f.default, f.metadata["help"], f.metadata["check"]))
    return tuple(found)


# ---- defaults the components share with the schema (they import them from here) ----------------------

DEFAULT_COLLECTOR_PORT = 7700
DEFAULT_COLLECTOR_ADDRESS = f"127.0.0.1:{DEFAULT_COLLECTOR_PORT}"
DEFAULT_MEMORY_LIMIT = "1GB"
DEFAULT_SPAN_RETENTION_S = 1800.0
DEFAULT_QUERY_WORKERS = 16
DEFAULT_MAX_IN_FLIGHT = 4096  # batches received and not yet committed, all streams together
DEFAULT_STREAM_IDLE_S = 300.0  # agents send every batch_interval (5 s by default)
DEFAULT_MAX_INGEST_STREAMS = 20_000  # one per agent; docs/scale.md sizes a collector for thousands
DEFAULT_SCORE_INTERVAL_S = 60.0
DEFAULT_FALSE_ALARM_BUDGET = 1.0  # false alarms per 1,000 GPU-days (docs/failure-model.md)
DEFAULT_JOBS_INTERVAL_S = 30.0
DEFAULT_JOBS_WINDOW_S = 300.0
DEFAULT_HANG_S = 300.0
DEFAULT_JOB_GPUS = 1024
DEFAULT_CHECKPOINT_COST_S = 300.0


# ---- component schemas --------------------------------------------------------------------------------

def log_level_setting() -> Any:
    """``log_level``, which every long-running command has."""
    return setting("info", "log level", one_of("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class ClientSecurity:
    """How a client (the agent, the query commands, replay) proves itself to the collector and checks it: TLS
    (``tls_ca``), mutual TLS (``tls_cert``/``tls_key``) and the bearer token in ``token_file``.
    :func:`gpuwatch.core.security.client_channel` opens a channel with it."""

    tls_ca: str | None = setting(None, "CA certificate (PEM) to verify the collector; enables TLS")
    tls_cert: str | None = setting(None, "client certificate (PEM) for mutual TLS")
    tls_key: str | None = setting(None, "client private key (PEM) for mutual TLS")
    token_file: str | None = setting(None, "file holding the bearer token sent to the collector")
    insecure: bool = setting(False, "allow a plaintext token to a non-loopback collector (the agent: also its "
                                    "metrics endpoint beyond loopback without a token)")


@dataclass(frozen=True)
class AgentSettings(ClientSecurity):
    """``gpuwatch agent`` (deploy/agent.toml). :class:`gpuwatch.agent.daemon.AgentConfig` extends it with what
    one run adds."""

    collector: str | None = setting(DEFAULT_COLLECTOR_ADDRESS, "collector address HOST:PORT, or several "
                                    "HOST:PORT,HOST:PORT sharing one store (failed over in turn)", addresses)
    node: str | None = setting(None, "node name (default: the hostname)")
    interval: float = setting(1.0, "fast-tier sampling interval in seconds", positive)
    slow_interval: float = setting(30.0, "slow-tier (reliability counters) interval in seconds", positive)
    batch_interval: float = setting(5.0, "how often a batch is cut and sent, seconds", positive)
    spool: str | None = setting(None, "spool directory (default /var/lib/gpuwatch/spool or ~/.cache/gpuwatch/spool)")
    spool_max_bytes: int = setting(256 * 1024 * 1024, "spool size bound; oldest batches dropped", positive)
    probe_socket: str | None = setting(None, "Unix socket the in-process training probe sends to")
    job_label: str | None = setting(None, "environment variable naming the job (beyond SLURM/torchelastic)")
    kubelet_socket: str | None = setting(None, "the kubelet's pod-resources socket, to name each GPU's pod (default "
                                         "/var/lib/kubelet/pod-resources/kubelet.sock when it exists)")
    nccl_inspector_dir: str | None = setting(None, "directory of NCCL inspector plugin dumps "
                                             "(NCCL_INSPECTOR_DUMP_DIR) to send as collective spans")
    metrics_listen: str | None = setting(None, "optional node-local Prometheus endpoint HOST:PORT", address)
    metrics_token_file: str | None = setting(None, "bearer token Prometheus must send to the node-local endpoint")
    metrics_names: str = setting("gpuwatch", "metric names of the node-local endpoint: gpuwatch, dcgm "
                                 "(dcgm-exporter 4.9's names, units and labels) or dcgm-legacy (up to 4.8's)",
                                 one_of("gpuwatch", "dcgm", "dcgm-legacy"))
    log_level: str = log_level_setting()


@dataclass(frozen=True)
class CollectorSettings:
    """``gpuwatch collector`` (deploy/collector.toml): the command builds it once from its sources;
    :func:`gpuwatch.collector.assembly.start_collector` and :func:`gpuwatch.collector.server.serve` take it whole."""

    listen: str = setting(DEFAULT_COLLECTOR_ADDRESS, "gRPC listen address HOST:PORT", address)
    db: str = setting("gpuwatch.duckdb", "DuckDB database file (shorthand for --store PATH)")
    store: str | None = setting(None, "store URL: PATH or duckdb:///PATH (embedded DuckDB), chdb:///DIR (in-process "
                                "ClickHouse), clickhouse[s]://[USER:PASSWORD@]HOST:8123/DB (ClickHouse server); "
                                "default --db")
    clickhouse_cluster: str | None = setting(None, "ClickHouse cluster NAME: tables are ReplicatedMergeTree ON "
                                             "CLUSTER NAME behind Distributed tables (docs/scale.md)")
    memory_limit: str = setting(DEFAULT_MEMORY_LIMIT, "memory the store engine may use, e.g. 1GB (DuckDB's buffer "
                                "manager; ClickHouse: per query); the collector's own memory (agent streams, "
                                "batches in flight, caches) comes on top: docs/operations.md, Memory", memory_size)
    span_retention: float = setting(DEFAULT_SPAN_RETENTION_S, "seconds of raw probe spans kept per job (its own "
                                    "clock; per-step aggregates and step marks are kept for --retention-days; 0 "
                                    "keeps all)", non_negative)
    retention_days: float = setting(30.0, "delete samples and events older than this (0 keeps everything)",
                                    non_negative)
    raw_retention: str = setting("2d", "DUR raw GPU samples are kept (e.g. 2d); older minutes are answered from "
                                 "per-minute rollups (min, max, mean, last per field); 0 keeps raw samples for "
                                 "--retention-days and builds no rollups", duration)
    rollup_retention: str = setting("90d", "DUR the per-minute rollups of GPU samples are kept (0 keeps them)",
                                    duration)
    max_workers: int = setting(DEFAULT_QUERY_WORKERS, "threads answering queries (ingest runs on the event loop, "
                               "not on these)", positive)
    max_in_flight: int = setting(DEFAULT_MAX_IN_FLIGHT, "batches received and not yet committed, all agents "
                                 "together; beyond it the collector stops reading streams until the store catches "
                                 "up", positive)
    stream_idle_timeout: float = setting(DEFAULT_STREAM_IDLE_S, "seconds an agent stream may send nothing before "
                                         "it is closed", positive)
    max_ingest_streams: int = setting(DEFAULT_MAX_INGEST_STREAMS, "agent streams served at once; more are refused "
                                      "(RESOURCE_EXHAUSTED) and retry later", positive)
    max_sample_age_days: float = setting(3650.0, "refuse batches with times further back than this", positive)
    max_sample_ahead_days: float = setting(30.0, "refuse batches with times further ahead than this", positive)
    metrics_listen: str | None = setting(None, "Prometheus /metrics listen address HOST:PORT", address)
    metrics_interval: float = setting(5.0, "seconds between /metrics renders (a scrape gets the last one)",
                                      positive)
    metrics_token_file: str | None = setting(None, "bearer token Prometheus must send to /metrics")
    metrics_gpu_telemetry: bool = setting(True, "export per-GPU and host telemetry on /metrics; false when "
                                          "Prometheus scrapes the agents' own /metrics")
    tls_cert: str | None = setting(None, "server certificate (PEM); enables TLS")
    tls_key: str | None = setting(None, "server private key (PEM)")
    tls_client_ca: str | None = setting(None, "CA (PEM) agents' client certificates must chain to (mutual TLS)")
    token_file: str | None = setting(None, "file holding the bearer token agents and queries must send")
    insecure: bool = setting(False, "allow listening on a non-loopback address without TLS")
    alertmanager_url: str | None = setting(None, "Prometheus Alertmanager base URL", http_url)
    webhook_url: str | None = setting(None, "generic JSON webhook for alerts", http_url)
    model: str | None = setting(None, "failure model file (default: the bundled model)")
    score_interval: float = setting(DEFAULT_SCORE_INTERVAL_S, "seconds between failure-scoring rounds", positive)
    score_clock: str = setting("auto", "time failure scoring runs on: wall, data (the newest sample's time, for "
                               "agents on simulated time or replays) or auto (data once the newest sample is over "
                               "15 min off the wall clock)", one_of("auto", "wall", "data"))
    false_alarm_budget: float = setting(DEFAULT_FALSE_ALARM_BUDGET, "failure alerts per 1,000 GPU-days accepted: "
                                        "the alert threshold is calibrated to it on the fleet's recent scores",
                                        positive)
    jobs_interval: float = setting(DEFAULT_JOBS_INTERVAL_S, "seconds between jobs-monitor rounds", positive)
    jobs_window: float = setting(DEFAULT_JOBS_WINDOW_S, "seconds of recent spans analysed per job", positive)
    hang_threshold: float = setting(DEFAULT_HANG_S, "seconds without a completed step or op before a job counts "
                                    "as hung", non_negative)
    job_gpus: int = setting(DEFAULT_JOB_GPUS, "GPUs of a typical job: sets its MTBF for the alerts' checkpoint "
                            "advice", positive)
    checkpoint_cost: float = setting(DEFAULT_CHECKPOINT_COST_S, "seconds one checkpoint stalls a job: the alerts' "
                                     "checkpoint-now break-even", positive)
    log_level: str = log_level_setting()


_ALL_TIME_DAYS = 4e6  # wider than the years 1970 to 9999 a store keeps


def local_collector(store: str, **changes: Any) -> CollectorSettings:
    """Settings of a collector on a free loopback port over ``store`` (a path or store URL) that takes and
    keeps every time it is given (no time window, retention or rollups): what the demo, tests and benchmarks
    run, whose telemetry is simulated or recorded, often older or further ahead than a production collector
    accepts. ``changes``: other settings."""
    return replace(CollectorSettings(listen="127.0.0.1:0", store=store, retention_days=0.0, raw_retention="0",
                                     max_sample_age_days=_ALL_TIME_DAYS, max_sample_ahead_days=_ALL_TIME_DAYS),
                   **changes)


AGENT_OPTIONS: tuple[Option, ...] = options(AgentSettings)
COLLECTOR_OPTIONS: tuple[Option, ...] = options(CollectorSettings)
CLIENT_SECURITY_OPTIONS: tuple[Option, ...] = options(ClientSecurity)
# the connection flags of the commands that query a collector (no config file: GPUWATCH_CONFIG is the agent's
# or the collector's); --collector takes one address there
CONNECTION_OPTIONS: tuple[Option, ...] = (
    Option("collector", str, DEFAULT_COLLECTOR_ADDRESS, "collector HOST:PORT", address),
    *CLIENT_SECURITY_OPTIONS,
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

    def build(self, settings_class: type[T], **more: Any) -> T:
        """An instance of ``settings_class`` (a dataclass of :func:`setting` fields, perhaps with more fields)
        from the values it declares, plus ``more`` (values of its other fields, or overriding ones)."""
        names = {f.name for f in fields(settings_class)}  # type: ignore[arg-type]
        return settings_class(**{**{k: v for k, v in self._values.items() if k in names}, **more})

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
    *,
    config_file: bool = True,
) -> Config:
    """Merge defaults, the TOML file, ``GPUWATCH_<KEY>`` variables and flags (None = flag not given).

    The file is ``path``, else the ``config`` flag, else ``$GPUWATCH_CONFIG``, else none (always none when
    ``config_file`` is false: commands that only talk to a collector read no file). Unknown keys in the file
    are errors; unrelated ``GPUWATCH_*`` variables are ignored because components share one environment, and
    an empty one counts as unset. Raises :class:`UserError` naming key, source and problem.
    """
    flags = _flag_values(args)
    path = (path or flags.get("config") or env.get(CONFIG_ENV)) if config_file else None
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
        if env.get(option.env_var):  # set and not empty: VAR= unsets it, as in a shell
            take(option, env[option.env_var], f"environment variable {option.env_var}", _from_text)
    for option in schema:
        raw = flags.get(option.key)
        if raw is not None:
            parse = _from_text if isinstance(raw, str) and option.type is not str else _typed
            take(option, raw, f"flag {option.flag}", parse)
    return Config(values, sources)


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, schema: Sequence[Option], *,
                  config_file: bool = True) -> None:
    """Add ``--config`` (unless ``config_file`` is false) and one flag per option; flags default to None so file
    and environment can apply."""
    if config_file:
        parser.add_argument("--config", metavar="PATH", help=f"TOML config file (env {CONFIG_ENV})")
    for option in schema:
        # a None default is said by the option's own help, where it means something ("the hostname")
        shown = (f"{option.help} (env {option.env_var})" if option.default is None
                 else f"{option.help} (default: {option.default}; env {option.env_var})")
        if option.type is bool:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=shown)
        else:
            parser.add_argument(option.flag, type=option.type, default=None, metavar=option.key.upper(), help=shown)
