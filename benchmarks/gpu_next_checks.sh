#!/usr/bin/env bash
# H200: the checks this code still owes a GPU, in one device call of about 9 minutes (run it from
# the repository root; no wheels needed):
#   1. tests/gpu and the CUDA tests of tests/test_gpu_kernels.py and tests/test_tree_reference.py
#      (fused kernels, Triton attention, the tree kernels with budgets up to 256 so the long-list
#      threshold searches run too, the Triton log-normalizer of the drafter's top-k);
#   2. each tree kernel alone (gpu_tree_kernel_warps.py): top-k (Triton normalizer vs the torch
#      ops), the kept lists by warps and by threshold search (sort / bisection / radix), select, walk;
#   3. build + walk by budget as shipped (tree_build_speed.py; checks equality with the torch ops),
#      once per long-list threshold search (gpu_kernels.LONG_LIST_THRESHOLD candidates);
#   4. round cost with the tree kernels (gpu_rounds.py).
#   [WARP_BUDGETS=256,1024 LONG_LIST="bisection radix"] bash benchmarks/gpu_next_checks.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# (the interpreter test is CI's: it repeats on the CPU what the CUDA test checks here)
timeout 220 python -m pytest -q tests/gpu tests/test_gpu_kernels.py tests/test_tree_reference.py \
    -k "(cuda or gpu or graph) and not interpreter" 2>&1 | tail -4
timeout 170 python benchmarks/gpu_tree_kernel_warps.py --budgets ${WARP_BUDGETS:-256,1024} --batches 1 \
    --out "$OUT/gpu_tree_kernel_warps_h200.json" 2>&1 | tail -5
for way in ${LONG_LIST:-bisection radix}; do
  timeout 70 python benchmarks/tree_build_speed.py --device cuda --budgets 16,64,256,1024 --batches 1,8 \
      --long-list-threshold "$way" --out "$OUT/tree_build_speed_h200_$way.json" 2>&1 | tail -1
done
timeout 90 python benchmarks/gpu_rounds.py --methods ${ROUND_METHODS:-none,ddtree:64,ddtree:256} \
    --batches ${ROUND_BATCHES:-1} --tree-budgets 64,256 --steps 20 --out "$OUT/gpu_rounds.json" 2>&1 | tail -8
