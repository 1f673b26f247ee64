#!/usr/bin/env bash
# H200: the checks this code still owes a GPU, in two device calls of up to 10 minutes each (run
# from the repository root; no wheels needed). PART=1 (exactness):
#   1. the tree kernels against the torch ops on CUDA (tests/support/kernel_checks.py compare_tree with
#      TREE_CASES random cases, budgets up to 256 so the bisection runs too, and the three threshold
#      searches against each other; the drafter's top-k; the KV commit kernel), and the
#      CUDA-graph tree test of test_tree_reference; each case compiles kernels for its shapes, so
#      40 cases took over 120 s in the seventh session (killed, no result);
#   2. FULL_TESTS=1: every CUDA test (tests/gpu; over 220 s).
# PART=2 (timing):
#   3. build + walk by budget as shipped (tree_build_speed.py; checks equality with the torch ops);
#   4. SM cycles per stage inside the kept-list and node-selection kernels (gpu_tree_kernel_stages.py);
#   5. each tree kernel alone (gpu_tree_kernel_warps.py): top-k (Triton normalizer vs the torch
#      ops), the kept lists by warps and by threshold search (sort or bisection), the node
#      selection by warps, the walk (over 170 s at budget 256 in the seventh session);
#   6. ROUNDS=1: round cost with the tree kernels (gpu_rounds.py).
#   PART=1|2 [TREE_CASES=12 WARP_BUDGETS=256 WARPS=1,2,4,8 STAGE_BUDGETS=64,256,1024 BUDGETS=16,64,256,1024
#   BATCHES=1,8 ROUNDS=1 ROUND_METHODS=... ROUND_BATCHES=1] bash benchmarks/gpu_next_checks.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ "${PART:-1}" == 1 ]]; then
  timeout 250 python -c "import json; from tests.support.kernel_checks import compare_tree, compare_top_tokens, compare_commit; \
print(json.dumps(compare_tree('cuda', cases=${TREE_CASES:-12}) | compare_top_tokens('cuda') | compare_commit('cuda')))" 2>&1 | tail -2
  timeout 60 python -m pytest -q tests/unit/test_tree_reference.py -k cuda 2>&1 | tail -1
  if [[ -n "${FULL_TESTS:-}" ]]; then
    timeout 300 python -m pytest -q tests/gpu 2>&1 | tail -4
  fi
  exit 0
fi
timeout 150 python benchmarks/tree_build_speed.py --device cuda --budgets ${BUDGETS:-16,64,256,1024} \
    --batches ${BATCHES:-1,8} --out "$OUT/tree_build_speed_h200.json" 2>&1 | tail -9
timeout 90 python benchmarks/gpu_tree_kernel_stages.py --budgets ${STAGE_BUDGETS:-64,256,1024} \
    --out "$OUT/gpu_tree_kernel_stages_h200.json" 2>&1 | tail -6
timeout 200 python benchmarks/gpu_tree_kernel_warps.py --budgets ${WARP_BUDGETS:-256} --batches 1 --warps ${WARPS:-1,2,4,8} \
    --out "$OUT/gpu_tree_kernel_warps_h200.json" 2>&1 | tail -4
if [[ -n "${ROUNDS:-}" ]]; then
  timeout 90 python benchmarks/gpu_rounds.py --methods ${ROUND_METHODS:-none,ddtree:64,ddtree:256} \
      --batches ${ROUND_BATCHES:-1} --tree-budgets 64,256 --steps 20 --out "$OUT/gpu_rounds.json" 2>&1 | tail -8
fi
