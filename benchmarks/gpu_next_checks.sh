#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1|2|3 bash benchmarks/gpu_next_checks.sh OUT_DIR (every log goes whole to OUT_DIR).
# What the last run found, and why these calls: benchmarks/journal/session-28-2026-12-06.md.
# CALL=1 (~9 min): where the exact mode's DDTree-16 round at batch 32 loses 1.41x to the fast mode (#29): the
#   exact attention against the fast one per tile size (gpu_exact_attention.py), the tile sweep of the chunked
#   exact product at the verify's 544 rows (and 1,088), the kernels of that round in both modes (torch.profiler).
# CALL=2 (~9 min): the exact mode's GPU tests (the attention's tile agreement among them) and the exact
#   against the fast mode's plain step and DDTree-16 round at batch 1 and 32 (gpu_rounds.py, profiled).
# CALL=3 (~9 min): the fp32 FP8 tests the last runs did not reach, and the tree-kernel part of
#   test_fused_kernels (200 random cases, many Triton shapes: no verdict in 200 s before).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2|3 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)
    timeout 150 python benchmarks/gpu_exact_attention.py --out "$OUT/gpu_exact_attention.json" \
        > "$OUT/gpu_exact_attention.txt" 2>&1
    echo "attention rc=$?"; grep -E "^b=" "$OUT/gpu_exact_attention.txt" | cut -c1-150
    timeout 190 python benchmarks/gpu_exact_gemm.py --rows 544,1088 --products o,qkv,gate_up,down \
        --out "$OUT/gpu_exact_gemm_544.json" > "$OUT/gpu_exact_gemm_544.txt" 2>&1
    echo "sweep rc=$?"; grep -E "M=" "$OUT/gpu_exact_gemm_544.txt" | cut -c1-200
    for mode in fast exact; do
      timeout 105 python benchmarks/gpu_rounds.py --methods ddtree:16 --batches 32 --no-profile --tree-budgets "" \
          --kernel-table 15 $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_kernels_$mode.json" \
          > "$OUT/gpu_rounds_kernels_$mode.txt" 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' "$OUT/gpu_rounds_kernels_$mode.txt" | cut -c1-300
    done ;;
  2)
    timeout 220 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        tests/gpu/test_invariant_gemm.py > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -12
    for mode in fast exact; do
      timeout 150 python benchmarks/gpu_rounds.py --methods none,ddtree:16 --batches 1,32 --tree-budgets "" \
          $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_$mode.json" > "$OUT/gpu_rounds_$mode.txt" 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' "$OUT/gpu_rounds_$mode.txt" | cut -c1-300
    done ;;
  3)
    timeout 200 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fp8_gemm.py -k float32 \
        > "$OUT/tests_fp8_float32.txt" 2>&1
    echo "fp8 fp32 rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_fp8_float32.txt" | tail -6
    timeout 370 python -m pytest -v -rfE -p no:cacheprovider --tb=short --timeout 360 --durations=3 \
        tests/gpu/test_fused_kernels.py -k tree_kernels > "$OUT/test_fused_kernels_tree.txt" 2>&1
    echo "tree rc=$?"; grep -E "PASSED|FAILED|ERROR|Timeout|s call" "$OUT/test_fused_kernels_tree.txt" | tail -6 ;;
esac
