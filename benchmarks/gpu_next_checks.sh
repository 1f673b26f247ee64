#!/usr/bin/env bash
# H200 or H100: the checks this code still owes a GPU, in device calls of up to 10 minutes each, run from the
# repository root: CALL=1..37 bash benchmarks/gpu_next_checks.sh OUT_DIR (every log goes whole to OUT_DIR).
# What the last runs found, and why these calls: benchmarks/journal/session-29-2026-12-06.md and session-30-2026-12-06.md.
# CALL=1 (~9 min): where the exact mode's DDTree-16 round at batch 32 loses 1.41x to the fast mode (#29): the
#   exact attention against the fast one per tile size (gpu_exact_attention.py), the tile sweep of the chunked
#   exact product at the verify's 544 rows (and 1,088), the kernels of that round in both modes (torch.profiler).
# CALL=2 (~9 min): tuning after CALL=1 (the exact products at 544 rows were 2-3x cuBLAS, most of the round's
#   gap; splits by K chunks no longer taken there): the tile sweep at 544 rows, the exact DDTree-16 round at
#   batch 32 with several large-row tiles, the exact attention's tile sizes (bits and time), the exact-mode tests.
# CALL=3 (~9 min): with the tiles chosen from CALL=2: TMA and unmasked-K variants of the exact product at verify
#   widths (a prototype), the exact tests, the exact against the fast mode's plain step and DDTree-16 round at
#   batch 1 and 32 (~6.5 min).
# CALL=4 (~9 min): the fp32 FP8 tests the last runs did not reach, and the tree-kernel part of
#   test_fused_kernels (200 random cases, many Triton shapes: no verdict in 200 s before).
# CALL=5 (~7 min, not yet run): DFlash verification as a causal chain in the exact attention (ForwardBatch.chain,
#   after session 29's runs): the exact-mode GPU tests, then the DFlash round fast against exact at batch 1
#   and 32 (session 29, before it: 24.2 / 36.2 ms at batch 32).
# CALL=6 (~9 min): the fast rounds against their roofline (round_roofline.py) at batch 1 / 8 / 16 / 32 with the
#   kernels of the timed rounds only (#39; the kernel tables before session 30 also held the requests' prefill),
#   then the exact DFlash round (the chain flag) beside the fast one at batch 1 and 32.
# CALL=7 (~9 min): the fast tree attention's launch tile per round shape against its K/V bytes
#   (gpu_tree_attention.py: at batch 32 a DDTree-16 verify's attention was ~9x its bytes on an H100).
# CALL=8 (~9 min): CALL=7's sweep at batch 16 and 32 only, the fast rounds against their roofline (CALL=6's first
#   part at batch 16 and 32), and the DDTree-16 and DFlash rounds with the swept tiles (gpu_rounds --attention-tiles).
# CALL=9 (~9 min): the page pool's admitted 1k-token requests at 32k max context (gpu_kv_capacity.py; with the DDTree
#   drafter its start-up ran out of memory before the sampler took rows in groups), the tree attention's tests at
#   Qwen3-8B heads (session 30's launch) and the exact-mode GPU tests.
# CALL=10 (~7 min): the exact attention with the fast kernel's lessons (session 30: 128 keys a step, 2 stages gave
#   the fast kernel 1.3-2.9x): time and bits across tiles at BLOCK_N 128 / 64 and 2 stages against today's launch.
# CALL=11 (~4 min): DDTree rounds with the drafter's 16-bit logits (radix top-k) against float32 ones.
# CALL=12 (~9 min): the tree attention with whole committed blocks unmasked (session 31) against the kernel before
#   it (carry .old/triton_attention_before.py = git show 1db760d~1:flashtree/kernels/gpu/triton_attention.py):
#   the GPU attention tests, then the default tile per forward and the rounds, after and before, on one machine.
# CALL=13 (~6 min): the draft-head and page-pool GPU tests, the page pool at 0.9 with the activation reserve (session 31: plain 0.929 of the device in use
#   after the steps, ~9 GiB beyond weights + pool + reserve): the allocator's memory by pool (graphs, streams), and
#   DDTree-16 at 1,024 rows after the grouped log-probabilities, without and with --max-round-tokens 4096.
# CALL=14 (~4 min): why session 31's committed-block attention (1.4x a layer) gained the rounds only 0.2 of ~1.1 ms
#   (DDTree-16, batch 16): the round's kernel table after and before (carry .old/triton_attention_before.py as CALL=12).
# CALL=15 (#39 item 2): FlashInfer's paged prefill with a custom mask against the Triton tree attention
#   (gpu_flashinfer_attention.py). The tracked tree is ~35 MB of the 64 MiB a call carries, so FlashInfer comes as
#   .old/wheels/fisite.tar.xz (ignored, 22 MB): flashinfer-python 0.7.4 with apache-tvm-ffi (cp312), einops, tabulate,
#   click and nvidia-ml-py unzipped, less the CUDA sources of modules other than attention (the csrc/ subfolders
#   but generated/ and nv_internal/, the *_backend/csrc folders); remake: unzip the wheels into a folder, delete those,
#   tar -cJ. PART=2 (carry it) unpacks into /root/stash/site, builds the kernel and times every shape; PART=3 (no
#   carry, same warm machine) times them again, or finishes when PART=2's build took its whole call.
# CALL=17 (~4 min; run 12-07 before session 38's reserve change: the 8B pool at 1,024 rows, DDTree-16, left the device
#   0.919 in use against 0.9, the graphs' pool 8.42 GiB against 5.16 measured for the widest rounds; the reserve now
#   captures every start-up graph; rerun it): gpu_reserve_probe.py prints
#   the allocator's allocated and reserved growth of each profiled run of the tiny
#   engine's activation reserve, the pool GPU tests (session 32's CALL=13: the reserve measured 2-4 MiB of reserved
#   growth for a round of 135 MB of logits; peaks now take the larger of allocated and reserved growth), then the
#   8B pool at 1,024 rows with start-up graphs captured widest first (session 32's CALL=13 ran out of memory while
#   capturing plain graphs narrow-first: 10.9 GiB in the graphs' pool against a 2.5 GiB widest round), and DDTree-16
#   under --max-round-tokens 4096.
# CALL=18 (~3 min, never run on a GPU): #39's prefix-cache target on the device it names: 32 requests sharing a
#   2,048-token system prompt at the Qwen3-8B shape (random weights), time to first token of requests 2..32 against
#   the first's, prefix caching on and off (prefix_cache_ttft.py; the CPU gave 0.353x, bounded by the suffixes' compute).
# CALL=16 (~8 min, #29): the exact attention at 128 keys a block / 2 stages for 16-bit dtypes (the default since
#   session 32; float32 keeps 64 / 3): tests/gpu/test_exact_mode.py, then fast and exact rounds at batch 1 / 32.
# CALL=19 (~9 min, never run on a GPU: session 33 had no device time): packed verify rounds (#39 item 3). First the
#   GPU tests the packed path touches (fused kernels, graphs, tree attention with counts), then rounds at the 8B shape,
#   batch 16 and 32: padded (trees of N per row) against packed (rows x (N + 1) tokens from trees of min(B, S x N), S 2
#   and 4), N 4 / 8 / 16 with a budget of 32: the round's ms at equal verified tokens, and the plain step beside them.
# CALL=20 (~9 min, #39): the start-up warm-up of prefill kernels (engine/warm_up.py): the GPU tests of start-up
#   graphs and of no kernel compiled while serving, then the first plain and DDTree-16 engines of a process (an empty
#   Triton cache each) on SmolLM2-135M's shape with random weights and the HumanEval prompt ids (carry
#   benchmarks/out/real_pair/humaneval_ids.jsonl from PART=prepare of gpu_real_pair.sh), exact and fast, warm-up on
#   and off: each pass's Triton kernel loads by name and the first pass against the second.
# CALL=21 (~6 min, #39): session 36's prefix-cache TTFT at the 8B shape moved 2x between machines (0.25-0.46x): five
#   system prompts in one engine each, short prompt chunks through the paged attention (64) against every chunk
#   through SDPA over gathered pages (0); then the page pool's overshoot of gpu_memory_utilization after the widest
#   eager rounds (gpu_pool_headroom.py; session 36: 210-238 MiB over with 10% headroom, warm-up on or off).
# CALL=22 (~6 min, #39): fast-mode first passes ran 0.84-1.04x the second with no Triton load and no capture
#   (session 36): CUDA's lazy module loading (cuBLAS / cuDNN kernels loaded at first use, per new GEMM shape) against
#   CUDA_MODULE_LOADING=EAGER, plain and DDTree-16 at batch 1 / 16 / 64, three passes each, warm-up on (carry
#   benchmarks/out/real_pair/humaneval_ids.jsonl as CALL=20). Each pass counts the caching allocator's cudaMalloc calls;
#   PRIMES="0 4096" also runs each engine with one 4 GiB block allocated and freed after start-up (the allocator splits it).
# CALL=23 (~7 min, #39): the activation reserve with the widest graphed rounds captured and dropped on the provisional
#   cache (their pool, and their launch data times the graphs start-up captures), the widest eager round run twice,
#   one warm-up stream per device: the page pool against gpu_memory_utilization (gpu_pool_headroom.py, session 37
#   before: 210-238 MiB over), then the GPU tests of the pool, start-up graphs and graph replay.
# CALL=24 (~3 min, #39, run 12-07: the profiler's own first-pass cost hid the gap): fast-mode plain first passes at batch 16 / 64 still ran 0.91-0.94x the second
#   with no compile, capture, lazy module load (CUDA_MODULE_LOADING=EAGER alike) or cudaMalloc (CALL=22, session 37):
#   passes 1 and 2 at batch 16 under torch.profiler, their top ops and kernels by self CPU and device time.
# CALL=25 (~5 min, #29, run 12-07: passed): exact mode over 4,096 new tokens at batch 1 / 16 / 64 in bf16, DFlash and
#   DDTree-16 / 64 / 256 against plain (tests/gpu/test_exact_mode.py, tiny pair); the real pair's DDTree-256 is
#   gpu_real_pair.sh PART=2 METHODS=none,ddtree:256 EXTRA=--exact TAG=_exact_256 (two calls: the GGUF's parts).
# CALL=26 (~3 min, #39, run 12-07: fresh1 = fresh2 at batch 16, 0.96 at 32; a first torch.mm at a new M ~2.4 ms): the first-pass gap (0.943 at batch 16 on random SmolLM2, 12-07; uploading
#   each graph at capture gave 0.948, no change, so not the graphs' first launches) is per shape or per batch size?
#   torch.mm's first and second call at 15 new row counts per product shape (gpu_gemm_first_call.py), then
#   gpu_first_pass.py --fresh-prompts: after passes 1-2, two passes over the next 16 / 32 prompts (carry
#   benchmarks/out/real_pair/humaneval_ids.jsonl). fresh1 < fresh2 means a cost per new prompt length, which a
#   served process pays in every request with a new length (then: prefill widths in buckets the warm-up meets).
# CALL=27 (~6 min, #29 / #39, run 12-07: all 36 pass once structured draws need xgrammar; pool tests pass): the lossless fuzz on CUDA (tests/gpu/test_lossless_fuzz_cuda.py: random
#   speculative setups and engine settings, with start-up graphs, fp32 and bf16 exact; all at once and with arrivals
#   and aborts), then the pool tests after session 38's reserve change (every start-up graph captured in the profile).
# CALL=28 (~2 min, H200 only: the 48-layer model needs ~61 GB; run with needs_h200): the Qwen3-30B-A3B shape's decode
#   step and one-token forward with its kernel table (gpu_moe.py; session 39 measured 24 layers on an H100).
# CALL=29 (~3 min, #39): is the first torch.mm at a new row count slow by itself or by its output's first allocation
#   (gpu_gemm_first_call.py with and without --allocate), and the eager products new to the process in each pass
#   (gpu_first_pass.py --product-shapes --fresh-prompts, batch 16 / 32; carry benchmarks/out/real_pair/humaneval_ids.jsonl).
# CALL=31 (~2 min, #38 FP8 <= 0.6x bf16; 0.70x on the H100 with the split products qkv / o / down at 45-65% of the floor
#   against the unsplit gate-up's 80%): the FP8 product by how K is cut and whether the chunks run apart, per tile
#   (gpu_fp8.py --sweep-chunks). A faster cut changes k_chunk (bits change with it: rerun tests/gpu/test_fp8_gemm.py).
# CALL=30 (~6 min, #39, no GGUF needed): is the served plain step at 64 streams (7.8 ms against 4.2-5.3 offline, session 39)
#   bound by the server or by the client? Random SmolLM2-135M weights behind the SmolLM2 tokenizer, served plain
#   and plain with --switch-interval-ms 0.5, paired, the client over 4 processes, with step traces (the gap
#   before each engine step); then the offline plain first pass at batch 64 of the same shape. Carry
#   benchmarks/out/serve_wheels, benchmarks/out/serve_tokenizer (README "Serving inputs") and humaneval_ids.jsonl.
#   Session 40: uvloop in the wheels (as `pip install flashtree` has it), levels 16 and 64, and a third server with the
#   engine in its own process (--engine-process).
# CALL=36 (~8 min, #38 FP8 step / #29 exact plain step): split products ended by each tile's last program (an arrival
#   count, then the ordered sum: gemm.FUSED_SUM) against the sum kernel: the GPU stress test, the decode-row
#   products (bf16 exact), the FP8 products and steps at batch 1 / 16 both ways (gpu_fp8.py --fused-sum-ab).
# CALL=37 (~5 min, #39): CALL=35's served run at 16 / 64 streams with three servers (plain, adaptive DDTree, and that
#   without prefix caching) and step traces, then engine_churn.py on the real pair (the workload without a server).
# CALL=35 (~9 min, #39's served ratios): the real pair offline (gpu_first_pass, batch 1 / 16 / 64, plain and the
#   adaptive default, 128 tokens) and served (paired, process and thread); after gpu_real_pair.sh PART=1.
# Served real pair at 64 streams (#39) with the client spread over processes: gpu_real_pair.sh's serving call with
#   CLIENT_PROCESSES=4 LEVELS="16 64" (session 39's one client process: plain 7,293 tok/s at 64, ~7.8 ms a step).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: CALL=1..37 gpu_next_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${CALL:-1}" in
  1)
    timeout 150 python benchmarks/gpu_exact_attention.py --out "$OUT/gpu_exact_attention.json" \
        > "$OUT/gpu_exact_attention.txt" 2>&1
    echo "attention rc=$?"; grep -E "^b=" "$OUT/gpu_exact_attention.txt" | cut -c1-150
    timeout 190 python benchmarks/gpu_exact_gemm.py --rows 544,1088 --products o,qkv,gate_up,down \
        --out "$OUT/gpu_exact_gemm_544.json" > "$OUT/gpu_exact_gemm_544.txt" 2>&1
    echo "sweep rc=$?"; grep -E "M=" "$OUT/gpu_exact_gemm_544.txt" | cut -c1-200
    for mode in fast exact; do
      timeout 105 python benchmarks/gpu_rounds.py --methods ddtree:16 --batches 32 --no-profile --tree-budgets "" \
          --kernel-table 15 $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_kernels_$mode.json" \
          > "$OUT/gpu_rounds_kernels_$mode.txt" 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' "$OUT/gpu_rounds_kernels_$mode.txt" | cut -c1-300
    done ;;
  2)  # (at most 8 files come back from a call: logs go to /tmp, what matters to OUT)
    timeout 80 python benchmarks/gpu_exact_gemm.py --rows 544 --products o,qkv,gate_up,down \
        --out "$OUT/gpu_exact_gemm_544_nosplit.json" > /tmp/sweep.txt 2>&1
    echo "sweep rc=$?"; grep -E "M=" /tmp/sweep.txt | cut -c1-200
    timeout 45 python benchmarks/gpu_rounds.py --methods ddtree:16 --batches 32 --no-profile --tree-budgets "" \
        --out /tmp/rounds_fast.json | grep -E '^\{' | tee "$OUT/gpu_rounds_tiles.txt" | cut -c1-120
    for tile in 128,128,64,8,3 128,256,64,8,3 128,128,64,8,4 64,128,64,4,4; do
      echo "exact tile $tile" | tee -a "$OUT/gpu_rounds_tiles.txt"
      timeout 45 python benchmarks/gpu_rounds.py --methods ddtree:16 --batches 32 --no-profile --tree-budgets "" \
          --exact --exact-tile $tile --out /tmp/rounds_$tile.json | grep -E '^\{' | tee -a "$OUT/gpu_rounds_tiles.txt" \
          | cut -c1-120
    done
    timeout 120 python benchmarks/gpu_exact_attention.py --forwards dflash16,ddtree16,ddtree64 --tokens 4,8,16 \
        --parallel auto --out "$OUT/gpu_exact_attention.json" > /tmp/attention.txt 2>&1
    echo "attention rc=$?"; grep -E "^b=" /tmp/attention.txt | cut -c1-220
    timeout 180 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        tests/gpu/test_invariant_gemm.py > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -12 ;;
  3)
    timeout 80 python benchmarks/gpu_exact_gemm_tma.py --out "$OUT/gpu_exact_gemm_tma.json" > /tmp/tma.txt 2>&1
    echo "tma rc=$?"; grep -E "M=|error" /tmp/tma.txt | cut -c1-400
    timeout 120 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_invariant_gemm.py \
        tests/gpu/test_exact_mode.py -k "invariant or logical_keys or bfloat16" > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -8
    for mode in fast exact; do
      timeout 90 python benchmarks/gpu_rounds.py --methods none,ddtree:16 --batches 1,32 --no-profile --tree-budgets "" \
          $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_$mode.json" > /tmp/rounds_$mode.txt 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' /tmp/rounds_$mode.txt | cut -c1-110
    done ;;
  4)
    timeout 200 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_fp8_gemm.py -k float32 \
        > "$OUT/tests_fp8_float32.txt" 2>&1
    echo "fp8 fp32 rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_fp8_float32.txt" | tail -6
    timeout 370 python -m pytest -v -rfE -p no:cacheprovider --tb=short --timeout 360 --durations=3 \
        tests/gpu/test_fused_kernels.py -k tree_kernels > "$OUT/test_fused_kernels_tree.txt" 2>&1
    echo "tree rc=$?"; grep -E "PASSED|FAILED|ERROR|Timeout|s call" "$OUT/test_fused_kernels_tree.txt" | tail -6 ;;
  5)
    timeout 240 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -10
    for mode in fast exact; do
      timeout 80 python benchmarks/gpu_rounds.py --methods dflash --batches 1,32 --no-profile --tree-budgets "" \
          $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_dflash_$mode.json" > /tmp/rounds_$mode.txt 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' /tmp/rounds_$mode.txt | cut -c1-110
    done ;;
  6)
    timeout 330 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:4,ddtree:16 --batches 1,8,16,32 \
        --no-profile --tree-budgets "" --kernel-table 30 --out "$OUT/gpu_rounds_roofline_fast.json" > /tmp/roofline.txt 2>&1
    echo "rounds fast rc=$?"; tail -20 /tmp/roofline.txt | cut -c1-150
    timeout 150 python benchmarks/gpu_rounds.py --methods none,dflash --batches 1,32 --no-profile --tree-budgets "" \
        --exact --out "$OUT/gpu_rounds_dflash_exact.json" > /tmp/rounds_exact.txt 2>&1
    echo "rounds exact rc=$?"; tail -6 /tmp/rounds_exact.txt | cut -c1-150 ;;
  7)
    timeout 560 python benchmarks/gpu_tree_attention.py --out "$OUT/gpu_tree_attention.json" > /tmp/tree_att.txt 2>&1
    echo "tree attention rc=$?"; grep -E "^b=|Error|error" /tmp/tree_att.txt | cut -c1-200 ;;
  8)
    timeout 230 python benchmarks/gpu_tree_attention.py --batches 16,32 --forwards plain,ddtree4,dflash16,ddtree16,drafter16 \
        --out "$OUT/gpu_tree_attention.json" > /tmp/tree_att.txt 2>&1
    echo "tree attention rc=$?"; grep -E "^b=|Error|error" /tmp/tree_att.txt | cut -c1-200
    timeout 200 python benchmarks/gpu_rounds.py --methods none,ddtree:4,ddtree:16,dflash --batches 16,32 --no-profile \
        --tree-budgets "" --kernel-table 25 --out "$OUT/gpu_rounds_roofline_fast.json" > /tmp/roofline.txt 2>&1
    echo "rounds fast rc=$?"; tail -9 /tmp/roofline.txt | cut -c1-150
    timeout 130 python benchmarks/gpu_rounds.py --methods ddtree:16,dflash --batches 16,32 --no-profile --tree-budgets "" \
        --attention-tiles "$OUT/gpu_tree_attention.json" --out "$OUT/gpu_rounds_swept_tiles.json" > /tmp/swept.txt 2>&1
    echo "rounds swept tiles rc=$?"; tail -5 /tmp/swept.txt | cut -c1-150 ;;
  9)
    timeout 150 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_fused_kernels.py -k attention \
        > "$OUT/tests_attention.txt" 2>&1
    echo "attention tests rc=$?"; tail -3 "$OUT/tests_attention.txt"
    timeout 240 python benchmarks/gpu_kv_capacity.py --out "$OUT/gpu_kv_capacity.json" > /tmp/kv_capacity.txt 2>&1
    echo "kv capacity rc=$?"; grep -E '^\{|Error' /tmp/kv_capacity.txt | cut -c1-400
    timeout 300 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -10 ;;
  11)  # the drafter's 16-bit logits (the radix top-k) against float32 ones (torch.topk), one machine
    for flag in "" --float-draft-logits; do
      timeout 100 python benchmarks/gpu_rounds.py --methods ddtree:16,ddtree:64 --batches 1,16,32 --no-profile \
          --tree-budgets "" $flag --out "$OUT/gpu_rounds_draft_logits${flag}.json" > /tmp/dl.txt 2>&1
      echo "rounds $flag rc=$?"; tail -7 /tmp/dl.txt | cut -c1-110
    done ;;
  17)  # the tiny engine's reserve, the pool tests, then the 8B pool at 1,024 rows with widest-first captures
    timeout 100 python benchmarks/gpu_reserve_probe.py > "$OUT/reserve_probe.txt" 2>&1; echo "probe rc=$?"
    grep -vE "Warn|warn|capturing" "$OUT/reserve_probe.txt" | tail -12 | cut -c1-300
    timeout 90 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_paged_kv.py -k "utilization or widest" \
        > "$OUT/tests_pool.txt" 2>&1
    echo "pool tests rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_pool.txt" | tail -4 | cut -c1-300
    timeout 200 python benchmarks/gpu_kv_capacity.py --max-running 1024 --methods none,ddtree --max-round-tokens 4096 \
        --out "$OUT/gpu_kv_capacity_090_1024_bounded.json" > /tmp/kv_b.txt 2>&1
    echo "kv capacity 1024, rounds of <= 4096 tokens rc=$?"; grep -E '^\{|Error' /tmp/kv_b.txt | cut -c1-1200 ;;
  19)
    timeout ${TESTS_S:-150} python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_fused_kernels.py \
        tests/gpu/test_startup_graphs.py tests/gpu/test_cuda_graphs.py > "$OUT/tests_packed.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_packed.txt" | tail -6 | cut -c1-300
    for mode in ${MODES:-off:1 on:2 on:4}; do  # (MODES="off:1 on:4": the short form, about 6 minutes)
      timeout 125 python benchmarks/gpu_rounds.py --methods none,ddtree:32@4,ddtree:32@8,ddtree:32@16 --batches 16,32 \
          --no-profile --tree-budgets "" --packed-verify ${mode%:*} --packed-span ${mode#*:} \
          --out "$OUT/gpu_rounds_packed_${mode/:/_}.json" > /tmp/rp.txt 2>&1
      echo "rounds packed=$mode rc=$?"; grep -E '^\{|Error' /tmp/rp.txt | cut -c1-140
    done ;;
  20)
    timeout 90 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_startup_graphs.py \
        -k "compiled_while_serving or no_capture_while_serving" > "$OUT/tests_warm_up.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_warm_up.txt" | tail -6 | cut -c1-300
    for run in ${RUNS:-exact:on fast:on exact:off fast:off}; do
      mode=${run%:*} warm=${run#*:}
      TRITON_CACHE_DIR=$(mktemp -d) timeout 110 python benchmarks/gpu_first_pass.py --random-smollm2 \
          --prompts benchmarks/out/real_pair/humaneval_ids.jsonl --methods none,ddtree:16 --batches 1,16,64 \
          --new-tokens 128 $([ $mode = exact ] && echo --exact) --warm-up $warm \
          --out "$OUT/gpu_first_pass_warm_up_${warm}_${mode}.json" > /tmp/fp_$run.txt 2>&1
      echo "first pass $mode warm-up $warm rc=$?"; grep -vE "Warn|warn|capturing|warming" /tmp/fp_$run.txt | tail -7 | cut -c1-130
    done ;;
  21)
    python -c "import sys; sys.path.insert(0, 'benchmarks'); from qwen3_8b_shape import QWEN3_8B, write_config; write_config('/tmp/qwen3-8b', QWEN3_8B)"
    for short in 64 0; do
      timeout 150 python benchmarks/prefix_cache_ttft.py --model /tmp/qwen3-8b --random-weights --device cuda --repeats 5 \
          --short-prefill-tokens $short --out "$OUT/prefix_cache_ttft_qwen3_8b_shape_short_$short.json" > /tmp/p_$short.txt 2>&1
      echo "prefix ttft, short chunks <= $short paged, rc=$?"; grep -E "prefix caching|Error" /tmp/p_$short.txt | cut -c1-300
    done
    for warm in on off; do
      timeout 100 python benchmarks/gpu_pool_headroom.py --headroom 0.1 --warm-up $warm \
          --out "$OUT/gpu_pool_headroom_warm_up_$warm.json" 2>/dev/null | tail -1 | cut -c1-400
    done ;;
  37)  # #39: CALL=35 served the adaptive DDTree at 0.46x / 0.61x plain (16 / 64 streams) against 1.2x offline, with four
    # servers up; here plain, DDTree and DDTree without prefix caching (offline engines have none; the passes repeat
    # the same 64 chats), with step traces. After gpu_real_pair.sh PART=1; CALL=35's carry.
    PART=join bash benchmarks/gpu_real_pair.sh || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    mkdir -p "$OUT/steps"  # (seven files come back: a call returns at most eight)
    REAL_MODEL=/root/stash/smollm2.gguf REAL_DRAFT=flashtree/assets/smollm2-dflash \
      PROMPTS=benchmarks/out/real_pair/humaneval_messages.jsonl WHEELS=benchmarks/out/serve_wheels_nouv NAME=smollm2_real_pair2 \
      MAX_RUNNING=64 LEVELS="16 64" METHODS="none ddtree ddtree@nopc" FLAGS_nopc="--no-prefix-caching" \
      STEP_TRACE_DIR="$OUT/steps" \
      LOG_DIR=/tmp/serve_logs PAIRED=1 REPEATS=2 CLIENT_PROCESSES=4 timeout 240 bash benchmarks/gpu_load.sh "$OUT" 2>&1 | tail -12
    python benchmarks/step_trace_summary.py none="$OUT/steps/steps_none.jsonl" ddtree="$OUT/steps/steps_ddtree.jsonl" \
        nopc="$OUT/steps/steps_ddtree_at_nopc.jsonl" 2>&1 | tail -30 | cut -c1-220
    timeout 80 python benchmarks/engine_churn.py --model /root/stash/smollm2.gguf \
        --draft flashtree/assets/smollm2-dflash --levels 16 --repeats 1 --requests 64 --out "$OUT/engine_churn_real_pair.json" \
        2>&1 | grep -vE "Warn|warn" | tail -14 | cut -c1-200 ;;
  36)  # split products ended in their tiles' last programs (gemm.FUSED_SUM) against the sum kernel: bits, then time
    timeout 200 python -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_invariant_gemm.py -k "last_programs" \
        > "$OUT/tests_fused_sum.txt" 2>&1
    echo "tests rc=$?"; tail -3 "$OUT/tests_fused_sum.txt"
    timeout 100 python benchmarks/gpu_exact_gemm.py --decode --products o,qkv,down --out "$OUT/gpu_exact_gemm_decode_fused_sum.json" \
        2>&1 | python -c "import json, sys; [print(r['product'], r['m'], round(r['cublas_us'], 1), round(r['split_us'], 1), round(r['fused_sum_us'], 1), r['fused_sum_same_bits']) for r in map(json.loads, (l for l in sys.stdin if l.startswith('{')))]"
    timeout 200 python benchmarks/gpu_fp8.py --parts products,steps --fused-sum-ab --batches 1,16 \
        --out "$OUT/gpu_fp8_fused_sum.json" 2>&1 | grep -E '^fp8 /|"weights"|"product"' | cut -c1-260 ;;
  35)  # #39 "served keeps the offline ratios within 10%": the real pair offline (first pass, then a second) and
    # served (paired, 4 client processes), the engine in a process and in a thread, 128 tokens, HumanEval chats.
    # Needs gpu_real_pair.sh PART=1 on this machine first; carry gguf.xz.b, the gguf wheel, humaneval_ids.jsonl,
    # humaneval_messages.jsonl and the serve wheels without uvloop as benchmarks/out/serve_wheels_nouv.
    PART=join bash benchmarks/gpu_real_pair.sh || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    timeout 170 python benchmarks/gpu_first_pass.py --target /root/stash/smollm2.gguf --drafter flashtree/assets/smollm2-dflash \
        --prompts benchmarks/out/real_pair/humaneval_ids.jsonl --dtype bfloat16 --batches 1,16,64 --new-tokens 128 \
        --methods none,adaptive --passes 2 --out "$OUT/gpu_first_pass_smollm2_real_humaneval_128.json" > /tmp/off35.txt 2>&1
    echo "offline rc=$?"; grep -vE "Warn|warn" /tmp/off35.txt | tail -8 | cut -c1-200
    REAL_MODEL=/root/stash/smollm2.gguf REAL_DRAFT=flashtree/assets/smollm2-dflash \
      PROMPTS=benchmarks/out/real_pair/humaneval_messages.jsonl WHEELS=benchmarks/out/serve_wheels_nouv NAME=smollm2_real \
      MAX_RUNNING=64 LEVELS="1 16 64" METHODS="none ddtree none@thread ddtree@thread" FLAGS_thread="--no-engine-process" \
      LOG_DIR=/tmp/serve_logs PAIRED=1 REPEATS=3 CLIENT_PROCESSES=4 timeout 370 bash benchmarks/gpu_load.sh "$OUT" 2>&1 | tail -16 ;;
  34)  # #39 first-pass gap: full garbage collections inside the passes, start-up objects frozen or not
    for freeze in "" --freeze-gc; do
      timeout 150 python benchmarks/gpu_first_pass.py --random-smollm2 --prompts benchmarks/out/real_pair/humaneval_ids.jsonl \
          --methods none --batches 16,64 --new-tokens 128 --passes 2 $freeze \
          --out "$OUT/gpu_first_pass_random_smollm2_gc${freeze:+_frozen}.json" > /tmp/fp34.txt 2>&1
      echo "first pass ${freeze:-unfrozen} rc=$?"; python -c "import json, sys; [print(r['batch'], round(r['pass1_tok_s']), round(r['pass2_tok_s']), r['pass1_gc'], r['pass2_gc']) for r in json.load(open(sys.argv[1]))['rows']]" "$OUT/gpu_first_pass_random_smollm2_gc${freeze:+_frozen}.json"
    done ;;
  33)  # the engine process (the CUDA default since session 41) against a thread at one stream (CALL=30: 1.34x / 1.09x at 16 / 64)
    SHAPE_OVERRIDE='{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": true}' \
      TOKENIZER=benchmarks/out/serve_tokenizer WHEELS=benchmarks/out/serve_wheels NAME=smollm2_random_one_stream MAX_RUNNING=64 \
      LEVELS="1" METHODS="none@thread none" FLAGS_thread="--no-engine-process" \
      PAIRED=1 REPEATS=3 CLIENT_PROCESSES=1 timeout 300 bash benchmarks/gpu_load.sh "$OUT" 2>&1 | tail -8 ;;
  32)  # #39: the 8B plain step against its HBM floor at batch 1 and 32 (70% / 55% on 11-29), and its kernels
    timeout 200 python benchmarks/gpu_decode_step.py --batches 1,32 --modes graphs --steps 40 \
        --out "$OUT/gpu_decode_step_qwen3_8b_shape.json" 2>&1 | grep -vE "Warn|warn" | tail -4 | cut -c1-300
    timeout 240 python benchmarks/gpu_rounds.py --methods none --batches 1,32 --kernel-table 25 \
        --out "$OUT/gpu_rounds_plain_kernels_qwen3_8b_shape.json" > /tmp/r32.txt 2>&1
    echo "plain kernels rc=$?"; tail -3 /tmp/r32.txt | cut -c1-300 ;;
  31)
    timeout 300 python benchmarks/gpu_fp8.py --parts products --sweep-chunks --batches 1,16 \
        --out "$OUT/gpu_fp8_chunk_sweep.json" 2>&1 | grep -E "chunk sweep|fp8_us" | cut -c1-260 ;;
  30)
    mkdir -p "$OUT/steps"
    SHAPE_OVERRIDE='{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": true}' \
      TOKENIZER=benchmarks/out/serve_tokenizer WHEELS=benchmarks/out/serve_wheels NAME=smollm2_random MAX_RUNNING=64 \
      LEVELS="16 64" METHODS="none@thread none@si none" FLAGS_thread="--no-engine-process" \
      FLAGS_si="--no-engine-process --switch-interval-ms 0.5" \
      PAIRED=1 REPEATS=2 CLIENT_PROCESSES=4 STEP_TRACE_DIR="$OUT/steps" timeout 380 bash benchmarks/gpu_load.sh "$OUT" 2>&1 | tail -14
    timeout 120 python benchmarks/gpu_first_pass.py --random-smollm2 --prompts benchmarks/out/real_pair/humaneval_ids.jsonl \
        --methods none --batches 16,64 --new-tokens 128 --passes 2 --out "$OUT/gpu_first_pass_random_smollm2_b64.json" 2>&1 | tail -3 ;;
  29)
    for alloc in "" --allocate; do
      timeout 60 python benchmarks/gpu_gemm_first_call.py $alloc --out "$OUT/gpu_gemm_first_call${alloc:+_allocate}.json" 2>&1 | tail -6
    done
    timeout 240 python benchmarks/gpu_first_pass.py --random-smollm2 --prompts benchmarks/out/real_pair/humaneval_ids.jsonl \
        --methods none --batches 16,32 --new-tokens 256 --passes 2 --fresh-prompts --product-shapes \
        --out "$OUT/gpu_first_pass_random_smollm2_product_shapes.json" > /tmp/fp29.txt 2>&1
    echo "first pass with product shapes rc=$?"
    python -c "import json, sys; [print(r['batch'], {k: len(v) for k, v in r.items() if k.endswith('new_product_shapes')}) for r in json.load(open(sys.argv[1]))['rows']]" \
        "$OUT/gpu_first_pass_random_smollm2_product_shapes.json" ;;
  28)
    timeout 420 python benchmarks/gpu_moe.py --out "$OUT/gpu_moe_qwen3_30b_a3b_shape.json" --tokens 1,4,16,64,256 \
        > "$OUT/gpu_moe.txt" 2>&1; echo "moe rc=$?"; tail -7 "$OUT/gpu_moe.txt" ;;
  27)
    timeout ${TESTS_S:-420} python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_lossless_fuzz_cuda.py \
        > "$OUT/tests_lossless_fuzz_cuda.txt" 2>&1
    echo "lossless fuzz rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_lossless_fuzz_cuda.txt" | tail -8 | cut -c1-300
    timeout 120 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_paged_kv.py -k "utilization or widest" \
        > "$OUT/tests_pool.txt" 2>&1
    echo "pool tests rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_pool.txt" | tail -4 | cut -c1-300 ;;
  26)
    timeout 60 python benchmarks/gpu_gemm_first_call.py --out "$OUT/gpu_gemm_first_call.json" 2>&1 | tail -7
    timeout 200 python benchmarks/gpu_first_pass.py --random-smollm2 --prompts benchmarks/out/real_pair/humaneval_ids.jsonl \
        --methods none --batches 16,32 --new-tokens 256 --passes 2 --fresh-prompts \
        --out "$OUT/gpu_first_pass_random_smollm2_fresh_prompts.json" > /tmp/fp26.txt 2>&1
    echo "first pass with fresh prompts rc=$?"
    python -c "import json, sys; [print({k: round(v) for k, v in r.items() if k.endswith('tok_s')}) for r in json.load(open(sys.argv[1]))['rows']]" \
        "$OUT/gpu_first_pass_random_smollm2_fresh_prompts.json" ;;
  25)
    timeout ${TESTS_S:-400} python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        -k "4096" > "$OUT/tests_exact_4096.txt" 2>&1
    echo "exact 4,096-token tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact_4096.txt" | tail -6 ;;
  24)
    TRITON_CACHE_DIR=$(mktemp -d) timeout 200 python benchmarks/gpu_first_pass.py --random-smollm2 \
        --prompts benchmarks/out/real_pair/humaneval_ids.jsonl --methods none --batches 1,16 --new-tokens 128 \
        --warm-up on --passes 3 --profile-batch 16 --out "$OUT/gpu_first_pass_fast_profiled_b16.json" > /tmp/fp24.txt 2>&1
    echo "first pass profiled rc=$?"; grep -vE "Warn|warn|capturing|warming" /tmp/fp24.txt | tail -5 | cut -c1-150 ;;
  23)
    for warm in on off; do
      timeout 100 python benchmarks/gpu_pool_headroom.py --headroom 0.1 --warm-up $warm \
          --out "$OUT/gpu_pool_headroom_warm_up_$warm.json" 2>/dev/null | tail -1 | cut -c1-900
    done
    timeout ${TESTS_S:-300} python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_paged_kv.py \
        tests/gpu/test_startup_graphs.py tests/gpu/test_cuda_graphs.py > "$OUT/tests_pool_graphs.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "^E |passed|failed" "$OUT/tests_pool_graphs.txt" | tail -8 | cut -c1-300 ;;
  22)
    for loading in ${LOADINGS:-LAZY EAGER}; do
      for prime in ${PRIMES:-0}; do
        CUDA_MODULE_LOADING=$loading TRITON_CACHE_DIR=$(mktemp -d) timeout 150 python benchmarks/gpu_first_pass.py \
            --random-smollm2 --prompts benchmarks/out/real_pair/humaneval_ids.jsonl --methods none,ddtree:16 \
            --batches 1,16,64 --new-tokens 128 --warm-up on --passes 3 --prime-allocator-mib $prime \
            --out "$OUT/gpu_first_pass_fast_module_loading_${loading,,}_prime_$prime.json" > /tmp/fp_$loading.txt 2>&1
        echo "first pass fast, module loading $loading, allocator primed with $prime MiB rc=$?"
        grep -vE "Warn|warn|capturing|warming" /tmp/fp_$loading.txt | tail -7 | cut -c1-150
      done
    done ;;
  18)
    python -c "import sys; sys.path.insert(0, 'benchmarks'); from qwen3_8b_shape import QWEN3_8B, write_config; write_config('/tmp/qwen3-8b', QWEN3_8B)"
    timeout 200 python benchmarks/prefix_cache_ttft.py --model /tmp/qwen3-8b --random-weights --device cuda \
        --out "$OUT/prefix_cache_ttft_qwen3_8b_shape.json" > "$OUT/prefix_ttft.txt" 2>&1
    echo "prefix ttft rc=$?"; grep -E "prefix caching|Error" "$OUT/prefix_ttft.txt" | cut -c1-200 ;;
  16)  # the exact attention's 16-bit key loop at 128 keys / 2 stages (session 32's default): tests, then rounds
    timeout 240 python -m pytest -v -rfE -p no:cacheprovider --tb=short tests/gpu/test_exact_mode.py \
        > "$OUT/tests_exact.txt" 2>&1
    echo "exact tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_exact.txt" | tail -10
    for mode in fast exact; do
      timeout 110 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16 --batches 1,32 --no-profile --tree-budgets "" \
          $([ $mode = exact ] && echo --exact) --out "$OUT/gpu_rounds_$mode.json" > /tmp/rounds_$mode.txt 2>&1
      echo "rounds $mode rc=$?"; grep -E '^\{' /tmp/rounds_$mode.txt | cut -c1-110
    done ;;
  15)
    case "${PART:-2}" in
      2) mkdir -p /root/stash/site && tar -C /root/stash/site -xJf .old/wheels/fisite.tar.xz
         PYTHONPATH=/root/stash/site python -c "import flashinfer; print(flashinfer.__version__)"
         PYTHONPATH=$PYTHONPATH:/root/stash/site timeout 520 python benchmarks/gpu_flashinfer_attention.py \
             --out "$OUT/gpu_flashinfer_attention.json" > "$OUT/flashinfer.txt" 2>&1
         echo "build and time rc=$?"; grep -E "^b=|Error" "$OUT/flashinfer.txt" | cut -c1-220; tail -3 "$OUT/flashinfer.txt" | cut -c1-300 ;;
      3) PYTHONPATH=$PYTHONPATH:/root/stash/site timeout 500 python benchmarks/gpu_flashinfer_attention.py \
             --out "$OUT/gpu_flashinfer_attention.json" > "$OUT/flashinfer.txt" 2>&1
         echo "flashinfer rc=$?"; grep -E "^b=|Error" "$OUT/flashinfer.txt" | cut -c1-220 ;;
    esac ;;
  14)
    cp flashtree/kernels/gpu/triton_attention.py /tmp/triton_attention_after.py
    for side in after before; do
      [ $side = before ] && cp .old/triton_attention_before.py flashtree/kernels/gpu/triton_attention.py
      timeout 110 python benchmarks/gpu_rounds.py --methods ddtree:16,dflash --batches 16 --no-profile --tree-budgets "" \
          --kernel-table 12 --out "$OUT/gpu_rounds_kernels_$side.json" > "$OUT/gpu_rounds_kernels_$side.txt" 2>&1
      echo "rounds $side rc=$?"; tail -30 "$OUT/gpu_rounds_kernels_$side.txt" | cut -c1-160
    done
    cp /tmp/triton_attention_after.py flashtree/kernels/gpu/triton_attention.py ;;
  13)  # (session 31's CALL=9 ran these two files under -k attention, which deselected them)
    timeout 150 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_draft_head.py \
        tests/gpu/test_paged_kv.py -k "draft_logits or utilization or widest" > "$OUT/tests_pool_draft_head.txt" 2>&1
    echo "pool and draft-head tests rc=$?"; tail -3 "$OUT/tests_pool_draft_head.txt"
    timeout 150 python benchmarks/gpu_kv_capacity.py --max-running 1024 --methods none,ddtree,adaptive \
        --out "$OUT/gpu_kv_capacity_090_1024.json" > /tmp/kv_1024.txt 2>&1
    echo "kv capacity 1024 rc=$?"; grep -E '^\{|Error' /tmp/kv_1024.txt | cut -c1-900
    timeout 100 python benchmarks/gpu_kv_capacity.py --max-running 1024 --methods ddtree --max-round-tokens 4096 \
        --out "$OUT/gpu_kv_capacity_090_1024_bounded.json" > /tmp/kv_b.txt 2>&1
    echo "kv capacity 1024, rounds of <= 4096 tokens rc=$?"; grep -E '^\{|Error' /tmp/kv_b.txt | cut -c1-900 ;;
  12)
    cp flashtree/kernels/gpu/triton_attention.py /tmp/triton_attention_after.py
    for side in after before; do
      [ $side = before ] && cp .old/triton_attention_before.py flashtree/kernels/gpu/triton_attention.py
      timeout 60 python benchmarks/gpu_tree_attention.py --batches 1,16,32 --forwards plain,ddtree4,dflash16,ddtree16,ddtree64 \
          --default-only --reps 5 --out "$OUT/gpu_tree_attention_$side.json" > /tmp/tree_att.txt 2>&1
      echo "tree attention $side rc=$?"; grep -E "^b=|Error" /tmp/tree_att.txt | cut -c1-80
      timeout 190 python benchmarks/gpu_rounds.py --methods none,dflash,ddtree:16,ddtree:64 --batches 1,16,32 --no-profile \
          --tree-budgets "" --out "$OUT/gpu_rounds_$side.json" > "$OUT/gpu_rounds_$side.txt" 2>&1
      echo "rounds $side rc=$?"; grep -E "^\{" "$OUT/gpu_rounds_$side.txt" | cut -c1-150
    done
    cp /tmp/triton_attention_after.py flashtree/kernels/gpu/triton_attention.py
    timeout 90 python -m pytest -q -rfE -p no:cacheprovider --tb=short tests/gpu/test_fused_kernels.py -k attention \
        > "$OUT/tests_attention.txt" 2>&1
    echo "attention tests rc=$?"; tail -3 "$OUT/tests_attention.txt" ;;
  10)
    for launch in "" "--block-n 128 --stages 2" "--block-n 64 --stages 2"; do
      name=$(echo "block${launch}" | tr -d ' -')
      timeout 150 python benchmarks/gpu_exact_attention.py --forwards plain,dflash16,ddtree16,ddtree64 --tokens 4,8 \
          --parallel auto $launch --out "$OUT/gpu_exact_attention_$name.json" > /tmp/exact_$name.txt 2>&1
      echo "exact attention $launch rc=$?"; grep -E "^b=" /tmp/exact_$name.txt | cut -c1-200
    done ;;
esac
