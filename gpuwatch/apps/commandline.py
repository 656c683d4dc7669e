"""What every `gpuwatch` command shares: how it registers, its common flags and argument types, its output.

A command is a :class:`Command` (its flags, what it runs), named with its help text in
:data:`gpuwatch.apps.cli.COMMANDS`. The flags every command spells the same are declared here once
(``--json``, ``--quiet``, the collector address with the TLS and token settings of
:mod:`gpuwatch.core.settings`); durations and times are parsed one way; results are printed one way
(:func:`print_json`, :func:`format_table`). A new command is a few lines::

    def _hello(args: argparse.Namespace) -> dict[str, Any]:
        return {"hello": args.name}

    HELLO = result_command(lambda p: p.add_argument("name"), _hello, lambda r: f"hello {r['hello']}\n")

plus ``"hello": ("gpuwatch.apps.hello:HELLO", "say hello")`` in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwatch.core.errors import UserError
from gpuwatch.core.times import parse_duration

if TYPE_CHECKING:
    from gpuwatch.core.settings import ClientSecurity


class Command(NamedTuple):
    """One subcommand: ``add_arguments(parser)`` declares its flags, ``run(args)`` runs it and returns the exit
    status (a :class:`UserError` becomes one line on stderr and status 2)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def result_command(add_arguments: Callable[[argparse.ArgumentParser], None],
                   compute: Callable[[argparse.Namespace], dict[str, Any]],
                   as_text: Callable[[dict[str, Any]], str]) -> Command:
    """A command that computes one result document: printed as JSON with ``--json``, else as ``as_text`` writes
    it; ``--quiet`` silences its progress line on stderr."""

    def add_all_arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)
        add_json_flag(parser, "print the result as JSON")
        add_quiet_flag(parser)

    def run(args: argparse.Namespace) -> int:
        result = compute(args)
        if args.json:
            print_json(result)
        else:
            sys.stdout.write(as_text(result))
        return 0

    return Command(add_all_arguments, run)


# ---- common flags -------------------------------------------------------------------------------------

def add_json_flag(parser: argparse.ArgumentParser, help: str = "print JSON instead of a table") -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def add_client_security_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--tls-ca --tls-cert --tls-key --token-file --insecure`` (or GPUWATCH_TLS_CA, ...), as the agent has them."""
    from gpuwatch.core import settings  # here, as below: commands without a collector (analyze) start without it

    settings.add_arguments(parser, settings.CLIENT_SECURITY_OPTIONS, config_file=False)


def client_security(args: argparse.Namespace) -> ClientSecurity:
    """The TLS and token settings from the flags of :func:`add_client_security_arguments` and GPUWATCH_*."""
    from gpuwatch.core import settings

    return settings.load_config(settings.CLIENT_SECURITY_OPTIONS, args,
                                config_file=False).build(settings.ClientSecurity)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--collector HOST:PORT`` (or GPUWATCH_COLLECTOR) and the TLS/token flags of a command that queries it."""
    from gpuwatch.core import settings

    settings.add_arguments(parser, settings.CONNECTION_OPTIONS, config_file=False)


def connection(args: argparse.Namespace) -> tuple[str, ClientSecurity]:
    """The collector address and the client security settings of :func:`add_connection_arguments`."""
    from gpuwatch.core import settings

    cfg = settings.load_config(settings.CONNECTION_OPTIONS, args, config_file=False)
    return cfg.collector, cfg.build(settings.ClientSecurity)


@contextmanager
def collector_errors(address: str) -> Iterator[None]:
    """A failed call to the collector as one line naming it: "collector at HOST:PORT: details (CODE)"."""
    import grpc  # here: commands that never talk to a collector (analyze) start without it

    try:
        yield
    except grpc.RpcError as exc:
        raise UserError(f"collector at {address}: {exc.details()} ({exc.code().name})") from None


# ---- argument types -----------------------------------------------------------------------------------

def duration(text: str) -> float:
    """argparse type: a positive duration ('90s', '10m', '1h', '2d' or seconds) in seconds."""
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (e.g. 60s, 10m, 1h, 24h)")
    return seconds


def positive_float(text: str) -> float:
    """argparse type: a number greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def int_in(flag: str, low: int, high: int) -> Callable[[str], int]:
    """argparse type: an integer from ``low`` to ``high``, the range its request field holds and means something
    in (a GPU index is never negative: -1 on the wire means "every GPU"); anything else is a UserError naming
    the flag (one line, status 2, as for :func:`time_flag`)."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{flag} {text!r} is not an integer") from None
        if not low <= value <= high:
            raise UserError(f"{flag} {text} is out of range: expected {low} to {high}")
        return value

    return integer


def parse_time_ms(text: str, now_ms: int | None = None) -> int:
    """A point in time as epoch ms from "15m"/"2h"/"7d" (ago), an ISO 8601 time (UTC if no zone) or epoch ms;
    ValueError otherwise."""
    if text.isdigit():
        return int(text)
    if text[-1:].isalpha():  # a duration needs its unit here: a bare number is epoch ms
        try:
            ago_s = parse_duration(text)
        except ValueError:
            pass
        else:
            now_ms = int(time.time() * 1000) if now_ms is None else now_ms
            return now_ms - int(ago_s * 1000)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a duration like 15m/2h/7d, an ISO 8601 time or epoch ms") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def time_flag(flag: str) -> Callable[[str], int]:
    """argparse type of a time flag (``--since``): 15m, 2h, 7d (ago), an ISO 8601 time or epoch ms, as epoch
    ms; anything else is a UserError naming the flag (the dispatcher prints it as one line, status 2)."""

    def time_ms(text: str) -> int:
        try:
            return parse_time_ms(text)
        except ValueError as exc:
            raise UserError(f"{flag} {exc}") from None

    return time_ms


# ---- output -------------------------------------------------------------------------------------------

def json_text(value: Any) -> str:
    """Standard JSON, indented: a non-finite number (from a store written before ingest refused them) is null,
    never the ``Infinity``/``NaN`` tokens that strict parsers reject; numpy numbers as numbers; anything else
    JSON has no type for (paths, times) as its text. orjson is imported here, when JSON is printed: a command
    that prints none does not pay for loading it and its modules."""
    import orjson

    options = (orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
               | orjson.OPT_PASSTHROUGH_DATETIME)
    return orjson.dumps(value, default=str, option=options).decode()


def print_json(value: Any) -> None:
    sys.stdout.write(json_text(value) + "\n")


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows as an aligned text table (floats with 4 significant digits, nested values by name); "(none)" when
    empty."""
    if not rows:
        return "(none)\n"
    columns = list(columns or rows[0].keys())
    cells = [[format_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def format_cell(value: Any) -> str:
    """One value as a short cell: lists joined with commas, a dict by its name (a signal, a straggler's rank,
    a hang's summary) or else as k=v pairs, so nested rows stay readable instead of collapsing to "yes"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        for key in _NAME_KEYS:
            if key in value:
                return format_cell(value[key])
        return " ".join(f"{k}={format_cell(v)}" for k, v in value.items()) or "-"
    return str(value)


_NAME_KEYS = ("signal", "name", "rank", "summary")  # what names a nested dict, in order of preference
