#!/usr/bin/env bash
# H200 load test of `flashtree serve` at Qwen3-8B shape with random bf16 weights: plain, DFlash and
# DDTree (adaptive speculation on, the serving default), concurrency 1 / 4 / 16 / 32, streamed
# chat requests through the official openai client (benchmarks/load_test.py).
#
# The model is Qwen3-8B's shape with SmolLM2's 49,152-token vocabulary and tokenizer (the
# machine has no Qwen tokenizer; the lm_head is then 0.4 GB instead of 1.2 GB of the 16.4 GB),
# and the drafter is z-lab's Qwen3-8B-DFlash-b16 shape, also random: its drafts are almost
# never accepted, so this measures what the serving path costs and whether adaptive
# speculation avoids losing to plain decoding, not a speedup.
#
# Needs the serving wheels for the device's Python (see benchmarks/README.md) in $WHEELS and the
# SmolLM2 tokenizer files in $TOKENIZER.
#   WHEELS=dir TOKENIZER=dir [REQUESTS=32 MAX_TOKENS=128 METHODS="none dflash ddtree" LEVELS="1 4 16 32"
#   EXTRA="--trace-policy FILE"] bash benchmarks/gpu_load.sh OUT_DIR
# CLIENT_PROCESSES=N shares each level's streams out over N client processes (load_test.py --client-processes).
# REAL_MODEL / REAL_DRAFT serve a real pair instead (no TOKENIZER then); PROMPTS=FILE sends its conversations
# (load_test.py --prompts); MAX_RUNNING (32) and NAME (qwen3_8b_shape, in the output names) as named.
# A method may be SPEC@LABEL: that --spec with the extra serve flags in $FLAGS_LABEL (see start_server).
# PAIRED=1 starts every method's server at once (ports PORT, PORT+1, ...) and measures them in
# alternation with benchmarks/load_paired.py (REPEATS repeats, PAIRED_REQUESTS and WAVES per pass),
# so drift of the machine hits all of them alike. WAVES defaults to 8: a 32-row pass of 4 waves lasts
# about 3 s on the H200, and such passes spread 0.93-0.99 between servers running identical rounds
# (8 waves: 0.996-1.014; benchmarks/journal/session-18-2026-12-03.md). TRACE_DIR=dir writes each server's policy trace
# (--trace-policy; the plain server's has its round times) to dir/policy_METHOD.jsonl.
# STEP_TRACE_DIR=dir writes each server's step trace (--trace-steps: round, prefill and the gap
# before each engine step; the same short line on every server) to dir/steps_METHOD.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: gpu_load.sh OUT_DIR}
REQUESTS=${REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
METHODS=${METHODS:-none dflash ddtree}
LEVELS=${LEVELS:-1 4 16 32}  # concurrency levels
REPEATS=${REPEATS:-1}  # measured passes over the levels (each level reports its median pass)
BUDGET=${BUDGET:-64}
PORT=${PORT:-8140}
EXTRA=${EXTRA:-}
WARMUP=${WARMUP---warmup}  # WARMUP= (empty) measures a fresh server
mkdir -p "$OUT_DIR" "${LOG_DIR:-$OUT_DIR}" /tmp/site
if [[ -n "${WHEELS:-}" ]]; then  # every wheel there, without resolving (the device has some of the deps itself,
  # e.g. prometheus-client: resolving by name failed in the tenth session's first call)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl 2>&1 \
    | grep -v -i warning || true
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

NAME=${NAME:-qwen3_8b_shape}  # in the output files' names
MAX_RUNNING=${MAX_RUNNING:-32}
PROMPT_FLAGS=()
[[ -n "${PROMPTS:-}" ]] && PROMPT_FLAGS=(--prompts "$PROMPTS")
if [[ -n "${REAL_MODEL:-}" ]]; then  # a real pair (REAL_MODEL a GGUF or HF folder, REAL_DRAFT its drafter), e.g.
  # the SmolLM2 GGUF joined by gpu_real_pair.sh PART=2 and PROMPTS=benchmarks/out/real_pair/humaneval_messages.jsonl
  MODEL=$REAL_MODEL DRAFT=${REAL_DRAFT:?REAL_DRAFT=the drafter of REAL_MODEL} WEIGHTS=()
else
  MODEL=/tmp/flashtree-load/qwen3-8b-shape DRAFT=/tmp/flashtree-load/qwen3-8b-dflash-shape WEIGHTS=(--random-weights)
  python3 - "$MODEL" "$DRAFT" "${TOKENIZER:?TOKENIZER=dir with the SmolLM2 tokenizer files}" <<'EOF'
import json, os, shutil, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from qwen3_8b_shape import write_served_pair
model, draft, tokenizer = sys.argv[1:]
small = json.loads(os.environ.get("SHAPE_OVERRIDE", "{}"))  # a tiny shape for a CPU dry run
write_served_pair(model, draft, small)
for f in Path(tokenizer).iterdir():
    shutil.copy(f, Path(model) / f.name)
EOF
fi

start_server() {  # start_server METHOD PORT: a server in the background, its pid in $server
  # METHOD is a --spec value, or SPEC@LABEL: that method with the extra serve flags in $FLAGS_LABEL
  # (e.g. METHODS="none none@h11" FLAGS_h11="--http h11 --loop asyncio": two plain servers, paired)
  local method=$1 port=$2 draft_flags=() spec=${1%%@*} label_flags=()
  if [[ $method == *@* ]]; then local var="FLAGS_${method#*@}"; read -r -a label_flags <<< "${!var:-}"; fi
  [[ $spec != none ]] && draft_flags=(--draft "$DRAFT" --budget "$BUDGET")
  local file_tag=${method//@/_at_}  # (a device call returns no file whose name holds '@')
  [[ -n "${TRACE_DIR:-}" ]] && draft_flags+=(--trace-policy "$TRACE_DIR/policy_$file_tag.jsonl")
  [[ -n "${STEP_TRACE_DIR:-}" ]] && draft_flags+=(--trace-steps "$STEP_TRACE_DIR/steps_$file_tag.jsonl")
  python3 -m flashtree.cli serve --model "$MODEL" "${WEIGHTS[@]}" --spec "$spec" "${draft_flags[@]}" "${label_flags[@]}" \
    --max-running "$MAX_RUNNING" --max-context 1024 --port "$port" --log-level warning $EXTRA \
    >"${LOG_DIR:-$OUT_DIR}/serve_$file_tag.log" 2>&1 &
  server=$!
}

wait_healthy() {  # wait_healthy METHOD PORT PID
  for _ in $(seq 1 300); do
    [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$2/health")" == 200 ]] && break
    kill -0 "$3" 2>/dev/null || { echo "server for $1 died:"; tail -20 "${LOG_DIR:-$OUT_DIR}/serve_${1//@/_at_}.log"; exit 1; }
    sleep 1
  done
  echo "== $1: server up after $SECONDS s"
}

if [[ -n "${PAIRED:-}" ]]; then  # every server up at once, measured in alternation (load_paired.py)
  pids=() servers=() port=$PORT
  for method in $METHODS; do
    start_server "$method" "$port"
    pids+=("$server") servers+=(--server "$method=http://127.0.0.1:$port/v1")
    port=$((port + 1))
  done
  port=$PORT i=0
  for method in $METHODS; do
    wait_healthy "$method" "$port" "${pids[$i]}"
    port=$((port + 1)) i=$((i + 1))
  done
  python3 benchmarks/load_paired.py "${servers[@]}" --model "$MODEL" --concurrency $LEVELS \
    --requests "${PAIRED_REQUESTS:-12}" --waves "${WAVES:-8}" --max-tokens "$MAX_TOKENS" --ignore-eos \
    --repeats "$REPEATS" --client-processes "${CLIENT_PROCESSES:-1}" "${PROMPT_FLAGS[@]}" --out "$OUT_DIR/load_paired_$NAME" 2>&1 \
    | tee "$OUT_DIR/load_paired_progress.txt" | tail -40  # (the progress file keeps what a timed-out run printed)
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
  exit 0
fi

for method in $METHODS; do
  start_server "$method" "$PORT"
  wait_healthy "$method" "$PORT" "$server"
  python3 benchmarks/load_test.py --base-url "http://127.0.0.1:$PORT/v1" --model "$MODEL" \
    --concurrency $LEVELS --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --ignore-eos $WARMUP --repeats "$REPEATS" \
    --client-processes "${CLIENT_PROCESSES:-1}" "${PROMPT_FLAGS[@]}" --out "$OUT_DIR/load_${NAME}_$method" 2>&1 | tee "$OUT_DIR/load_progress_$method.txt" | tail -8
  kill $server; wait $server 2>/dev/null || true
done
