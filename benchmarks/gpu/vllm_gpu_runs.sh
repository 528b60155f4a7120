#!/usr/bin/env bash
# Issue 31's H100 runs, one group per device call (10 minutes), on a machine where the vLLM 0.26
# bundle is joined (benchmarks/gpu/vllm_gpu_install.sh stash 1 | stash 2 + join) and, for the
# SmolLM2 groups, the model too (benchmarks/gpu/smollm2_gpu.sh stash | join, with the RULER samples
# and tokenizer.json carried). Every run has its own time limit and log in $OUT (default
# ./vllm_runs); a failed run is reported and the rest go on.
#
#   bash benchmarks/gpu/vllm_gpu_runs.sh perf       # vLLM dense vs the plugin in vLLM's default
#                                               # graphs (decode captured whole), 8B shape, 16K/32K x 8
#   bash benchmarks/gpu/vllm_gpu_runs.sh engine     # the plugin with piecewise graphs (attention eager),
#                                               # and this project's engine, dense and Quest, same cells
#   bash benchmarks/gpu/vllm_gpu_runs.sh equality   # SmolLM2 bf16 in vLLM's default graphs: covering
#                                               # budget vs vLLM dense, prefix caching on/off
#   bash benchmarks/gpu/vllm_gpu_runs.sh ruler      # SmolLM2 RULER 4K x 50 per task: dense, Quest, Quest rw0
#   bash benchmarks/gpu/vllm_gpu_runs.sh perf-tp    # batch 32 (does not fit one H100) with tensor parallelism
#                                               # TP (default 2): vLLM dense vs the plugin, 16K/32K x 32
#                                               # (CONFIGS=dense: the baseline alone)
#   bash benchmarks/gpu/vllm_gpu_runs.sh equality-tp  # SmolLM2 (3 KV heads) at TP (default 3), default graphs
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-vllm_runs}
mkdir -p "$OUT"
eval "$(bash benchmarks/gpu/vllm_gpu_install.sh env)"
export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD
# shellcheck source=benchmarks/gpu/run_logged.sh
source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...

DENSE='{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}'
QUEST='{"algorithm": "quest", "backend": "triton", "store": "resident", "top_k": 2048}'

engine() {  # engine NAME LIMIT_S CONFIG INPUT_LEN: this project's engine, 8 requests, 64 tokens
    run "$1" "$2" sparse-framework bench --random llama-3-8b --device cuda --cuda-graphs --no-progress \
        --config "$3" --input-len "$4" --output-len 64 --num-prompts 8 --max-num-batched-tokens 16384 \
        --json "$OUT/$1.json"
}

smollm2() {  # the converted model's directory (benchmarks/gpu/smollm2_gpu.sh join made it) in $model
    eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"  # SPARSE_FRAMEWORK_CACHE: the model and RULER samples
    export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD
    model=$(python3 -c "from sparse_framework.engine.models.catalog import resolve_model as r; print(r('smollm2-135m-instruct'))")
}

case ${1:-} in
    perf)
        run paged_scores_gpu_tests 60 python3 -m pytest -q -m gpu tests/test_kernels_paged_scores.py
        run perf 480 python3 benchmarks/vllm_gpu.py perf --contexts 16384,32768 --batches 8 --configs quest,dense \
            --repeats 2 --out "$OUT/perf.json" --log-dir "$OUT/perf_logs" --timeout 270
        tail -n 8 "$OUT/perf.log" ;;
    engine)
        run perf_piecewise 280 python3 benchmarks/vllm_gpu.py perf --contexts 16384,32768 --batches 8 \
            --configs quest-piecewise --repeats 2 --out "$OUT/perf_piecewise.json" --log-dir "$OUT/perf_logs" --timeout 270
        tail -n 5 "$OUT/perf_piecewise.log"
        engine engine_16k_dense 70 "$DENSE" 16384
        engine engine_16k_quest 70 "$QUEST" 16384
        engine engine_32k_dense 90 "$DENSE" 32768
        engine engine_32k_quest 90 "$QUEST" 32768 ;;
    equality)
        smollm2
        run equality 560 python3 benchmarks/vllm_gpu.py equality --model "$model" --modes default \
            --out "$OUT/equality.json" --log-dir "$OUT/equality_logs" --timeout 150
        tail -n 12 "$OUT/equality.log" ;;
    ruler)
        smollm2
        run ruler 560 python3 benchmarks/vllm_gpu.py ruler --model "$model" --context 4096 --samples 50 \
            --tasks niah_single_1,niah_multikey_2,ruler_cwe,ruler_vt --top-k 512 --configs dense,quest,quest-rw0 \
            --out "$OUT/ruler.json" --log-dir "$OUT/ruler_logs" --timeout 180
        tail -n 8 "$OUT/ruler.log" ;;
    perf-tp)
        tp=${TP:-2}
        run "perf_tp$tp" 580 python3 benchmarks/vllm_gpu.py perf --tensor-parallel-size "$tp" --contexts 16384,32768 \
            --batches 32 --configs "${CONFIGS:-dense,quest}" --repeats 2 --out "$OUT/perf_tp$tp.json" --log-dir "$OUT/perf_tp_logs" \
            --timeout 285
        tail -n 8 "$OUT/perf_tp$tp.log" ;;
    equality-tp)
        smollm2
        tp=${TP:-3}
        run "equality_tp$tp" 560 python3 benchmarks/vllm_gpu.py equality --tensor-parallel-size "$tp" --model "$model" \
            --modes default --out "$OUT/equality_tp$tp.json" --log-dir "$OUT/equality_tp_logs" --timeout 150
        tail -n 12 "$OUT/equality_tp$tp.log" ;;
    *)
        awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
        exit 2 ;;
esac
