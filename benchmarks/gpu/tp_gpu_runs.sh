#!/usr/bin/env bash
# Issue 32's GPU runs on one host of 4 GPUs (nvidia-h100-x4), grouped so that each group fits
# one device call (10 minutes). Every run has its own time limit and log; a failed run is
# reported and the group goes on. Results land in $OUT (or ./tp_runs).
#
#   bash benchmarks/gpu/tp_gpu_runs.sh equality   # TP=2 and TP=4 outputs vs TP=1 (tp_equality.py)
#   bash benchmarks/gpu/tp_gpu_runs.sh perf16k    # Llama-3-8B shape, 16K x 8: TP=1/2/4, Quest and dense
#   bash benchmarks/gpu/tp_gpu_runs.sh perf32k    # 8B at 32K x 8 (TP=1/2/4), 70B at 16K x 8 (TP=4)
#   bash benchmarks/gpu/tp_gpu_runs.sh batch32    # issue 31's batch 32 (does not fit one H100): 8B at 16K
#                                             # and 32K x 32, TP=2, Quest (resident and host tier) and
#                                             # dense, admitted by memory (0.9 of each GPU), beside vLLM's
#                                             # (vllm_gpu_runs.sh perf-tp); batch32-resident: Quest resident alone
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-tp_runs}
mkdir -p "$OUT"
# NVLink multicast stays off in every process (the lent machines' KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DENSE='{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}'

# shellcheck source=benchmarks/gpu/run_logged.sh
source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...

bench() {  # bench NAME NPROC LIMIT_S tp_bench.py arguments...
    local name=$1 n=$2 limit=$3
    shift 3
    run "$name" "$limit" torchrun --nproc-per-node "$n" benchmarks/tp_bench.py --cuda-graphs --out "$OUT/$name.json" "$@"
}

case ${1:-} in
    equality)
        for n in 2 4; do
            run "tp_equality_tp$n" 200 torchrun --nproc-per-node "$n" benchmarks/tp_equality.py --out "$OUT/tp_equality_tp$n.json"
        done ;;
    perf16k)
        for n in 1 2 4; do
            bench "tp_bench_8b_16k_quest_tp$n" "$n" 120 --random llama-3-8b --input-len 16384 --output-len 64 --num-prompts 8
        done
        for n in 1 4; do
            bench "tp_bench_8b_16k_dense_tp$n" "$n" 100 --random llama-3-8b --input-len 16384 --output-len 64 --num-prompts 8 \
                --config "$DENSE"
        done ;;
    perf32k)
        for n in 1 2 4; do
            bench "tp_bench_8b_32k_quest_tp$n" "$n" 150 --random llama-3-8b --input-len 32768 --output-len 64 --num-prompts 8
        done
        bench tp_bench_70b_16k_quest_tp4 4 150 --random llama-3-70b --input-len 16384 --output-len 64 --num-prompts 8 ;;
    batch32|batch32-resident)
        # quest: the resident store, as the plugin inside vLLM runs; quest_hier: the engine's default
        # store, the host tier (stop 40 ran batch32-resident after batch32 had measured the other two)
        names="quest dense quest_hier" && [[ $1 == batch32-resident ]] && names=quest
        for ctx in 16384 32768; do
            for name in $names; do
                case $name in
                    quest) config='{"algorithm": "quest", "backend": "triton", "store": "resident", "top_k": 2048}' ;;
                    quest_hier) config='{"algorithm": "quest", "backend": "triton", "top_k": 2048}' ;;
                    *) config=$DENSE ;;
                esac
                # 256 output tokens: with 64 (stop 39's run) the prefill of 32 long prompts left few steps
                # with every request decoding, and the median "decode step" was not one
                bench "tp_bench_8b_${ctx}_x32_${name}_tp2" 2 240 --random llama-3-8b --input-len "$ctx" --output-len 256 \
                    --num-prompts 32 --gpu-memory-utilization 0.9 --config "$config"
            done
        done ;;
    *)
        echo "usage: bash benchmarks/gpu/tp_gpu_runs.sh equality|perf16k|perf32k|batch32|batch32-resident" >&2
        exit 2 ;;
esac
