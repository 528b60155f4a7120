#!/usr/bin/env bash
# RULER at 8K, 16K and 32K on Gemma 3 270M on the H200 (issue 47): experiments/ruler_32k_gpu.json
# on one GPU, resumable across device calls. The results live in $KEEP on the warm machine (a
# warm machine keeps /tmp between calls) and are copied to $OUT at the end of every call; copy
# that file over benchmarks/results/ruler_32k_gpu.jsonl here and render the page with
# `sparse-framework eval experiments/ruler_32k_gpu.json --out benchmarks/results/ruler_32k_gpu.jsonl
#  --plots docs/ruler_32k --markdown docs/ruler_32k.md --report-only`.
#
# Before the first call: the model, by gemma3_gpu.sh (split HERE; stash 1..N and convert THERE),
# and the prompts, drawn HERE with lm-eval (the GPU machine has none) into the project cache and
# packed:  tar -C ~/.cache/sparse-framework -cJf .gpu_carry/gemma3_ruler/ruler.tar.xz ruler/<tokenizer>
#
#   run(command="LIMIT=540 bash benchmarks/gpu/ruler_32k_runs.sh",
#       carry=[".gpu_carry/gemma3_ruler", ".gpu_carry/whl"])       # again until every cell is in
#
# EXP=experiments/ruler_gemma3_options_gpu.json: the options that answer the gaps of the first
# (Quest page_size 4/8, PQCache bits 8 at 1/8; the defaults beside the same config with
# sparse_policy "always", every answer kept): results in benchmarks/results/<EXP name>.jsonl.
#
# FIRST=1: only the experiment's first algorithm at its first budget, beside dense, for every
# task and context (the same cells, so a later full run skips them): what the model can do
# before the 10 algorithm cells of each task and context.
set -uo pipefail
cd "$(dirname "$0")/../.."
LIMIT=${LIMIT:-540}
EXP=${EXP:-experiments/ruler_32k_gpu.json}
RESULTS=${RESULTS:-benchmarks/results/$(basename "$EXP" .json).jsonl}  # committed cells: the start
KEEP=${KEEP:-/tmp/$(basename "$EXP" .json)}
OUT=${OUT:-$KEEP/out}
eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"
SITE=${PYTHONPATH%%:*}
mkdir -p "$KEEP" "$OUT" "$SPARSE_FRAMEWORK_CACHE"
[[ -f $SPARSE_FRAMEWORK_CACHE/models/gemma3-270m/config.json ]] \
    || { echo "gemma3-270m is not converted here: run gemma3_gpu.sh stash/convert first" >&2; exit 2; }
[[ -f $KEEP/results.jsonl ]] || { [[ -f $RESULTS ]] && cp "$RESULTS" "$KEEP/results.jsonl"; } || touch "$KEEP/results.jsonl"
tar -xJf .gpu_carry/gemma3_ruler/ruler.tar.xz -C "$SPARSE_FRAMEWORK_CACHE"
# the prompts are cached under a hash of the tokenizer files, and this machine's transformers
# writes them differently: the carried prompts (the same text) go under this machine's hash too
carried=$(tar -tJf .gpu_carry/gemma3_ruler/ruler.tar.xz | awk -F/ 'NF > 2 {print $2; exit}')
here=$(python3 -c "from sparse_framework.engine.models.catalog import resolve_model
from sparse_framework.eval.ruler import tokenizer_fingerprint
print(tokenizer_fingerprint(resolve_model('gemma3-270m')))" 2>/dev/null | tail -n 1)
if [[ -n $carried && -n $here && $carried != "$here" ]]; then
    mkdir -p "$SPARSE_FRAMEWORK_CACHE/ruler/$here"
    cp --update=none "$SPARSE_FRAMEWORK_CACHE/ruler/$carried"/* "$SPARSE_FRAMEWORK_CACHE/ruler/$here/"
fi
if [[ ! -x $SITE/bin/sparse-framework || $(cat "$KEEP/commit" 2>/dev/null) != "${SF_COMMIT:-tree}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade .gpu_carry/whl/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" --upgrade .
    echo "${SF_COMMIT:-tree}" >"$KEEP/commit"
fi
before=$(wc -l <"$KEEP/results.jsonl")
start=$SECONDS
if [[ -n ${FIRST:-} ]]; then
    python3 -c "import json, sys; e = json.load(open(sys.argv[1])); e['algorithms'] = e['algorithms'][:1]; e['budgets'] = e['budgets'][:1]; json.dump(e, open(sys.argv[2], 'w'))" \
        "$EXP" "$KEEP/first.json"
    EXP=$KEEP/first.json
fi
# the experiment's order: task by task, each at every context (the likeliest tasks first), so a
# call cut by its limit leaves whole tasks from 8K to 32K
timeout "$LIMIT" "$SITE/bin/sparse-framework" eval "$EXP" --device cuda --out "$KEEP/results.jsonl" --no-progress \
    >>"$KEEP/eval.log" 2>&1
echo "eval: rc=$? in $((SECONDS - start)) s; cells $before -> $(wc -l <"$KEEP/results.jsonl")"
tail -n 5 "$KEEP/eval.log"
cp "$KEEP/results.jsonl" "$OUT/$(basename "$RESULTS")" && cp "$KEEP/eval.log" "$OUT/"
