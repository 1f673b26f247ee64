#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1|2 bash benchmarks/gpu_next_checks.sh OUT_DIR (every pytest log goes whole to OUT_DIR).
# What the last run found, and why these calls: benchmarks/journal/session-27-2026-12-06.md.
# CALL=1 (~6 min): the tests/gpu files the last run did not reach (row budgets, start-up graphs, CUDA tensor
#   parallelism, traces) and test_invariant_gemm, after test_fp8_gemm's 8B-shape row check (FP8 plain and DDTree-16
#   tokens differed on the 8B shape in the exact mode while bf16 weights agreed: is it the FP8 product?).
# CALL=2 (~9 min): test_fused_kernels alone (it compiles many Triton shapes: 200 s did not finish its first test).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)  # (the FP8 check first: it is the short one, and the question)
    timeout 100 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fp8_gemm.py \
        -k 8b_shapes > "$OUT/test_fp8_8b_shapes.txt" 2>&1
    echo "fp8 8b rc=$?"; grep -E "PASSED|FAILED|ERROR|assert" "$OUT/test_fp8_8b_shapes.txt" | tail -8
    timeout 240 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_row_budget_kernels.py \
        tests/gpu/test_startup_graphs.py tests/gpu/test_tensor_parallel_cuda.py tests/gpu/test_traces.py \
        tests/gpu/test_invariant_gemm.py > "$OUT/tests_gpu_rest.txt" 2>&1
    echo "rest rc=$?"; tail -15 "$OUT/tests_gpu_rest.txt" ;;
  2)
    timeout 560 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fused_kernels.py \
        > "$OUT/test_fused_kernels.txt" 2>&1
    echo "fused rc=$?"; grep -E "PASSED|FAILED|ERROR" "$OUT/test_fused_kernels.txt" | tail -8 ;;
esac
