#!/usr/bin/env bash
# Issue 43's H200 runs in two device calls on one warm machine (benchmarks/README_gpu_model.md
# carries SmolLM2 the same way). Every run has its own time limit and log in $OUT.
#
#   HERE:  bash benchmarks/smollm2_gpu.sh prepare --context 8192 --samples 50 --tasks niah_single_1
#   call 1 (carry .gpu_carry/part1): bash benchmarks/defaults_gpu_runs.sh speed
#     defaults_gpu        benchmarks/defaults_gpu.py: dense, {"algorithm": "quest"}, the tuned resident
#                         Quest; 16K x 8 and batch 1 at 1K, 4K, 8K, from outside (whole generate calls)
#     decode_layer_short  one Llama-3-8B layer's sparse decode beside dense, 1K-32K x batch 1-32:
#                         the cost policy's constants for this GPU (benchmarks/sparse_policy_fit.py --gpu)
#   call 2 (carry .gpu_carry/part2): bash benchmarks/defaults_gpu_runs.sh accuracy
#     ruler_defaults      experiments/defaults_gpu.json: RULER niah_single_1 at 8K on SmolLM2, 50 prompts,
#                         dense beside the defaults as written
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-defaults_runs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/run_logged.sh
source benchmarks/run_logged.sh  # run NAME LIMIT_S COMMAND...

case ${1:-} in
    speed)
        bash benchmarks/smollm2_gpu.sh stash
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            /tmp/gpu_carry/part1/whl/*.whl
        export PYTHONPATH=/tmp/site
        python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
        python3 -c 'import torch; print(torch.cuda.get_device_name(), torch.__version__)'
        run defaults_gpu 330 python3 benchmarks/defaults_gpu.py --out "$OUT/defaults_h200.json"
        run decode_layer_short 150 python3 benchmarks/decode_layer.py --contexts 1024,2048,4096,8192,16384,32768 \
            --batches 1,2,4,8,16,32 --algorithms quest --shapes mha --backends triton \
            --json "$OUT/decode_layer_short_h200.json"
        ;;
    accuracy)
        bash benchmarks/smollm2_gpu.sh join && eval "$(bash benchmarks/smollm2_gpu.sh env)"
        run ruler_defaults 300 sparse-framework eval experiments/defaults_gpu.json --out "$OUT/defaults_gpu.jsonl" \
            --no-progress
        tail -n 30 "$OUT/ruler_defaults.log"
        ;;
    *) echo "usage: defaults_gpu_runs.sh speed|accuracy" >&2; exit 2 ;;
esac
