#!/usr/bin/env bash
# Train a DFlash drafter for SmolLM2-135M-Instruct on one H200 in about 8-9 minutes:
#   1. regenerate assistant turns for ShareGPT first-turn prompts with SmolLM2 itself (our engine),
#   2. train a 3-layer, block-16 drafter on them (bf16 autocast, fixed wall-clock budget),
#   3. check the checkpoint size (< 40 MB), print held-out metrics, and measure tau in the engine
#      (flashtree bench: ar, dflash, ddtree:16/64/256 on held-out ShareGPT prompts).
# Notes, inputs and the files to carry: benchmarks/train_smollm2.md.
#
# Environment (all optional):
#   MODEL        target (default: the carried GGUF in $STASH, else the embedded 'smollm2')
#   CARRY        folder with the exported prompt files (default benchmarks/out/train_carry)
#   PROMPTS      prompts to regenerate    (default $CARRY/sharegpt_prompts.jsonl: both splits; the
#                trainer holds out the held-out split's chats again, by the same id hash)
#   HELDOUT      held-out prompts JSONL   (default $CARRY/sharegpt_heldout_prompts.jsonl)
#   WORK         scratch folder           (default benchmarks/out/smollm2-drafter)
#   OUT          where the small results are copied (the device tool sets it; optional)
#   REGEN_S / TRAIN_S   wall-clock budgets of steps 1 and 2 in seconds (default 140 / 230)
#   REGEN_LIMIT  prompts to answer at most (default 8498: all exported)
#   NEW_TOKENS   max new tokens per regenerated answer (default 256)
#   BENCH_PROMPTS / BENCH_TOKENS   held-out prompts and new tokens of the tau measurement (default 8 / 64)
#   BENCH_METHODS  decoding methods measured (default ar,dflash,ddtree:16,ddtree:64)
#   MAX_RUNNING  requests decoded together while regenerating (default 512)
#   DEVICE       --device for every step (default auto)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

STASH=${STASH:-/root/stash}
CARRY=${CARRY:-benchmarks/out/train_carry}
GGUF="$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -z "${MODEL:-}" ]]; then
  if [[ -f "$GGUF" ]]; then MODEL="$GGUF"; else MODEL=smollm2; fi
fi
PROMPTS=${PROMPTS:-$CARRY/sharegpt_prompts.jsonl}
HELDOUT=${HELDOUT:-$CARRY/sharegpt_heldout_prompts.jsonl}
WORK=${WORK:-benchmarks/out/smollm2-drafter}
REGEN_S=${REGEN_S:-140}
TRAIN_S=${TRAIN_S:-230}
REGEN_LIMIT=${REGEN_LIMIT:-8498}
NEW_TOKENS=${NEW_TOKENS:-256}
BENCH_PROMPTS=${BENCH_PROMPTS:-8}
BENCH_TOKENS=${BENCH_TOKENS:-64}
BENCH_METHODS=${BENCH_METHODS:-ar,dflash,ddtree:16,ddtree:64}
MAX_RUNNING=${MAX_RUNNING:-512}
DEVICE=${DEVICE:-auto}
PY=${PY:-python3}
mkdir -p "$WORK"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

stamp "1/3 regenerate: $MODEL answers up to $REGEN_LIMIT prompts of $PROMPTS (budget ${REGEN_S}s)"
$PY -m flashtree.cli regenerate --model "$MODEL" --prompts "$PROMPTS" --split all --limit "$REGEN_LIMIT" \
  --max-new-tokens "$NEW_TOKENS" --temperature 0.7 --max-running "$MAX_RUNNING" --max-context 768 --device "$DEVICE" \
  --time-budget-s "$REGEN_S" --output "$WORK/regenerated.jsonl" --no-progress

stamp "2/3 train-drafter: 3 layers, block 16, bf16 (budget ${TRAIN_S}s)"
$PY -m flashtree.cli train-drafter --model "$MODEL" --data "$WORK/regenerated.jsonl" --output "$WORK/drafter" \
  --layers 3 --block-size 16 --dtype bfloat16 --device "$DEVICE" --batch-size 16 --anchors-per-seq 64 --max-seq-len 768 \
  --steps 20000 --time-budget-s "$TRAIN_S" --lr 6e-4 --warmup 100 --eval-every 500 --eval-batches 8 \
  --heldout-percent 2 --log-every 50 --max-shard-mb 15 --no-progress | tee "$WORK/train_summary.json"

stamp "3/3 checks and held-out tau"
bytes=$(du -cb "$WORK"/drafter/*.safetensors | tail -1 | cut -f1)
echo "checkpoint weights: $bytes bytes"
if (( bytes >= 40 * 1024 * 1024 )); then echo "FAIL: checkpoint is not under 40 MB"; exit 1; fi
$PY -m flashtree.cli bench --model "$MODEL" --draft "$WORK/drafter" --dataset "$HELDOUT" \
  --num-prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_TOKENS" --device "$DEVICE" --methods "$BENCH_METHODS" \
  --json "$WORK/bench/bench.json" --no-progress --allow-inexact
stamp "done"

if [[ -n "${OUT:-}" ]]; then  # bring back the checkpoint (shards < 16 MiB) and the reports
  mkdir -p "$OUT/drafter"
  cp "$WORK"/drafter/config.json "$WORK"/drafter/*.safetensors "$OUT/drafter/"
  cp "$WORK"/drafter/model.safetensors.index.json "$OUT/drafter/" 2>/dev/null || true
  cp "$WORK"/drafter/train_metrics.json "$WORK"/bench/bench.md "$OUT/" 2>/dev/null || true
fi
