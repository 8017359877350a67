"""Float comparisons in the suite are relative to the scale of their values (issue #34: values ~500 compared with
an absolute 1e-4 failed on another CPU by 1.8e-4, a relative 3.7e-7, ordinary float32 rounding)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests._util import FP32_EPS, REPO, assert_close_at_scale


def test_the_tolerance_follows_the_scale_of_the_values():
    want = np.linspace(-500.0, 500.0, 11, dtype=np.float32)
    assert_close_at_scale(want + 1.8e-4, want, rel=64 * FP32_EPS)  # another CPU's rounding at magnitude 500
    with pytest.raises(AssertionError, match="max .difference. 0.01"):
        assert_close_at_scale(want + 1e-2, want, rel=64 * FP32_EPS)  # a real difference still fails
    small = want / 1e4
    with pytest.raises(AssertionError):
        assert_close_at_scale(small + 1.8e-4, small, rel=64 * FP32_EPS)  # the same offset at magnitude 0.05
    assert_close_at_scale(np.zeros(3), np.zeros(3), rel=1.0)  # zero scale: exact equality only
    with pytest.raises(AssertionError):
        assert_close_at_scale(np.full(3, 1e-30), np.zeros(3), rel=1.0)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_at_scale(np.array([np.nan]), np.array([1.0]), rel=1.0)


def test_no_test_compares_floats_with_an_absolute_tolerance_only():
    """`rtol=0` with a nonzero `atol` is a tolerance that ignores the scale of the values: use
    tests._util.assert_close_at_scale (or exact equality, rtol=0 and atol=0, where both sides run the same
    computation)."""
    pattern = re.compile(r"rtol=0(?:\.0)?\s*,\s*atol=(?!0\b|0\.0\b)")
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "tests").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
