#!/usr/bin/env bash
# The GPU checks of docs/performance.md in one prepared run, for a session lent a GPU machine
# (device tool: run "bash bench/gpu_check.sh", timeout_s 600). It uses that machine's python3
# and its torch with CUDA, and rldiag from this checkout (the recompute path needs only torch,
# pyarrow, numpy and pyyaml, all there). Everything it prints is also written under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rldiag-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
# 1. the GPU path gives the CPU path's numbers (and the scan kernels their loop references)
"$PY" -m pytest -q -p no:cacheprovider tests/test_device_equality.py tests/engine/test_scan.py tests/engine/test_thread_count.py 2>&1 | tee "$OUT/equality.txt" || rc=1
# 2. end-to-end rate: reading Parquet, hashing, the engine on the GPU, writing the scenario
timeout 300 "$PY" bench/bench_recompute.py --device cuda --steps 20 --rows 512 --tokens 1024 --estimators grpo,gae --repeat 2 --dir /tmp/rldiag-bench 2>&1 | tee "$OUT/recompute_cuda.txt" || rc=1
# 3. kernel time against the memory-bandwidth floor, at the size and at a larger pack
for size in "4 512 1024" "8 2048 4096"; do
  set -- $size
  timeout 120 "$PY" bench/bench_kernels.py --device cuda --steps "$1" --rows "$2" --tokens "$3" --dir /tmp/rldiag-kernels 2>&1 | grep -v '^USDT' | tee -a "$OUT/kernels_cuda.txt" || rc=1
done
exit $rc
