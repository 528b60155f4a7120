#!/usr/bin/env bash
# Issue 45's side-by-side table on the lent H200: vLLM 0.26 dense and with the plugin, and this
# project's engine (dense, the defaults, resident and hierarchical Quest), timed the same way in
# one machine session (benchmarks/side_by_side.py says how). Calls back to back on one warm
# machine: /tmp is kept only while it stays warm.
#
#   HERE:   PART_MIB=40 bash benchmarks/gpu/vllm_gpu_bundle.sh     # vLLM's bundle in 3 parts
#           bash benchmarks/gpu/side_by_side_runs.sh pack           # HEAD's code as one tar.xz
#   call 1 (carry .gpu_carry/vllm/p1, .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh stash 1
#   call 2 (carry .gpu_carry/vllm/p2, .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh stash 2
#   call 3 (carry .gpu_carry/vllm/p3, .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh vllm
#           joins vLLM, runs the CUDA tests, then the vLLM group (dense, plugin)
#   call 4 (carry .gpu_carry/tree): bash benchmarks/gpu/side_by_side_runs.sh engine [PATHS]
#           the engine group (default: dense, defaults, resident; hierarchical in a call of its own)
#   HERE:   python benchmarks/side_by_side.py --merge OUT/vllm.json OUT/engine*.json --out benchmarks/results/side_by_side_h200.json
#
# Why the tree travels as a tarball: the device machine copies the working tree as it is, and
# other work in progress there must not change what is measured; pack takes HEAD (its commit goes
# into every result through $SF_COMMIT).
set -uo pipefail
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
OUT=${OUT:-$HERE/side_by_side_runs}
TREE=/tmp/sbs_tree
SITE=/tmp/sf_site
export PYTHONUNBUFFERED=1

# shellcheck source=benchmarks/gpu/packed_tree.sh
source "$HERE/benchmarks/gpu/packed_tree.sh"
unpack() {  # the packed tree into $TREE (this project is installed into $SITE by `install`)
    unpack_tree "$HERE" $TREE $SITE
}

install() {  # after vLLM's site is joined (it brings pydantic, which this project needs)
    eval "$(bash $TREE/benchmarks/gpu/vllm_gpu_install.sh env)"
    if [[ ! -d $SITE ]]; then
        python3 -m pip install -q --no-deps --no-build-isolation --target $SITE $TREE >/dev/null 2>&1 ||
            python3 -m pip install -q --no-deps --no-build-isolation --target $SITE $TREE
    fi
    export PYTHONPATH=$SITE:$PYTHONPATH
    python3 -c 'import torch, sparse_framework, vllm; print(torch.cuda.get_device_name(), torch.__version__, "vllm", vllm.__version__)'
}

case ${1:-} in
    pack)  # HERE
        mkdir -p .gpu_carry/tree
        git -C "$HERE" archive HEAD sparse_framework benchmarks/gpu tests pyproject.toml README.md experiments \
            $(git -C "$HERE" ls-files 'benchmarks/*.py') | xz -9 >"$HERE/.gpu_carry/tree/tree.tar.xz"
        git -C "$HERE" rev-parse --short HEAD >"$HERE/.gpu_carry/tree/COMMIT"
        du -b "$HERE"/.gpu_carry/tree/* ;;
    stash)
        unpack
        bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" stash "$2" ;;
    vllm)
        unpack
        mkdir -p "$OUT"
        bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" stash 3 && bash "$HERE/benchmarks/gpu/vllm_gpu_install.sh" join | tail -5
        install
        cd $TREE || exit 1
        # shellcheck source=benchmarks/gpu/run_logged.sh
        source benchmarks/gpu/run_logged.sh  # run NAME LIMIT_S COMMAND...
        run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_kernels_decode_slots.py \
            tests/test_kernels_residency.py tests/test_engine_prefetch.py tests/test_gpu.py tests/test_plugin_matrix.py \
            tests/test_engine_prefill_attention.py
        tail -n 4 "$OUT/gpu_tests.log"
        run side_by_side_vllm 400 python3 benchmarks/side_by_side.py --group vllm --timeout 190 --log-dir /tmp/sbs_logs --out "$OUT/vllm.json"
        tail -n 8 "$OUT/side_by_side_vllm.log" ;;
    engine)
        unpack
        install
        mkdir -p "$OUT"
        cd $TREE || exit 1
        source benchmarks/gpu/run_logged.sh
        paths=${2:-engine-dense,engine-defaults,engine-resident}
        run "side_by_side_${paths//,/_}" 560 python3 benchmarks/side_by_side.py --paths "$paths" --timeout 270 \
            --log-dir /tmp/sbs_logs --out "$OUT/engine_${paths//,/_}.json"
        tail -n 10 "$OUT/side_by_side_${paths//,/_}.log" ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac
