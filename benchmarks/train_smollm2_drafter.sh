#!/usr/bin/env bash
# Train a DFlash drafter for SmolLM2-135M-Instruct on one H200, in one or two device calls:
#   PHASE=first   1. regenerate assistant turns for the exported prompts with SmolLM2 itself
#                    (our engine, greedy by default) into the shard directory $WORK/regen,
#                 2. train a 3-layer drafter (block 8 by default, bf16 autocast) until the call's
#                    deadline or the total time budget, saving a resumable checkpoint;
#   PHASE=resume  2'. continue that training (same cosine schedule: it follows TRAIN_S in total),
#                 3. check the checkpoint size (< 60 MB) and measure tau and tokens/s in the engine
#                    (flashtree bench on held-out ShareGPT and HumanEval prompts).
#   PHASE=all     both in one go (when the whole run fits one call).
#   PHASE=regen   only step 1: new shards in $WORK/regen (answered ids are skipped, every call adds shards):
#                 more data over several calls before PHASE=train.
#   PHASE=train   steps 2 and 3 on the answers already in $WORK/regen, from INIT if given.
# A device call lasts at most 600 s, so each phase ends DEADLINE_S seconds after the script started,
# minus what it still has to do (--max-minutes of regenerate and train-drafter: both save and exit
# in time, and the next call resumes exactly). Notes, inputs, files to carry: train_smollm2.md.
#
# Environment (all optional):
#   MODEL        target (default: the carried GGUF in $STASH, else the embedded 'smollm2')
#   CARRY        folder with the exported prompt files (default benchmarks/out/train_carry)
#   PROMPTS      prompts to regenerate (default $CARRY/prompts.jsonl.gz: export-prompts --sources, both splits,
#                each record with its split; the trainer holds out the records marked heldout)
#   HELDOUT / HUMANEVAL   bench prompt files (default $CARRY/sharegpt_heldout_prompts.jsonl and
#                $CARRY/humaneval_prompts.jsonl)
#   WORK         scratch folder (default benchmarks/out/smollm2-drafter)
#   REGEN_S      wall-clock budget of the regeneration (default 200; PHASE=regen: the whole call)
#   REGEN_SAMPLES  answers per prompt (default 1; more needs REGEN_TEMPERATURE > 0)
#   REGEN_TEMPERATURE  sampling temperature of the regenerated answers (default 0: greedy)
#   REGEN_FLAGS  extra engine flags for the regeneration (default: the contents of $STASH/regen_flags,
#                which benchmarks/regen_speed.sh writes with the faster attention variant; else none)
#   TRAIN_STEPS  total optimizer steps over all calls: the cosine schedule follows steps, so a resumed run is
#                exactly the uninterrupted one (recommended for long runs)
#   TRAIN_S      without TRAIN_STEPS: total training wall time over all phases (default 680) sets the schedule
#   DEADLINE_S   seconds after the start by which a phase must be done (default 570)
#   LAYERS / BLOCK / ANCHORS / LR   drafter layers (3), block size (8), anchors per sequence (128), lr (6e-4)
#   TRAIN_FLAGS  extra train-drafter flags (the levers: --loss-gamma, --target-layer-ids, --intermediate-size, ...)
#   NEW_TOKENS   max new tokens per regenerated answer (default 256)
#   MAX_CONTEXT  prompt + answer tokens while regenerating, and the training sequence length (768)
#   INIT         a drafter checkpoint directory to start the first phase from (its weights and shape; a new
#                optimizer and schedule), e.g. flashtree/assets/smollm2-dflash to train the shipped drafter on
#                (default: a new drafter of LAYERS layers, block BLOCK)
#   BENCH_PROMPTS / BENCH_TOKENS / BENCH_METHODS   the tau measurement (16 / 128 / ar,dflash,ddtree:8..64)
#   MAX_RUNNING  requests decoded together while regenerating (default 512)
#   BENCH_BF16   0: only the float32 benches (tau on ShareGPT and HumanEval), not the bf16 speed ones (default 1)
#   BENCH_RESERVE_S  seconds the last phase keeps for the checks and benches (default 200; 120 is enough
#                without the bf16 benches)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

PHASE=${PHASE:-all}
STASH=${STASH:-/root/stash}
CARRY=${CARRY:-benchmarks/out/train_carry}
GGUF="$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -z "${MODEL:-}" ]]; then
  if [[ -f "$GGUF" ]]; then MODEL="$GGUF"; else MODEL=smollm2; fi
fi
PROMPTS=${PROMPTS:-$CARRY/prompts.jsonl.gz}
HELDOUT=${HELDOUT:-$CARRY/sharegpt_heldout_prompts.jsonl}
HUMANEVAL=${HUMANEVAL:-$CARRY/humaneval_prompts.jsonl}
WORK=${WORK:-benchmarks/out/smollm2-drafter}
DEADLINE_S=${DEADLINE_S:-570}
[[ "$PHASE" == regen && -z "${REGEN_S:-}" ]] && REGEN_S=$DEADLINE_S  # regen alone: the whole call
REGEN_S=${REGEN_S:-200}
REGEN_TEMPERATURE=${REGEN_TEMPERATURE:-0}
REGEN_SAMPLES=${REGEN_SAMPLES:-1}
TRAIN_FLAGS=${TRAIN_FLAGS:-}
if [[ -z "${REGEN_FLAGS+set}" ]]; then REGEN_FLAGS=$(cat "$STASH/regen_flags" 2>/dev/null || true); fi
TRAIN_S=${TRAIN_S:-680}
TRAIN_STEPS=${TRAIN_STEPS:-}
SCHEDULE=(--steps 100000 --time-budget-s "$TRAIN_S")
[[ -n "$TRAIN_STEPS" ]] && SCHEDULE=(--steps "$TRAIN_STEPS")
LAYERS=${LAYERS:-3}
BLOCK=${BLOCK:-8}
ANCHORS=${ANCHORS:-128}
LR=${LR:-6e-4}
NEW_TOKENS=${NEW_TOKENS:-256}
MAX_CONTEXT=${MAX_CONTEXT:-768}
BENCH_PROMPTS=${BENCH_PROMPTS:-16}
BENCH_TOKENS=${BENCH_TOKENS:-128}
BENCH_METHODS=${BENCH_METHODS:-ar,dflash,ddtree:8,ddtree:16,ddtree:32,ddtree:64}
MAX_RUNNING=${MAX_RUNNING:-512}
DEVICE=${DEVICE:-auto}
PY=${PY:-python3}
BENCH_BF16=${BENCH_BF16:-1}
BENCH_RESERVE_S=${BENCH_RESERVE_S:-200}  # what the checks and benches of the last phase take, model loads included
mkdir -p "$WORK"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( DEADLINE_S - ($(date +%s) - start) - $1 )); }  # seconds left after a reserve
minutes() { awk -v s="$1" 'BEGIN { printf "%.2f", (s < 30 ? 30 : s) / 60 }'; }

regenerate() {
  stamp "regenerate: $MODEL answers the prompts of $PROMPTS (budget ${REGEN_S}s, temperature $REGEN_TEMPERATURE, flags '$REGEN_FLAGS')"
  $PY -m flashtree.cli regenerate --model "$MODEL" --prompts "$PROMPTS" --split all \
    --max-new-tokens "$NEW_TOKENS" --temperature "$REGEN_TEMPERATURE" --max-running "$MAX_RUNNING" \
    --max-context "$MAX_CONTEXT" --device "$DEVICE" --time-budget-s "$REGEN_S" --output "$WORK/regen" \
    --samples "$REGEN_SAMPLES" --max-minutes "$(minutes "$(left 10)")" --no-progress $REGEN_FLAGS
}

train() {  # $1: seconds to reserve after training in this phase; $2...: extra train-drafter flags
  local reserve=$1; shift
  local stop; stop=$(left "$reserve")
  stamp "train-drafter: $LAYERS layers, block $BLOCK, end within ${stop}s (schedule: ${SCHEDULE[*]})"
  $PY -m flashtree.cli train-drafter --model "$MODEL" --data "$WORK/regen" --output "$WORK/drafter" \
    --layers "$LAYERS" --block-size "$BLOCK" --dtype bfloat16 --device "$DEVICE" --batch-size 16 \
    --anchors-per-seq "$ANCHORS" --max-seq-len "$MAX_CONTEXT" "${SCHEDULE[@]}" \
    --max-minutes "$(minutes "$stop")" --lr "$LR" --warmup 100 --eval-every 1000 --eval-batches 8 --log-every 100 \
    --max-shard-mb 15 --no-progress $TRAIN_FLAGS "$@" | tee -a "$WORK/train_summary.json"
}

bench() {  # $1: dataset file, $2: name, $3: batch size, $4: dtype
  $PY -m flashtree.cli bench --model "$MODEL" --draft "$WORK/drafter" --dataset "$1" --num-prompts "$BENCH_PROMPTS" \
    --max-new-tokens "$BENCH_TOKENS" --ignore-eos --device "$DEVICE" --dtype "$4" --batch-size "$3" \
    --methods "$BENCH_METHODS" --json "$WORK/bench/$2_b$3_$4.json" --no-progress --allow-inexact
}

checks_and_bench() {
  local bytes; bytes=$(du -cb "$WORK"/drafter/*.safetensors | tail -1 | cut -f1)
  stamp "checkpoint weights: $bytes bytes"
  if (( bytes >= 60 * 1024 * 1024 )); then echo "FAIL: checkpoint is not under 60 MB"; exit 1; fi
  stamp "bench: held-out ShareGPT and HumanEval, $BENCH_TOKENS new tokens"
  bench "$HELDOUT" sharegpt 1 float32
  bench "$HUMANEVAL" humaneval 1 float32
  (( BENCH_BF16 )) || return 0
  bench "$HELDOUT" sharegpt 1 bfloat16
  bench "$HELDOUT" sharegpt 16 bfloat16
}

INIT_FLAGS=()
[[ -n "${INIT:-}" ]] && INIT_FLAGS=(--resume "$INIT")  # a checkpoint without trainer_state.pt: weights only

case "$PHASE" in
  regen) regenerate ;;
  first) regenerate; train 20 "${INIT_FLAGS[@]}" ;;
  resume) train "$BENCH_RESERVE_S" --resume "$WORK/drafter"; checks_and_bench ;;
  all) regenerate; train "$BENCH_RESERVE_S" "${INIT_FLAGS[@]}"; checks_and_bench ;;
  train) train "$BENCH_RESERVE_S" "${INIT_FLAGS[@]}"; checks_and_bench ;;
  *) echo "PHASE must be regen, first, resume, all or train, got $PHASE"; exit 2 ;;
esac
stamp "done ($PHASE)"

if [[ -n "${OUT:-}" ]]; then  # bring back the checkpoint (shards < 16 MiB) and the reports
  mkdir -p "$OUT/drafter"
  cp "$WORK"/drafter/config.json "$WORK"/drafter/*.safetensors "$OUT/drafter/"
  cp "$WORK"/drafter/model.safetensors.index.json "$OUT/drafter/" 2>/dev/null || true
  cp "$WORK"/drafter/train_metrics.json "$WORK"/drafter/train_curve.png "$OUT/" 2>/dev/null || true
  if [[ -d "$WORK/bench" ]]; then tar czf "$OUT/bench.tgz" -C "$WORK" bench; fi
  tar czf "$OUT/regen.tgz" -C "$WORK" regen  # the data, for later runs (if under 16 MiB)
  (( $(stat -c %s "$OUT/regen.tgz") < 16 * 1024 * 1024 )) || rm "$OUT/regen.tgz"
fi
