#!/usr/bin/env bash
# Build deepseek-ai/FlashMLA for the H100 machine (sm_90a, nvcc 13, torch 2.11) from source
# carried there as files (the machine has no internet). What this does, and why:
#   - sources: FlashMLA at 9241ae3 ("Swap FlashMLA combine grid dimensions (#182)") and its
#     CUTLASS submodule at 147f567, only include/ and tools/util/include/ (all the build reads),
#     packed as one ~3 MB tarball (`pack` below, run where the repositories are);
#   - CUDA 13 moved libcu++ (cuda/std/...) under include/cccl: CUTLASS's `#include
#     <cuda/std/utility>` fails without it on the include path (the first build stopped there:
#     benchmarks/results/flashmla_build_h100.log is the successful second one);
#   - FLASH_MLA_DISABLE_SM100=1: Hopper only (the sm100 files then compile to empty stubs).
# Build time on the machine's 16 cores: 159 s.
#
#   bash benchmarks/gpu/build_flashmla.sh pack FLASHMLA_REPO CUTLASS_REPO OUT.tgz   # here
#   bash benchmarks/gpu/build_flashmla.sh build OUT.tgz BUILD_DIR                   # on the GPU machine
#   PYTHONPATH=BUILD_DIR/fmla python -m pytest -m gpu tests/test_backends_flashmla.py
set -euo pipefail
case "${1:-}" in
  pack)
    tmp="$(mktemp -d)"; mkdir -p "$tmp/fmla"
    git -C "$2" archive 9241ae3 | tar -x -C "$tmp/fmla"
    git -C "$3" archive 147f5673d0c1c3dcf66f78d677fd647e4a020219 include tools/util/include | tar -x -C "$tmp/fmla/csrc/cutlass"
    tar -czf "$4" -C "$tmp" fmla && rm -rf "$tmp" ;;
  build)
    mkdir -p "$3" && tar -xzf "$2" -C "$3" && cd "$3/fmla"
    CPATH=/usr/local/cuda/include/cccl NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" \
      FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=16 NVCC_THREADS=2 python setup.py build_ext --inplace ;;
  *) echo "usage: $0 pack FLASHMLA_REPO CUTLASS_REPO OUT.tgz | build OUT.tgz BUILD_DIR" >&2; exit 2 ;;
esac
