#!/usr/bin/env bash
# Issue 24's GPU run: the Triton kernels of the CUDA step beside the torch step
# (benchmarks/bench_triton.py), from a cold machine with the image's torch and triton only (no
# vLLM), in at most 8 minutes: the warm-up from an empty Triton cache and again from the cache
# (a restart), then exactness at [256, 128256], GPU times at [64, 128256] and [256, 128256]
# beside torch.softmax and torch.sort, the flat worst cases, launches and syncs, recompiles.
#
#   bash benchmarks/gpu_run.sh      # prints, and writes gpu_run.log here (into $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# An empty cache: the first warm-up compiles every kernel, the second loads them.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$(mktemp -d)}"
log="${OUT:-.}/gpu_run.log"

run() {  # run LIMIT_SECONDS COMMAND...: each stage under its own limit (200 + 60 + 200 s)
    echo "+ ${*:2}"
    timeout "$@"
    echo "(exit $?)"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
                                       "triton", triton.__version__)'
    run 200 $PY benchmarks/bench_triton.py --only warm-up
    run 60 $PY benchmarks/bench_triton.py --only warm-up
    run 200 $PY benchmarks/bench_triton.py --skip warm-up
} 2>&1 | tee "$log"
