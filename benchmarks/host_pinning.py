"""How fast can the host KV pool be allocated and pinned? (CUDA)

The hierarchical store keeps every token on the host, in page-locked ("pinned") memory that
its kernels read over PCIe. On the H100 machine the first `enable` of an 8 x 16K Llama-3-8B
shape spent 26 s in `torch.zeros(..., pin_memory=True)` for 17 GiB. This script allocates
`--gib` GiB (zero-filled, usable by a kernel) in each of these ways and times it:

  torch_zeros        torch.zeros(pin_memory=True): cudaHostAlloc, then a memset (today's way)
  torch_empty        torch.empty(pin_memory=True): cudaHostAlloc alone (the driver's part)
  register           pageable torch.empty, zero-filled by torch (its threads fault the
                     pages in), then one cudaHostRegister of the whole range
  register_threads   the same, the zero fill in chunks from a thread pool (--threads)
  register_chunks    the zero fill and cudaHostRegister both in chunks, each chunk by a
                     thread of the pool (registrations side by side: one address range)
  thp_register       anonymous mmap advised for transparent huge pages (2 MiB pages: 512x
                     fewer pages to fault and lock), zero-filled in chunks, one register
  thp_register_chunks the same, registered in chunks from the thread pool
  torch_host_register torch's own option (`pinned_use_cuda_host_register`, with
                     `pinned_num_register_threads`): malloc, pages mapped by threads, register
  store              what the store's host pool does: `kv_store/pinned.py`'s pinned_zeros
                     (loaded from its file: no package dependencies needed)

Each way runs in its own process (no allocator cache, no pages left over from another). For
each: seconds, GB/s (bytes / seconds), the bandwidth of a 1 GiB host->device copy out of the
region (pinned memory: ~50 GB/s; pageable: a fraction), and a zero-copy check: a Triton kernel
reads words across every chunk boundary through the host address (what the store's kernels
do) and must see what the CPU wrote.

    python benchmarks/host_pinning.py --gib 6 --json benchmarks/results/host_pinning_h100.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("torch_zeros", "torch_empty", "register", "register_threads", "register_chunks",
           "thp_register", "thp_register_chunks", "torch_host_register", "store")
HUGE_PAGE = 2 << 20


def _register(ptr: int, nbytes: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed with error {err}")


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, nbytes - start)) for start in range(0, nbytes, chunk)]


def _fill_in_chunks(t: torch.Tensor, pool: ThreadPoolExecutor, chunk: int) -> None:
    """Zero `t` (uint8) chunk by chunk from the pool's threads (torch releases the GIL)."""
    list(pool.map(lambda c: t[c[0] : c[0] + c[1]].zero_(), _chunks(t.numel(), chunk)))


def _thp_region(nbytes: int) -> tuple[mmap.mmap, torch.Tensor, int]:
    """Anonymous memory advised for transparent huge pages, 2 MiB aligned: (map, uint8 view, address)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE, 0, len(region))
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    off = (-base) % HUGE_PAGE
    return region, torch.frombuffer(region, dtype=torch.uint8)[off : off + nbytes], base + off


def _store_module():
    """kv_store/pinned.py loaded from its file (beside this script, or in the package)."""
    import importlib.util

    here = Path(__file__).resolve().parent
    for path in (here.parent / "sparse_framework" / "kv_store" / "pinned.py", here / "pinned.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("pinned", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError("kv_store/pinned.py not found")


def allocate(method: str, nbytes: int, threads: int, chunk: int) -> tuple[torch.Tensor, object, int]:
    """(zero-filled pinned uint8 tensor, whatever keeps it alive, registration chunk bytes)."""
    pool = ThreadPoolExecutor(threads)
    if method == "store":
        return _store_module().pinned_zeros((nbytes,), torch.uint8, "host KV pool"), None, nbytes
    if method == "torch_zeros":
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True), None, nbytes
    if method == "torch_empty":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None, nbytes
    if method == "torch_host_register":  # PYTORCH_CUDA_ALLOC_CONF set by the parent (`_env`)
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True), None, nbytes
    keep: object = None
    if method.startswith("thp"):
        keep, t, ptr = _thp_region(nbytes)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8)
        ptr = t.data_ptr()
    if method == "register":
        t.zero_()
    else:
        _fill_in_chunks(t, pool, chunk)
    if method.endswith("chunks"):
        list(pool.map(lambda c: _register(ptr + c[0], c[1]), _chunks(nbytes, chunk)))
        return t, keep, chunk
    _register(ptr, nbytes)
    return t, keep, nbytes


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _read_words(src, offsets, out, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < n
        off = tl.load(offsets + i, mask=m, other=0)
        tl.store(out + i, tl.load(src + off, mask=m, other=0), mask=m)
except ImportError:  # the zero-copy check reports it
    triton = None


class _HostWords:
    """A host address handed to Triton (which refuses CPU tensors), read over UVA."""

    dtype = torch.int64

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _check_zero_copy(t: torch.Tensor, reg_chunk: int) -> bool:
    """A Triton kernel reads 8-byte words on both sides of every registration boundary (and
    the ends) through the host address; True when it sees what the CPU wrote."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    words = t.numel() // 8
    bounds = sorted({0, words - 1, *(b // 8 + d for b in range(reg_chunk, t.numel(), reg_chunk) for d in (-1, 0))})
    bounds = [b for b in bounds if 0 <= b < words][:4096]
    view = t[: words * 8].view(torch.int64)
    idx = torch.tensor(bounds, dtype=torch.int64)
    view[idx] = torch.arange(1, len(bounds) + 1, dtype=torch.int64) * 7919
    out = torch.zeros(len(bounds), dtype=torch.int64, device="cuda")
    _read_words[(1,)](_HostWords(t.data_ptr()), idx.cuda(), out, len(bounds), BLOCK=max(16, triton.next_power_of_2(len(bounds))))
    torch.cuda.synchronize()
    return bool(torch.equal(out.cpu(), view[idx]))


def run_one(method: str, gib: float, threads: int, chunk_mib: int) -> dict:
    nbytes = int(gib * 2**30)
    chunk = chunk_mib << 20
    torch.cuda.init()
    torch.empty(1, device="cuda")  # context created before the clock starts
    start = time.perf_counter()
    t, keep, reg_chunk = allocate(method, nbytes, threads, chunk)
    seconds = time.perf_counter() - start
    pinned = bool(t.is_pinned())
    n = min(nbytes, 1 << 30)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(t[:n], non_blocking=True)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(t[:n], non_blocking=True)
    torch.cuda.synchronize()
    h2d = 3 * n / (time.perf_counter() - t0) / 1e9
    try:
        zero_copy = _check_zero_copy(t, reg_chunk)
    except Exception as exc:  # noqa: BLE001 (reported, not fatal)
        zero_copy = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:  # torch's host allocator rounds each block up to a power of two: what it really holds
        held = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k and "current" in k}
    except Exception:  # noqa: BLE001 (older torch)
        held = {}
    del keep
    return {"method": method, "gib": gib, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
            "is_pinned": pinned, "h2d_copy_gb_per_s": h2d, "zero_copy_read_ok": zero_copy,
            "threads": threads, "chunk_mib": chunk_mib if reg_chunk != nbytes else None,
            "torch_host_allocator": held}


def _env(method: str, threads: int) -> dict[str, str]:
    """The child's environment: torch's host-register option for `torch_host_register`."""
    env = dict(os.environ)
    if method == "torch_host_register":
        conf = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (env.get("PYTORCH_CUDA_ALLOC_CONF"), conf) if x)
    return env


def _machine() -> dict:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "?"
    return {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "mem_total": read("/proc/meminfo").splitlines()[0] if read("/proc/meminfo") != "?" else "?",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=6.0, help="pool size, GiB (default 6: not a power of two)")
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="thread pool size")
    parser.add_argument("--chunk-mib", type=int, default=256, help="chunk of the threaded fills / registrations")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each method (each its own process)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one method, JSON on stdout
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_pinning.py needs a CUDA device (pinned memory is a CUDA driver service); none here.")
        return 2
    if args.one:
        print(json.dumps(run_one(args.one, args.gib, args.threads, args.chunk_mib)))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    results = []
    print(f"{'method':<22}{'s':>8}{'GB/s':>8}{'pinned':>8}{'H2D GB/s':>10}  zero-copy", flush=True)
    for method in methods:
        for _ in range(args.repeats):
            cmd = [sys.executable, __file__, "--one", method, "--gib", str(args.gib), "--threads", str(args.threads),
                   "--chunk-mib", str(args.chunk_mib)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(method, args.threads))
            if proc.returncode != 0:
                lines = [x for x in proc.stderr.strip().splitlines() if "Error" in x or "error" in x]
                err = " | ".join(lines[-2:])[:300] or (proc.stderr.strip().splitlines() or ["?"])[-1][:150]
                results.append({"method": method, "gib": args.gib, "error": err})
                print(f"{method:<22}  failed: {err}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{method:<22}{r['seconds']:>8.2f}{r['gb_per_s']:>8.2f}{str(r['is_pinned']):>8}"
                  f"{r['h2d_copy_gb_per_s']:>10.1f}  {r['zero_copy_read_ok']}", flush=True)
    if args.json:
        from timing import write_results
        meta = {"what": "host pool allocation + pinning, zero-filled", **_machine(), "threads": args.threads,
                "chunk_mib": args.chunk_mib}
        write_results(args.json, meta, results, "host_pinning.py", argv)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
