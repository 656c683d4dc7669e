"""The shared CLI layer: command registration, duration and time parsing, connection flags from the settings."""
from __future__ import annotations

import argparse

import pytest

from gpuwatch.apps import cli, commandline, recording_cli
from gpuwatch.apps.commandline import Command, duration, parse_time_ms
from gpuwatch.core.times import parse_duration


def _parser(command: Command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuwatch x")
    command.add_arguments(parser)
    return parser


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_is_a_registered_command_with_its_own_flags(name):
    command = cli.command(name)
    assert isinstance(command, Command)
    flags = {a.dest for a in _parser(command)._actions}
    # every command that prints a result offers --json, declared once in commandline
    assert "json" in flags or name == "collector"


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("5min", 300.0),
                                           ("1.5h", 5400.0), ("2d", 172800.0), (".5s", 0.5)])
def test_one_duration_syntax(text, seconds):
    assert parse_duration(text) == seconds == duration(text)


@pytest.mark.parametrize("text", ["", "5 parsecs", "-1s", "1h30m"])
def test_a_bad_duration_names_the_text(text):
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)
    with pytest.raises(argparse.ArgumentTypeError, match="not a positive duration"):
        duration(text)


def test_times_are_ago_iso_or_epoch_ms():
    now = 1_700_000_000_000
    assert parse_time_ms("15m", now) == now - 15 * 60_000
    assert parse_time_ms("1700000000000", now) == now
    assert parse_time_ms("2023-11-14T22:13:20Z", now) == now
    with pytest.raises(ValueError, match="'soon' is not a duration like 15m"):
        parse_time_ms("soon", now)


def test_a_bad_since_is_one_line_naming_the_flag(capsys):
    assert cli.main(["events", "--since", "soon"]) == 2
    assert capsys.readouterr().err == "gpuwatch events: error: --since 'soon' is not a duration like 15m/2h/7d, " \
                                      "an ISO 8601 time or epoch ms\n"


def test_replay_takes_the_connection_settings_from_the_environment_like_the_other_commands(monkeypatch):
    monkeypatch.setenv("GPUWATCH_TLS_CA", "/etc/ca.pem")
    monkeypatch.setenv("GPUWATCH_TOKEN_FILE", "/etc/token")
    args = _parser(recording_cli.REPLAY).parse_args(["rec", "--collector", "c:7700", "--tls-cert", "agent.pem"])
    security = commandline.client_security(args)
    assert (security.tls_ca, security.tls_cert, security.token_file, security.insecure) == \
        ("/etc/ca.pem", "agent.pem", "/etc/token", False)
    query = _parser(cli.command("nodes")).parse_args(["--collector", "c:7700", "--tls-cert", "agent.pem"])
    assert commandline.connection(query) == ("c:7700", security)


def test_help_is_wrapped_at_the_terminal_width_columns_says(monkeypatch, capsys):
    widest = {}
    for columns in (70, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        with pytest.raises(SystemExit):
            cli.main(["analyze", "--help"])
        lines = capsys.readouterr().out.splitlines()
        widest[columns] = max(map(len, lines))
        assert len(lines) > 5 and widest[columns] <= columns - 2, lines
    assert widest[120] > 70


def test_every_command_has_help(capsys):
    """argparse %-formats each option's help: a stray '%' in one crashes the command's --help."""
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0, name
        assert "usage: gpuwatch " + name in capsys.readouterr().out
