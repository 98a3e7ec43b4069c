"""Engine time against the memory-bandwidth floor, on a CPU or a GPU.

For each estimator, ``--steps`` synthetic steps of ``--rows`` x ``--tokens`` are packed into one
batch on the device (as the executors pack them) and ``recompute_batch`` (every metric) is run
warm, then:

- wall ms:    one pack, end to end (the device synchronised);
- kernel ms:  the time the device spent in kernels (CUDA: the profiler's device time; CPU: the
              self time of the aten operators, i.e. without Python's dispatch), and how many;
- floor ms:   bytes the engine cannot avoid moving (every input token tensor read once, every
              token output written once) over the device's copy bandwidth, measured here with one
              large copy (bytes read + written);
- kernel / floor: how far the engine is from a single fused pass over its data.

Usage::

  .venv/bin/python bench/bench_kernels.py                         # CPU, default sizes
  python3 bench/bench_kernels.py --device cuda --steps 16 --rows 1024 --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rldiag.config.settings import resolve_settings  # noqa: E402
from rldiag.engine.batch import TOKEN_FIELDS, pack  # noqa: E402
from rldiag.engine.pipeline import recompute_batch  # noqa: E402
from rldiag.engine.requirements import recompute_columns  # noqa: E402
from rldiag.executors.allocator import tune_host_allocator  # noqa: E402
from rldiag.io.loader import load_step  # noqa: E402
from rldiag.io.rundir import RunDir  # noqa: E402
from rldiag.synth import SynthSpec, write_synth_run  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of one large copy on ``device``, counting bytes read and written."""
    n = (mib << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def kernel_time(fn, device: torch.device) -> tuple[float, int]:
    """(seconds in kernels, kernels) of one call of ``fn``, from torch's profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    total_us, count = 0.0, 0
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type == DeviceType.CUDA:  # a kernel (or a copy/memset) on the GPU
                total_us += e.time_range.elapsed_us()
                count += 1
        elif e.name.startswith("aten::"):
            total_us += float(e.self_cpu_time_total)
            count += 1
    return total_us / 1e6, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=4, help="steps packed into one batch")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--estimators", default="grpo,gae,rloo")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copy-mib", type=int, default=0, help="size of the bandwidth copy (default: 256 CPU, 2048 GPU)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        tune_host_allocator()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-kernels-"))
    run = base / f"run-{args.steps}-{args.rows}-{args.tokens}"
    if not (run / "batches").is_dir():
        write_synth_run(run, SynthSpec(steps=args.steps, prompts=max(1, args.rows // 8), n=8, min_len=args.tokens,
                                       max_len=args.tokens, seed=0, write_metrics=False))
    bw = copy_bandwidth(device, args.copy_mib or (2048 if device.type == "cuda" else 256))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    print(f"pack: {args.steps} steps x {args.rows} rows x {args.tokens} tokens\n")
    cols = [("estimator", "<10"), ("wall ms", ">9"), ("kernel ms", ">10"), ("kernels", ">8"), ("floor ms", ">9"),
            ("kernel/floor", ">13"), ("MB moved", ">9"), ("Mtok/s", ">9")]
    print(" ".join(format(c, spec) for c, spec in cols))
    for est in args.estimators.split(","):
        settings = resolve_settings(run, {"algorithm.adv_estimator": est})
        plan = recompute_columns(settings)
        batch = pack([load_step(sf, settings, plan).batch for sf in RunDir(run).require_steps()]).to(device)
        inputs = tensor_bytes(getattr(batch, f) for f in TOKEN_FIELDS)
        result = recompute_batch(batch, settings, None)  # warm: kernels chosen, memory cached
        sync(device)
        moved = inputs + tensor_bytes(result.tokens.values())
        del result
        wall = float("inf")
        for _ in range(args.repeat):
            sync(device)
            t = time.perf_counter()
            recompute_batch(batch, settings, None)
            sync(device)
            wall = min(wall, time.perf_counter() - t)
        kern, n = kernel_time(lambda b=batch, s=settings: recompute_batch(b, s, None), device)
        floor = moved / bw
        tokens = int(batch.lengths.sum())
        cells = [est, f"{wall * 1e3:.2f}", f"{kern * 1e3:.2f}", str(n), f"{floor * 1e3:.3f}",
                 f"{kern / floor:.1f}", f"{moved / 1e6:.1f}", f"{tokens / wall / 1e6:.3g}"]
        print(" ".join(format(c, spec) for c, (_, spec) in zip(cells, cols)))


if __name__ == "__main__":
    main()
