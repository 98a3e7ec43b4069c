"""Regenerate the sample runs shipped in ``samples/``: ``python -m rldiag.toy.make_samples samples/``.

Each sample is trained from its preset (fixed seed) on one CPU thread, so the same torch
build gives the same numbers, into a staging directory that then replaces ``samples/<name>``
whole (its ``rldiag/`` outputs included, which are stale for a new run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from rldiag.io.run_layout import OUTPUT_DIR
from rldiag.io.staged import open_staged
from rldiag.toy.config import PRESETS
from rldiag.toy.trainer import ToyTrainer


def make_sample(root: Path, name: str) -> Path:
    """Train preset ``name`` into ``root/name``; returns the path."""
    cfg = PRESETS[name]()
    target = root / name
    with open_staged(target) as writer:  # the trainer writes into the staging directory, swapped in whole
        ToyTrainer(cfg).run(writer.staging)
        writer.commit()
    return target


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and OUTPUT_DIR not in p.relative_to(path).parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rldiag.toy.make_samples", description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="where the sample runs go (samples/)")
    ap.add_argument("--only", choices=sorted(PRESETS), action="append", help="regenerate only this sample")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: reproducible)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.root.mkdir(parents=True, exist_ok=True)
    for name in args.only or sorted(PRESETS):
        t0 = time.perf_counter()
        path = make_sample(args.root, name)
        print(f"{path}: {_size(path) / 1e6:.2f} MB in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
