#!/usr/bin/env bash
# DFlash against DFlash2 on the same data and budget (#38 part 3): one starting drafter (INIT, default the
# shipped SmolLM2 drafter) trained further for STEPS steps twice with the same flags and data, once as itself
# (DFlash) and once made a DFlash2 drafter (--arch dflash2: it starts drafting exactly as INIT, its
# convolutions passing through and its selector adding nothing), then tau of the start and of both in the
# engine on held-out ShareGPT prompts (greedy, fp32, batch 1, the same prompts for all).
#   bash benchmarks/drafter_arch_ab.sh OUT_DIR
# The training data are SmolLM2's own greedy answers (flashtree regenerate, DDTree: the plain tokens) to
# ShareGPT prompts of the train split. Environment (all optional): DEVICE (cpu), PY (python3), INIT,
# PROMPTS (400 prompts to answer), NEW_TOKENS (128), STEPS (150), BATCH (4 sequences a step), SEQ (384 tokens),
# LR (2e-4), BENCH_PROMPTS (12), BENCH_TOKENS (128), METHODS (dflash,ddtree:16,ddtree:64), TRAIN_FLAGS (extra),
# SELECTOR_RANK (the DFlash2 selector's codebook width; default 256: a 71 MB drafter, over the 60 MB cap).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: drafter_arch_ab.sh OUT_DIR}
DEVICE=${DEVICE:-cpu} PY=${PY:-python3} INIT=${INIT:-flashtree/assets/smollm2-dflash}
PROMPTS=${PROMPTS:-400} NEW_TOKENS=${NEW_TOKENS:-128} STEPS=${STEPS:-150} BATCH=${BATCH:-4} SEQ=${SEQ:-384}
LR=${LR:-2e-4} BENCH_PROMPTS=${BENCH_PROMPTS:-12} BENCH_TOKENS=${BENCH_TOKENS:-128}
METHODS=${METHODS:-dflash,ddtree:16,ddtree:64} TRAIN_FLAGS=${TRAIN_FLAGS:-}
mkdir -p "$OUT/bench"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

stamp "prompts: $PROMPTS to answer (train split), $BENCH_PROMPTS held out"
$PY -m flashtree.cli export-prompts --data sharegpt --split train --limit "$PROMPTS" --model smollm2 \
  --max-prompt-tokens 384 --output "$OUT/prompts.jsonl"
$PY -m flashtree.cli export-prompts --data sharegpt --split heldout --limit "$BENCH_PROMPTS" --model smollm2 \
  --max-prompt-tokens 384 --output "$OUT/heldout.jsonl"
stamp "regenerate: SmolLM2 answers them ($NEW_TOKENS new tokens at most)"
[[ -f "$OUT/regen.jsonl" ]] || $PY -m flashtree.cli regenerate --model smollm2 --prompts "$OUT/prompts.jsonl" \
  --split all --max-new-tokens "$NEW_TOKENS" --device "$DEVICE" --spec ddtree --output "$OUT/regen.jsonl" --no-progress

bench() {  # $1: drafter directory, $2: name
  $PY -m flashtree.cli bench --model smollm2 --draft "$1" --dataset "$OUT/heldout.jsonl" \
    --num-prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_TOKENS" --ignore-eos --device "$DEVICE" \
    --dtype float32 --batch-size 1 --methods "ar,$METHODS" --json "$OUT/bench/$2.json" --no-progress
}

for arch in dflash dflash2; do
  stamp "train: $INIT as $arch, $STEPS steps of $BATCH x $SEQ tokens, lr $LR"
  $PY -m flashtree.cli train-drafter --model smollm2 --data "$OUT/regen.jsonl" --init "$INIT" --arch "$arch" \
    --output "$OUT/$arch" --steps "$STEPS" --batch-size "$BATCH" --max-seq-len "$SEQ" --lr "$LR" --warmup 10 \
    --device "$DEVICE" --dtype float32 --eval-every 0 --log-every 25 --seed 0 --no-progress $TRAIN_FLAGS \
    $([[ $arch == dflash2 && -n "${SELECTOR_RANK:-}" ]] && echo --selector-rank "$SELECTOR_RANK") \
    | tail -1 > "$OUT/train_$arch.json"
  cat "$OUT/train_$arch.json"
done
for name in start dflash dflash2; do
  stamp "bench: $name"
  bench "$([[ $name == start ]] && echo "$INIT" || echo "$OUT/$name")" "$name"
done
stamp "done: $OUT/bench/{start,dflash,dflash2}.json"
