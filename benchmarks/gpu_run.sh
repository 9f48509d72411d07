#!/usr/bin/env bash
# The GPU runs, from a cold machine with the image's torch and triton only (no vLLM), each in at
# most 8 minutes:
#
# * kernels (issue 24, the default): the Triton kernels of the CUDA step beside the torch step
#   (benchmarks/bench_triton.py): the warm-up from an empty Triton cache and again from the
#   cache (a restart), then exactness at [256, 128256] (the window's families, the search
#   pass's and the wide pass's), GPU times at [64, 128256] and [256, 128256] beside
#   torch.softmax and torch.sort, the flat worst cases (the wide pass: k* in the tens of
#   thousands, beside a sort), launches and syncs, recompiles;
# * exact (issue 25): the exact path's worst cases on the GPU (benchmarks/bench_core.py): the
#   floor table at [256, 128256] (a sort, the output map alone with k* given, the whole call)
#   and the extremes table at [64, 128256] (each case's time over a sort of the same rows,
#   host syncs, launched ops).
#
#   bash benchmarks/gpu_run.sh [kernels|exact]   # prints, and writes gpu_run_<run>.log here
#                                                # (into $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# An empty cache: the first warm-up compiles every kernel, the second loads them.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$(mktemp -d)}"
which="${1:-kernels}"
case "$which" in kernels | exact) ;; *) echo "usage: bash benchmarks/gpu_run.sh [kernels|exact]" >&2
    exit 2 ;; esac
log="${OUT:-.}/gpu_run_${which}.log"
DEVICE=${DEVICE:-cuda}  # (DEVICE=cpu with SMALL=1: the script's own check on a CPU)
if [ "${SMALL:-0}" = 1 ]; then FLOOR_SHAPE=4x4096 EXTREMES_SHAPE=4x4096; else
    FLOOR_SHAPE=256x128256 EXTREMES_SHAPE=64x128256; fi

# run LIMIT_SECONDS COMMAND...: each stage under its own limit (kernels: 240 + 30 + 200 s, the
# cold warm-up compiling every kernel, the wide pass's too; exact: 120 + 300 s)
run() {
    echo "+ ${*:2}"
    timeout "$@"
    echo "(exit $?)"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
                                       "triton", triton.__version__)'
    case "$which" in
        kernels)
            run 240 $PY benchmarks/bench_triton.py --only warm-up
            run 30 $PY benchmarks/bench_triton.py --only warm-up
            run 200 $PY benchmarks/bench_triton.py --skip warm-up
            ;;
        exact)
            run 120 $PY benchmarks/bench_core.py --device "$DEVICE" --only floor \
                --extremes-shape "$FLOOR_SHAPE"
            run 300 $PY benchmarks/bench_core.py --device "$DEVICE" --only extremes \
                --extremes-shape "$EXTREMES_SHAPE" --repeats 4
            ;;
    esac
} 2>&1 | tee "$log"
