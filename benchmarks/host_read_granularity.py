"""How fast the GPU reads scattered rows straight from pinned host memory, by row size (CUDA).

Why: the hierarchical store's swap-in copies each missed row with a kernel that reads pinned
host memory over PCIe (zero-copy). Full-token MHA rows (2-4 KiB) reach ~90% of PCIe's 55 GB/s
(docs/kv_store.md, "Swap-in throughput"), but Quest, SnapKV and PQCache select per KV head, so
the engine's swap-in copies one head's 256-byte piece of each host row (the host pool is
token-major), and the engine's timelines show it at ~37 GB/s. This measures whether the row
size is the cause: `copy_rows` (kv_store/copy.py, the store's plain row-copy kernel) over the
same bytes per call as random rows of 256 B .. 4 KiB, and as 256-byte rows in runs of 16: every
8th row (one head's rows of a 16-token unit in today's token-major host pool of 8 heads) or
consecutive ones (what a head-major host layout would give).

    python benchmarks/host_read_granularity.py [--mib 256] [--host-gib 4] [--json FILE]

Medians of 20 calls after 5 warm-up ones (benchmarks/timing.py `Timer`, CUDA events, the L2
flushed before each call); for each case the fastest of the copy kernel's launch shapes tried
(rows per program x columns x warps). The copied rows are checked, not only timed.
"""

from __future__ import annotations

import argparse

import torch
from timing import Timer, write_results

PCIE_GBPS = 55.0  # DESIGN.md: pinned host -> device, contiguous
SHAPES = ((1, 128, 4), (4, 128, 4), (16, 128, 4), (1, 1024, 8), (4, 512, 8))  # rows/program, cols, warps


def offsets(n_host_rows: int, rows: int, run: int, row: int, device: str = "cuda", stride: int = 1) -> torch.Tensor:
    """Element offsets of `rows` rows of `row` elements out of `n_host_rows`: random runs of
    `run` rows `stride` rows apart (1: consecutive), no row twice. A run of stride s takes one
    of the s interleaved rows of a block of run x s rows (one KV head's rows of a unit in a
    token-major host pool of s heads)."""
    block = run * stride
    if rows % run or rows > (n_host_rows // block) * stride * run:
        raise ValueError(f"offsets: {rows} rows in runs of {run} (stride {stride}) do not fit {n_host_rows} host rows")
    slots = torch.randperm((n_host_rows // block) * stride, device=device)[: rows // run]  # (block, lane) pairs
    starts = slots // stride * block + slots % stride
    return ((starts.view(-1, 1) + torch.arange(run, device=device) * stride).flatten() * row).to(torch.int64)


def measure(timer: Timer, host: torch.Tensor, row_bytes: int, run: int, total: int, stride: int = 1) -> dict:
    """The fastest launch shape's GB/s for `total` bytes of rows of `row_bytes` in runs of `run`
    rows `stride` rows apart."""
    import sparse_framework.kv_store.copy as copy_mod

    row = row_bytes // 2  # bf16 elements
    rows = total // row_bytes
    src = offsets(host.numel() // row, rows, run, row, stride=stride)
    dst = torch.arange(rows, device="cuda", dtype=torch.int64) * row
    dev = torch.empty(rows * row, dtype=torch.bfloat16, device="cuda")
    best = None
    for shape in SHAPES:
        launch = copy_mod.RowCopyShape(*shape)
        us = timer(lambda: copy_mod.copy_rows(host, dev, src, dst, row, shape=launch))
        if best is None or us < best[0]:
            best = (us, shape)
    assert best is not None
    probe = src[:4096]  # the copy is checked, not only timed
    want = host.view(-1, row)[(probe // row).cpu()]
    got = dev.view(-1, row)[:4096].cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "copy_rows copied the wrong rows"
    us, shape = best
    gbps = rows * row_bytes / us / 1e3
    return {"row_bytes": row_bytes, "run": run, "stride": stride, "rows": rows, "bytes": rows * row_bytes, "us": us, "gbps": gbps,
            "pct_of_pcie": 100 * gbps / PCIE_GBPS, "rows_per_program": shape[0], "cols": shape[1], "warps": shape[2]}


def filled_host(n: int, chunk: int = 1 << 26) -> torch.Tensor:
    """A pinned bf16 host buffer of n elements, element i the bit pattern i mod 32633 (a prime
    below 0x7F80, bf16's +inf: every value finite, and rows rarely equal), filled a chunk at a
    time."""
    host = torch.empty(n, dtype=torch.int16).pin_memory()
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        host[start:end] = (torch.arange(start, end, dtype=torch.int64) % 32633).to(torch.int16)
    return host.view(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes copied per call, MiB (default 256)")
    parser.add_argument("--host-gib", type=float, default=4.0, help="pinned host buffer the rows come from (default 4)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.host_gib * 1024 < 2 * args.mib:
        parser.error(f"--mib must be at least 1 and at most half of --host-gib (got {args.mib} MiB, {args.host_gib} GiB)")
    if not torch.cuda.is_available():
        raise SystemExit("host_read_granularity: needs a CUDA GPU")
    torch.manual_seed(0)  # the random rows
    host = filled_host(int(args.host_gib * 2**30) // 2)
    # (row bytes, run, stride): one KV head's 256-byte rows of Llama-3-8B (8 heads of 128 bf16),
    # alone, as a 16-token unit of a token-major host pool (every 8th row) and of a head-major
    # one (consecutive); then whole rows
    cases = [(256, 1, 1), (256, 16, 8), (256, 16, 1), (512, 1, 1), (1024, 1, 1), (2048, 1, 1), (4096, 1, 1)]
    timer = Timer(torch.device("cuda"), warmup=5, iters=20, flush=True)
    out = []
    print(f"{'row':>7} {'run':>4} {'stride':>6} {'rows':>9} {'µs':>8} {'GB/s':>6} {'% of 55':>7}  shape")
    for row_bytes, run, stride in cases:
        r = measure(timer, host, row_bytes, run, args.mib * 2**20, stride)
        out.append(r)
        print(f"{row_bytes:>5} B {run:>4} {stride:>6} {r['rows']:>9,} {r['us']:>8.0f} {r['gbps']:>6.1f} {r['pct_of_pcie']:>6.0f}%  "
              f"{r['rows_per_program']}x{r['cols']}x{r['warps']}", flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "mib_per_call": args.mib, "pcie_gbps": PCIE_GBPS}
        write_results(args.json, meta, out, "host_read_granularity.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
