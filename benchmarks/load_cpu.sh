#!/usr/bin/env bash
# CPU load test of `flashtree serve` with the embedded SmolLM2-135M-Instruct: plain decoding by
# default, or SPEC=ddtree / dflash with the shipped drafter (adaptive speculation, the serving default).
# Starts the server, waits for /health, runs benchmarks/load_test.py, stops the server.
#   [SPEC=none REQUESTS=16 MAX_TOKENS=64 REPEATS=1 PORT=8131 WARMUP=--warmup] bash benchmarks/load_cpu.sh [OUT_PREFIX] [extra serve flags]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/load_cpu_smollm2}
shift || true
PORT=${PORT:-8131}
python -m flashtree.cli serve --model smollm2 --spec "${SPEC:-none}" --device cpu --max-running 32 --max-context 512 \
    --port "$PORT" --log-level warning "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT  # wait: the next run may reuse the port
for _ in $(seq 1 300); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")" = 200 ] && break
    sleep 1
done
python benchmarks/load_test.py --base-url "http://127.0.0.1:$PORT/v1" --model smollm2 \
    --concurrency 1 4 16 32 --requests "${REQUESTS:-16}" --max-tokens "${MAX_TOKENS:-64}" --ignore-eos ${WARMUP:-} --repeats "${REPEATS:-1}" --out "$OUT"
