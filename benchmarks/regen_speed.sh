#!/usr/bin/env bash
# Throughput of `flashtree regenerate` (the data step of drafter training) on one GPU, for the
# attention variants: SDPA (cuDNN) over K/V gathered for the batch's slots, or the Triton
# attention that reads the cache by slot. SmolLM2-135M's shape with random weights (the answers
# are noise and never end early, so every request runs MAX_NEW tokens: a per-step cost test).
# Writes $OUT_DIR/regen_speed.json and, with FLAGS_FILE, the faster variant's flags to that file
# (the training script reads them as REGEN_FLAGS).
#   SHAPE=dir (config.json [+ tokenizer files]) PROMPTS=file.jsonl[.gz] [TOKENIZER=dir LIMIT=1024
#   MAX_NEW=256 MAX_RUNNING=512 VARIANTS="sdpa triton" FLAGS_FILE=path] bash benchmarks/regen_speed.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: regen_speed.sh OUT_DIR}
LIMIT=${LIMIT:-1024}
MAX_NEW=${MAX_NEW:-256}
MAX_RUNNING=${MAX_RUNNING:-512}
VARIANTS=${VARIANTS:-sdpa triton}
PY=${PY:-python3}
mkdir -p "$OUT_DIR"
model=$(mktemp -d)
cp "${SHAPE:?SHAPE=dir with the model config.json}"/config.json "$model/"
[[ -n "${TOKENIZER:-}" ]] && cp "$TOKENIZER"/* "$model/"
prompts=${PROMPTS:?PROMPTS=prompts .jsonl or .jsonl.gz}
if [[ $prompts == *.gz ]]; then gunzip -c "$prompts" > "$model/prompts.jsonl"; prompts=$model/prompts.jsonl; fi

declare -A FLAGS=([sdpa]="--no-triton-attention" [triton]="--triton-attention")
for variant in $VARIANTS; do
  log="$OUT_DIR/regen_speed_$variant.log"
  start=$(date +%s%N)
  $PY -m flashtree.cli regenerate --model "$model" --random-weights --prompts "$prompts" --split all \
    --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --temperature 0 --max-running "$MAX_RUNNING" --max-context 1024 \
    --output "$model/out_$variant.jsonl" --no-progress ${FLAGS[$variant]} > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
  wall_ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "$variant $(grep '^{"output"' "$log" | tail -1) wall_ms=$wall_ms flags=${FLAGS[$variant]}"
done | tee "$OUT_DIR/regen_speed.txt"

$PY - "$OUT_DIR" "${FLAGS_FILE:-}" <<'EOF'
import json, sys
from pathlib import Path
out, flags_file = Path(sys.argv[1]), sys.argv[2]
runs = {}
for line in (out / "regen_speed.txt").read_text().splitlines():
    variant, rest = line.split(" ", 1)
    rest, flags = rest.rsplit(" flags=", 1)
    record, wall_ms = rest.rsplit(" wall_ms=", 1)
    runs[variant] = {**json.loads(record), "wall_s_with_load": int(wall_ms) / 1000, "flags": flags}
best = max(runs, key=lambda v: runs[v]["tokens_per_second"])
(out / "regen_speed.json").write_text(json.dumps({"runs": runs, "best": best}, indent=1))
print(f"fastest: {best} ({runs[best]['tokens_per_second']} tokens/s)")
if flags_file:
    Path(flags_file).write_text(runs[best]["flags"])
EOF
