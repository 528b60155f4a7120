"""How fast can a GPU kernel gather rows from pinned host memory at all? (CUDA)

The hierarchical store's swap-in (`copy_missing_kernel`) is a zero-copy gather: GPU threads
load the missed rows straight from pinned host memory over PCIe. This benchmark strips it to
the bone — no look-ups, no planning: a row index, one load, one store — and asks what limits
it, for MLA rows (1152 B) and MHA rows (4096 B), at 16384 rows (one layer's misses at batch
8, top-2048 at 100% misses) and 131072 rows (batch 64). Beside each figure: the copy
engine's contiguous copy of the same number of bytes (what no gather can beat) and the 55
GB/s ceiling of DESIGN.md.

Variants of the gather, each a kernel below:
  rows        the store's launch shape: 2048 programs, one row per loop iteration, bf16,
              8 warps (also 2 and 4)
  rows-int32x4  int32 elements, four rows per iteration (more bytes in flight per program)
  lines-256   whole 128-byte lines read from a 256-byte-aligned base, masked
  ptx.L2::256B  each thread's 16-byte load an explicit `ld.global.L2::256B.v4.b32` (the L2
              prefetch-size hint)
  tma         the tensor memory accelerator, one [1, 16, 64] box per row over a
              [rows, 9, 64] view (TMA reads only the 9 lines inside the view)
and where the rows lie: random or consecutive (a contiguous block), starts 256- or
2048-byte aligned, a 64 MiB or an 8 GiB pool, the pool pinned by cudaHostAlloc, made of
transparent huge pages and registered with cudaHostRegister, or allocated by the driver's
virtual memory API (cuMemCreate, host location, 2 MiB granules). Every variant's output is
checked against the host rows. Each figure is the median of `--iters` calls (CUDA events,
after warm-up, the L2 flushed before each: timing.Timer); each configuration is timed
`--repeats` times and the table shows the median of those with their range, because PCIe
figures move by a few percent between runs.

    python benchmarks/pcie_rows.py --json benchmarks/results/pcie_rows_h100.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import sys

import torch
import triton
import triton.language as tl

from timing import Timer, write_results

PCIE_GBPS = 55.0  # pinned host -> device, contiguous (DESIGN.md)
HUGE_PAGE = 2 << 20


@triton.jit
def rows_kernel(src, dst, rows, n, STRIDE, OFFSET, ROW: tl.constexpr, COLS: tl.constexpr, R: tl.constexpr):
    """dst[k] = src[OFFSET + rows[k] * STRIDE : ... + ROW], R rows per loop iteration."""
    cols = tl.arange(0, COLS)
    cm = cols < ROW
    for k in range(tl.program_id(0) * R, n, tl.num_programs(0) * R):
        rr = k + tl.arange(0, R)
        m = rr < n
        s = tl.load(rows + rr, mask=m, other=0)
        mm = m[:, None] & cm[None, :]
        x = tl.load(src + OFFSET + s[:, None] * STRIDE + cols[None, :], mask=mm)
        tl.store(dst + rr[:, None].to(tl.int64) * ROW + cols[None, :], x, mask=mm)


@triton.jit
def lines_kernel(src, dst, rows, n, STRIDE, ROW: tl.constexpr, LINE: tl.constexpr, ALIGN: tl.constexpr,
                 NL: tl.constexpr):
    """The same copy in whole 128-byte lines (LINE elements) read from an ALIGN-aligned base,
    the lines outside the row masked, so each warp's loads cover aligned blocks."""
    li = tl.arange(0, NL)
    c = tl.arange(0, LINE)
    for k in range(tl.program_id(0), n, tl.num_programs(0)):
        a = tl.load(rows + k) * STRIDE
        base = tl.multiple_of((a // ALIGN) * ALIGN, ALIGN)
        first = (a - base) // LINE
        lm = (li >= first) & (li < first + ROW // LINE)
        x = tl.load(src + base + li[:, None] * LINE + c[None, :], mask=lm[:, None])
        tl.store(dst + k * ROW + (li - first)[:, None] * LINE + c[None, :], x, mask=lm[:, None])


@triton.jit
def ptx_kernel(src, dst, rows, n, STRIDE, ROW: tl.constexpr, CHUNKS: tl.constexpr, LD: tl.constexpr):
    """The same copy, each thread loading 16 bytes with the PTX load `LD` (int32 elements)."""
    c = tl.arange(0, CHUNKS)
    cm = c < ROW // 4
    q = tl.arange(0, 4)
    for k in range(tl.program_id(0), n, tl.num_programs(0)):
        ptr = src + tl.load(rows + k) * STRIDE + c * 4
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            "{ .reg .pred %p<1>; setp.ne.s32 %p0, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
            "mov.b32 $3, 0; @%p0 " + LD + " {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r", [ptr, cm.to(tl.int32)], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=False, pack=1)
        x = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [CHUNKS, 4])
        tl.store(dst + k * ROW + c[:, None] * 4 + q[None, :], x, mask=cm[:, None])


@triton.jit
def tma_kernel(src, dst, rows, n, pool_rows, LINES: tl.constexpr, LINE: tl.constexpr, BOX: tl.constexpr):
    """The same copy by the tensor memory accelerator: a [1, BOX, LINE] box per row over a
    [rows, LINES, LINE] view (lines past LINES are neither read nor written)."""
    sd = tl.make_tensor_descriptor(src, shape=[pool_rows, LINES, LINE], strides=[LINES * LINE, LINE, 1],
                                   block_shape=[1, BOX, LINE])
    dd = tl.make_tensor_descriptor(dst, shape=[n, LINES, LINE], strides=[LINES * LINE, LINE, 1],
                                   block_shape=[1, BOX, LINE])
    for k in tl.range(tl.program_id(0), n, tl.num_programs(0), num_stages=2):
        dd.store([k, 0, 0], sd.load([tl.load(rows + k).to(tl.int32), 0, 0]))


class HostPointer:
    """A pinned host address handed to Triton (which refuses CPU tensors), read over UVA."""

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _vmm_host(nbytes: int) -> tuple[int, int]:
    """Pinned host memory from the CUDA driver's virtual memory API (cuMemCreate with a host
    location, mapped in 2 MiB granules): (address, mapped bytes). Raises if unsupported."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(what: str, err: int) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed with CUresult {err}")

    prop = _AllocProp(type=1, handle_types=0, location=_Location(type=2, id=0))  # PINNED, HOST
    gran = ctypes.c_size_t()
    check("cuMemGetAllocationGranularity", cuda.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0))
    size = -(-nbytes // gran.value) * gran.value
    handle = ctypes.c_ulonglong()
    check("cuMemCreate", cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), 0))
    ptr = ctypes.c_ulonglong()
    check("cuMemAddressReserve", cuda.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size),
                                                          ctypes.c_size_t(gran.value), ctypes.c_ulonglong(0), 0))
    check("cuMemMap", cuda.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, 0))
    access = _AccessDesc(location=_Location(type=1, id=torch.cuda.current_device()), flags=3)  # DEVICE, RW
    check("cuMemSetAccess", cuda.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), 1))
    print(f"vmm host pool: granularity {gran.value >> 10} KiB", flush=True)
    return ptr.value, size


class Pool:
    """A copy of `data` (uint8) in pinned host memory, allocated by `kind`: "pinned"
    (cudaHostAlloc, torch's pin_memory), "thp" (anonymous memory advised for transparent huge
    pages, registered with cudaHostRegister) or "vmm" (the driver's virtual memory API, host
    location: `_vmm_host`; filled by cuMemcpy, and `bytes` is then the source copy)."""

    def __init__(self, data: torch.Tensor, kind: str) -> None:
        nbytes = self.nbytes = data.numel()
        if kind == "pinned":
            self.bytes = data.pin_memory()
            self.ptr = self.bytes.data_ptr()
            return
        if kind == "vmm":
            self.ptr, _ = _vmm_host(nbytes)
            err = ctypes.CDLL("libcuda.so.1").cuMemcpy(ctypes.c_ulonglong(self.ptr), ctypes.c_ulonglong(data.data_ptr()),
                                                       ctypes.c_size_t(nbytes))
            if err != 0:
                raise RuntimeError(f"cuMemcpy failed with CUresult {err}")
            self.bytes = data
            return
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        off = (-base) % HUGE_PAGE
        self._map.madvise(mmap.MADV_HUGEPAGE, 0, len(self._map))
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)[off : off + nbytes]
        self.bytes.copy_(data)
        self.ptr = base + off
        err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {err}")

    def huge_kib(self) -> str:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages"):
                return line.split(":")[1].strip()
        return "?"


def row_ids(order: str, n: int, pool_rows: int, gen: torch.Generator, streams: int = 8) -> torch.Tensor:
    """`streams`: n / streams rows from each of `streams` equal regions of the pool, ascending
    within each (as a batch's missed rows are listed); `random`: anywhere, shuffled;
    `consecutive`: rows 0 .. n-1."""
    if order == "consecutive":
        return torch.arange(n)
    if order == "random":
        return torch.randperm(pool_rows, generator=gen)[:n]
    region = pool_rows // streams
    per = -(-n // streams)
    ids = [s * region + torch.randperm(region, generator=gen)[:per].sort().values for s in range(streams)]
    return torch.cat(ids)[:n]


def gather(variant: str, pool: Pool, row_bytes: int, stride_bytes: int, offset_bytes: int, ids: torch.Tensor):
    """(a callable doing one gather of rows `ids`, its output)."""
    n = ids.numel()
    dev = ids.device
    grid = (2048,)
    if variant.startswith("ptx") or variant == "rows-int32x4":
        elem = torch.int32
    else:
        elem = torch.bfloat16
    size = torch.tensor([], dtype=elem).element_size()
    row, stride, offset = row_bytes // size, stride_bytes // size, offset_bytes // size
    dst = torch.empty(n * row, dtype=elem, device=dev)
    src = HostPointer(pool.ptr, elem)
    if variant.startswith("rows"):
        r, warps = (4, 4) if variant == "rows-int32x4" else (1, int(variant.split("-w")[1]))
        def call() -> None:
            rows_kernel[grid](src, dst, ids, n, stride, offset, ROW=row, COLS=triton.next_power_of_2(row), R=r,
                              num_warps=warps)
    elif variant == "lines-256":
        assert offset_bytes == 0
        def call() -> None:
            lines_kernel[grid](src, dst, ids, n, stride, ROW=row, LINE=128 // size, ALIGN=256 // size,
                               NL=triton.next_power_of_2(row_bytes // 128 + 1), num_warps=2)
    elif variant.startswith("ptx"):
        assert offset_bytes == 0
        ld = "ld.global" + variant[3:] + ".v4.b32"
        def call() -> None:
            ptx_kernel[grid](src, dst, ids, n, stride, ROW=row, CHUNKS=triton.next_power_of_2(row_bytes // 16), LD=ld,
                             num_warps=2)
    elif variant == "tma":
        assert offset_bytes == 0 and stride_bytes == row_bytes
        pool_rows = pool.nbytes // row_bytes
        def call() -> None:
            tma_kernel[(528,)](src, dst, ids, n, pool_rows, LINES=row_bytes // 128, LINE=128 // size,
                               BOX=triton.next_power_of_2(row_bytes // 128), num_warps=1)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return call, dst


def host_rows(pool: Pool, row_bytes: int, stride_bytes: int, offset_bytes: int, ids: torch.Tensor) -> torch.Tensor:
    """The rows a gather of `ids` must return, read on the CPU: uint8 [len(ids), row_bytes]."""
    rows = pool.bytes[offset_bytes:].as_strided(((pool.nbytes - offset_bytes - row_bytes) // stride_bytes + 1,
                                                 row_bytes), (stride_bytes, 1))
    return rows[ids.cpu()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--pool-gib", type=float, default=8.0, help="the large pinned pool (GiB)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    parser.add_argument("--repeats", type=int, default=3, help="figures per configuration (their median is shown)")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    if args.pool_gib < 1:
        parser.error(f"--pool-gib must be at least 1 (131072 rows of 4096 B spread over it), got {args.pool_gib}")
    if args.iters < 1 or args.repeats < 1:
        parser.error(f"--iters and --repeats must be at least 1, got {args.iters} and {args.repeats}")
    if not torch.cuda.is_available():
        print("pcie_rows.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=dev))
    # random bytes: 1 GiB drawn, repeated with a different offset added to each copy (cheap)
    nbytes = int(args.pool_gib * 2**30)
    block = torch.randint(0, 256, (min(nbytes, 1 << 30),), dtype=torch.uint8, generator=gen)
    copies = -(-nbytes // block.numel())
    data = (block.repeat(copies).view(copies, -1) + torch.arange(copies, dtype=torch.uint8)[:, None]).view(-1)[:nbytes]
    big = Pool(data, "pinned")
    pools = {"pinned-8g": big, "pinned-64m": Pool(data[: 64 << 20], "pinned"), "thp-8g": None, "vmm-8g": None}
    configs = [  # (variant, pool, row bytes, stride, offset, order, rows)
        *[("rows-w8", "pinned-8g", rb, rb, 0, "streams", n) for rb in (1152, 4096) for n in (16384, 131072)],
        ("rows-w8", "pinned-8g", 1152, 1152, 0, "consecutive", 16384),
        ("rows-w8", "pinned-8g", 1152, 1152, 0, "random", 16384),
        ("rows-w8", "pinned-64m", 1152, 1152, 0, "random", 16384),
        ("rows-w8", "thp-8g", 1152, 1152, 0, "random", 16384),
        ("rows-w8", "vmm-8g", 1152, 1152, 0, "random", 16384),
        ("rows-w8", "vmm-8g", 1152, 1152, 0, "streams", 16384),
        ("rows-w4", "vmm-8g", 1152, 1152, 0, "streams", 16384),
        ("rows-w8", "pinned-8g", 1152, 1280, 0, "streams", 16384),
        ("rows-w8", "pinned-8g", 1152, 2048, 0, "streams", 16384),
        ("rows-w2", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("rows-w4", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("rows-int32x4", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("lines-256", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("ptx.L2::256B", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("ptx.L2::256B", "pinned-8g", 4096, 4096, 0, "streams", 16384),
        ("tma", "pinned-8g", 1152, 1152, 0, "streams", 16384),
        ("tma", "pinned-8g", 4096, 4096, 0, "streams", 16384),
    ]
    timer = Timer(dev, warmup=5, iters=args.iters, flush=True)  # the L2 flushed (read) before each call
    # settle: right after pinning GiBs the first figures came out at half speed on one machine
    settle, _ = gather("rows-w8", big, 1152, 1152, 0, row_ids("streams", 16384, big.nbytes // 1152, gen).to(dev))
    for _ in range(200):
        settle()
    torch.cuda.synchronize()
    results = []
    for variant, pool_name, rb, stride, offset, order, n in configs:
        if pools[pool_name] is None:
            try:
                pools[pool_name] = Pool(data, pool_name.split("-")[0])
            except (RuntimeError, OSError, AttributeError) as e:  # no THP / VMM host memory here
                pools[pool_name] = f"{type(e).__name__}: {e}"
            if pool_name.startswith("thp") and isinstance(pools[pool_name], Pool):
                print(f"huge-page pool: AnonHugePages {pools[pool_name].huge_kib()}", flush=True)
        pool = pools[pool_name]
        if isinstance(pool, str):
            print(f"{variant} on {pool_name}: skipped, the pool could not be made ({pool})", flush=True)
            continue
        ids = row_ids(order, n, (pool.nbytes - offset - rb) // stride, gen).to(dev)
        call, dst = gather(variant, pool, rb, stride, offset, ids)
        call()
        torch.cuda.synchronize()
        if not torch.equal(dst.cpu().view(torch.uint8).view(n, rb), host_rows(pool, rb, stride, offset, ids)):
            raise AssertionError(f"{variant}: gathered rows differ from the host rows")
        gbps = [n * rb / timer(call) / 1e3 for _ in range(args.repeats)]
        rec = dict(variant=variant, pool=pool_name, row_bytes=rb, stride=stride, offset=offset, order=order, rows=n,
                   gbps=statistics.median(gbps), gbps_runs=gbps)
        results.append(rec)
        print(f"{variant:14s} {pool_name:10s} row {rb:5d} stride {stride:5d} {order:11s} rows {n:6d}: "
              f"{rec['gbps']:5.1f} GB/s ({min(gbps):.1f}-{max(gbps):.1f})", flush=True)
    for nbytes in sorted({r["rows"] * r["row_bytes"] for r in results if r["variant"] == "rows-w8"} | {1 << 30}):
        src = big.bytes[:nbytes]
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        gbps = [nbytes / timer(lambda: d.copy_(src, non_blocking=True)) / 1e3 for _ in range(args.repeats)]
        results.append(dict(variant="copy-engine", pool="pinned-8g", bytes=nbytes, order="contiguous",
                            gbps=statistics.median(gbps), gbps_runs=gbps))
        print(f"copy engine, contiguous {nbytes / 2**20:8.1f} MiB: {statistics.median(gbps):5.1f} GB/s "
              f"({min(gbps):.1f}-{max(gbps):.1f})", flush=True)

    print(f"\n| variant | pool | row | stride | order | rows | GB/s (range) | % of {PCIE_GBPS:.0f} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        rng = f"{r['gbps']:.1f} ({min(r['gbps_runs']):.1f}-{max(r['gbps_runs']):.1f})"
        if r["variant"] == "copy-engine":
            print(f"| copy engine | pinned-8g | {r['bytes'] / 2**20:.1f} MiB contiguous | - | - | - | {rng} | "
                  f"{100 * r['gbps'] / PCIE_GBPS:.0f}% |")
        else:
            print(f"| {r['variant']} | {r['pool']} | {r['row_bytes']} B | {r['stride']} | {r['order']} | {r['rows']} | "
                  f"{rng} | {100 * r['gbps'] / PCIE_GBPS:.0f}% |")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    ceiling_gbps=PCIE_GBPS, iters=args.iters, repeats=args.repeats)
        write_results(args.json, meta, results, "pcie_rows.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
