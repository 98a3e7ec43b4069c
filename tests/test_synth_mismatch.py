"""The planted rollout-vs-trainer log-prob mismatch causes (rldiag.synth.mismatch): each cause's
fingerprint on d = old_log_probs - rollout_log_probs, read back from the written batch files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rldiag.errors import ConfigError
from rldiag.synth import MISMATCH_CAUSES, MismatchSpec, write_mismatch_run
from rldiag.synth.mismatch import OUTLIER_TEXT, bf16_round

SMALL = {"steps": 3, "rows": 32, "tokens": 120}


@dataclass
class Tokens:
    """A run's batches, flat over its tokens (every step, in step order)."""

    old: np.ndarray
    rollout: np.ndarray
    mask: np.ndarray  # bool: actor tokens
    row: np.ndarray  # the token's row over the whole run
    pos: np.ndarray  # its position in the row
    step: np.ndarray
    tables: list[pa.Table]

    @property
    def d(self) -> np.ndarray:
        return (self.old - self.rollout)[self.mask]


def _flat(table: pa.Table, col: str) -> np.ndarray:
    return table[col].combine_chunks().flatten().to_numpy(zero_copy_only=False)


def read_run(root: Path) -> Tokens:
    files = sorted((root / "batches").glob("step_*.parquet"), key=lambda p: int(p.stem.split("_")[1]))
    tables = [pq.read_table(f) for f in files]
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("old", "rollout", "mask", "row", "pos", "step")}
    rows = 0
    for t in tables:
        lengths = t["old_log_probs"].combine_chunks().value_lengths().to_numpy()
        row = np.repeat(np.arange(len(lengths)), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        parts["old"].append(_flat(t, "old_log_probs"))
        parts["rollout"].append(_flat(t, "rollout_log_probs"))
        parts["mask"].append(_flat(t, "response_mask") == 1)
        parts["row"].append(row + rows)
        parts["pos"].append(np.arange(len(row)) - starts[row])
        parts["step"].append(np.repeat(t["step"].to_numpy(), lengths))
        rows += len(lengths)
    return Tokens(*(np.concatenate(parts[k]) for k in parts), tables=tables)


def plant(tmp_path: Path, cause: str, **kw) -> Tokens:
    return read_run(write_mismatch_run(tmp_path / cause, MismatchSpec(cause=cause, **kw)))


def rollout_config(root: Path) -> dict:
    return yaml.safe_load((root / "run.yaml").read_text())["actor_rollout_ref"]["rollout"]


@pytest.mark.parametrize("cause", MISMATCH_CAUSES)
def test_every_cause_writes_a_complete_run_with_tool_spans_the_rollout_leaves_at_zero(tmp_path, cause):
    root = write_mismatch_run(tmp_path / "run", MismatchSpec(cause=cause, first_step=2, **SMALL))
    tok = read_run(root)
    assert sorted(int(p.stem.split("_")[1]) for p in (root / "batches").glob("*.parquet")) == [2, 3, 4]
    assert [json_step(line) for line in (root / "metrics.jsonl").read_text().splitlines()] == [2, 3, 4]
    assert (~tok.mask).any() and tok.mask.mean() > 0.8
    assert (tok.rollout[~tok.mask] == 0.0).all()
    assert (tok.old <= 0).all() and np.isfinite(tok.old).all()
    t = tok.tables[0]
    assert t.schema.field("response_mask").type == pa.list_(pa.int8())
    assert t.schema.field("rollout_log_probs").type == pa.list_(pa.float32())
    assert t["uid"].to_pylist()[:9] == ["s2-p0"] * 8 + ["s2-p1"]
    assert set(t["score"].to_pylist()) <= {0.0, 1.0}
    entropy = _flat(t, "entropy")
    assert (entropy >= -1e-5).all() and (entropy <= np.log(64) + 1e-4).all() and entropy.std() > 0.1
    text = t["response_tokens"].to_pylist()
    assert [len(r) for r in text] == t["old_log_probs"].combine_chunks().value_lengths().to_pylist()
    assert all(w.startswith("tok") or w in OUTLIER_TEXT for r in text for w in r)


def json_step(line: str) -> int:
    import json

    return json.loads(line)["step"]


def test_clean_is_equal_and_float_noise_is_far_below_bf16(tmp_path):
    clean = plant(tmp_path, "clean", **SMALL)
    assert (clean.d == 0).all()
    assert rollout_config(tmp_path / "clean") == {"n": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                  "calculate_log_probs": True, "logprobs_mode": "processed_logprobs"}
    noisy = plant(tmp_path, "float_noise", **SMALL)
    assert np.abs(noisy.d).max() < 1e-5 and (noisy.d != 0).mean() > 0.2


def test_truncation_is_one_sided_by_the_log_of_the_kept_mass(tmp_path):
    tok = plant(tmp_path, "sampling_truncation", **SMALL)
    assert (tok.d <= 1e-6).all() and tok.d.mean() < -0.01
    assert tok.d.min() >= np.log(0.9) - 1e-5  # the kept mass reaches top_p
    assert (tok.rollout <= 0).all()
    assert rollout_config(tmp_path / "sampling_truncation")["top_p"] == 0.9
    write_mismatch_run(tmp_path / "hidden", MismatchSpec(cause="sampling_truncation", config_matches=False, steps=1))
    assert rollout_config(tmp_path / "hidden")["top_p"] == 1.0


def _slope(tok: Tokens) -> float:
    x, y = tok.rollout[tok.mask].astype(np.float64), tok.old[tok.mask].astype(np.float64)
    return float(np.polyfit(x, y, 1)[0])


def test_temperature_scales_the_log_probs(tmp_path):
    tok = plant(tmp_path, "temperature", **SMALL)
    assert _slope(tok) < 0.9
    cfg = rollout_config(tmp_path / "temperature")
    assert cfg["temperature"] == 0.7 and cfg["logprobs_mode"] == "raw_logprobs"
    raw = plant(tmp_path / "raw", "temperature", temperature_mode="raw", **SMALL)
    assert _slope(raw) > 1.1  # the trainer at the temperature, the rollout raw: the other way round


def test_precision_is_symmetric_at_bf16_scale(tmp_path):
    d = plant(tmp_path, "precision", **SMALL).d
    assert abs(d.mean()) < 1e-3 and 0.4 < (d > 0).mean() < 0.6 and 1e-3 < d.std() < 3e-2


def test_bf16_rounding_is_torch_s():
    torch = pytest.importorskip("torch")
    x = (np.random.default_rng(0).standard_normal(100_000) * np.exp(np.random.default_rng(1).normal(0, 4, 100_000)))
    x = np.concatenate([x.astype(np.float32), np.array([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_round(x), want)


@pytest.mark.parametrize("shift", [1, -1, 2])
def test_misaligned_shifts_the_rollout_within_rows(tmp_path, shift):
    tok = plant(tmp_path, "misaligned", shift=shift, min_len=20, max_len=60, **SMALL)
    i = np.arange(len(tok.old))
    j = i + shift
    inside = (j >= 0) & (j < len(tok.old))
    inside[inside] &= tok.row[j[inside]] == tok.row[i[inside]]
    check = tok.mask & inside
    assert check.sum() > 0.8 * tok.mask.sum()
    assert np.array_equal(tok.rollout[check], tok.old[j[check]])
    assert (tok.d != 0).mean() > 0.9


def test_policy_lag_grows_the_gap_with_the_lag(tmp_path):
    root = write_mismatch_run(tmp_path / "lag", MismatchSpec(cause="policy_lag", first_step=5, steps=3))
    tok = read_run(root)
    version = np.concatenate([t["policy_version"].to_numpy() for t in tok.tables])
    vmin = np.concatenate([t["policy_version_min"].to_numpy() for t in tok.tables])
    steps = np.concatenate([t["step"].to_numpy() for t in tok.tables])
    assert tok.tables[0].schema.field("policy_version").type == pa.int64()
    lag = steps - 1 - version
    assert set(lag.tolist()) == {0, 1, 2, 3}
    assert ((version - vmin >= 0) & (version - vmin <= 1)).all()
    token_lag = lag[tok.row][tok.mask]
    d = np.abs(tok.d)
    assert (d[token_lag == 0] == 0).all()
    gaps = [d[token_lag == k].mean() for k in range(4)]
    assert all(a < b for a, b in zip(gaps, gaps[1:])), gaps


def test_early_steps_lag_no_further_back_than_version_zero(tmp_path):
    root = write_mismatch_run(tmp_path / "lag", MismatchSpec(cause="policy_lag", steps=2, **{"rows": 32, "tokens": 20}))
    first = read_run(root).tables[0]
    assert first["policy_version"].to_pylist() == [0] * 32


def test_outlier_tokens_are_few_far_off_both_ways_and_special_in_text(tmp_path):
    tok = plant(tmp_path, "outlier_tokens", outliers_per_step=6, **SMALL)
    d_all = tok.old - tok.rollout
    far = tok.mask & (np.abs(d_all) > 1)
    assert [int(far[tok.step == s].sum()) for s in (1, 2, 3)] == [6, 6, 6]
    assert (d_all[tok.mask & ~far] == 0).all()
    assert (d_all[far] > 0).any() and (d_all[far] < 0).any()
    words = np.array([w for t in tok.tables for r in t["response_tokens"].to_pylist() for w in r])
    assert set(words[far]) <= set(OUTLIER_TEXT) and not np.isin(words[~far], OUTLIER_TEXT).any()


def test_same_seed_same_arrays_other_seed_other_ones(tmp_path):
    spec = {"cause": "precision", "steps": 2, "rows": 16, "tokens": 50}
    a = read_run(write_mismatch_run(tmp_path / "a", MismatchSpec(**spec))).tables
    b = read_run(write_mismatch_run(tmp_path / "b", MismatchSpec(**spec))).tables
    c = read_run(write_mismatch_run(tmp_path / "c", MismatchSpec(seed=1, **spec))).tables
    assert all(x.equals(y) for x, y in zip(a, b))
    assert not a[0]["rollout_log_probs"].equals(c[0]["rollout_log_probs"])


@pytest.mark.parametrize("kw, match", [
    ({"cause": "nope"}, "unknown cause 'nope'"),
    ({"rows": 30}, r"rows \(30\) must be a positive multiple of n \(8\)"),
    ({"cause": "misaligned", "shift": 0}, r"shift \(0\) must be non-zero"),
    ({"temperature_mode": "hot"}, "temperature_mode 'hot'"),
])
def test_bad_specs_are_refused(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        write_mismatch_run(tmp_path / "run", MismatchSpec(**kw))


@pytest.mark.parametrize("cause", ["sampling_truncation", "policy_lag"])
def test_the_runs_recompute(tmp_path, cause):
    from rldiag.api import recompute

    root = write_mismatch_run(tmp_path / "run", MismatchSpec(cause=cause, steps=2, rows=16, tokens=40))
    report = recompute(root)
    assert report.steps_failed == {} and report.steps_done == [1, 2]
