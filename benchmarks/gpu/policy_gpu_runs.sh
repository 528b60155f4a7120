#!/usr/bin/env bash
# Issue 33's H100 runs for the cost policy and the FP8 host tier, in one device call (10
# minutes): what docs/engine.md ("Sparse only when it pays") names as missing. Every run has
# its own time limit and log; a failed run is reported and the rest go on. Results in $OUT
# (default ./policy_runs).
#
#   bash benchmarks/gpu/policy_gpu_runs.sh
#
#   decode_layer_short   one Llama-3-8B layer's sparse decode (Quest, Triton, graph replays)
#                        beside dense, 1K-32K x batch 1-32: the overhead below 16K, to refit
#   policy_b1_4k_*       a batch-1 4K request, 256 tokens: the policy on ("cost") against
#                        dense; the policy's step must not be slower
#   engine_short         whole engine steps, dense vs Quest resident, 2K-16K x batch 1/8
#   fp8_host_16k_*       hierarchical Quest at 16K x 8, host KV in bf16 vs FP8 (e4m3): swap-in
#                        traffic and step time
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-policy_runs}
mkdir -p "$OUT"
DENSE='{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}'
POLICY='{"algorithm": "quest", "backend": "triton", "store": "resident", "sparse_policy": "cost"}'
HIER='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048}'
HIER_FP8='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048, "host_kv_dtype": "fp8_e4m3"}'

# shellcheck source=benchmarks/gpu/run_logged.sh
source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...

bench() {  # bench NAME LIMIT_S CONFIG bench arguments...
    local name=$1 limit=$2 config=$3
    shift 3
    run "$name" "$limit" sparse-framework bench --random llama-3-8b --device cuda --cuda-graphs --no-progress \
        --config "$config" --json "$OUT/$name.json" "$@"
}

run decode_layer_short 120 python3 benchmarks/decode_layer.py --contexts 1024,2048,4096,8192,16384,32768 \
    --batches 1,2,4,8,16,32 --algorithms quest --shapes mha --backends triton --json "$OUT/decode_layer_short.json"
bench policy_b1_4k_dense 60 "$DENSE" --input-len 4096 --output-len 256 --num-prompts 1 --concurrency 1
bench policy_b1_4k_cost 60 "$POLICY" --input-len 4096 --output-len 256 --num-prompts 1 --concurrency 1
bench fp8_host_16k_bf16 90 "$HIER" --input-len 16384 --output-len 256 --num-prompts 8 --max-num-batched-tokens 16384
bench fp8_host_16k_fp8 90 "$HIER_FP8" --input-len 16384 --output-len 256 --num-prompts 8 --max-num-batched-tokens 16384
run engine_short 140 python3 benchmarks/engine_sweep.py --random llama-3-8b --device cuda --cuda-graphs \
    --lengths 2048,4096,8192,16384 --configs dense,quest-resident --concurrency 1,8 --output-len 64 \
    --min-sparse-prompt-len 0 --time-limit-s 130 --out "$OUT/engine_short.json"
