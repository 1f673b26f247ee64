#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1|2|3 bash benchmarks/gpu_next_checks.sh OUT_DIR (every pytest log goes whole to OUT_DIR).
# What the last run found, and why these calls: benchmarks/journal/session-27-2026-12-06.md.
# CALL=1 (~6 min): test_fp8_gemm whole (its tile table now stops at 32 rows: the 64-row tiles rounded rows of the
#   8B products apart on an H100), then the tests/gpu files the last run did not reach (row budgets, start-up
#   graphs, CUDA tensor parallelism, traces) and test_invariant_gemm (now also rows at the 8B shapes, every tile).
# CALL=2 (~9 min): test_fused_kernels alone (it compiles many Triton shapes: 200 s did not finish its first test).
# CALL=3 (~6 min): gpu_fp8.py at the 8B shape: FP8 plain == FP8 DDTree-16 tokens with the new table (#38), the FP8
#   step against bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2|3 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)
    timeout 200 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fp8_gemm.py \
        > "$OUT/test_fp8_gemm.txt" 2>&1
    echo "fp8 rc=$?"; grep -E "PASSED|FAILED|ERROR|assert" "$OUT/test_fp8_gemm.txt" | tail -12
    timeout 240 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_row_budget_kernels.py \
        tests/gpu/test_startup_graphs.py tests/gpu/test_tensor_parallel_cuda.py tests/gpu/test_traces.py \
        tests/gpu/test_invariant_gemm.py > "$OUT/tests_gpu_rest.txt" 2>&1
    echo "rest rc=$?"; tail -15 "$OUT/tests_gpu_rest.txt" ;;
  2)
    timeout 560 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fused_kernels.py \
        > "$OUT/test_fused_kernels.txt" 2>&1
    echo "fused rc=$?"; grep -E "PASSED|FAILED|ERROR" "$OUT/test_fused_kernels.txt" | tail -8 ;;
  3)
    timeout 330 python benchmarks/gpu_fp8.py --workdir /tmp/flashtree-fp8 --out "$OUT/gpu_fp8_qwen3_8b_shape.json" 2>&1 | tail -12 ;;
esac
