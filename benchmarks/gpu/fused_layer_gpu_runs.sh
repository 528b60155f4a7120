#!/usr/bin/env bash
# Issue 33's H100 runs for the fused decode layer, one group per device call (10 minutes). Every
# run has its own time limit and log in $OUT (default ./fused_runs); a failed run is reported and
# the rest go on. Llama-3-8B shape, random bf16 weights, whole-step CUDA graphs.
#
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh timeline PATCH
#       the kernel timeline of a 16K x 8 decode step (profile_engine_step.py: kernels by GPU time,
#       launches per step), Quest resident and hierarchical, after and before the change that
#       PATCH holds (`git diff BASE -- sparse_framework/`: reverse-applied for "before", then
#       applied again)
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh targets
#       issue 33's step targets with `sparse-framework bench` (256 output tokens, each beside its
#       floor): dense, Quest resident and Quest hierarchical (8,192-token buffer) at 16K x 8,
#       Quest resident at 32K x 16 (what fits at once), and the FP8 host tier at 16K x 8
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh prefetch
#       the hierarchical runs again with prefetch "early_query" (the next layer's selection
#       predicted and swapped in on a side stream): the CUDA prefetch tests, the 16K x 8 timeline
#       and bench, and the 32K memory-bound maximum
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh prefetch-grid
#       the prefetch's copy on a small grid of many-row programs (prefetch_programs x prefetch_rows
#       of kv_store/residency.py's CopyShapes, so that it leaves the SMs to the compute it should overlap): the
#       compiled copy kernel's and the prefetch's GPU tests, the 16K x 8 timeline with and without
#       prefetch (overlap shows as kernel time above the step's wall time), bench off / on at the
#       default shape and two others (PROGRAMS:ROWS), and the 32K memory-bound maximum off / on
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh capacity
#       Quest resident at 32K x 16 again, then the memory-bound maximum at 32K: 24 requests, dense
#       (resident, admitted by memory) vs Quest hierarchical
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh capacity128k
#       the memory-bound maximum at 128K: 6 requests (what a 128 GiB host's budget holds in bf16),
#       dense (resident, admitted by memory) vs Quest hierarchical, then the FP8 host
#       tier with 12 (twice the requests in the same host bytes). HOST_GIB (default 99.7, the
#       budget 0.8 x MemAvailable gave on the 128 GiB single-H100 machine) caps the host pool, so
#       that a bigger host (the 4-GPU machines have 512 GiB) gives the same plan
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh timeline32k
#       the kernel timeline of the hierarchical step at the 32K memory-bound maximum (24 x 32K)
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh copy-grid PROGRAMS:ROWS:WARPS...
#       the decode path's swap-in copy (copy_* and narrow_* programs, rows, warps of
#       kv_store/residency.py's CopyShapes) at each launch shape given: the hierarchical 16K x 8 timeline,
#       `copy_missing_kernel`'s GPU time per step beside the step's
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh narrow-copy
#       one head's rows copied with the narrow shape (narrow_* of residency.py's CopyShapes, the
#       default) and, at 16K x 8, with the wide one they took before stop 41 (2,048 x 1 x 8); the
#       32K memory-bound maximum with the narrow shape
#   bash benchmarks/gpu/fused_layer_gpu_runs.sh recheck
#       after stop 41's fix of the fused decode write (every KV head's host copy of a dense
#       layer's token): the compiled store and kernel GPU tests, the 16K x 8 targets again (Quest
#       resident and hierarchical, dense beside them), and the prefetch timeline whose per-kernel
#       split stop 40 lost
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-fused_runs}
mkdir -p "$OUT"
DENSE='{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}'
RES='{"algorithm": "quest", "backend": "triton", "store": "resident", "top_k": 2048}'
HIER='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048, "device_buffer_tokens": 8192}'
HIER_PF='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048, "device_buffer_tokens": 8192, "prefetch": "early_query"}'
HOST_GIB=${HOST_GIB:-99.7}
HIER_FP8='{"algorithm": "quest", "backend": "triton", "store": "hierarchical", "top_k": 2048, "device_buffer_tokens": 8192, "host_kv_dtype": "fp8_e4m3"}'

# shellcheck source=benchmarks/gpu/run_logged.sh
source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...

CLI=(sparse-framework)  # the command bench runs; bench_with swaps it for a wrapper

bench() {  # bench NAME LIMIT_S CONFIG bench arguments...
    local name=$1 limit=$2 config=$3
    shift 3
    run "$name" "$limit" "${CLI[@]}" bench --random llama-3-8b --device cuda --cuda-graphs --no-progress \
        --config "$config" --json "$OUT/$name.json" --output-len 256 --max-num-batched-tokens 16384 "$@"
    tail -n 14 "$OUT/$name.log" | cut -c1-100 | sed "s/^/    /"
}

# a Python prelude: argv[1] names fields of the copy launch shapes (`CopyShapes` of
# kv_store/residency.py, "a,b"), argv[2] their integer values ("1:2"); every hierarchical store
# built after it is given those shapes (its copy_shapes keyword); what follows in the same -c
# string then sees argv[3:]
SET_RESIDENCY='import dataclasses, functools, sys
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore
from sparse_framework.kv_store.residency import CopyShapes
values = dict(zip(sys.argv[1].split(","), map(int, sys.argv[2].split(":")), strict=True))
shapes = dataclasses.replace(CopyShapes(), **values)  # a misspelt name fails here, not silently
HierarchicalKVStore.__init__ = functools.partialmethod(HierarchicalKVStore.__init__, copy_shapes=shapes)
'

bench_with() {  # bench_with NAMES VALUES bench's arguments...: bench with those copy launch shapes
    local names=$1 values=$2
    shift 2
    local CLI=(python3 -c "$SET_RESIDENCY"'from sparse_framework.cli.main import main
sys.exit(main(sys.argv[3:]))' "$names" "$values")  # bench, called from here, sees this one
    bench "$@"
}

profile() {  # profile NAME CONFIG [BATCH CONTEXT LIMIT_S]
    run "$1" "${5:-150}" python3 benchmarks/profile_engine_step.py --config "$2" --batch "${3:-8}" --context "${4:-16384}" \
        --cuda-graphs --top 25 --json "$OUT/$1.json"
    grep -E "^decode step|hit rate" "$OUT/$1.log" | sed 's/^/    /'
}

profile_grid() {  # profile_grid PROGRAMS:ROWS:WARPS NAME CONFIG: profile with that decode-path copy shape
    local shape=$1 name=$2 config=$3
    run "$name" 150 python3 -c "$SET_RESIDENCY"'import runpy
sys.path.insert(0, "benchmarks")
sys.argv = ["profile_engine_step.py", *sys.argv[3:]]
runpy.run_path("benchmarks/profile_engine_step.py", run_name="__main__")' \
        copy_programs,copy_rows,copy_warps,narrow_programs,narrow_rows,narrow_warps "$shape:$shape" --config "$config" \
        --batch 8 --context 16384 --cuda-graphs --top 25 --json "$OUT/$name.json"
    grep -E "^decode step|hit rate|copy_missing" "$OUT/$name.log" | cut -c1-110 | sed 's/^/    /'
}

case ${1:-} in
    timeline)
        patch=${2:?the patch of the change (git diff BASE -- sparse_framework/)}
        profile timeline_resident_after "$RES"
        profile timeline_hier_after "$HIER"
        patch -p1 -R --quiet <"$patch" || exit 1
        profile timeline_resident_before "$RES"
        profile timeline_hier_before "$HIER"
        patch -p1 --quiet <"$patch" ;;
    targets)
        bench dense_16k_x8 120 "$DENSE" --input-len 16384 --num-prompts 8
        bench quest_resident_16k_x8 120 "$RES" --input-len 16384 --num-prompts 8
        bench quest_hier_16k_x8 150 "$HIER" --input-len 16384 --num-prompts 8
        bench quest_hier_fp8_16k_x8 150 "$HIER_FP8" --input-len 16384 --num-prompts 8
        bench quest_resident_32k_x16 200 "$RES" --input-len 32768 --num-prompts 16 --max-num-seqs 16 \
            --gpu-memory-utilization 0.9 ;;
    prefetch)
        run prefetch_gpu_tests 200 python3 -m pytest -q -m gpu tests/test_engine_prefetch.py
        tail -n 3 "$OUT/prefetch_gpu_tests.log"
        profile timeline_hier_prefetch "$HIER_PF"
        for pf in off on; do  # the same machine without and with it
            config=$HIER && [[ $pf == on ]] && config=$HIER_PF
            bench "quest_hier_prefetch_${pf}_16k_x8" 150 "$config" --input-len 16384 --num-prompts 8
            bench "quest_hier_prefetch_${pf}_32k_max" 240 "$config" --input-len 32768 --num-prompts 24 \
                --max-num-seqs 24 --gpu-memory-utilization 0.9
        done ;;
    prefetch-grid)
        run prefetch_grid_gpu_tests 200 python3 -m pytest -q -m gpu tests/test_kernels_residency.py \
            tests/test_engine_prefetch.py
        tail -n 3 "$OUT/prefetch_grid_gpu_tests.log"
        profile timeline_hier_prefetch_grid "$HIER_PF"
        profile timeline_hier_no_prefetch "$HIER"
        bench quest_hier_prefetch_off_16k_x8 100 "$HIER" --input-len 16384 --num-prompts 8
        bench quest_hier_prefetch_grid_on_16k_x8 100 "$HIER_PF" --input-len 16384 --num-prompts 8
        for shape in 32:16 8:64; do
            bench_with prefetch_programs,prefetch_rows "$shape" "quest_hier_prefetch_grid_${shape/:/x}_16k_x8" 100 \
                "$HIER_PF" --input-len 16384 --num-prompts 8
        done
        for pf in off on; do
            config=$HIER && [[ $pf == on ]] && config=$HIER_PF
            bench "quest_hier_prefetch_grid_${pf}_32k_max" 130 "$config" --input-len 32768 --num-prompts 24 \
                --max-num-seqs 24 --gpu-memory-utilization 0.9
        done ;;
    capacity)
        bench quest_resident_32k_x16 200 "$RES" --input-len 32768 --num-prompts 16 --max-num-seqs 16 \
            --gpu-memory-utilization 0.9
        bench dense_32k_max 240 "$DENSE" --input-len 32768 --num-prompts 24 --max-num-seqs 24 --gpu-memory-utilization 0.9
        bench quest_hier_32k_max 240 "$HIER" --input-len 32768 --num-prompts 24 --max-num-seqs 24 \
            --gpu-memory-utilization 0.9 ;;
    capacity128k)
        host=(--host-memory-gib "$HOST_GIB" --gpu-memory-utilization 0.9 --input-len 131072)
        bench dense_128k_max 420 "$DENSE" "${host[@]}" --num-prompts 6 --max-num-seqs 6
        bench quest_hier_128k_max 420 "$HIER" "${host[@]}" --num-prompts 6 --max-num-seqs 6
        bench quest_hier_fp8_128k_max 600 "$HIER_FP8" "${host[@]}" --num-prompts 12 --max-num-seqs 12 ;;
    timeline32k)
        profile timeline_hier_32k_x24 "$HIER" 24 32768 300 ;;
    copy-grid)
        shift
        for shape in "$@"; do
            profile_grid "$shape" "timeline_hier_copy_${shape//:/x}" "$HIER"
        done ;;
    narrow-copy)
        bench quest_hier_16k_x8_narrow 100 "$HIER" --input-len 16384 --num-prompts 8
        bench_with narrow_programs,narrow_rows,narrow_warps 2048:1:8 quest_hier_16k_x8_wide 100 "$HIER" \
            --input-len 16384 --num-prompts 8
        bench quest_hier_32k_max_narrow 240 "$HIER" --input-len 32768 --num-prompts 24 --max-num-seqs 24 \
            --gpu-memory-utilization 0.9 ;;
    recheck)
        run recheck_gpu_tests 240 python3 -m pytest -q -m gpu tests/test_kernels_decode_slots.py \
            tests/test_kernels_residency.py tests/test_engine_prefetch.py tests/test_gpu.py
        tail -n 3 "$OUT/recheck_gpu_tests.log"
        bench dense_16k_x8 100 "$DENSE" --input-len 16384 --num-prompts 8
        bench quest_resident_16k_x8 100 "$RES" --input-len 16384 --num-prompts 8
        bench quest_hier_16k_x8 120 "$HIER" --input-len 16384 --num-prompts 8
        profile timeline_hier_no_prefetch "$HIER"
        profile timeline_hier_prefetch_grid "$HIER_PF" ;;
    *)
        awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
        exit 2 ;;
esac
