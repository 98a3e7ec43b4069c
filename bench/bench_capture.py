"""Benchmark: the capture's bytes per token, per column and in all, and its cost on the training
thread and on the writer thread.

Writes realistic verl batches through :class:`rldiag.capture.RunWriter`: a GRPO step of verl's
V1 trainer after ``compute_advantage`` (padded ``(rows, width)`` tensors: ``responses``,
``attention_mask``, ``response_mask``, ``old_log_probs``, ``ref_log_prob``,
``rollout_log_probs``, ``token_level_scores``, ``token_level_rewards``, ``advantages``,
``returns``; ``--critic``: ``values`` too; ``uid`` in the non-tensor batch), with long-tailed
response lengths (lognormal around ``--median`` tokens, 2 % at the cap), tool-observation spans
(mask 0) in 30 % of the rows, and log-probs from a real softmax: each token's logits over a
vocabulary of ``--vocab`` are drawn with a per-token confidence, rounded to bfloat16 as a model
outputs them, and ``log_softmax`` (float32) gives the trainer's log-prob of the sampled token;
the rollout's from the same logits through another rounding (an inference kernel's), the
reference model's from logits drifted by a little noise. With ``--text`` a tokenizer stub turns
the ids into word strings (``response_tokens``, ``prompt_tokens``).

For each Parquet layout (``--layouts``): ``legacy`` (pyarrow's defaults with zstd: what
captures wrote before issue 38) and ``tuned`` (:func:`rldiag.capture.table.parquet_options`:
byte-stream-split floats, dictionary strings, the chosen codec level), plus a few single
variations for the choice: bytes per response token per column (from the file's column-chunk
sizes) and in all (the file), and the seconds on the training thread (``write_batch``) and on
the writer thread. Usage:

  .venv/bin/python bench/bench_capture.py                    # 2 steps x 256 rows, with and without text
  .venv/bin/python bench/bench_capture.py --rows 1024 --cap 16384 --steps 2 --layouts legacy,tuned
  .venv/bin/python bench/bench_capture.py --policy 5,0.25 --policy-steps 20   # a capture policy's disk share

``--policy EVERY,GROUPS``: instead, a run of ``--policy-steps`` steps (the made batches in turn)
captured whole and under ``RunWriter(every=EVERY, groups=GROUPS)`` (:mod:`rldiag.capture.policy`):
the bytes of each, their ratio, and the training thread's seconds.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class WordTokenizer:
    """A tokenizer stub: id -> one word (Zipf-ranked vocabulary of ``vocab`` words)."""

    def __init__(self, vocab: int):
        base = "the a of to and is in that it for on with as this by be are at from or an we".split()
        self.words = [" " + w for w in base] + [f" w{i}" for i in range(max(0, vocab - len(base)))]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.words[i] for i in ids]


def softmax_logprobs(n: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``(n,)`` float32 each: the sampled token id and its log-prob under the trainer (old), the
    rollout and the reference model, and the trainer's entropy; chunked over tokens."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("token", "old", "rollout", "ref", "entropy")}
    chunk = 1 << 14
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        # a per-token confidence: most tokens near-certain, a long tail of uncertain ones
        scale = torch.exp(torch.randn(m, 1, generator=gen) * 0.8 + 1.2)
        z = torch.randn(m, vocab, generator=gen) * scale
        trainer = z.to(torch.bfloat16).to(torch.float32)
        rollout = (z + torch.randn(m, vocab, generator=gen) * 1e-3).to(torch.bfloat16).to(torch.float32)
        ref = (z + torch.randn(m, vocab, generator=gen) * 0.05).to(torch.bfloat16).to(torch.float32)
        lp_roll = torch.log_softmax(rollout, -1)
        tok = torch.multinomial(lp_roll.exp(), 1, generator=gen)
        lp_old = torch.log_softmax(trainer, -1)
        out["token"].append(tok.squeeze(1))
        out["old"].append(lp_old.gather(1, tok).squeeze(1))
        out["rollout"].append(lp_roll.gather(1, tok).squeeze(1))
        out["ref"].append(torch.log_softmax(ref, -1).gather(1, tok).squeeze(1))
        out["entropy"].append(-(lp_old.exp() * lp_old).sum(-1))
    return {k: torch.cat(v) for k, v in out.items()}


def make_batch(rows: int, n: int, cap: int, median: int, vocab: int, critic: bool, seed: int) -> dict:
    """One step's padded batch as verl's trainer holds it after ``compute_advantage``."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(median), 0.8, rows)), 16, cap).astype(np.int64)
    lengths[rng.random(rows) < 0.02] = cap
    width = int(lengths.max())
    total = int(lengths.sum())
    pos = torch.arange(width).expand(rows, width)
    live = pos < torch.from_numpy(lengths)[:, None]
    lp = softmax_logprobs(total, vocab, gen)

    def padded(flat: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        t = torch.zeros(rows, width, dtype=dtype)
        t[live] = flat.to(dtype)
        return t

    # tool spans: positions [a, a + w) of 30 % of the rows are observations (mask 0)
    mask = live.clone()
    tool = rng.random(rows) < 0.3
    a = (lengths * rng.uniform(0.2, 0.5, rows)).astype(np.int64)
    w = np.maximum(1, (lengths * rng.uniform(0.1, 0.3, rows)).astype(np.int64))
    in_tool = torch.from_numpy(tool)[:, None] & (pos >= torch.from_numpy(a)[:, None]) & (
        pos < torch.from_numpy(a + w)[:, None])
    mask &= ~in_tool
    rollout = padded(lp["rollout"]).masked_fill(in_tool, 0.0)  # verl's agent loop stores 0.0 at tool tokens
    score = torch.from_numpy((rng.random(rows) < rng.uniform(0, 1, rows // n).repeat(n)).astype(np.float32))
    last = torch.from_numpy(lengths - 1)
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), last] = score
    grp = score.view(-1, n)
    adv_row = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).reshape(-1)
    adv = adv_row[:, None] * mask.float()
    prompt_w = 256
    plen = torch.from_numpy(rng.integers(32, prompt_w + 1, rows))
    prompt_attn = torch.arange(prompt_w).expand(rows, prompt_w) >= (prompt_w - plen)[:, None]  # left-padded
    batch = {
        "prompts": torch.from_numpy(rng.integers(0, vocab, (rows, prompt_w))) * prompt_attn,
        "responses": padded(lp["token"], torch.int64),
        "attention_mask": torch.cat([prompt_attn, live], 1).to(torch.int64),
        "response_mask": mask.to(torch.int64),
        "old_log_probs": padded(lp["old"]),
        "ref_log_prob": padded(lp["ref"]),
        "rollout_log_probs": rollout,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "advantages": adv,
        "returns": adv.clone(),
        "uid": np.array([f"prompt-{seed}-{i // n}" for i in range(rows)], dtype=object),
    }
    if critic:
        batch["values"] = padded(torch.randn(total, generator=gen) * 0.3 + 0.5)
    return batch


def column_bytes(path: Path) -> dict[str, int]:
    """Compressed bytes per top-level column (its column chunks over every row group)."""
    md = pq.ParquetFile(path).metadata
    out: dict[str, int] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            name = col.path_in_schema.split(".")[0]
            out[name] = out.get(name, 0) + col.total_compressed_size
    return out


def run_layout(layout: str, batches: list[dict], base: Path, text: bool, vocab: int) -> dict:
    """Write ``batches`` through a RunWriter whose batch files take ``layout`` (the writer thread
    writes each through its :class:`rldiag.capture.diskio.WriterDisk`, whose ``write_step`` the
    bench points at :func:`rldiag.capture.table.write_step_file` with that layout)."""
    from rldiag.capture import RunWriter, table

    path = base / f"{layout}-{'text' if text else 'notext'}"
    tok = WordTokenizer(vocab) if text else None
    t0 = time.perf_counter()
    with RunWriter(path, tokenizer=tok) as w:
        w.disk.write_step = functools.partial(table.write_step_file, layout=layout)  # type: ignore[method-assign]
        for i, b in enumerate(batches):
            w.write_batch(i + 1, b)
    wall = time.perf_counter() - t0
    files = sorted((path / "batches").glob("*.parquet"))
    cols: dict[str, int] = {}
    for f in files:
        for k, v in column_bytes(f).items():
            cols[k] = cols.get(k, 0) + v
    return {"bytes": sum(f.stat().st_size for f in files), "cols": cols, "files": files,
            "train_s": w.stats.train_thread_s, "writer_s": w.stats.writer_thread_s, "wall_s": wall}


def run_policy(batches: list[dict], steps: int, base: Path, **policy) -> dict:
    """``steps`` steps (``batches`` in turn) through a RunWriter with ``policy``; bytes and times."""
    from rldiag.capture import RunWriter

    path = base / ("policy" if policy else "whole")
    with RunWriter(path, last_step=steps, max_wait_s=600.0, wait_share=None, **policy) as w:  # nothing dropped
        for step in range(1, steps + 1):
            w.write_batch(step, batches[(step - 1) % len(batches)])
            w.log_metrics(step, {"loss": 0.0})
            w.sync()
    files = sorted((path / "batches").glob("*.parquet"))
    return {"bytes": sum(f.stat().st_size for f in files), "files": len(files), "train_s": w.stats.train_thread_s,
            "writer_s": w.stats.writer_thread_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--cap", type=int, default=8192, help="max_response_length")
    ap.add_argument("--median", type=int, default=600)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--critic", action="store_true", help="a values column too (PPO with a critic)")
    ap.add_argument("--layouts", default=None, help="Parquet layouts (rldiag.capture.table.LAYOUTS); default all")
    ap.add_argument("--text", default="no,yes", help="no, yes or both (no,yes)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--policy", default=None, help="EVERY,GROUPS: compare a whole capture with this policy's")
    ap.add_argument("--policy-steps", type=int, default=20)
    args = ap.parse_args()
    from rldiag.capture.table import LAYOUTS

    torch.set_num_threads(1)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-capture-bench-"))
    t0 = time.perf_counter()
    batches = [make_batch(args.rows, args.n, args.cap, args.median, args.vocab, args.critic, seed)
               for seed in range(args.steps)]
    print(f"{args.steps} steps x {args.rows} rows, lognormal lengths (median {args.median}, cap {args.cap}), "
          f"vocab {args.vocab}; batches made in {time.perf_counter() - t0:.1f} s")
    if args.policy:
        every, groups = args.policy.split(",")
        share = float(groups) if "." in groups else int(groups)
        whole = run_policy(batches, args.policy_steps, base)
        part = run_policy(batches, args.policy_steps, base, every=int(every), groups=share)
        print(f"{args.policy_steps} steps, whole: {whole['bytes'] / 1e6:.1f} MB in {whole['files']} files, training "
              f"thread {whole['train_s']:.2f} s, writer thread {whole['writer_s']:.2f} s")
        print(f"every={every} groups={groups}: {part['bytes'] / 1e6:.2f} MB in {part['files']} files, training thread "
              f"{part['train_s']:.2f} s, writer thread {part['writer_s']:.2f} s; "
              f"{100 * part['bytes'] / whole['bytes']:.1f} % of the whole capture's bytes")
        return
    layouts = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    for text in [t == "yes" for t in args.text.split(",")]:
        res = {name: run_layout(name, batches, base, text, args.vocab) for name in layouts}
        tokens = sum(int(b["response_mask"].shape[0] and b["attention_mask"][:, -b["response_mask"].shape[1]:].sum())
                     for b in batches)
        names = sorted({c for r in res.values() for c in r["cols"]}, key=lambda c: -res[layouts[0]]["cols"].get(c, 0))
        print(f"\n{'with' if text else 'without'} text: {tokens / 1e6:.2f} M response tokens; bytes per token")
        print(f"{'column':<22}" + "".join(f"{n:>12}" for n in layouts))
        for c in names:
            print(f"{c:<22}" + "".join(f"{res[n]['cols'].get(c, 0) / tokens:>12.3f}" for n in layouts))
        print(f"{'file (all)':<22}" + "".join(f"{res[n]['bytes'] / tokens:>12.2f}" for n in layouts))
        print(f"{'training thread s':<22}" + "".join(f"{res[n]['train_s']:>12.2f}" for n in layouts))
        print(f"{'writer thread s':<22}" + "".join(f"{res[n]['writer_s']:>12.2f}" for n in layouts))


if __name__ == "__main__":
    main()
