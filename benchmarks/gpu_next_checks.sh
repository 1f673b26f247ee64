#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1|2 bash benchmarks/gpu_next_checks.sh OUT_DIR (every log goes whole to OUT_DIR).
# What the last runs found, and why these calls: benchmarks/journal/session-28-2026-12-06.md.
# CALL=1 (~8 min): the K-chunked exact and FP8 products (#29, #38): decode rows timed split / one program / no
#   chunks against cuBLAS with same-bits checks, the exact and FP8 GEMM tests, and the exact mode's plain step
#   and DDTree-16 round against the fast mode's at the Qwen3-8B shape, batch 1 and 32.
# CALL=2 (~9 min): test_fused_kernels, one test per part with a time limit each, then the FP8 products and
#   steps at the 8B shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)
    timeout 200 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_invariant_gemm.py \
        tests/gpu/test_fp8_gemm.py > "$OUT/tests_gemm.txt" 2>&1
    echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/tests_gemm.txt" | tail -8
    timeout 120 python benchmarks/gpu_exact_gemm.py --decode --products o,down,qkv,gate_up,lm_head \
        --out "$OUT/gpu_exact_gemm_decode.json" > "$OUT/gpu_exact_gemm_decode.txt" 2>&1
    echo "gemm rc=$?"; cut -c1-400 "$OUT/gpu_exact_gemm_decode.txt" | tail -26
    for mode in fast exact; do
      timeout 110 python benchmarks/gpu_rounds.py --methods none,ddtree:16 --batches 1,32 --no-profile \
          --tree-budgets "" $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_$mode.json" \
          > "$OUT/gpu_rounds_$mode.txt" 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' "$OUT/gpu_rounds_$mode.txt" | cut -c1-200
    done ;;
  2)
    timeout 420 python -m pytest -v -rfE -p no:cacheprovider --tb=short --timeout 120 \
        tests/gpu/test_fused_kernels.py > "$OUT/test_fused_kernels.txt" 2>&1
    echo "fused rc=$?"; grep -E "PASSED|FAILED|ERROR|Timeout" "$OUT/test_fused_kernels.txt" | tail -12
    timeout 150 python benchmarks/gpu_fp8.py --parts products,steps --workdir /tmp/flashtree-fp8 \
        --out "$OUT/gpu_fp8_qwen3_8b_shape.json" 2>&1 | tail -12 ;;
esac
