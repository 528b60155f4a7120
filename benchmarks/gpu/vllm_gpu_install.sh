#!/usr/bin/env bash
# Install (THERE, on the GPU machine, which has no network) the vLLM 0.26.0 bundle built here by
# benchmarks/gpu/vllm_gpu_bundle.sh: its parts come one per call (at most 64 MiB a call), are
# stashed in /tmp (kept while the machine stays warm: make the calls back to back), joined,
# checked against the sha256 in p1/MANIFEST and unpacked with python3's tarfile into a site
# folder to put first on PYTHONPATH. The image's own torch/numpy/transformers/... are used;
# of the five small fallbacks carried (typing-extensions, anyio, idna, h11, packaging) `join`
# puts one in the site only where the image's version misses a floor that a carried package
# declares (pydantic 2.14 fails to import with typing-extensions < 4.16: no Sentinel), and says so.
# `join` then runs the smoke check and lists the carried packages' requirements the image misses.
#
#   bash benchmarks/gpu/vllm_gpu_install.sh stash N   # call N, carry .gpu_carry/vllm/pN
#   bash benchmarks/gpu/vllm_gpu_install.sh join      # once all parts are stashed (same call as
#                                                 # the last stash is fine); idempotent
#   eval "$(bash benchmarks/gpu/vllm_gpu_install.sh env)"   # every later call: the exports
#
# e.g. call 1: bash benchmarks/gpu/vllm_gpu_install.sh stash 1
#      call 2: bash benchmarks/gpu/vllm_gpu_install.sh stash 2 && bash benchmarks/gpu/vllm_gpu_install.sh join
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.gpu_carry/vllm"
PARTS=${VLLM_PARTS_DIR:-/tmp/vllm_parts}
SITE=${VLLM_SITE:-/tmp/vllm_site}
PY=${PYTHON:-python3}

env_lines() {
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
  # no hub there; FlashInfer's sampler would JIT-compile with nvcc on first use
  echo "export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=\${VLLM_USE_FLASHINFER_SAMPLER:-0}"
}

case "${1:-}" in
stash)
  n=${2:?usage: stash N}
  src="$CARRY/p$n/site.tar.xz.part"
  mkdir -p "$PARTS"
  if [ -f "$src" ]; then
    mv -f "$src" "$PARTS/site.tar.xz.part$n"
  elif [ ! -f "$PARTS/site.tar.xz.part$n" ]; then
    echo "part $n: neither $src nor $PARTS/site.tar.xz.part$n" >&2; exit 1
  fi
  [ -f "$CARRY/p$n/MANIFEST" ] && cp -f "$CARRY/p$n/MANIFEST" "$PARTS/MANIFEST"
  if [ -f "$PARTS/MANIFEST" ]; then
    want=$(sed -n "s/^part${n}_sha256=//p" "$PARTS/MANIFEST")
    got=$(sha256sum "$PARTS/site.tar.xz.part$n" | cut -d' ' -f1)
    [ -z "$want" ] || [ "$want" = "$got" ] || { echo "part $n: sha256 $got, MANIFEST says $want" >&2; exit 1; }
  fi
  echo "stashed part $n: $(stat -c %s "$PARTS/site.tar.xz.part$n") B in $PARTS"
  ls -l "$PARTS"
  ;;
join)
  "$PY" - "$PARTS" "$SITE" <<'PYEOF'
import hashlib, os, shutil, sys, tarfile
parts, site = sys.argv[1:3]
man_path = os.path.join(parts, "MANIFEST")
if not os.path.exists(man_path):
    sys.exit(f"no {man_path}: stash part 1 (it carries the MANIFEST) first")
man = dict(l.strip().split("=", 1) for l in open(man_path) if "=" in l)
n, sha = int(man["parts"]), man["sha256"]
done = os.path.join(site, ".bundle_sha256")
if os.path.exists(done) and open(done).read().strip() == sha:
    print(f"{site} already holds bundle {sha[:16]}...; nothing to do")
    sys.exit(0)
files = [os.path.join(parts, f"site.tar.xz.part{i}") for i in range(1, n + 1)]
missing = [f for f in files if not os.path.exists(f)]
if missing:
    sys.exit(f"{len(missing)} of {n} parts missing: {' '.join(missing)}")
joined = os.path.join(parts, "site.tar.xz")
h = hashlib.sha256()
with open(joined, "wb") as out:
    for f in files:
        with open(f, "rb") as src:
            while chunk := src.read(1 << 22):
                h.update(chunk); out.write(chunk)
if h.hexdigest() != sha:
    os.remove(joined)
    sys.exit(f"sha256 mismatch: joined {h.hexdigest()}, MANIFEST {sha}")
print(f"joined {n} parts, {os.path.getsize(joined)} B, sha256 ok")
tmp = site + ".partial"
shutil.rmtree(tmp, ignore_errors=True)
with tarfile.open(joined, "r:xz") as tar:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(tmp, filter="data")
    else:
        tar.extractall(tmp)
# fallbacks: use a carried copy only where the image's version misses a floor of a carried package
fbroot = os.path.join(tmp, "_fallback")
if os.path.isdir(fbroot):
    import pathlib, importlib.metadata as md
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as cn
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.abspath(site)]
    floors = {}
    for d in os.listdir(tmp):
        if d.endswith(".dist-info"):
            dist = md.PathDistribution(pathlib.Path(tmp, d))
            for r in dist.requires or []:
                req = Requirement(r)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    floors.setdefault(cn(req.name), []).append((req.specifier, dist.metadata["Name"]))
    for pkg in sorted(os.listdir(fbroot)):
        fdir = os.path.join(fbroot, pkg)
        di = [e for e in os.listdir(fdir) if e.endswith(".dist-info")][0]
        fdist = md.PathDistribution(pathlib.Path(fdir, di))
        name, fver = cn(fdist.metadata["Name"]), fdist.version
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        unmet = [f"{spec or 'any'} ({by})" for spec, by in floors.get(name, [])
                 if have is None or not spec.contains(have, prereleases=True)]
        if unmet:
            for e in os.listdir(fdir):
                shutil.move(os.path.join(fdir, e), os.path.join(tmp, e))
            print(f"fallback: using carried {name} {fver} (image has {have}; wanted {', '.join(unmet)})")
        else:
            print(f"fallback: image's {name} {have} is fine; carried {fver} left out")
    shutil.rmtree(fbroot)
with open(os.path.join(tmp, ".bundle_sha256"), "w") as f:
    f.write(sha + "\n")
shutil.rmtree(site, ignore_errors=True)
os.rename(tmp, site)
os.remove(joined)
print(f"unpacked into {site}")
PYEOF
  echo "== use it with:"
  env_lines
  echo "== smoke check"
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    "import vllm, vllm.v1.attention.backends.flash_attn; print('vllm', vllm.__version__)"
  echo "== requirements of the carried packages that the image does not meet (warnings only)"
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SITE" <<'PYEOF' || true
import os, sys, pathlib, importlib.metadata as md
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
site = sys.argv[1]
# left out on purpose by vllm_gpu_bundle.sh (lazily imported, not used by LLM(...) on Hopper)
TRIMMED = {canonicalize_name(n) for n in """tokenspeed-mla tilelang humming-kernels nvidia-cutlass-dsl
    quack-kernels cuda-tile nvidia-cudnn-frontend fastsafetensors torchcodec pynvvideocodec anthropic
    mcp watchfiles model-hosting-container-standards prometheus-fastapi-instrumentator""".split()}
bad, trimmed = 0, set()
for d in sorted(os.listdir(site)):
    if not d.endswith(".dist-info"):
        continue
    dist = md.PathDistribution(pathlib.Path(site, d))
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            v = md.version(req.name)
        except md.PackageNotFoundError:
            v = None
        if v is None and canonicalize_name(req.name) in TRIMMED:
            trimmed.add(req.name)
            continue
        if v is None or (req.specifier and not req.specifier.contains(v, prereleases=True)):
            bad += 1
            print(f"  {dist.metadata['Name']} {dist.version} wants {req}; found {v}")
print(f"  {bad} unmet; absent as trimmed on purpose: {' '.join(sorted(trimmed))}")
PYEOF
  ;;
env)
  env_lines
  ;;
*)
  echo "usage: $0 stash N | join | env" >&2; exit 2
  ;;
esac
