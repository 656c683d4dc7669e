"""The HTML report: what it says (coverage and window, stragglers marked, a step axis, top kernels, the
what-if, metadata), that it needs no network, and what headless Chromium actually draws of it."""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess

import numpy as np
import orjson
import pytest

from gpuwatch.apps.cli import main
from gpuwatch.efficiency.partition import CATEGORIES
from gpuwatch.efficiency.html import COLOURS
from helpers import KINETO_DATA

DATA = KINETO_DATA
SAMPLED = os.path.join(DATA, "sampled_2ranks_of128")
STRAGGLER_RED = (0xCF, 0x22, 0x2E)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    """The report of both ranks of a two-rank job (the sampled pair, its world size set to 2: the
    straggler verdict is then determined), over step 551, where rank 1 is the straggler."""
    folder = tmp_path_factory.mktemp("job")
    for rank in (0, 1):
        with gzip.open(os.path.join(SAMPLED, f"rank{rank}.json.gz"), "rb") as f:
            doc = orjson.loads(f.read())
        doc["distributedInfo"]["world_size"] = 2
        (folder / f"rank{rank}.json").write_bytes(orjson.dumps(doc))
    page = folder / "report.html"
    assert main(["analyze", str(folder), "--steps", "551", "--html", str(page)]) == 0
    return str(page)


def test_report_says_everything(report):
    page = open(report, encoding="utf-8").read()
    assert "<script" not in page and "http://" not in page and "https://" not in page and "url(" not in page
    for section in ("What was analysed", "Breakdown per rank", "Lost time per step", "What-if", "Top kernels",
                    "by GPU time", "by count", "Trace metadata"):
        assert section in page
    assert "rank 1 ★" in page and "straggler (holds peers back" in page
    assert "2 of 2 rank(s) present" in page and "analysed window: activities of steps 551..551" in page
    assert ">551</text>" in page and ">step</text>" in page  # the step axis
    assert "ncclKernel_SendRecv" in page and "Memcpy HtoD (Pageable -&gt; Device)" in page
    assert "replay check" in page and "distributedInfo" in page


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_chromium_draws_the_report(report, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium)")
    from PIL import Image

    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,2400",
                    f"--screenshot={shot}", f"file://{report}"],
                   check=True, capture_output=True, timeout=120)
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    colours = {tuple(int(c) for c in p) for p in np.unique(pixels, axis=0)}
    drawn = [name for name, hex_colour in zip(CATEGORIES, COLOURS)
             if tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) in colours]
    # Each rank's bar shows the categories it has (no bubble here, a trace without p2p).
    assert {"compute", "comm_transfer", "comm_wait", "host_stall", "idle_other"} <= set(drawn)
    assert STRAGGLER_RED in colours  # the straggler's label and the what-if bar
    background = np.mean(np.all(pixels == pixels[0], axis=1))
    assert background < 0.9  # more than a blank page
