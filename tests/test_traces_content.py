"""Loaders read a trace given in memory (an upload: bytes or an open file) exactly as the file on disk."""
from __future__ import annotations

import io
import os

import numpy as np
import pandas as pd
import pytest

from gpuwatch.collector.breakdowns import load_submitted
from gpuwatch.core.errors import UserError
from gpuwatch.efficiency.load import load_file
from helpers import KINETO_DATA

DATA = KINETO_DATA
GZ = os.path.join(DATA, "sampled_2ranks_of128", "rank1.json.gz")


def _same(a, b) -> None:
    assert (a.rank, a.world_size, a.source, a.events_sampled) == (b.rank, b.world_size, b.source, b.events_sampled)
    np.testing.assert_array_equal(a.start_us, b.start_us)
    np.testing.assert_array_equal(a.kind, b.kind)


def test_a_gzipped_trace_reads_the_same_from_bytes_and_from_an_open_file():
    (on_disk,) = load_file(GZ)
    with open(GZ, "rb") as f:
        data = f.read()
        f.seek(0)
        (from_file,) = load_file(GZ, content=f)
        assert not f.closed  # the caller's file stays the caller's
    (from_bytes,) = load_file(GZ, content=data)
    _same(from_bytes, on_disk)
    _same(from_file, on_disk)


def test_a_span_table_upload_is_read_from_memory_and_named_by_its_filename():
    rows = pd.DataFrame({"rank": [0, 0, 1, 1], "kind": ["compute", "collective"] * 2, "start_us": [0.0, 10, 0, 12],
                         "dur_us": [10.0, 5, 12, 3], "name": ["", "all_reduce"] * 2, "seq": [-1, 0, -1, 0]})
    buffer = io.BytesIO()
    rows.to_parquet(buffer)
    timelines = load_submitted("uploads/job.parquet", buffer.getvalue())
    assert [tl.rank for tl in timelines] == [0, 1]
    assert all(tl.source.startswith("uploads/job.parquet") for tl in timelines)


def test_a_broken_upload_is_named_by_its_filename():
    with pytest.raises(UserError, match=r"^uploads/rank0\.json: "):
        load_submitted("uploads/rank0.json", b'{"traceEvents": [{"ph": "X", ')
