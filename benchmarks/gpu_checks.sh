#!/usr/bin/env bash
# The checks to run first when a session is lent a GPU (docs/status.md), as one command that
# fits the device's time (15 minutes a session, 10 a command, start-up included):
#
#   bash benchmarks/gpu_checks.sh [DIR]     # DIR: logs and figures (default: $OUT, else gpu-out)
#
# 1. install this tree over the device's torch and triton (no download);
# 2. tests/test_cuda.py, then again with SPECDEC_UNVERIFIED_GPU_PATHS=1 (the opt-in paths:
#    the Triton kernels' tree, sliding-window, soft-cap, sink and MLA variants);
# 3. python -m benchmarks.bench_tree_gpu (issue 53): the verify-cost curve, then trees against
#    chains on the embedded model.
# Each step has its own time limit (510 s in all at most) and the next one runs whatever the
# last gave; the summary at the end gives each step's exit status, seconds and the tests' last
# lines.
set -u
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.is_available())" >> "$out/gpu.txt" 2>&1
pip install --no-deps --no-build-isolation --no-index -e . > "$out/install.log" 2>&1
echo "install rc=$?" > "$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$? ($((SECONDS - start)) s)" >> "$out/summary.txt"
}

step test_cuda 180 python -m pytest -o addopts="" -q -rs -p no:cacheprovider tests/test_cuda.py
SPECDEC_UNVERIFIED_GPU_PATHS=1 step test_cuda_unverified 120 \
    python -m pytest -o addopts="" -q -rs -p no:cacheprovider tests/test_cuda.py
step verify_cost 90 python -m benchmarks.bench_tree_gpu --skip trees --out "$out/verify_cost.json"
step trees 120 python -m benchmarks.bench_tree_gpu --skip verify --repeats 2 --out "$out/trees.json"

for log in test_cuda test_cuda_unverified; do
    echo "--- $log" >> "$out/summary.txt"
    tail -n 3 "$out/$log.log" >> "$out/summary.txt"
done
cat "$out/gpu.txt" "$out/summary.txt"
