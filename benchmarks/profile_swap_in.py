"""Where does one `ensure_resident` call spend its time? (CUDA; torch.profiler table)

    python benchmarks/profile_swap_in.py --batch 8 --miss 0.0
"""

from __future__ import annotations

import argparse

import torch

from swap_in import LAYOUTS, windows
from sparse_framework import Batch, Request, Selection
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="mha")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--miss", type=float, default=0.0)
    ap.add_argument("--context", type=int, default=16384)
    args = ap.parse_args()
    layout = LAYOUTS[args.layout](1)
    b_n, sel_n = args.batch, 2048
    store = HierarchicalKVStore(layout, page_size=64, device_buffer_tokens=sel_n + 64, sink_tokens=0, recent_tokens=0,
                                unit=1, max_requests=b_n, max_seq_len=args.context + 1,
                                device_capacity_tokens=b_n * (sel_n + 64), host_capacity_tokens=b_n * args.context)
    reqs = []
    for i in range(b_n):
        r = Request(f"r{i}", args.context, seq_len=args.context, slot=i)
        store.admit(r)
        k = torch.randn(args.context, layout.num_kv_heads, layout.head_dim, device="cuda").to(layout.dtype)
        store.write_prefill(0, r, k, None if layout.is_mla else k)
        reqs.append(r)
    batch = Batch(reqs)
    batch.prepare("cuda")
    sels = [s.cuda() for s in windows(args.context, sel_n, round(args.miss * sel_n), 40, b_n, 1)]
    lengths = torch.full((b_n, 1), sel_n, dtype=torch.int32, device="cuda")
    for i in range(20):
        store.ensure_resident(0, batch, Selection(sels[i], lengths))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(20, 30):
            store.ensure_resident(0, batch, Selection(sels[i], lengths))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
