#!/usr/bin/env bash
# Build (HERE, on the CPU machine that reaches PyPI) the bundle that lets vLLM 0.26.0 run on the
# GPU machine: the wheels that machine lacks, unzipped into one site folder, packed as one
# xz-compressed tar stream and cut into parts of at most 46 MiB under .gpu_carry/vllm/pN/.
#
# Why: the GPU machine has no network (no pip install there), and one call to it carries at most
# 64 MiB in all, the repo's tracked tree (~14 MB) included, so the bundle travels in parts, one
# per call, back to back on a warm machine (/tmp is kept only while it stays warm), and is joined
# and unpacked there by benchmarks/gpu/vllm_gpu_install.sh (python3's tarfile/lzma: no tool needed).
#
# Why vLLM 0.26.0: 0.20-0.26 pin torch==2.11.0, the image's (+cu130); 0.27 pins 2.13.
#
# What is carried: the vllm wheel plus those of its requirements (METADATA, Linux x86-64,
# Python 3.12, recursively) that the GPU image lacks (KINDS.md "Python packages already there":
# torch, numpy 2.5.2, numba, triton, transformers, tokenizers, protobuf, typing-extensions, ...
# are NOT carried; the image's versions are used, except the five small FALLBACK ones below,
# which `join` swaps in only where the image's version is too old). The pins below are what pip's
# resolver chose (pip install --dry-run --report, torch/triton stubbed at the image's versions).
# Result (2026-11-27): 2 parts (46.0 + 42.0 MiB), 88.0 MiB of xz from 433 MiB unpacked, ~2.5 min.
#
# What is trimmed, and why (a plain `LLM(...)` generate of a Llama on Hopper never imports it,
# or imports it only inside try/except / find_spec guards; checked by an import trace of
# `import vllm; from vllm import LLM`, vllm.platforms.cuda, the FlashAttention backend, llama,
# the V1 engine, worker, model runner, sampler and loaders, with CUDA faked as an H100):
#  - members of the vllm wheel:
#    vllm_flash_attn/_vllm_fa2_C (291 MiB raw): imported in try/except ImportError; on SM90
#      get_flash_attn_version() picks FA3 (_vllm_fa3_C, kept); FA2 only serves pre-Hopper GPUs,
#      ALiBi models and the sparse FA2 kernels. (On SM90 vLLM switches FA3 -> FA4, CuTe DSL,
#      for head_size > 256, sinks with diff-KV or diffusion models: these fail without cutlass.)
#    _moe_C_stable_libtorch (45 MiB raw, ~39 MiB xz): imported under
#      contextlib.suppress(ImportError) in CudaPlatform.import_kernels(); only the fused-MoE ops
#      (topk_softmax, moe_align_block_size, moe_permute, ...) use torch.ops._moe_C, so a dense
#      model never calls it. KEEP_MOE=1 keeps it (costs one more part).
#    vllm-rs (41 MiB): the Rust frontend binary, used only with VLLM_USE_RUST_FRONTEND=1.
#    third_party/deep_gemm/_C.cpython-3{10,11,13,14}: other Pythons (the cp312 one is kept).
#    third_party/fmha_sm100/{cutlass,cute,csrc}: JIT sources of the SM100 (Blackwell) sparse FMHA
#      used by MiniMax-M3 only.
#  - members of other wheels: mistral_common/data (sample tokenizer files; vLLM reads a Mistral
#    tokenizer from the model's folder), pycountry/locales (gettext translations only),
#    flashinfer's top-level build_backend.py/build_utils.py (build hooks).
#  - whole packages:
#    tokenspeed-triton, tokenspeed-mla (DeepSeek MLA kernels), tilelang + z3-solver, humming-kernels
#      + pyelftools (mxfp4/w4 quantized kernels; has_humming() guard), nvidia-cutlass-dsl and its
#      libs-base/-core/-cu12/-cu13 + quack-kernels (CuTe DSL: FA4 / Blackwell / flashinfer's
#      cute_dsl kernels, all guarded; their .pth file would not be read from PYTHONPATH anyway),
#      cuda-tile (flashinfer cuTile kernels; need the tileiras compiler), nvidia-cudnn-frontend
#      (flashinfer cuDNN backends, try/except), fastsafetensors (load_format="fastsafetensors"
#      only), torchcodec + PyNvVideoCodec (video/audio decoding for multimodal models),
#      nvidia-cuda-nvcc/-nvvm/-crt/-cccl/-nvdisasm and cuda-python (the image has CUDA 13's
#      toolkit and cuda-bindings);
#    the OpenAI-compatible *server* stack, which `vllm serve` needs but LLM(...) never imports:
#      uvicorn, httptools, watchfiles, websockets, python-dotenv, fastapi-cli, fastapi-cloud-cli,
#      rich-toolkit, rignore, sentry-sdk, fastar, agent-detector, detect-installer, anthropic,
#      docstring-parser, mcp, mcp-types, pyjwt, cryptography, cffi, pycparser,
#      sse-starlette, pydantic-settings, supervisor, model-hosting-container-standards, jmespath,
#      prometheus-fastapi-instrumentator.
#  Kept although guarded: flashinfer-python (its top-k/top-p sampler is vLLM's default on CUDA,
#  VLLM_USE_FLASHINFER_SAMPLER=1, and that path imports it unguarded; it JIT-compiles with the
#  image's nvcc on first use, so its data/ sources stay), xgrammar/llguidance/outlines-core/
#  lm-format-enforcer (structured output), fastapi/starlette/openai/opentelemetry/mistral-common/
#  pycountry (imported at `from vllm import LLM` time).
#
# Usage (HERE):  bash benchmarks/gpu/vllm_gpu_bundle.sh
#   env: VLLM_BUNDLE_WORK (default /work/vllm026: wheels/, site/ and the vllm wheel live there,
#        outside the repo), XZ_PRESET (default 9), PART_MIB (default 46), KEEP_MOE=1.
# Then carry .gpu_carry/vllm/p1, p2, ... one per call (see benchmarks/gpu/vllm_gpu_install.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK=${VLLM_BUNDLE_WORK:-/work/vllm026}
WHEELS="$WORK/wheels"
SITE="$WORK/site"
OUT="$ROOT/.gpu_carry/vllm"
XZ_PRESET=${XZ_PRESET:-9}
PART_MIB=${PART_MIB:-46}
KEEP_MOE=${KEEP_MOE:-0}
PY=${PYTHON:-python3}
VLLM_WHL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl

# The packages carried (besides vllm itself), pinned.
PACKAGES='
annotated-types==0.8.0
apache-tvm-ffi==0.1.10
astor==0.8.1
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
compressed-tensors==0.17.0
depyf==0.20.0
dill==0.4.1
dnspython==2.9.2
email-validator==2.4.0
fastapi==0.136.3
flashinfer-python==0.6.14
googleapis-common-protos==1.76.0
httpcore2==2.16.2
httpx2==2.16.2
ijson==3.6.0
interegular==0.3.3
jiter==0.19.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
lark==1.2.2
llguidance==1.7.6
lm-format-enforcer==0.11.3
loguru==0.7.3
mistral-common==1.13.1
msgspec==0.22.0
nvtx==0.2.15
openai==3.57.0
openai-harmony==0.0.8
opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2
opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2
opentelemetry-semantic-conventions-ai==0.5.1
outlines-core==0.2.14
partial-json-parser==0.2.1.1.post7
pybase64==1.5.1
pycountry==26.2.16
pydantic==2.14.4
pydantic-core==2.50.5
pydantic-extra-types==2.11.1
python-json-logger==4.2.0
python-multipart==0.0.34
pyzmq==27.3.0
referencing==0.37.0
rpds-py==2026.9.1
setproctitle==1.3.8
sniffio==1.3.1
starlette==1.10.0
torch-c-dlpack-ext==0.1.5
truststore==0.10.5
typing-inspection==0.4.5
xgrammar==0.2.7
'

# Fallbacks: small pure-Python packages the image HAS, in the version pip chose, carried under
# _fallback/<name>/ and moved into the site by vllm_gpu_install.sh `join` only where the image's
# version misses a floor that a carried package declares (pydantic 2.14 wants
# typing-extensions>=4.16, openai anyio>=4.10, httpx2 idna>=3.18, httpcore2 h11>=0.16, flashinfer
# packaging>=24.2; the image's versions are not listed anywhere here). Otherwise the image's stay.
FALLBACK='
typing-extensions==4.16.0
anyio==4.16.0
idna==3.20
h11==0.16.0
packaging==26.4
'

# Members left out of the site folder (fnmatch globs on the installed path).
EXCLUDE='
vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
vllm/vllm-rs
vllm/third_party/deep_gemm/_C.cpython-310-*
vllm/third_party/deep_gemm/_C.cpython-311-*
vllm/third_party/deep_gemm/_C.cpython-313-*
vllm/third_party/deep_gemm/_C.cpython-314-*
vllm/third_party/fmha_sm100/cutlass/*
vllm/third_party/fmha_sm100/cute/*
vllm/third_party/fmha_sm100/csrc/*
mistral_common/data/*
pycountry/locales/*
build_backend.py
build_utils.py
'
if [ "$KEEP_MOE" != 1 ]; then
  EXCLUDE="$EXCLUDE
vllm/_moe_C_stable_libtorch.abi3.so"
fi

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64
           --platform manylinux1_x86_64)

echo "== 1/3 wheels -> $WHEELS"
mkdir -p "$WORK"
if [ ! -f "$WORK/$VLLM_WHL" ]; then
  "$PY" -m pip download --no-deps vllm==0.26.0 --python-version 3.12 "${PLATFORMS[@]}" \
    --only-binary=:all: -d "$WORK"
fi
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
printf '%s\n' $PACKAGES > "$WORK/packages.txt"
"$PY" -m pip download --no-deps -r "$WORK/packages.txt" --python-version 3.12 "${PLATFORMS[@]}" \
  --only-binary=:all: -d "$WHEELS" 2>&1 | grep -Ev '^WARNING: Location' || true
cp "$WORK/$VLLM_WHL" "$WHEELS/"
want=$(( $(grep -c . "$WORK/packages.txt") + 1 ))
have=$(ls "$WHEELS"/*.whl | wc -l)
[ "$have" = "$want" ] || { echo "expected $want wheels in $WHEELS, found $have" >&2; exit 1; }
mkdir -p "$WHEELS/fallback"
printf '%s\n' $FALLBACK > "$WORK/fallback.txt"
"$PY" -m pip download --no-deps -r "$WORK/fallback.txt" --only-binary=:all: --python-version 3.12 \
  -d "$WHEELS/fallback" 2>&1 | grep -Ev '^WARNING: Location' || true
[ "$(ls "$WHEELS"/fallback/*.whl | wc -l)" = "$(grep -c . "$WORK/fallback.txt")" ] \
  || { echo "fallback wheels missing in $WHEELS/fallback" >&2; exit 1; }

echo "== 2/3 site folder -> $SITE; 3/3 tar.xz parts -> $OUT"
rm -rf "$SITE" "$OUT"
printf '%s\n' $EXCLUDE > "$WORK/exclude.txt"
"$PY" - "$WHEELS" "$SITE" "$WORK/exclude.txt" "$OUT" "$XZ_PRESET" "$PART_MIB" <<'PYEOF'
import calendar, fnmatch, hashlib, io, lzma, os, sys, tarfile, zipfile

wheels_dir, site, excl_file, out, preset, part_mib = sys.argv[1:7]
preset, part_bytes = int(preset), int(part_mib) * 2**20
excl = [l.strip() for l in open(excl_file) if l.strip()]

# 1. unzip every wheel into one folder, as `pip install --target` lays it out (dist-info kept;
#    <name>.data/purelib|platlib merged in; scripts/headers/data left out: nothing imports them)
dropped = kept = 0
jobs = [(os.path.join(wheels_dir, w), site) for w in sorted(os.listdir(wheels_dir)) if w.endswith(".whl")]
fb = os.path.join(wheels_dir, "fallback")
jobs += [(os.path.join(fb, w), os.path.join(site, "_fallback", w.split("-")[0]))
         for w in sorted(os.listdir(fb)) if w.endswith(".whl")]
for whl, root in jobs:
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                    name = "/".join(parts[2:])
                else:
                    continue
            if any(fnmatch.fnmatchcase(name, g) for g in excl):
                dropped += info.file_size
                continue
            dest = os.path.join(root, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.chmod(dest, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
            mtime = calendar.timegm(info.date_time + (0, 0, 0))
            os.utime(dest, (mtime, mtime))
            kept += info.file_size
print(f"site: {kept / 2**20:.1f} MiB kept, {dropped / 2**20:.1f} MiB of members trimmed")

# 2. one tar stream (sorted, owner-free), xz-compressed, cut into parts while it is written
os.makedirs(out)
class Parts(io.RawIOBase):
    def __init__(self):
        self.n, self.f, self.left, self.sha, self.total, self.part_sha = 0, None, 0, hashlib.sha256(), 0, []
    def writable(self):
        return True
    def write(self, b):
        b = memoryview(b)
        done = 0
        while done < len(b):
            if self.left == 0:
                self._next()
            k = min(self.left, len(b) - done)
            self.f.write(b[done:done + k]); self.ps.update(b[done:done + k])
            self.left -= k; done += k
        self.sha.update(b); self.total += len(b)
        return len(b)
    def _next(self):
        self._close_part()
        self.n += 1
        d = os.path.join(out, f"p{self.n}"); os.makedirs(d)
        self.f = open(os.path.join(d, "site.tar.xz.part"), "wb")
        self.left, self.ps = part_bytes, hashlib.sha256()
    def _close_part(self):
        if self.f:
            self.f.close(); self.part_sha.append(self.ps.hexdigest())

parts = Parts()
xz = lzma.LZMAFile(parts, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=preset)
def clean(ti):
    ti.uid = ti.gid = 0; ti.uname = ti.gname = ""
    if ti.isdir():
        ti.mtime = 1700000000
    return ti
n_files = 0
with tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
    def add(rel):
        global n_files
        p = os.path.join(site, rel)
        tar.add(p, arcname=rel, recursive=False, filter=clean)
        if os.path.isdir(p):
            for e in sorted(os.listdir(p)):
                add(os.path.join(rel, e))
        else:
            n_files += 1
    for e in sorted(os.listdir(site)):
        add(e)
xz.close()
parts._close_part()
sha = parts.sha.hexdigest()
with open(os.path.join(out, "p1", "MANIFEST"), "w") as f:
    f.write(f"parts={parts.n}\nsha256={sha}\nbytes={parts.total}\nfiles={n_files}\n")
    for i, s in enumerate(parts.part_sha, 1):
        f.write(f"part{i}_sha256={s}\n")
with open(os.path.join(out, "SHA256"), "w") as f:
    f.write(f"{sha}  site.tar.xz\n")
print(f"stream: {parts.total} B ({parts.total / 2**20:.1f} MiB), {n_files} files, "
      f"{parts.n} parts of <= {part_bytes} B, sha256 {sha}")
for i in range(1, parts.n + 1):
    print(f"  p{i}: {os.path.getsize(os.path.join(out, f'p{i}', 'site.tar.xz.part'))} B")
PYEOF
cat "$OUT/p1/MANIFEST"
