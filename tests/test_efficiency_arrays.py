"""The engine's array helpers answer as the numpy functions they stand in for."""
from __future__ import annotations

import numpy as np
import pytest

from gpuwatch.efficiency.arrays import distinct, median


@pytest.mark.parametrize("size", [1, 2, 3, 8, 9, 40])
def test_distinct_and_median_answer_as_numpy(size):
    rng = np.random.default_rng(size)
    for _ in range(50):
        values = rng.normal(size=size) * 10.0 ** rng.integers(-3, 7)
        assert median(values) == np.median(values)
        assert median(values.tolist()) == np.median(values)
        ints = rng.integers(-4, 4, size=(size, 2))
        assert np.array_equal(distinct(ints), np.unique(ints))


def test_a_nan_makes_the_median_nan_and_nothing_has_no_distinct_values():
    assert np.isnan(median(np.array([1.0, np.nan, 2.0]))) and np.isnan(np.median(np.array([1.0, np.nan, 2.0])))
    assert distinct(np.array([], np.int64)).tolist() == []
