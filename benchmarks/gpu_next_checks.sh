#!/usr/bin/env bash
# H200: the checks this code still owes a GPU, in one device call of about 8 minutes (run it from
# the repository root with the serving wheels and the SmolLM2 tokenizer carried; see gpu_load.sh):
#   1. tests/gpu and tests/test_gpu_kernels.py (fused kernels, Triton attention and tree kernel exact);
#   2. tree work with and without the Triton kept-list kernel (tree_build_speed.py, checks equality);
#   3. round cost with the tree kernel (gpu_rounds.py --triton-tree);
#   4. DDTree serving at concurrency 1..32 after a full warm-up, with the policy trace (issue #5's
#      open question: does the recheck keep the policy on plain rounds when drafts never match?);
#   (after 1) with SHAPE and PROMPTS (see regen_speed.sh): regeneration throughput, SDPA vs Triton attention,
#      the faster one's flags written to $STASH/regen_flags for the training script.
#   WHEELS=dir TOKENIZER=dir [SHAPE=dir PROMPTS=file STASH=/root/stash LOAD_LEVELS="1 4 16 32" LOAD_REQUESTS=32]
#   bash benchmarks/gpu_next_checks.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# (the interpreter test is CI's: it repeats on the CPU what the CUDA test checks here)
timeout 200 python -m pytest -q tests/gpu tests/test_gpu_kernels.py -k "not interpreter" 2>&1 | tail -3
if [[ -n "${SHAPE:-}" ]]; then
  mkdir -p "${STASH:-/root/stash}"
  FLAGS_FILE="${STASH:-/root/stash}/regen_flags" timeout 240 bash benchmarks/regen_speed.sh "$OUT" 2>&1 | tail -4
fi
timeout 120 python benchmarks/tree_build_speed.py --device cuda --budgets 16,64,256,1024 --batches 1,8 \
    --out "$OUT/tree_build_speed_h200_kernel.json" 2>&1 | tail -2
timeout 120 python benchmarks/gpu_rounds.py --triton-tree --methods ${ROUND_METHODS:-none,ddtree:16,ddtree:64,ddtree:256} \
    --batches ${ROUND_BATCHES:-1,8} --tree-budgets 256 --steps 20 --out "$OUT/gpu_rounds_triton_tree.json" 2>&1 | tail -10
METHODS="ddtree" LEVELS="${LOAD_LEVELS:-1 4 16 32}" REQUESTS=${LOAD_REQUESTS:-32} LOG_DIR=/tmp/loadlogs \
    EXTRA="--trace-policy $OUT/policy_ddtree_all_levels.jsonl" \
    timeout 200 bash benchmarks/gpu_load.sh "$OUT" 2>&1 | grep -v "^$" | tail -6
gzip -f "$OUT/policy_ddtree_all_levels.jsonl" 2>/dev/null || true
