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


def test_text_columns_have_one_word_per_token_and_leave_the_numbers_unchanged(tmp_path):
    import pyarrow.parquet as pq

    from rldiag import api
    from rldiag.synth import SynthSpec, write_synth_run

    base = dict(steps=2, prompts=3, n=4, lengths="lognormal", median_len=20, max_len=64, capped=0.1)
    plain = write_synth_run(tmp_path / "plain", SynthSpec(**base))
    text = write_synth_run(tmp_path / "text", SynthSpec(**base, text=True))
    for f in sorted((text / "batches").iterdir()):
        t = pq.read_table(f)
        lengths = [len(m) for m in t["response_mask"].to_pylist()]
        assert [len(w) for w in t["response_tokens"].to_pylist()] == lengths
        assert [len(w) for w in t["prompt_tokens"].to_pylist()] == t["prompt_length"].to_pylist()
        assert all(w.startswith(" ") and len(w) > 1 for row in t["response_tokens"].to_pylist() for w in row)
        assert t.drop_columns(["response_tokens", "prompt_tokens"]).equals(pq.read_table(plain / "batches" / f.name))
    rep = api.check(text)  # the checker accepts the text columns
    assert rep.ok, rep.problems
