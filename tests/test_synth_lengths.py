"""The synthetic runs' length distributions, which the benchmarks' workloads rest on."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.errors import ConfigError
from rldiag.synth import SynthSpec, draw_lengths


def test_lognormal_lengths_are_long_tailed_within_bounds():
    spec = SynthSpec(lengths="lognormal", min_len=16, max_len=16384, median_len=600, capped=0.02)
    lengths = draw_lengths(spec, 20_000, np.random.default_rng(0))
    assert lengths.min() >= 16 and lengths.max() == 16384
    assert 500 < np.median(lengths) < 700
    assert 0.015 < np.mean(lengths == 16384) < 0.025  # the capped share, besides the tail's own


def test_capped_rows_puts_exactly_that_many_rows_at_the_cap():
    spec = SynthSpec(lengths="lognormal", min_len=16, max_len=200_000, median_len=600, capped_rows=1)
    for seed in range(5):
        lengths = draw_lengths(spec, 64, np.random.default_rng(seed))
        assert int((lengths == 200_000).sum()) == 1 and lengths.sum() < 200_000 + 64 * 20_000


def test_unknown_distribution_is_refused():
    with pytest.raises(ConfigError, match="SynthSpec.lengths: unknown length distribution .zipf.; use uniform or lognormal"):
        draw_lengths(SynthSpec(lengths="zipf"), 4, np.random.default_rng(0))
