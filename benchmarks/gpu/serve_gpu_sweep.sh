#!/usr/bin/env bash
# Issue 30's online rate sweep on one GPU: `sparse-framework serve` started per configuration,
# driven by `sparse-framework bench-serve` with Poisson arrivals at rising rates up to all at
# once (inf), dense decode vs hierarchical sparse decode. One JSON report per (model, context,
# configuration) in $OUT (default ./serve_runs), with the server's log and its /metrics at the
# end of the sweep beside it. Each group fits one device call (10 minutes).
#
#   bash benchmarks/gpu/serve_gpu_sweep.sh 8b16k      # Llama-3-8B shape (random weights), 16K prompts
#   bash benchmarks/gpu/serve_gpu_sweep.sh 8b32k      # the same at 32K
#   bash benchmarks/gpu/serve_gpu_sweep.sh smollm2    # SmolLM2-135M-Instruct (converted), 4K prompts
#   SKIP_DENSE=1 bash ...                         # the sparse configuration only (a call cut short)
#
# Both configurations size their pools with --gpu-memory-utilization 0.9 (the engine admits by
# its memory plan: the server's log prints it) and replay decode steps from CUDA graphs captured
# at start-up (the warm-up; /health is 200 only after it). Dense is the resident store with
# every request decoding densely; sparse is Quest (top_k 2048) over the hierarchical store.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-serve_runs}
PORT=${PORT:-8123}
# the device flags; a dry run on the CPU: ENGINE_FLAGS="--device cpu" bash ... tiny
ENGINE_FLAGS=${ENGINE_FLAGS:---device cuda --cuda-graphs --gpu-memory-utilization 0.9}
mkdir -p "$OUT"
DENSE='{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}'
QUEST='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048}'
# SmolLM2 at 4K: 1/8 of the context, Quest scoring page midpoints (range_weight 0: the variant
# that keeps its RULER accuracy at 1/8, docs/algorithms.md), a device buffer of 1/4 of the
# context (as the 8B runs' 4096 of 16K) so that the host tier is used. (DSA over the keys, the
# accuracy oracle, is no serving configuration: it copies every key to float32 each step.)
SMOL_SPARSE='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 512, "device_buffer_tokens": 1024, "min_sparse_prompt_len": 512, "extra": {"range_weight": 0}}'

fetch() {  # fetch URL: its body on stdout, non-zero unless 200 (no curl needed)
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

sweep() {  # sweep NAME INPUT_LEN OUTPUT_LEN NUM_PROMPTS RATES CONFIG MODEL_ARGS...
    local name=$1 input_len=$2 output_len=$3 n=$4 rates=$5 config=$6
    shift 6
    local start=$SECONDS log="$OUT/$name.server.log"
    # shellcheck disable=SC2086  # ENGINE_FLAGS are several words
    sparse-framework serve "$@" $ENGINE_FLAGS --max-num-seqs 64 \
        --max-num-batched-tokens 16384 --max-model-len $((input_len + output_len)) --max-waiting 4096 \
        --config "$config" --port "$PORT" --log-level warning >"$log" 2>&1 &
    local pid=$! ready=0
    for _ in $(seq 600); do  # start-up: weights, pools, warm-up (up to 300 s)
        if fetch "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then ready=1; break; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if [[ $ready != 1 ]]; then
        echo "$name: the server did not become ready in $((SECONDS - start)) s"; tail -n 15 "$log" | sed 's/^/    /'
        kill -TERM "$pid" 2>/dev/null; wait "$pid"; return
    fi
    echo "$name: ready in $((SECONDS - start)) s"
    # shellcheck disable=SC2086  # the rates are several words
    sparse-framework bench-serve --base-url "http://127.0.0.1:$PORT" --request-rate $rates --num-prompts "$n" \
        --input-len "$input_len" --output-len "$output_len" --prompt-format ids --slo-ttft-ms 5000 \
        --slo-tpot-ms 100 --timeout 300 --no-progress --out "$OUT/$name.json" >"$OUT/$name.bench.log" 2>&1
    echo "$name: bench-serve rc=$? after $((SECONDS - start)) s"
    fetch "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.txt"
    kill -TERM "$pid"
    wait "$pid"
    echo "$name: server exit $? after $((SECONDS - start)) s"
    grep -v '^\s*$' "$OUT/$name.bench.log" | tail -n 14
}

case ${1:-} in
    8b16k)
        [[ -n ${SKIP_DENSE:-} ]] || sweep serve_8b_16k_dense 16384 256 24 "0.5 1 inf" "$DENSE" --random llama-3-8b
        sweep serve_8b_16k_quest 16384 256 24 "0.5 1 inf" "$QUEST" --random llama-3-8b ;;
    8b32k)
        [[ -n ${SKIP_DENSE:-} ]] || sweep serve_8b_32k_dense 32768 256 12 "0.25 0.5 inf" "$DENSE" --random llama-3-8b
        sweep serve_8b_32k_quest 32768 256 12 "0.25 0.5 inf" "$QUEST" --random llama-3-8b ;;
    smollm2)
        [[ -n ${SKIP_DENSE:-} ]] || sweep serve_smollm2_4k_dense 4096 256 64 "4 16 inf" "$DENSE" --model smollm2-135m-instruct
        sweep serve_smollm2_4k_quest 4096 256 64 "4 16 inf" "$SMOL_SPARSE" --model smollm2-135m-instruct ;;
    tiny)  # a dry run of the script itself (any device): the `tiny` shape, torch_ref
        sweep serve_tiny_dense 256 8 6 "20 inf" '{"algorithm": "quest", "store": "resident", "min_sparse_prompt_len": 1000000000}' --random tiny
        sweep serve_tiny_quest 256 8 6 "20 inf" '{"algorithm": "quest", "top_k": 64, "page_size": 16, "device_buffer_tokens": 192, "min_sparse_prompt_len": 0}' --random tiny ;;
    *)
        echo "usage: bash benchmarks/gpu/serve_gpu_sweep.sh 8b16k|8b32k|smollm2|tiny" >&2
        exit 2 ;;
esac
