"""A distance of identical inputs is 0, never a rounding error below it, and the printout rounds the distances
(issue #34: sFID printed as -6.9e-18)."""
from __future__ import annotations

import numpy as np

from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.run import format_result


def test_distances_of_identical_inputs_are_never_negative():
    for seed in (0, 4, 5, 9):  # seeds whose float64 rounding gave -1.8e-15 .. -5.3e-15 before the clamp
        x = np.random.default_rng(seed).standard_normal((50, 8))
        st = M.statistics(x)
        for d in (M.frechet_distance_of_features(x, x), M.frechet_distance(st, st),
                  M.frechet_distance_of_features(x[:5], x[:5]),
                  M.frechet_distance_to_statistics(x[:5], M.statistics(x[:5]))):
            assert 0.0 <= d < 1e-12
    assert M.nonnegative(-6.9e-18) == 0.0 and M.nonnegative(2.5) == 2.5


def test_the_printout_rounds_distances_and_shows_no_negative_zero():
    result = {"inception_score": 1.0000123456789, "fid": 12.3456789012345, "sfid": -6.9e-18, "precision": 0.5,
              "recall": None, "fd_dinov2": 3.0000000004}
    # issue 41: the Inception Score was printed unrounded; every metric now to 6 decimals (the JSON keeps all)
    assert format_result(result).splitlines() == ["Inception Score: 1.000012", "FID: 12.345679", "sFID: 0.0",
                                                  "Precision: 0.5", "Recall: n/a", "FD_DINOv2: 3.0"]
