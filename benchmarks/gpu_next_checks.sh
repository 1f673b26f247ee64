#!/usr/bin/env bash
# H200: the checks this code still owes a GPU, in one device call of about 8 minutes (run it from
# the repository root; no wheels needed):
#   1. tests/gpu and the CUDA tests of tests/test_gpu_kernels.py (fused kernels, Triton attention,
#      the three tree kernels with budgets up to 256 so the kept lists' bisection path runs too);
#   2. build + walk by budget with the shipped tree kernels (tree_build_speed.py; checks equality
#      with the torch ops): the sort / bisection split (gpu_kernels.SORT_LIST_MAX) was chosen from
#      each path timed alone and has not been timed as shipped;
#   3. each tree kernel alone by warps per program (gpu_tree_kernel_warps.py; TREE_WARPS);
#   4. round cost with the tree kernels (gpu_rounds.py).
#   bash benchmarks/gpu_next_checks.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# (the interpreter test is CI's: it repeats on the CPU what the CUDA test checks here)
timeout 260 python -m pytest -q tests/gpu tests/test_gpu_kernels.py -k "not interpreter" 2>&1 | tail -3
timeout 70 python benchmarks/tree_build_speed.py --device cuda --budgets 16,64,256,1024 --batches 1,8 \
    --out "$OUT/tree_build_speed_h200.json" 2>&1 | tail -2
timeout 150 python benchmarks/gpu_tree_kernel_warps.py --budgets 64,256,1024 --batches 1 \
    --out "$OUT/gpu_tree_kernel_warps_h200.json" 2>&1 | tail -5
timeout 90 python benchmarks/gpu_rounds.py --methods ${ROUND_METHODS:-none,ddtree:64,ddtree:256} \
    --batches ${ROUND_BATCHES:-1} --tree-budgets 64,256 --steps 20 --out "$OUT/gpu_rounds.json" 2>&1 | tail -8
