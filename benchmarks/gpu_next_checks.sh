#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1|2|3 bash benchmarks/gpu_next_checks.sh OUT_DIR (every pytest log goes whole to OUT_DIR).
# What the last run found, and why these calls: benchmarks/journal/session-25-2026-12-05.md.
# CALL=1 (~9 min): the rest of tests/gpu but the exact mode's (~2.5 min), then test_fused_kernels and
#   test_fp8_gemm (its every-tile check decides whether the FP8 tile table is row-invariant on this GPU).
# CALL=2 (~8 min): exact vs fast rounds on the Qwen3-8B shape (#29 cost targets 1.10x / 1.15x at batch 1 / 32),
#   and the FP8 step against bf16 (#38: <= 0.6x at batch 1) with FP8 plain == FP8 DDTree-16 tokens, and the same
#   token check with bf16 weights (lossless_bf16_weights: whether the exact mode or the FP8 product breaks it).
# CALL=3 (~6 min): tensor parallelism at size 1 against the pre-TP code (#32 <= 1%): needs 164d528's flashtree/
#   unpacked at /tmp/pre-tp (git archive 164d528 flashtree > .old/device/pre-tp.tar; carry .old/device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1|2|3 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)  # (the rest of tests/gpu first: it confirms session 25's fixes and fits a short lease)
    timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/gpu --tb=short --deselect tests/gpu/test_exact_mode.py \
        --deselect tests/gpu/test_fused_kernels.py --deselect tests/gpu/test_fp8_gemm.py > "$OUT/tests_gpu_rest.txt" 2>&1
    tail -15 "$OUT/tests_gpu_rest.txt"
    for f in test_fused_kernels test_fp8_gemm; do
      timeout 200 python -m pytest -v -rfE -p no:cacheprovider tests/gpu/$f.py --tb=short > "$OUT/$f.txt" 2>&1
      echo "$f rc=$?"; grep -E "PASSED|FAILED|ERROR" "$OUT/$f.txt" | tail -8
    done ;;
  2)
    timeout 140 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16,ddtree:64 --batches 1,32 --steps 20 \
        --no-profile --tree-budgets "" --exact --out "$OUT/gpu_rounds_exact.json" 2>&1 | tail -9
    timeout 110 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16,ddtree:64 --batches 1,32 --steps 20 \
        --no-profile --tree-budgets "" --out "$OUT/gpu_rounds_fast.json" 2>&1 | tail -9
    timeout 330 python benchmarks/gpu_fp8.py --workdir /tmp/flashtree-fp8 --out "$OUT/gpu_fp8_qwen3_8b_shape.json" 2>&1 | tail -12 ;;
  3)
    mkdir -p /tmp/pre-tp && tar -xf .old/device/pre-tp.tar -C /tmp/pre-tp
    timeout 200 env PYTHONPATH=/tmp/pre-tp python benchmarks/gpu_tp.py --tp 1 --out /tmp/gpu_tp_before.json 2>&1 | tail -4
    timeout 200 python benchmarks/gpu_tp.py --tp 1 --compare /tmp/gpu_tp_before.json --out "$OUT/gpu_tp_tp1.json" 2>&1 | tail -8 ;;
esac
