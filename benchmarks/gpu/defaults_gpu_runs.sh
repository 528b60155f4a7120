#!/usr/bin/env bash
# Issue 43's H200 runs in two device calls on one warm machine (benchmarks/README_gpu_model.md
# carries SmolLM2 the same way). Every run has its own time limit and log in $OUT.
#
#   HERE:  bash benchmarks/gpu/smollm2_gpu.sh prepare --context 8192 --samples 50 --tasks niah_single_1
#          bash benchmarks/gpu/defaults_gpu_runs.sh split   # three parts: the tree is ~17 MB now, so two
#                                                       # halves of the GGUF no longer fit a call's 64 MiB
#   call 1 (carry .gpu_carry/part1): bash benchmarks/gpu/defaults_gpu_runs.sh speed
#     defaults_gpu        benchmarks/defaults_gpu.py: dense, {"algorithm": "quest"}, the tuned resident
#                         Quest; 16K x 8 and batch 1 at 1K, 4K, 8K, from outside (whole generate calls)
#     decode_layer_short  one Llama-3-8B layer's sparse decode beside dense, 1K-32K x batch 1-32:
#                         the cost policy's constants for this GPU (benchmarks/sparse_policy_fit.py --gpu)
#   call 2 (carry .gpu_carry/part1b): bash benchmarks/gpu/defaults_gpu_runs.sh gpu-tests
#     gpu_tests           the CUDA tests (tests/test_gpu.py and the compiled kernel tests) under the new defaults
#   (or calls 1-2 as `stash` and `stash1b`, and then, carry .gpu_carry/part2 on the first,
#    EXP=experiments/ruler_smollm2_8k_gpu.json LIMIT=540 bash benchmarks/gpu/defaults_gpu_runs.sh ruler
#    until every cell is in: SmolLM2's RULER at 8K for issue 47)
#   call 3 (carry .gpu_carry/part2): bash benchmarks/gpu/defaults_gpu_runs.sh accuracy
#     ruler_defaults      experiments/defaults_gpu.json: RULER niah_single_1 at 8K on SmolLM2, 50 prompts,
#                         dense beside the defaults as written
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-defaults_runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/gpu/run_logged.sh
source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...

G=SmolLM2-135M-Instruct.Q4_1.gguf
STASH=/tmp/gpu_carry/part1
case ${1:-} in
    split)  # HERE, after smollm2_gpu.sh prepare: part1 = wheels + 40 MB, part1b = 40 MB, part2 = the rest
        c=.gpu_carry
        [[ -f $c/part1/$G.1 && -f $c/part2/$G.2 ]] || { echo "run smollm2_gpu.sh prepare first" >&2; exit 1; }
        mkdir -p "$c/part1b" && cat "$c/part1/$G.1" "$c/part2/$G.2" >"$c/full.gguf" && rm "$c/part1/$G.1" "$c/part2/$G.2"
        # PART bytes a part: part1 also carries the wheels (~3.3 MB) and every call the working
        # tree (~21 MB at stop 54), all under a call's 64 MiB
        part=${PART:-40000000}
        head -c "$part" "$c/full.gguf" >"$c/part1/$G.1a"
        tail -c +$((part + 1)) "$c/full.gguf" | head -c "$part" >"$c/part1b/$G.1b"
        tail -c +$((2 * part + 1)) "$c/full.gguf" >"$c/part2/$G.2" && rm "$c/full.gguf"
        du -sb "$c"/part1 "$c"/part1b "$c"/part2
        exit 0
        ;;
    speed)
        mkdir -p $STASH && cp -r .gpu_carry/part1/. $STASH/
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            $STASH/whl/*.whl
        export PYTHONPATH=/tmp/site
        python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
        python3 -c 'import torch; print(torch.cuda.get_device_name(), torch.__version__)'
        run defaults_gpu 330 python3 benchmarks/defaults_gpu.py --out "$OUT/defaults_h200.json"
        run decode_layer_short 150 python3 benchmarks/decode_layer.py --contexts 1024,2048,4096,8192,16384,32768 \
            --batches 1,2,4,8,16,32 --algorithms quest --shapes mha --backends triton \
            --json "$OUT/decode_layer_short_h200.json"
        ;;
    gpu-tests)
        cat .gpu_carry/part1b/$G.1b >>$STASH/$G.1a && mv $STASH/$G.1a $STASH/$G.1
        export PYTHONPATH=/tmp/site
        run gpu_tests 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_decode_slots.py \
            tests/test_kernels_residency.py tests/test_engine_prefetch.py tests/test_gpu.py
        tail -n 15 "$OUT/gpu_tests.log"
        ;;
    accuracy)
        [[ -f $STASH/$G.1 ]] || { echo "call 2 (gpu-tests) joins part 1b first" >&2; exit 1; }
        bash benchmarks/gpu/smollm2_gpu.sh join && eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"
        run ruler_defaults 300 sparse-framework eval experiments/defaults_gpu.json --out "$OUT/defaults_gpu.jsonl" \
            --no-progress
        tail -n 30 "$OUT/ruler_defaults.log"
        ;;
    stash)  # THERE, call 1 (carry .gpu_carry/part1) when the speed runs are not wanted
        mkdir -p $STASH && cp -r .gpu_carry/part1/. $STASH/ && echo "part 1 in $STASH"
        ;;
    stash1b)  # THERE, call 2 (carry .gpu_carry/part1b): part 1b after part 1, without the tests
        cat .gpu_carry/part1b/$G.1b >>$STASH/$G.1a && mv $STASH/$G.1a $STASH/$G.1 && echo "parts 1 and 1b joined"
        ;;
    ruler)  # THERE, call 3 on (carry .gpu_carry/part2 on the first): EXP=experiments/<x>.json, LIMIT s
        # a call; resumable: the cells live in /tmp/<x>/results.jsonl on the warm machine
        [[ -f $STASH/$G.1 ]] || { echo "stash and stash1b (or gpu-tests) first" >&2; exit 1; }
        bash benchmarks/gpu/smollm2_gpu.sh join && eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"
        exp=${EXP:?EXP=experiments/<name>.json}
        keep=/tmp/$(basename "$exp" .json) && mkdir -p "$keep"
        run ruler ${LIMIT:-540} sparse-framework eval "$exp" --device cuda --out "$keep/results.jsonl" --no-progress
        tail -n 12 "$OUT/ruler.log" && cp "$keep/results.jsonl" "$OUT/$(basename "$exp" .json).jsonl"
        ;;
    *) echo "usage: defaults_gpu_runs.sh split|speed|stash|stash1b|gpu-tests|accuracy|ruler" >&2; exit 2 ;;
esac
