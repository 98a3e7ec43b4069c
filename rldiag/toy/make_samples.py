"""Regenerate the sample runs shipped in ``samples/``: ``python -m rldiag.toy.make_samples samples/``.

Each sample is trained from its preset (fixed seed) on one CPU thread, so the same torch
build gives the same numbers, into a staging directory that then replaces ``samples/<name>``
whole (its ``rldiag/`` outputs included, which are stale for a new run).

``--reward-columns`` instead adds the columns a reward function reads (``data_source``,
``ground_truth``, ``extra_info``, ``reward_inputs_repr``, ``response_text``, ``prompt_text``)
to the shipped runs' batch files without retraining: they are made from the files' own token
text (``response_tokens``, ``prompt_tokens``) and preset, every other column kept as it is.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rldiag.capture.reward_inputs import json_text
from rldiag.io.run_layout import OUTPUT_DIR
from rldiag.io.rundir import RunDir
from rldiag.io.schema import REWARD_INPUT_REPR_COLUMN
from rldiag.io.staged import open_staged, replace_file
from rldiag.toy.config import PRESETS
from rldiag.toy.task import DATA_SOURCE, SEP, TOKEN_NAMES, ToyTokenizer
from rldiag.toy.trainer import ToyTrainer

_IDS = {name: i for i, name in enumerate(TOKEN_NAMES)}


def make_sample(root: Path, name: str) -> Path:
    """Train preset ``name`` into ``root/name``; returns the path."""
    cfg = PRESETS[name]()
    target = root / name
    with open_staged(target) as writer:  # the trainer writes into the staging directory, swapped in whole
        ToyTrainer(cfg).run(writer.staging)
        writer.commit()
    return target


def reward_columns(table: pa.Table, partial_credit: float) -> dict[str, pa.Array]:
    """The reward function's columns of one toy batch table, as the toy trainer's capture writes
    them, from its ``response_tokens`` and ``prompt_tokens`` (the prompt's digits, then ``=``)."""
    tok = ToyTokenizer()
    responses, prompts = table["response_tokens"].to_pylist(), table["prompt_tokens"].to_pylist()
    if any(not p or p[-1] != TOKEN_NAMES[SEP] for p in prompts):
        raise ValueError("a prompt does not end with '=': not a toy task's batch")
    truths = [json_text(str(sum(int(w) for w in p[:-1])))[0] for p in prompts]
    n = table.num_rows
    return {
        "data_source": pa.array([DATA_SOURCE] * n, type=pa.string()),
        "ground_truth": pa.array(truths, type=pa.string()),
        "extra_info": pa.array([json_text({"partial_credit": partial_credit})[0]] * n, type=pa.string()),
        REWARD_INPUT_REPR_COLUMN: pa.array(np.zeros(n, dtype=np.int8), type=pa.int8()),
        "response_text": pa.array(tok.batch_decode([[_IDS[w] for w in r] for r in responses], True), type=pa.string()),
        "prompt_text": pa.array(tok.batch_decode([[_IDS[w] for w in p] for p in prompts], True), type=pa.string()),
    }


def _write_zstd(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd")


def add_reward_columns(run: Path, name: str) -> int:
    """Add :func:`reward_columns` to every batch file of the shipped run ``run`` (preset
    ``name``), each file replaced atomically; the other columns are kept as they are. Returns
    the files changed (a file that has the columns already is left alone)."""
    credit = PRESETS[name]().partial_credit
    changed = 0
    for sf in RunDir(run).step_files():
        table = pq.read_table(sf.path)
        new = {k: v for k, v in reward_columns(table, credit).items() if k not in table.column_names}
        if not new:
            continue
        for k, v in new.items():
            table = table.append_column(k, v)
        replace_file(sf.path, functools.partial(_write_zstd, table))
        changed += 1
    return changed


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and OUTPUT_DIR not in p.relative_to(path).parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rldiag.toy.make_samples", description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="where the sample runs go (samples/)")
    ap.add_argument("--only", choices=sorted(PRESETS), action="append", help="regenerate only this sample")
    ap.add_argument("--reward-columns", action="store_true",
                    help="add the reward function's columns to the runs in ROOT, without retraining")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: reproducible)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.reward_columns:
        for name in args.only or sorted(PRESETS):
            print(f"{args.root / name}: {add_reward_columns(args.root / name, name)} batch files given reward columns")
        return 0
    args.root.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(PRESETS):
        t0 = time.perf_counter()
        path = make_sample(args.root, name)
        print(f"{path}: {_size(path) / 1e6:.2f} MB in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
