"""Time ``rldiag import-wandb`` on an offline W&B run with a long history.

    .venv/bin/python bench/bench_wandb_import.py                 # 5,000 steps, 40 metrics per step
    .venv/bin/python bench/bench_wandb_import.py --steps 20000 --keys 80 --repeat 5

The run is written by the real wandb SDK (offline, in a subprocess with a throw-away HOME and
WANDB_* folders), with verl's metric names and a 3-step ``rl-batches`` artifact. Then, best of
``--repeat``:

- ``read blocks``: rldiag's block reader alone (records out of the .wandb file);
- ``decode``: blocks + protobuf decoding + value parsing (no output written);
- ``import``: ``import_wandb`` (the above, plus metrics.jsonl, run.yaml, batches, all atomic);
- ``CLI``: ``rldiag import-wandb`` in a fresh process (Python and wandb start-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GEN = r'''
import json, math, random, sys
import wandb
from rldiag.capture.wandb_export import log_batches
steps, keys, batches = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
names = ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/entropy_loss", "actor/grad_norm",
         "actor/lr", "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean",
         "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min", "critic/returns/mean",
         "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
         "prompt_length/mean", "prompt_length/max", "timing_s/gen", "timing_s/update_actor", "timing_s/step",
         "perf/throughput", "perf/max_memory_allocated_gb", "global_seqlen/mean"]
names += [f"rldiag/extra_{i}" for i in range(max(0, keys - len(names)))]
names = names[:keys]
rng = random.Random(0)
run = wandb.init(project="bench", mode="offline", config={"algorithm": {"adv_estimator": "grpo"},
                 "data": {"max_response_length": 32}})
for step in range(1, steps + 1):
    run.log({n: (rng.randint(1, 4096) if n.endswith("/max") else rng.random()) for n in names}, step=step)
log_batches(run, batches)
print(json.dumps({"folder": str(__import__("pathlib").Path(run.dir).parent)}))
run.finish()
'''


def hermetic_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    for name, sub in (("HOME", "home"), ("WANDB_DIR", "wandb-root"), ("WANDB_DATA_DIR", "data"),
                      ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / sub)
    env.update({"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "WANDB_SILENT": "true"})
    return env


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--keys", type=int, default=40, help="metrics per step")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", help="write the run and the imports here and keep them")
    args = ap.parse_args()

    from rldiag.importers.wandb_import import import_wandb
    from rldiag.importers.wandb_log import LogStats, iter_records
    from rldiag.importers.wandb_records import read_offline_run
    from rldiag.synth import SynthSpec, write_synth_run

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rldiag-bench-wandb-"))
    root.mkdir(parents=True, exist_ok=True)
    env = hermetic_env(root)
    try:
        synth = write_synth_run(root / "synth", SynthSpec(steps=3))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", GEN, str(args.steps), str(args.keys), str(synth)], env=env,
                              cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"writing the W&B run failed:\n{proc.stdout}\n{proc.stderr}")
        write_s = time.perf_counter() - t0
        folder = Path(json.loads(proc.stdout.strip().splitlines()[-1])["folder"])
        wandb_file = next(folder.glob("run-*.wandb"))
        size = wandb_file.stat().st_size

        os.environ.update({k: v for k, v in env.items() if k.startswith("WANDB_")})
        read_s = best(lambda: sum(1 for _ in iter_records(wandb_file, LogStats("b"))), args.repeat)
        decode_s = best(lambda: read_offline_run(wandb_file, lambda s, d: None), args.repeat)
        out = root / "imported"
        reports = []
        import_s = best(lambda: reports.append(import_wandb(folder, out)), args.repeat)
        rep = reports[-1]
        assert rep.history_rows == args.steps and rep.batch_steps == [1, 2, 3], rep
        cli = [sys.executable, "-m", "rldiag.cli.main", "import-wandb", str(folder), "--out", str(root / "cli"),
               "--no-progress"]
        cli_s = best(lambda: subprocess.run(cli, env=env, check=True, capture_output=True), args.repeat)

        rows = [
            ("history", f"{args.steps} steps x {args.keys} metrics"),
            ("file", f"{size / 1e6:.1f} MB, {rep.log['records']} records"),
            ("wandb SDK writing it", f"{write_s:.1f} s"),
            ("read blocks", f"{read_s:.3f} s"),
            ("decode (blocks + protobuf + values)", f"{decode_s:.3f} s  ({args.steps / decode_s:,.0f} rows/s)"),
            ("import_wandb (+ metrics.jsonl, run.yaml, 3 batches)", f"{import_s:.3f} s  ({args.steps / import_s:,.0f} rows/s)"),
            ("rldiag import-wandb, fresh process", f"{cli_s:.3f} s"),
        ]
        width = max(len(a) for a, _ in rows)
        print(f"rldiag import-wandb, offline run (best of {args.repeat})")
        for a, b in rows:
            print(f"  {a:<{width}}  {b}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
