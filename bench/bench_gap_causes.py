"""Benchmark: the rollout/trainer gap diagnosis on the toy corpus's gap runs (rldiag/toy/corpus_gap.py).

Trains the corpus's gap families (and the healthy runs, the bfloat16 copy's noise alone) of one
size into ``--out`` (a run already there, with its ``labels.json``, is kept), diagnoses each run
(``rldiag.mismatch``) and prints, per family, the mean run confidence of every cause over the
split's runs and how many runs meet issue 35's floors (``corpus_gap.verdict``: each labelled
cause >= 0.8, each other cause < 0.5 but precision at severity info, an implied cause listed in
the dominant cause's evidence); then every run that misses a floor, with what it missed.

Thresholds are fitted on ``train``; the figures to report are ``test``'s. Usage:

  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_gap_causes.py --size full --split test --out /tmp/gapcorpus
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rldiag.analysis.mismatch import CAUSES  # noqa: E402
from rldiag.toy.corpus import cases, train_case  # noqa: E402
from rldiag.toy.corpus_gap import GAP_CASES, verdict  # noqa: E402

SHORT = {"sampling_truncation": "trunc", "temperature": "temp", "precision": "prec", "misaligned": "misal",
         "policy_lag": "lag", "outlier_tokens": "outl"}


def diagnose(run: Path) -> tuple[dict, list[dict], dict[str, float]]:
    import rldiag

    labels = json.loads((run / "labels.json").read_text())
    diag = rldiag.mismatch(run, examples=False)
    causes = [{"cause": c.cause, "confidence": c.confidence, "severity": c.severity, "implied": c.implied}
              for c in diag.causes]
    return labels, causes, dict(diag.confidences)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("small", "full"), default="small")
    ap.add_argument("--split", choices=("train", "test", "all"), default="test")
    ap.add_argument("--out", default="/tmp/rldiag-gap-corpus")
    ap.add_argument("--kinds", default="", help="comma list of families (default: healthy and every gap family)")
    ap.add_argument("--json", help="write the per-run results here")
    args = ap.parse_args()
    kinds = args.kinds.split(",") if args.kinds else ["healthy", *[c.name for c in GAP_CASES]]
    selected = [c for c in cases(args.size, kinds=kinds) if args.split == "all" or c.split == args.split]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for case in selected:
        run = out / case.name
        if not (run / "labels.json").exists():
            train_case(case, out)
        labels, causes, conf = diagnose(run)
        rows.append({"name": case.name, "kind": case.kind, "split": case.split, "confidences": conf,
                     "causes": causes, "wrong": verdict(labels, causes, conf)})
    took = time.perf_counter() - t0
    print(f"{len(rows)} runs ({args.size}, split {args.split}), trained and diagnosed in {took:.0f} s "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})\n")
    head = "| family | runs | " + " | ".join(SHORT[c] for c in CAUSES) + " | floors met |"
    print(head + "\n|" + " --- |" * (len(CAUSES) + 3))
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        means = [sum(r["confidences"][c] for r in mine) / len(mine) for c in CAUSES]
        ok = sum(not r["wrong"] for r in mine)
        print(f"| {kind} | {len(mine)} | " + " | ".join(f"{m:.2f}" for m in means) + f" | {ok}/{len(mine)} |")
    missed = [r for r in rows if r["wrong"]]
    print(f"\n{len(rows) - len(missed)}/{len(rows)} runs meet every floor")
    for r in missed:
        print(f"  {r['name']}: {'; '.join(r['wrong'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
