#!/usr/bin/env bash
# Issue 46's serving curve on the lent H200: output tok/s against concurrency, this project's
# server (engine-dense, engine-defaults, engine-resident) and vLLM 0.26's OpenAI server (dense,
# and with this project's plugin), all driven by the same `sparse-framework bench-serve
# --max-concurrency ...` over the same prompts: 32K-token prompts (token ids), long outputs
# (ignore_eos), Llama-3-8B shape with random (engine) or dummy (vLLM) bf16 weights. One JSON
# report per server and config in $OUT (NAME.json), with the server's log, bench-serve's output
# and its /metrics at the end beside it (NAME.server.log, .bench.log, .metrics.txt; and
# vllm-plugin.plugin_counters.txt, the plugin's counters). Plotting happens HERE afterwards.
#
#   HERE:   PART_MIB=40 bash benchmarks/gpu/vllm_gpu_bundle.sh    # vLLM's bundle in 3 parts (once)
#           bash benchmarks/gpu/serve_curve_runs.sh pack          # HEAD as .gpu_carry/tree + the server wheels
#   call 1 (carry .gpu_carry/tree, .gpu_carry/serve_stack): bash benchmarks/gpu/serve_curve_runs.sh engine [PATHS]
#   call 2 (carry .gpu_carry/vllm/p1, .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh stash 1
#   call 3 (carry .gpu_carry/vllm/p2, .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh stash 2
#   call 4 (carry .gpu_carry/vllm/p3, .gpu_carry/tree, .gpu_carry/serve_stack):
#           bash benchmarks/gpu/serve_curve_runs.sh vllm [PATHS]
#   HERE:   python benchmarks/plot_serving_curve.py OUT/*.json --png docs/serving_curve/h200.png \
#               --md docs/serving_curve/h200.md --json benchmarks/results/serving_curve_h200.json
#   dry run of the engine half on any machine (CPU, the `tiny` shape, no packing):
#           OUT=/tmp/curve bash benchmarks/gpu/serve_curve_runs.sh tiny
#
# PATHS: comma list, default engine-dense,engine-defaults,engine-resident (engine) and
# vllm-dense,vllm-plugin (vllm): benchmarks/side_by_side.py's path names. The engine configs are
# defaults_gpu.py's (through side_by_side.ENGINE_PATHS); vllm-plugin is vllm_gpu.py perf's
# `quest` (vllm_gpu.QUEST with top_k 2048, sink 16, recent 64: perf() builds it inline, so those
# three numbers are repeated below). Calls 2-4 are needed only on a machine where vLLM's bundle is
# not joined yet (a warm machine keeps /tmp/vllm_site; `join` is idempotent).
#
# Why the GPU image needs the wheels in .gpu_carry/serve_stack (3.8 MB): it has no pydantic,
# starlette or uvicorn (this project and its server need them), and vLLM's bundle trims the
# OpenAI server's own stack (uvicorn, watchfiles, model-hosting-container-standards and its
# jmespath/supervisor, prometheus-fastapi-instrumentator): vllm_gpu_bundle.sh says why.
#
# Knobs (environment): INPUT_LEN (32768), OUTPUT_LEN (1024), CONCURRENCY ("auto": 1, 4, 16 below
# M, the requests the server runs at once, then the first multiple of 8 above M; M read from the
# server's log: the engine's memory plan (its memory-bound maximum, or MAX_NUM_SEQS, 64, if
# lower), vLLM's "Maximum concurrency" line; or a list, e.g. "1 2 4 8 16 32"),
# PROMPTS_PER_CONCURRENCY (1), MIN_PROMPTS (1), BUDGET_S (560: the call's seconds; a config that
# cannot start in what is left is skipped, and bench-serve is stopped before the call's end: its
# JSON keeps every point finished, being rewritten after each).
#
# The arithmetic (H200; docs/side_by_side.md, 32K x 8: prefill 1.2 s per prompt for vLLM, 1.34
# for the engine; decode step 12.94 ms vLLM dense, 11.01 the plugin, 16.42 engine dense, 8.3-8.4
# Quest resident, of which ~3.7 ms is reading the 16 GB of weights and ~1.0 ms per dense 33K
# request, ~0.2 ms per Quest one). At concurrency N with N prompts (K = 1) a point takes about
# N x prefill + OUTPUT_LEN x step(min(N, M)) x N / min(N, M); M ~ 21-24 at 33K tokens a request
# (0.9 x 141 GB - 16 GB weights - activations, ~4.4 GB of KV per request). With OUTPUT_LEN 1024
# and N = 1, 4, 16, 24 (or 32 past an M of 24):
#   engine-dense     8 + 16 + 50 + 71 s ~ 145 s     vllm-dense    7 + 14 + 41 + 80 s ~ 142 s
#   engine-defaults  8 + 13 + 32 + 46 s ~ 100 s     vllm-plugin  10 + 15 + 35 + 64 s ~ 124 s
#   engine-resident  the same                ~ 100 s
# plus start-up (engine: ~25 s dense, ~50 s Quest with CUDA graphs, as on the H100; vLLM: ~60 s,
# import and torch.compile) and ~30 s of unpacking/installing: engine call ~345 + 155 ~ 500 s,
# vllm call ~265 + 150 (+ ~60 s join where the bundle is new) ~ 415-475 s: each under ~8.5 min.
# OUTPUT_LEN 2048 (HiSparse's short end) would take ~1.5x the bench time: the engine group then
# needs two calls (PATHS engine-dense, then engine-defaults,engine-resident). Even at 2K, 32K
# prompts make prefill a third to a half of a point's time at N >= 16 (N x 1.3 s against 2K
# steps of 12-36 ms): the curve is what a user of 32K prompts gets, decode and prefill together.
set -uo pipefail
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
OUT=${OUT:-$HERE/serve_curve_runs}
TREE=/tmp/sbs_tree          # side_by_side_runs.sh's: one unpacked tree and one install serve both
SITE=/tmp/sf_site
STACK=/tmp/serve_stack_site
MODEL_DIR=/tmp/llama3_8b_dummy
# rows asked of both servers: above every 8B maximum at 32K (~21-24), so memory bounds them, as
# serve_gpu_sweep.sh's 64 (the engine sizes its captured graphs for it)
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
PORT=${PORT:-8123}
INPUT_LEN=${INPUT_LEN:-32768}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
CONCURRENCY=${CONCURRENCY:-auto}
PROMPTS_PER_CONCURRENCY=${PROMPTS_PER_CONCURRENCY:-1}
MIN_PROMPTS=${MIN_PROMPTS:-1}
BUDGET_S=${BUDGET_S:-560}
ENGINE_FLAGS=${ENGINE_FLAGS:---device cuda --cuda-graphs --gpu-memory-utilization 0.9}
VLLM_FLAGS=${VLLM_FLAGS:---dtype bfloat16 --gpu-memory-utilization 0.9 --max-num-batched-tokens 16384}
VLLM_PY=${VLLM_PY:-python3}
SERVED=llama-3-8b           # the served name, also bench-serve's tokenizer (ids over the shape's vocabulary)
# what the GPU image lacks for the two servers (pins: vLLM 0.26's bundle where it has them)
STACK_WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
              typing-extensions==4.16.0 starlette==1.10.0 uvicorn==0.54.0 watchfiles==1.3.0
              model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
              prometheus-fastapi-instrumentator==8.1.0)
export PYTHONUNBUFFERED=1
START=$SECONDS

left() { echo $((BUDGET_S - (SECONDS - START))); }

fetch() {  # fetch URL: its body on stdout, non-zero unless 200 (no curl needed)
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

# shellcheck source=benchmarks/gpu/packed_tree.sh
source "$HERE/benchmarks/gpu/packed_tree.sh"
unpack() {  # the packed tree into $TREE (as side_by_side_runs.sh does), this project into $SITE
    unpack_tree "$HERE" $TREE $SITE
    if [[ ! -f $STACK/.done ]]; then
        ls "$HERE"/.gpu_carry/serve_stack/*.whl >/dev/null 2>&1 || { echo "no .gpu_carry/serve_stack: carry it"; exit 1; }
        rm -rf $STACK
        python3 -m pip install -q --no-index --no-deps --target $STACK "$HERE"/.gpu_carry/serve_stack/*.whl && touch $STACK/.done
    fi
    export PYTHONPATH=$STACK${PYTHONPATH:+:$PYTHONPATH}
    if [[ ! -d $SITE ]]; then  # (its dist-info registers the vLLM plugin's entry point for vLLM's workers)
        python3 -m pip install -q --no-deps --no-build-isolation --target $SITE $TREE >/dev/null 2>&1 ||
            python3 -m pip install -q --no-deps --no-build-isolation --target $SITE $TREE
    fi
    export PYTHONPATH=$SITE:$PYTHONPATH
    cd $TREE || exit 1
    python3 -c 'import torch, sparse_framework, pydantic, starlette, uvicorn, httpx
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA", torch.__version__, "commit", "'"$commit"'")'
}

wait_ready() {  # wait_ready NAME PID LOG LIMIT_S: 0 once /health is 200
    local name=$1 pid=$2 log=$3 limit=$4 t0=$SECONDS
    while ((SECONDS - t0 < limit)); do
        if fetch "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
            echo "$name: ready in $((SECONDS - t0)) s"; return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    echo "$name: not ready after $((SECONDS - t0)) s"; tail -n 25 "$log" | sed 's/^/    /'
    return 1
}

stop_server() {  # stop_server PID: SIGTERM to its process group (vLLM's engine core too), then KILL
    local pid=$1
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

concurrencies() {  # concurrencies M: the list to sweep (CONCURRENCY, or auto from the maximum M)
    if [[ $CONCURRENCY != auto ]]; then echo "$CONCURRENCY"; return; fi
    local m=$1 out="" c
    if [[ -z $m ]]; then echo "1 4 16 32"; return; fi  # (no maximum found: the 8B guess)
    for c in 1 4 16 64 256; do ((c < m)) && out="$out $c"; done
    echo "$out $(((m / 8 + 1) * 8))"
}

bench() {  # bench NAME MEMORY_MAX MAX_RUNNING CONFIG_TEXT: the sweep against the server on $PORT
    local name=$1 top=$2 running=$3 config=$4 list limit
    list=$(concurrencies "$running")
    limit=$(($(left) - 25))
    echo "$name: memory-bound maximum ${top:-unknown}, runs ${running:-?} at once; concurrency $list; ${limit} s left for it"
    # shellcheck disable=SC2086  # the list is several words
    timeout "$limit" python3 -m sparse_framework.cli.main bench-serve --base-url "http://127.0.0.1:$PORT" \
        --max-concurrency $list --prompts-per-concurrency "$PROMPTS_PER_CONCURRENCY" --min-prompts "$MIN_PROMPTS" \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --prompt-format ids --tokenizer "$SERVED" \
        --timeout 900 --label "$name" --meta "memory_max=$top" --meta "max_running=$running" --meta "config=$config" --meta "device=$(gpu)" \
        --no-progress --out "$OUT/$name.json" </dev/null >"$OUT/$name.bench.log" 2>&1
    echo "$name: bench-serve rc=$? ($((SECONDS - START)) s into the call)"
    grep -v '^\s*$' "$OUT/$name.bench.log" | tail -n 14
}

gpu() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo unknown; }

engine_one() {  # engine_one NAME CONFIG_JSON MODEL_ARGS...: serve, sweep, stop
    local name=$1 config=$2
    shift 2
    local log="$OUT/$name.server.log" top running pid
    if (($(left) < 150)); then echo "$name: skipped, $(left) s left"; return; fi
    # the engine's own INFO lines (its memory plan, the warm-up) into the log: the plan's maximum
    # shellcheck disable=SC2086  # ENGINE_FLAGS are several words
    setsid python3 -c 'import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("sparse_framework.engine").setLevel(logging.INFO)
from sparse_framework.cli.main import main
sys.exit(main(sys.argv[1:]))' serve "$@" $ENGINE_FLAGS --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens 16384 \
        --max-model-len $((INPUT_LEN + OUTPUT_LEN)) --max-waiting 4096 --drain-timeout 5 --config "$config" \
        --port "$PORT" --log-level warning </dev/null >"$log" 2>&1 &
    pid=$!
    if wait_ready "$name" "$pid" "$log" 240; then
        # "requests: memory-bound maximum M (device), max_num_seqs 64: R rows (...)": R run at once
        top=$(sed -n 's/.*requests: memory-bound maximum \([0-9]*\).*/\1/p' "$log" | head -n 1)
        running=$(sed -n 's/.*requests: memory-bound maximum .*: \([0-9]*\) rows.*/\1/p' "$log" | head -n 1)
        grep -A 10 "memory plan:" "$log" | head -n 10 | sed 's/^/    /'
        bench "$name" "$top" "$running" "$config"
        fetch "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.txt" 2>/dev/null
    fi
    stop_server "$pid"
    echo "$name: server stopped ($((SECONDS - START)) s into the call)"
}

engine_configs() {  # engine_configs PATHS: "name<TAB>config json" lines, defaults_gpu.py's configs
    python3 - "$1" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from side_by_side import ENGINE_PATHS
from defaults_gpu import CONFIGS
for name in sys.argv[1].split(","):
    if name not in ENGINE_PATHS:
        sys.exit(f"unknown engine path {name!r}; allowed: {', '.join(ENGINE_PATHS)}")
    print(f"{name}\t{json.dumps(CONFIGS[ENGINE_PATHS[name]])}")
PY
}

vllm_one() {  # vllm_one NAME PLUGIN_CONFIG_JSON_OR_EMPTY: vLLM's OpenAI server, sweep, stop
    local name=$1 sparse=$2 log="$OUT/$1.server.log" top running pid extra=() envs=()
    if (($(left) < 150)); then echo "$name: skipped, $(left) s left"; return; fi
    if [[ -n $sparse ]]; then  # the plugin: on with the variable; its counters over /collective_rpc
        envs=(SPARSE_FRAMEWORK_VLLM_CONFIG="$sparse" VLLM_SERVER_DEV_MODE=1)
        extra=(--worker-extension-cls sparse_framework.integrations.vllm.WorkerReport)
    fi
    # prefix caching off: every point sends the same prompts, which a prefix cache would serve
    # from the previous point (the engine caches no prefix by default either)
    # shellcheck disable=SC2086  # VLLM_FLAGS are several words
    env -u SPARSE_FRAMEWORK_VLLM_CONFIG -u VLLM_SERVER_DEV_MODE "${envs[@]}" setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
        --model $MODEL_DIR --served-model-name "$SERVED" --load-format dummy --skip-tokenizer-init \
        --max-model-len $((INPUT_LEN + OUTPUT_LEN)) --max-num-seqs "$MAX_NUM_SEQS" --no-enable-prefix-caching --seed 0 \
        --host 127.0.0.1 --port "$PORT" $VLLM_FLAGS "${extra[@]}" </dev/null >"$log" 2>&1 &
    pid=$!
    if wait_ready "$name" "$pid" "$log" 300; then
        # "Maximum concurrency for 33,808 tokens per request: 24.13x": the KV cache's bound
        top=$(sed -n 's/.*Maximum concurrency for [0-9,]* tokens per request: \([0-9]*\).*/\1/p' "$log" | head -n 1)
        running=$top
        [[ -n $top ]] && ((top > MAX_NUM_SEQS)) && running=$MAX_NUM_SEQS
        grep -E "Maximum concurrency|KV cache size|Using .*backend|sparse_framework:|Graph capturing finished" "$log" |
            head -n 8 | cut -c 1-220 | sed 's/^/    /'
        bench "$name" "$top" "$running" "${sparse:-vLLM dense}"
        fetch "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.txt" 2>/dev/null
        if [[ -n $sparse ]]; then
            python3 -c 'import json, sys, urllib.request
r = urllib.request.Request(sys.argv[1], data=json.dumps({"method": "sparse_framework_report"}).encode(),
                           headers={"Content-Type": "application/json"})
body = urllib.request.urlopen(r, timeout=30).read().decode()
open(sys.argv[2], "w").write(body)
print("    plugin counters:", body[:400])
stats = [r.get("stats", {}) for r in json.loads(body).get("results", [])]
if not sum(s.get("sparse_rows", 0) for s in stats):
    print("    WARNING: the plugin decoded no row sparsely (forward_calls %d): not what vllm-plugin means"
          % sum(s.get("forward_calls", 0) for s in stats))' "http://127.0.0.1:$PORT/collective_rpc" "$OUT/$name.plugin_counters.txt" ||
                echo "    (the plugin's counters could not be read)"
        fi
    fi
    stop_server "$pid"
    echo "$name: server stopped ($((SECONDS - START)) s into the call)"
}

case ${1:-} in
    pack)  # HERE: HEAD as .gpu_carry/tree (side_by_side_runs.sh pack) and the wheels
        bash "$HERE/benchmarks/gpu/side_by_side_runs.sh" pack || exit 1
        rm -rf "$HERE/.gpu_carry/serve_stack" && mkdir -p "$HERE/.gpu_carry/serve_stack"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
            -d "$HERE/.gpu_carry/serve_stack" "${STACK_WHEELS[@]}" || exit 1
        du -sh "$HERE/.gpu_carry/serve_stack" ;;
    engine)
        mkdir -p "$OUT"
        unpack
        # where vLLM's bundle was joined on this machine (the vllm group ran first), the engine
        # takes vLLM's FlashAttention 3 for its prefill chunks, as in side_by_side.py; else SDPA
        # serves a prompt's later chunks (2x slower: stop 50's curve ran so, its TTFT 2.2x vLLM's)
        if [[ -d /tmp/vllm_site ]]; then
            eval "$(bash "$TREE/benchmarks/gpu/vllm_gpu_install.sh" env)"
            echo "engine: vLLM's site joined (/tmp/vllm_site): FlashAttention 3 for prefill"
        fi
        mapfile -t lines < <(engine_configs "${2:-engine-dense,engine-defaults,engine-resident}")
        ((${#lines[@]})) || exit 1
        for line in "${lines[@]}"; do
            engine_one "${line%%$'\t'*}" "${line#*$'\t'}" --random llama-3-8b
        done ;;
    vllm)
        mkdir -p "$OUT"
        unpack
        # part 3 (calls 2 and 3 stashed parts 1 and 2); on a machine that joined the bundle
        # before, no part is carried and join says it has nothing to do
        bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" stash 3 2>&1 | tail -n 1
        bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" join 2>&1 | tail -n 3
        eval "$(bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" env)"
        export PYTHONPATH=$SITE:$STACK:$PYTHONPATH  # this project and the server stack before vLLM's site
        python3 -c 'import vllm; print("vllm", vllm.__version__)' || exit 1
        python3 -c 'import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
from vllm_gpu import write_8b_config
print("model dir", write_8b_config(Path(sys.argv[1])))' "$MODEL_DIR" || exit 1
        quest=$(python3 -c 'import json, sys; sys.path.insert(0, "benchmarks")
from vllm_gpu import QUEST
print(json.dumps({**QUEST, "top_k": 2048, "sink_tokens": 16, "recent_tokens": 64}))')
        for name in $(echo "${2:-vllm-dense,vllm-plugin}" | tr , ' '); do
            case $name in
                vllm-dense) vllm_one vllm-dense "" ;;
                vllm-plugin) vllm_one vllm-plugin "$quest" ;;
                *) echo "unknown vLLM path $name; allowed: vllm-dense, vllm-plugin" ;;
            esac
        done ;;
    tiny)  # a dry run of the engine half in this checkout (any device): `tiny`, torch_ref, CPU
        mkdir -p "$OUT"
        ENGINE_FLAGS=${TINY_ENGINE_FLAGS:---device cpu} INPUT_LEN=${TINY_INPUT_LEN:-200} OUTPUT_LEN=${TINY_OUTPUT_LEN:-8}
        CONCURRENCY=${TINY_CONCURRENCY:-1 2 4} PROMPTS_PER_CONCURRENCY=2 MIN_PROMPTS=2 SERVED=tiny
        engine_one tiny-dense '{"algorithm": "quest", "store": "resident", "min_sparse_prompt_len": 1000000000}' --random tiny
        engine_one tiny-quest '{"algorithm": "quest", "top_k": 64, "page_size": 16, "device_buffer_tokens": 192, "min_sparse_prompt_len": 0}' --random tiny ;;
    vllm-tiny)  # a dry run of the vLLM half on the CPU: vLLM from $VLLM_PY, a tiny Llama, dummy weights
        mkdir -p "$OUT"
        VLLM_PY=${VLLM_PY/#python3//work/vllm-venv/bin/python} INPUT_LEN=200 OUTPUT_LEN=8 SERVED=tiny MODEL_DIR=/tmp/tiny_llama_dummy
        VLLM_FLAGS="--dtype float32 --enforce-eager --block-size 32 --kv-cache-memory-bytes 268435456"
        CONCURRENCY=${TINY_CONCURRENCY:-auto} PROMPTS_PER_CONCURRENCY=1 MIN_PROMPTS=2
        python3 -c 'import json, sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
from vllm_gpu import LLAMA_8B
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
shape = {**RANDOM_MODELS["tiny"], "hidden_size": 128, "head_dim": 32}  # (vLLM CPU attention: head_dim >= 32)
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / "config.json").write_text(json.dumps({**shape, **LLAMA_8B, "torch_dtype": "float32"}))' "$MODEL_DIR" || exit 1
        vllm_one vllm-tiny-dense ""
        # (both of tiny's layers would be dense under Quest's default dense_first_layers 2)
        vllm_one vllm-tiny-plugin '{"algorithm": "quest", "top_k": 64, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}' ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac
