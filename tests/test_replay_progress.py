"""gpuwatch.core.progress: draws on a terminal only, quiet on request."""
import io
import os
import pty
import select

from gpuwatch.core.progress import Progress


def _drawn(quiet: bool) -> str:
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as terminal:
            with Progress("import f.csv", total=1000, unit="rows", quiet=quiet, stream=terminal, interval_s=0) as p:
                for _ in range(4):
                    p.advance(100)
        return _read_until_quiet(master)
    finally:
        os.close(master)
        os.close(slave)


def _read_until_quiet(fd: int) -> str:
    """What the terminal shows: read until a line ends or nothing more arrives for 0.5 s."""
    text = b""
    while not text.endswith(b"\r\n") and select.select([fd], [], [], 0.5)[0]:
        text += os.read(fd, 65536)
    return text.decode()


def test_a_terminal_gets_count_rate_and_eta():
    text = _drawn(quiet=False)
    assert "import f.csv: 400/1,000 rows" in text and "ETA" in text and text.endswith("\r\n")


def test_quiet_and_pipes_get_nothing():
    assert _drawn(quiet=True) == ""
    pipe = io.StringIO()
    with Progress("x", total=10, stream=pipe, interval_s=0) as p:
        p.advance(5)
    assert pipe.getvalue() == "" and not p.enabled and p.line().startswith("x: 5/10 rows")
