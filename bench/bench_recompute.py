"""Benchmark: rldiag recompute against the I/O floor and a straightforward reference.

First, whole processes on the default workloads: a uniform run (steps x rows x tokens below)
and long-tailed runs as reasoning training has them (lognormal lengths around 600 tokens, 2 % of
the rows cut at a 16k or 32k cap; and one step of 8,192 rows with a 32k cap). For each,
`rldiag recompute RUN --no-reuse` (every metric, hashing included) against a process that only
decodes the Parquet columns that recompute reads, nothing else: wall time and peak RSS of each
process, and their ratios; and the same ratios less each process's fixed cost (the two commands
on a one-step run of 8 rows x 64 tokens: Python, the imports, torch's 2 s and 200 MB among them),
which is what each further step of a long run costs. Two one-step workloads of 64 rows, alike
but for one row of 200k tokens in the second, show what a very long row costs.

Then, on the uniform run, generates runs of a given size on disk (steps x rows x tokens, groups,
tool gaps, all log-prob columns) and reports side by side, each measured in its own subprocess
(so peak memory is its own):

  (a) read   reading the columns a recompute needs from Parquet into the engine's tensors
  (b) rldiag `rldiag.scenario.recompute.recompute` with all metrics (CPU, or --device), cold: it hashes
             every input file (SHA-256, for scenario.json) and reuses nothing
  (b') known the same recompute as a new scenario of a run that another scenario has recomputed
             already: the files' hashes are known (their size and mtime match that scenario's
             record); every metric is computed again
  (c) ref    a straightforward reference of the same computations, as a trainer's own code does
             it: per-time-step GAE loop, per-row Python loops for group statistics, per-step
             metrics with plain torch ops

tokens/s, the ratios b/a and c/b, and peak RSS. Usage:

  .venv/bin/python bench/bench_recompute.py                       # default sizes and workloads
  .venv/bin/python bench/bench_recompute.py --workloads tail16k,tail32k --process-repeat 3
  .venv/bin/python bench/bench_recompute.py --steps 20 --rows 512 --tokens 1024 --estimators grpo,gae
  .venv/bin/python bench/bench_recompute.py --memory              # peak memory, 10 vs 100 steps
  .venv/bin/python bench/bench_recompute.py --sweep --workloads uniform,tail16k --scale 0.25

``--sweep``: whole processes instead, `rldiag recompute RUN --no-reuse` against `rldiag sweep RUN
--no-reuse` of 8 scenarios (2 estimators x 4 clip ratios) and of 32 (2 x 16): wall time and peak
RSS, their ratios to the one recompute, and the time ratios less each process's fixed cost (the
same commands on a one-step run of 8 rows x 64 tokens).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


#: the long-tailed workloads of the whole-process table: steps, rows, cap (max_response_length),
#: rows of each step at the cap besides the capped share; row200k and its twin rows64 are the same
#: 64 rows but for one, at 200k tokens in row200k (what one very long row costs)
TAILED = {
    "tail16k": (10, 512, 16384, 0),
    "tail32k": (3, 2048, 32768, 0),
    "step8k32k": (1, 8192, 32768, 0),
    "step16m": (1, 8192, 32768, 0),
    "rows64": (1, 64, 200_000, 0),
    "row200k": (1, 64, 200_000, 1),
}
#: the capped share of the long-tailed workloads, but for the 64-row pair (no row at the cap by chance)
#: and step16m: 3.5 % of its 8,192 rows at the 32k cap make about 16 M tokens (issue 38's real step:
#: (1 - 0.035) x 826, the lognormal's mean, + 0.035 x 32,768 = 1,944 tokens a row)
CAPPED_SHARE = {"rows64": 0.0, "row200k": 0.0, "step16m": 0.035}
TAIL_MEDIAN, TAIL_SIGMA, TAIL_CAPPED = 600, 0.8, 0.02


def make_tailed_run(path: Path, steps: int, rows: int, cap: int, median: int = TAIL_MEDIAN, seed: int = 0,
                    capped: float = TAIL_CAPPED, capped_rows: int = 0) -> Path:
    """A run with lognormal response lengths (median ``median``), a share ``capped`` of the rows
    at ``cap`` and ``capped_rows`` more rows of each step there."""
    from rldiag.synth import SynthSpec, write_synth_run

    if (path / "batches").is_dir() and len(list((path / "batches").iterdir())) == steps:
        return path
    spec = SynthSpec(steps=steps, prompts=max(1, rows // 8), n=8, min_len=16, max_len=cap, lengths="lognormal",
                     median_len=median, sigma=TAIL_SIGMA, capped=capped, capped_rows=capped_rows, seed=seed,
                     write_metrics=False)
    return write_synth_run(path, spec)


def make_run(path: Path, steps: int, rows: int, tokens: int, seed: int = 0) -> Path:
    from rldiag.synth import SynthSpec, write_synth_run

    if (path / "batches").is_dir() and len(list((path / "batches").iterdir())) == steps:
        return path
    spec = SynthSpec(steps=steps, prompts=max(1, rows // 8), n=8, min_len=tokens, max_len=tokens, seed=seed,
                     write_metrics=False)
    return write_synth_run(path, spec)


# ---- the three measured workloads (run in a child process) --------------------------------


def work_read(run: str, estimator: str, device: str) -> dict:
    from rldiag.config.settings import resolve_settings
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    s = resolve_settings(Path(run), {"algorithm.adv_estimator": estimator})
    n = 0
    for sf in RunDir(run).require_steps():
        sd = load_step(sf, s, recompute_columns(s))
        n += sd.n_tokens
    return {"tokens": n}


def work_rldiag(run: str, estimator: str, device: str) -> dict:
    from rldiag.scenario.recompute import recompute

    rep = recompute(run, {"algorithm.adv_estimator": estimator}, name=f"bench-{estimator}", device=device, reuse=False)
    return {"tokens": rep.tokens, "failed": len(rep.steps_failed)}


def work_known(run: str, estimator: str, device: str) -> dict:
    from rldiag.scenario.recompute import recompute

    # a what-if (the clip ratio, which costs the same): a scenario whose resolved settings equal
    # (b)'s would reuse (b)'s steps whatever its name; this one finds only the input hashes
    rep = recompute(run, {"algorithm.adv_estimator": estimator, "actor_rollout_ref.actor.clip_ratio": 0.21},
                    name=f"bench-known-{estimator}", device=device)
    if rep.steps_reused:
        raise SystemExit(f"bench: (b') reused steps {rep.steps_reused}; its scenario was not removed")
    return {"tokens": rep.tokens, "failed": len(rep.steps_failed)}


def work_prime(run: str, estimator: str, device: str) -> dict:
    """Not measured: the scenario whose input records (b') finds."""
    from rldiag.scenario.recompute import recompute

    rep = recompute(run, {"algorithm.adv_estimator": "grpo"}, name="bench-hashes", device=device, reuse=False)
    return {"tokens": rep.tokens}


def work_ref(run: str, estimator: str, device: str) -> dict:
    """The same computations written the straightforward way: Python loops over rows and over
    time steps of each row's tokens (taken to lists first, the loops' best case)."""
    import math
    from collections import defaultdict

    import torch

    from rldiag.config.settings import resolve_settings
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    s = resolve_settings(Path(run), {"algorithm.adv_estimator": estimator})
    gamma, lam = float(s["algorithm.gamma"]), float(s["algorithm.lam"])
    n = 0
    for sf in RunDir(run).require_steps():
        sd = load_step(sf, s, recompute_columns(s))
        b = sd.batch
        lengths = b.lengths.tolist()

        def per_row(t, lengths=lengths):
            return [x.tolist() for x in torch.split(t, lengths)]

        mask = per_row(b.response_mask)
        scores = per_row(b.token_level_scores)
        old, new = per_row(b.old_log_probs), per_row(b.log_probs)
        n += sd.n_tokens
        rows = range(b.n_rows)
        if estimator == "gae":
            values = per_row(b.values)
            raw = []
            for i in rows:
                T = lengths[i]
                adv = [0.0] * T
                nextv = last = 0.0
                for t in reversed(range(T)):
                    delta = scores[i][t] + gamma * nextv - values[i][t]
                    cand = delta + gamma * lam * last
                    if mask[i][t]:
                        nextv, last = values[i][t], cand
                    adv[t] = last
                raw.append(adv)
            flat = [a for i in rows for a, m in zip(raw[i], mask[i]) if m]
            mean = sum(flat) / len(flat)
            var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
            inv = 1 / math.sqrt(var + 1e-8)
            advs = [[(a - mean) * inv for a in raw[i]] for i in rows]
            rets = [[a + v for a, v in zip(raw[i], values[i])] for i in rows]
        else:
            seq = [sum(scores[i][: lengths[i]]) for i in rows]
            groups = defaultdict(list)
            uids = b.group_ids.tolist()
            for i in rows:
                groups[uids[i]].append(seq[i])
            advs = []
            for i in rows:
                g = groups[uids[i]]
                k = len(g)
                mean = sum(g) / k if k > 1 else 0.0
                if estimator == "rloo":
                    a = (seq[i] - mean) * k / (k - 1) if k > 1 else seq[i]
                else:
                    std = math.sqrt(sum((x - mean) ** 2 for x in g) / (k - 1)) if k > 1 else 1.0
                    a = (seq[i] - mean) / (std + 1e-6)
                advs.append([a * m for m in mask[i][: lengths[i]]])
            rets = advs
        # PPO clipped loss and its metrics, per token
        tot = clip = kl = cnt = 0.0
        for i in rows:
            for t in range(lengths[i]):
                if not mask[i][t]:
                    continue
                lr = max(-20.0, min(20.0, new[i][t] - old[i][t]))
                ratio = math.exp(lr)
                a = advs[i][t]
                l1, l2 = -a * ratio, -a * max(0.8, min(1.2, ratio))
                c1 = max(l1, l2)
                tot += min(-a * 3.0, c1) if a < 0 else c1
                clip += l2 > l1
                kl -= lr
                cnt += 1
        _ = (tot / cnt, clip / cnt, kl / cnt, rets)
    return {"tokens": n}


# ---- whole processes: `rldiag recompute` against decoding the columns it reads ----------------

DECODE = """
import json, sys
import pyarrow.parquet as pq
files, columns = json.loads(sys.argv[1]), json.loads(sys.argv[2])
n = 0
for f in files:
    pf = pq.ParquetFile(f)
    t = pf.read(columns=[c for c in columns if c in pf.schema_arrow.names], use_threads=True)
    n += t.num_rows
print(n)
"""


def proc_child(cmd_json: str) -> None:
    """Run one command; print its wall time and peak RSS (this process's only child)."""
    cmd = json.loads(cmd_json)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                      "peak_rss_mb": usage.ru_maxrss / 1024}))


def measure_process(cmd: list[str], fresh: Path | None = None) -> dict:
    if fresh is not None and fresh.exists():
        shutil.rmtree(fresh)
    out = subprocess.run([sys.executable, __file__, "--proc", json.dumps(cmd)], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def run_shape(run: Path) -> tuple[int, int, int, int]:
    """(steps, rows, tokens, rows x longest row summed over steps) of a run."""
    import pyarrow.compute as pc

    from rldiag.io.arrays import read_parquet

    steps = rows = tokens = slots = 0
    for f in sorted((run / "batches").iterdir()):
        lengths = pc.list_value_length(read_parquet(f, ["response_mask"])["response_mask"]).to_numpy()
        steps += 1
        rows += len(lengths)
        tokens += int(lengths.sum())
        slots += len(lengths) * int(lengths.max())
    return steps, rows, tokens, slots


def _pair(run: Path, repeat: int, rldiag_cli: str) -> tuple[dict, dict]:
    """(rldiag, decode): the best of ``repeat`` alternating runs of each whole process on ``run``."""
    from rldiag.config.settings import resolve_settings
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import plan_columns, read_schema
    from rldiag.io.rundir import RunDir

    files = [str(sf.path) for sf in RunDir(run).require_steps()]
    columns = plan_columns(recompute_columns(resolve_settings(run)), read_schema(RunDir(run).require_steps()[0]).names)
    r = d = None
    for _ in range(repeat):  # alternating, best of each: a shared machine's spells weigh on both
        d = best(d, measure_process([sys.executable, "-c", DECODE, json.dumps(files), json.dumps(columns)]))
        r = best(r, measure_process([rldiag_cli, "recompute", str(run), "--no-reuse", "--device", "cpu",
                                     "--name", "bench-process"], fresh=run / "rldiag" / "scenarios" / "bench-process"))
    return r, d


def _less(m: dict, fixed: dict, key: str) -> float:
    return max(m[key] - fixed[key], 0.0)


def whole_process_table(runs: dict[str, Path], repeat: int) -> None:
    rldiag_cli = str(Path(sys.executable).with_name("rldiag"))
    # the fixed cost of each process: the same two commands on a run of one step of 8 rows x 64
    # tokens (starting Python, the imports, torch's included, the first read and the first
    # operations, writing a scenario), which a run of any size pays once
    tiny = make_run(Path(next(iter(runs.values()))).parent / "fixed-1-8-64", 1, 8, 64)
    f_r, f_d = _pair(tiny, repeat, rldiag_cli)
    print(f"fixed cost of a process (one step of 8 rows x 64 tokens): rldiag {f_r['seconds']:.2f} s "
          f"{f_r['peak_rss_mb']:.0f} MB (torch included), decode {f_d['seconds']:.2f} s {f_d['peak_rss_mb']:.0f} MB")
    cols = [("workload", "<10"), ("steps x rows", ">13"), ("Mtokens", ">8"), ("filled", ">7"), ("rldiag s", ">9"),
            ("decode s", ">9"), ("time x", ">7"), ("rldiag MB", ">10"), ("decode MB", ">10"), ("mem x", ">6"),
            ("work x", ">7"), ("data mem x", ">11")]
    hdr = " ".join(format(name, spec) for name, spec in cols)
    print("whole processes: `rldiag recompute RUN --no-reuse` (all metrics) vs decoding its Parquet columns only;")
    print("work x and data mem x: the same ratios less each process's fixed cost (what a longer run pays per step)")
    print(hdr)
    print("-" * len(hdr))
    for name, run in runs.items():
        steps, rows, tokens, slots = run_shape(run)
        r, d = _pair(run, repeat, rldiag_cli)
        print(f"{name:<10} {f'{steps} x {rows // steps}':>13} {tokens / 1e6:>8.2f} {tokens / slots:>7.0%} "
              f"{r['seconds']:>9.2f} {d['seconds']:>9.2f} {r['seconds'] / d['seconds']:>7.2f} "
              f"{r['peak_rss_mb']:>10.0f} {d['peak_rss_mb']:>10.0f} {r['peak_rss_mb'] / d['peak_rss_mb']:>6.2f} "
              f"{_less(r, f_r, 'seconds') / max(_less(d, f_d, 'seconds'), 1e-3):>7.2f} "
              f"{_less(r, f_r, 'peak_rss_mb') / max(_less(d, f_d, 'peak_rss_mb'), 1.0):>11.2f}")
    print()


#: the sweeps --sweep measures: 2 estimators x 4 and x 16 clip ratios
SWEEP_CLIPS = {8: [0.1, 0.15, 0.2, 0.28], 32: [round(0.05 + 0.02 * i, 2) for i in range(16)]}


def _sweep_cmds(run: Path, rldiag_cli: str) -> dict[str, tuple[list[str], Path]]:
    """name -> (command, the output it writes, removed before each run)."""
    out = {"recompute": ([rldiag_cli, "recompute", str(run), "--no-reuse", "--device", "cpu", "--name", "bench-process",
                          "--no-progress"], run / "rldiag" / "scenarios" / "bench-process")}
    for n, clips in SWEEP_CLIPS.items():
        out[f"sweep{n}"] = ([rldiag_cli, "sweep", str(run), "--no-reuse", "--device", "cpu", "--estimators", "grpo,rloo",
                             "--grid", "actor_rollout_ref.actor.clip_ratio=" + ",".join(map(str, clips)),
                             "--name", f"bench-sweep{n}", "--no-progress"], run / "rldiag" / "scenarios")
    return out


def _sweep_measure(run: Path, repeat: int, rldiag_cli: str) -> dict[str, dict]:
    cmds = _sweep_cmds(run, rldiag_cli)
    got: dict[str, dict | None] = dict.fromkeys(cmds)
    for _ in range(repeat):  # alternating, best of each
        for name, (cmd, fresh) in cmds.items():
            got[name] = best(got[name], measure_process(cmd, fresh=fresh))
    return {k: v for k, v in got.items() if v is not None}


def sweep_table(runs: dict[str, Path], repeat: int) -> None:
    rldiag_cli = str(Path(sys.executable).with_name("rldiag"))
    tiny = make_run(Path(next(iter(runs.values()))).parent / "fixed-1-8-64", 1, 8, 64)
    fixed = _sweep_measure(tiny, repeat, rldiag_cli)
    print("fixed cost of each process (one step of 8 rows x 64 tokens): "
          + ", ".join(f"{k} {v['seconds']:.2f} s {v['peak_rss_mb']:.0f} MB" for k, v in fixed.items()))
    cols = [("workload", "<10"), ("steps x rows", ">13"), ("Mtokens", ">8"), ("recompute s", ">12"),
            ("sweep8 s", ">9"), ("x", ">6"), ("sweep32 s", ">10"), ("x", ">6"), ("recompute MB", ">13"),
            ("sweep8 MB", ">10"), ("x", ">6"), ("sweep32 MB", ">11"), ("x", ">6"), ("work x8", ">8"), ("work x32", ">9"),
            ("cpu x8", ">7"), ("cpu x32", ">8")]
    hdr = " ".join(format(name, spec) for name, spec in cols)
    print("whole processes: `rldiag recompute RUN --no-reuse` vs `rldiag sweep RUN --no-reuse` of 8 scenarios "
          "(2 estimators x 4 clip ratios) and 32 (2 x 16);")
    print("x: the sweep's ratio to the one recompute; work x: the time ratio less each process's fixed cost;")
    print("cpu x: the same with CPU seconds (user + system), which a busy shared machine disturbs less")
    print(hdr)
    print("-" * len(hdr))
    for name, run in runs.items():
        steps, rows, tokens, _ = run_shape(run)
        m = _sweep_measure(run, repeat, rldiag_cli)
        r, s8, s32 = m["recompute"], m["sweep8"], m["sweep32"]
        work = max(_less(r, fixed["recompute"], "seconds"), 1e-3)
        cpu = max(_less(r, fixed["recompute"], "cpu_seconds"), 1e-3)
        print(f"{name:<10} {f'{steps} x {rows // steps}':>13} {tokens / 1e6:>8.2f} {r['seconds']:>12.2f} "
              f"{s8['seconds']:>9.2f} {s8['seconds'] / r['seconds']:>6.2f} {s32['seconds']:>10.2f} "
              f"{s32['seconds'] / r['seconds']:>6.2f} {r['peak_rss_mb']:>13.0f} {s8['peak_rss_mb']:>10.0f} "
              f"{s8['peak_rss_mb'] / r['peak_rss_mb']:>6.2f} {s32['peak_rss_mb']:>11.0f} "
              f"{s32['peak_rss_mb'] / r['peak_rss_mb']:>6.2f} "
              f"{_less(s8, fixed['sweep8'], 'seconds') / work:>8.2f} {_less(s32, fixed['sweep32'], 'seconds') / work:>9.2f} "
              f"{_less(s8, fixed['sweep8'], 'cpu_seconds') / cpu:>7.2f} "
              f"{_less(s32, fixed['sweep32'], 'cpu_seconds') / cpu:>8.2f}")
    print()


WORK = {"read": work_read, "rldiag": work_rldiag, "known": work_known, "prime": work_prime, "ref": work_ref}


def child(mode: str, run: str, estimator: str, device: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1))))
    t0 = time.perf_counter()
    res = WORK[mode](run, estimator, device)
    res["seconds"] = time.perf_counter() - t0
    res["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res))


def peak_rss_mb() -> float:
    """This process's peak RSS. ``VmHWM`` where /proc has it: ``ru_maxrss`` survives ``exec``, so
    a child of this (large) bench process would report at least the bench's own peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best(a: dict | None, b: dict) -> dict:
    return b if a is None or b["seconds"] < a["seconds"] else a


def measure(mode: str, run: Path, estimator: str, device: str, repeat: int, fresh: Path | None = None) -> dict:
    """Best of ``repeat`` child processes. ``fresh``: a scenario directory removed before each,
    so that every recompute starts cold (hashes every input file, reuses nothing)."""
    top = None
    for _ in range(repeat):
        if fresh is not None and fresh.exists():
            shutil.rmtree(fresh)
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(run), estimator, device],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        res = json.loads(out)
        top = best(top, res)
    return top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--estimators", default="grpo,gae,rloo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to keep generated runs (default: a temp dir)")
    ap.add_argument("--memory", action="store_true", help="peak memory of recompute at 10 vs 100 steps")
    ap.add_argument("--workloads", default="uniform,tail16k,tail32k,step8k32k,rows64,row200k",
                    help="whole-process workloads: uniform (--steps x --rows x --tokens) and the long-tailed "
                         f"{', '.join(TAILED)}; 'none' skips the table")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="shrink the long-tailed workloads' rows, cap and median by this factor (tests)")
    ap.add_argument("--process-repeat", type=int, default=2, help="best of N for the whole-process table")
    ap.add_argument("--sweep", action="store_true",
                    help="whole processes: one recompute vs sweeps of 8 and 32 scenarios, on --workloads")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--proc", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.proc:
        proc_child(args.proc)
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-bench-"))
    # rldiag's bytecode, as an installed package has it (pip compiles on install): with
    # PYTHONDONTWRITEBYTECODE set, every child would otherwise compile rldiag's modules from
    # source (about 50 ms in (b), 15 ms in (a)), a cost of the environment rather than of rldiag
    compileall.compile_dir(str(ROOT / "rldiag"), quiet=1)
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; device {args.device}")
    runs = {}
    for name in [w for w in args.workloads.split(",") if w and w != "none"]:
        if name == "uniform":
            runs[name] = make_run(base / f"run-{args.steps}-{args.rows}-{args.tokens}", args.steps, args.rows, args.tokens)
        elif name in TAILED:
            steps, rows, cap, at_cap = TAILED[name]
            rows, cap = max(8, int(rows * args.scale)), max(64, int(cap * args.scale))
            runs[name] = make_tailed_run(base / f"{name}-{rows}-{cap}", steps, rows, cap,
                                         median=max(8, int(TAIL_MEDIAN * args.scale)),
                                         capped=CAPPED_SHARE.get(name, TAIL_CAPPED), capped_rows=at_cap)
        else:
            raise SystemExit(f"unknown workload {name!r}; choose from uniform, {', '.join(TAILED)}")
    if args.sweep:
        sweep_table(runs, args.process_repeat)
        return
    if runs:
        whole_process_table(runs, args.process_repeat)
    if args.memory:
        print(f"\npeak memory of `recompute` (grpo) as the run grows, {args.rows} rows x {args.tokens} tokens per step")
        print(f"{'steps':>6} {'seconds':>8} {'peak RSS MB':>12}")
        for steps in (10, 100):
            run = make_run(base / f"mem-{steps}-{args.rows}-{args.tokens}", steps, args.rows, args.tokens)
            r = measure("rldiag", run, "grpo", args.device, 1)
            print(f"{steps:>6} {r['seconds']:>8.2f} {r['peak_rss_mb']:>12.0f}")
        return
    run = make_run(base / f"run-{args.steps}-{args.rows}-{args.tokens}", args.steps, args.rows, args.tokens)
    size = sum(p.stat().st_size for p in (run / "batches").iterdir()) / 1e6
    print(f"run: {args.steps} steps x {args.rows} rows x {args.tokens} tokens, {size:.0f} MB of Parquet at {run}\n")
    cols = [("estimator", "<10"), ("(a) read s", ">10"), ("(b) rldiag s", ">12"), ("(b') known s", ">13"),
            ("(c) ref s", ">10"), ("b/a", ">6"), ("b'/a", ">6"), ("c/b", ">6"), ("Mtok/s b", ">9"),
            ("RSS a MB", ">9"), ("RSS b MB", ">9"), ("RSS c MB", ">9")]
    hdr = " ".join(format(name, spec) for name, spec in cols)
    print(hdr)
    print("-" * len(hdr))
    scenarios = run / "rldiag" / "scenarios"
    measure("prime", run, "grpo", args.device, 1)
    for est in args.estimators.split(","):
        # (a), (b) and (b') alternate, so that a slower or faster spell of a shared machine
        # weighs on all alike; the best of the repeats is kept (the least disturbed run)
        a = b = k = None
        for _ in range(args.repeat):
            a = best(a, measure("read", run, est, args.device, 1))
            b = best(b, measure("rldiag", run, est, args.device, 1, fresh=scenarios / f"bench-{est}"))
            k = best(k, measure("known", run, est, args.device, 1, fresh=scenarios / f"bench-known-{est}"))
        c = measure("ref", run, est, args.device, args.repeat)
        print(f"{est:<10} {a['seconds']:>10.2f} {b['seconds']:>12.2f} {k['seconds']:>13.2f} {c['seconds']:>10.2f} "
              f"{b['seconds'] / a['seconds']:>6.2f} {k['seconds'] / a['seconds']:>6.2f} {c['seconds'] / b['seconds']:>6.2f} "
              f"{b['tokens'] / b['seconds'] / 1e6:>9.2f} "
              f"{a['peak_rss_mb']:>9.0f} {b['peak_rss_mb']:>9.0f} {c['peak_rss_mb']:>9.0f}")


if __name__ == "__main__":
    main()
