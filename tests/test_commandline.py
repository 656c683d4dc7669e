"""The shared CLI layer: command registration, duration and time parsing, connection flags from the settings."""
from __future__ import annotations

import argparse
import subprocess
import sys

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


_FAULTS_OF_REUSE = """
import resource, sys
from gpuwatch.apps import cli
if sys.argv[1] == "keep":
    cli._keep_freed_memory()
def round_trip():  # 12.8 MB in 200 KB pieces, every page written, then all freed
    blocks = [bytearray(200 << 10) for _ in range(64)]
    for b in blocks:
        b[::4096] = b"x" * len(range(0, len(b), 4096))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()
before = faults()
for _ in range(5):
    round_trip()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_one_shot_command_keeps_freed_memory_for_reuse_instead_of_faulting_it_in_again():
    def faults(mode):
        return int(subprocess.run([sys.executable, "-c", _FAULTS_OF_REUSE, mode], capture_output=True, text=True,
                                  check=True).stdout)

    default, kept = faults("default"), faults("keep")
    assert default > 5 * 3000 // 2  # 3,200 pages a round, given back and faulted in again (most of them)
    assert kept * 10 < default


_DOCSTRING_PROBE = """
import sys, types
from gpuwatch.apps import cli
from gpuwatch.apps.commandline import Command

def run(args):
    import numpy
    before = numpy.ndarray.all.__doc__
    sys.modules["numpy._core._add_newdocs"].__name__  # touched: the module runs now
    print(repr(before), repr(numpy.ndarray.all.__doc__))

probe = types.ModuleType("probe")
probe.DOCS = Command(lambda parser: None, run)
sys.modules["probe"] = probe
cli.COMMANDS.update(docs=("probe:DOCS", ""))
sys.argv = ["gpuwatch", "docs"]
sys.exit(cli.main())
"""


def test_as_the_process_gpuwatch_attaches_numpy_docstrings_only_once_something_reads_their_module(tmp_path):
    plain = subprocess.run([sys.executable, "-c", "import numpy; print(repr(numpy.ndarray.all.__doc__))"],
                           capture_output=True, text=True, check=True).stdout
    assert len(plain) > 100  # numpy as usual: the method's docstring attached at import
    ran = subprocess.run([sys.executable, "-c", _DOCSTRING_PROBE], capture_output=True, text=True, cwd=tmp_path)
    assert (ran.returncode, ran.stdout) == (0, f"None {plain}"), ran.stderr


def test_a_library_call_leaves_the_import_system_as_it_was(capsys):
    finders = list(sys.meta_path)
    with pytest.raises(SystemExit):
        cli.main(["analyze", "--help"])
    assert sys.meta_path == finders


@pytest.mark.parametrize("argv, message", [
    (["events", "--limit", "-4"], "--limit -4 is out of range: expected 0 to 4294967295"),
    (["series", "--node", "n", "--field", "gpu_power_watts", "--gpu", "-2"],
     "--gpu -2 is out of range: expected 0 to 2147483647"),
    (["latest", "--gpu", "99999999999"], "--gpu 99999999999 is out of range: expected 0 to 2147483647"),
    (["latest", "--gpu", "-1"], "--gpu -1 is out of range: expected 0 to 2147483647"),  # -1 is "all" on the wire
    (["series", "--node", "n", "--field", "gpu_power_watts", "--gpu", "two"], "--gpu 'two' is not an integer"),
])
def test_out_of_range_numbers_are_one_line_naming_the_flag(argv, message, capsys):
    # the collector address answers nothing: the flag must be refused before any request is made
    assert cli.main([*argv, "--collector", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == f"gpuwatch {argv[0]}: error: {message}\n"


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_help_says_each_default_once_helps_every_option_and_names_durations(name):
    for action in _parser(cli.command(name))._actions:
        where = f"gpuwatch {name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help != argparse.SUPPRESS, f"{where}: no help"
        assert action.help.count("default") <= 1 and "default: None" not in action.help, f"{where}: {action.help}"
        assert action.metavar != "SINCE_MS", where


def test_demo_speed_zero_is_refused_at_once_naming_the_flag(capsys):
    assert cli.main(["demo", "--speed", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuwatch demo: error:") and "--speed" in err and "sim-job-step" not in err


def test_readme_says_what_the_demo_and_progress_do():
    """README promised progress on stderr (drawn only on a terminal) and a 245-minute lead time (the screen
    capture shows 40, runs vary)."""
    import io
    import re
    from pathlib import Path

    from gpuwatch.core.progress import Progress

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (progress,) = [s for s in readme.split(". ") if "show progress on stderr" in s]
    assert not Progress("x", stream=io.StringIO()).enabled and "terminal" in progress
    demo = readme[:readme.index("## What it is")]
    assert "varies from run to run" in demo
    assert not re.search(r"about \d+ minutes", demo)
