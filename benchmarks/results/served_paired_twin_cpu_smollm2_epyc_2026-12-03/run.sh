# CPU paired serving run of the nineteenth session (from the repository root, flashtree installed):
#   bash benchmarks/results/served_paired_twin_cpu_smollm2_epyc_2026-12-03/run.sh
set -u
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/cpuserve
i=0; servers=(); pids=()
for m in none none@twin ddtree dflash; do
  port=$((8151 + i)); spec=${m%%@*}
  python -m flashtree.cli serve --model smollm2 --spec $spec --device cpu --max-running 32 --max-context 512 --port $port --log-level warning > /tmp/cpuserve/serve_$i.log 2>&1 &
  pids+=($!); servers+=(--server "$m=http://127.0.0.1:$port/v1"); i=$((i + 1))
done
for p in 8151 8152 8153 8154; do
  for _ in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$p/health)" = 200 ] && break; sleep 1; done
done
echo "servers up after $SECONDS s"
python benchmarks/load_paired.py "${servers[@]}" --model smollm2 --concurrency 1 4 16 32 --requests 8 --waves 2 --max-tokens 64 --ignore-eos --repeats 3 --out benchmarks/results/served_paired_twin_cpu_smollm2_epyc_2026-12-03/load_paired_cpu_smollm2 2>&1 | tail -60
kill "${pids[@]}"; wait
echo "done after $SECONDS s"
