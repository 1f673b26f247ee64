#!/usr/bin/env bash
# H200: the checks this code still owes a GPU (written 2026-12-05, when no device was lent), in device
# calls of up to 10 minutes each, run from the repository root: CALL=1|2|3 bash benchmarks/gpu_next_checks.sh OUT_DIR
# CALL=1 (correctness, ~8 min): the exact mode's tiled attention and the fast attention's shared K/V read
#   (2ba9789, 0044684: interpreter-checked only), the FP8 products and their engine test, the exact
#   products after the shared output-tile mapping; then the rest of tests/gpu if time is left.
# CALL=2 (timing, ~8 min): exact vs fast rounds on the Qwen3-8B shape (none, DFlash, DDTree-16/64 at
#   batch 1 and 32; the #29 cost targets 1.10x / 1.15x), and the FP8 step against bf16 (#38: <= 0.6x at
#   batch 1) with FP8 plain == FP8 DDTree-16 tokens.
# CALL=3 (~6 min): tensor parallelism at size 1 (#32: benchmarks/gpu_tp.py, its TP=1 cost needs the
#   pre-TP commit 164d528 in a worktree).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2|3 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)
    timeout 330 python -m pytest -q -p no:cacheprovider tests/gpu/test_exact_mode.py tests/gpu/test_fused_kernels.py \
        tests/gpu/test_invariant_gemm.py tests/gpu/test_fp8_gemm.py 2>&1 | tail -12
    timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu --deselect tests/gpu/test_exact_mode.py \
        --deselect tests/gpu/test_fused_kernels.py --deselect tests/gpu/test_fp8_gemm.py 2>&1 | tail -6 ;;
  2)
    timeout 140 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16,ddtree:64 --batches 1,32 --steps 20 \
        --no-profile --tree-budgets "" --exact --out "$OUT/gpu_rounds_exact.json" 2>&1 | tail -9
    timeout 110 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16,ddtree:64 --batches 1,32 --steps 20 \
        --no-profile --tree-budgets "" --out "$OUT/gpu_rounds_fast.json" 2>&1 | tail -9
    timeout 300 python benchmarks/gpu_fp8.py --workdir /tmp/flashtree-fp8 --out "$OUT/gpu_fp8_qwen3_8b_shape.json" 2>&1 | tail -12 ;;
  3)
    git worktree add -f /tmp/pre-tp 164d528 >/dev/null 2>&1
    timeout 200 env PYTHONPATH=/tmp/pre-tp python benchmarks/gpu_tp.py --tp 1 --out /tmp/gpu_tp_before.json 2>&1 | tail -4
    timeout 200 python benchmarks/gpu_tp.py --tp 1 --compare /tmp/gpu_tp_before.json --out "$OUT/gpu_tp_tp1.json" 2>&1 | tail -8 ;;
esac
