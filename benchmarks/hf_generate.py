"""transformers `generate` end to end, dense vs sparse: GPU memory, decode step time, set-up.

What a researcher gets today from `model.generate` on a long batch, and what the transformers
integration changes: a Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, d 128,
random bf16 weights: the shape sets the bytes, not the values), B prompts of L random tokens,
greedy decoding of N tokens, one row per mode:

  dense          transformers' default (dynamic) cache, sdpa attention
  dense-static   cache_implementation="static"
  <config>       the integration (`sparse(model, config)`), e.g. Quest at its defaults

Per row: the set-up time (`enable`: building and pinning the pools), prefill time, the median
decode step (from one timestamp per generated token, taken after a device sync in a logits
processor; the first step after the prefill is left out) beside its HBM floor, the memory the
integration holds while enabled (pools + representations) and the peak GPU memory during
generate less the weights (the pools count in it). Floors: dense = (weights + all KV read) ÷ the GPU's HBM ceiling; sparse =
(weights + the selected tokens' K/V + the algorithm's representation) ÷ the same.

    python benchmarks/hf_generate.py --batch 8 --context 16384 --new-tokens 32 \
        --json benchmarks/results/hf_generate_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402

from sparse_framework.common import hardware  # noqa: E402

HBM = hardware.hbm_bytes_per_s()  # the GPU's measured copy ceiling (common/hardware.py)
GIB = 1 << 30
DEFAULT_CONFIGS = ['{"algorithm": "quest"}']


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="prompts per generate (default 8)")
    p.add_argument("--context", type=int, default=16384, help="prompt tokens per row (default 16384)")
    p.add_argument("--new-tokens", type=int, default=32, help="generated tokens per row (default 32)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32: Llama-3-8B)")
    p.add_argument("--modes", default="dense,dense-static,sparse",
                   help="comma list of dense, dense-static, sparse (default all three)")
    p.add_argument("--config", action="append", default=None,
                   help=f"a sparse config (JSON), repeatable; default {DEFAULT_CONFIGS[0]}")
    p.add_argument("--decode-graphs", action="store_true", help="sparse rows replay each decode layer from a CUDA graph")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    for name in ("batch", "context", "new_tokens", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 3:
        p.error("--new-tokens must be >= 3 (the first step is left out of the median)")
    modes = args.modes.split(",")
    bad = sorted(set(modes) - {"dense", "dense-static", "sparse"})
    if bad:
        p.error(f"--modes: unknown {bad}; allowed: dense, dense-static, sparse")
    args.modes = modes
    args.config = args.config or DEFAULT_CONFIGS
    return args


def build_model(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, torch_dtype="bfloat16",
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    for p in model.parameters():  # small weights keep the activations finite through 32 layers
        p.data.normal_(0.0, 0.02)
    return model


class StepClock:
    """A logits processor that records a timestamp per generated token (after a device sync)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores


def run_generate(model: Any, ids: torch.Tensor, new_tokens: int, weights: int, **kwargs: Any) -> dict[str, float]:
    from transformers import LogitsProcessorList

    clock = StepClock()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **kwargs)
    torch.cuda.synchronize()
    steps = [b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:])]
    return {
        "prefill_s": clock.stamps[0] - t0,
        "step_ms": statistics.median(steps) * 1e3,
        "step_ms_min": min(steps) * 1e3,
        "peak_over_weights_gib": (torch.cuda.max_memory_allocated() - weights) / GIB,
    }


def kv_bytes_per_token(layers: int) -> int:
    return layers * 8 * 128 * 2 * 2  # K and V, 8 KV heads, d 128, bf16


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_generate.py needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_model(args.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 128000, (args.batch, args.context), device="cuda", generator=gen)
    kv_per_token = kv_bytes_per_token(args.layers)
    rows: list[dict[str, Any]] = []

    def finish(row: dict[str, Any], read_bytes: float) -> None:
        row["floor_ms"] = (weights + read_bytes) / HBM * 1e3
        row["x_floor"] = row["step_ms"] / row["floor_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    total_tokens = args.batch * (args.context + args.new_tokens // 2)
    for mode in [m for m in args.modes if m != "sparse"]:
        kw = {"cache_implementation": "static"} if mode == "dense-static" else {}
        try:
            row = {"mode": mode, "setup_s": 0.0, "held_gib": 0.0, **run_generate(model, ids, args.new_tokens, weights, **kw)}
        except torch.OutOfMemoryError as exc:
            print(f"{mode}: out of memory ({str(exc).splitlines()[0]})", flush=True)
            continue
        finish(row, total_tokens * kv_per_token)
        gc.collect()
        torch.cuda.empty_cache()

    if "sparse" in args.modes:
        from sparse_framework.integrations.transformers import sparse

        for text in args.config:
            gc.collect()
            torch.cuda.empty_cache()
            start = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            handle = sparse(model, text, max_requests=args.batch, max_seq_len=args.context + args.new_tokens,
                            decode_graphs=args.decode_graphs)
            torch.cuda.synchronize()
            setup = time.perf_counter() - t0
            held = (torch.cuda.memory_allocated() - start) / GIB
            try:
                with handle:
                    row = {"mode": text, "setup_s": setup, "held_gib": held,
                           **run_generate(model, ids, args.new_tokens, weights)}
                    stats = handle.stats()
            except torch.OutOfMemoryError as exc:
                print(f"{text}: out of memory ({str(exc).splitlines()[0]})", flush=True)
                continue
            row["stats"] = stats
            coord = handle.coordinator
            layout = coord.layout
            read = stats["read_fraction"] * total_tokens * kv_per_token
            reps = coord.algorithm.representation_bytes_per_token(layout, coord.config) * layout.num_layers * total_tokens
            finish(row, read + reps)
            del handle, coord
    print()
    print(f"{'mode':<34} {'setup s':>8} {'held GiB':>9} {'peak GiB':>9} {'prefill s':>9} "
          f"{'step ms':>8} {'floor ms':>8} {'x floor':>7}")
    for r in rows:
        print(f"{r['mode'][:34]:<34} {r['setup_s']:8.1f} {r['held_gib']:9.2f} {r['peak_over_weights_gib']:9.2f} "
              f"{r['prefill_s']:9.2f} {r['step_ms']:8.1f} {r['floor_ms']:8.2f} {r['x_floor']:7.2f}")
    print(f"weights {weights / GIB:.2f} GiB; dense KV at the end {args.batch * (args.context + args.new_tokens) * kv_per_token / GIB:.2f} GiB; "
          "peak = the most GPU memory allocated during generate, less the weights (pools included)")
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                "context": args.context, "new_tokens": args.new_tokens, "layers": args.layers,
                "weights_gib": weights / GIB, "hbm_bytes_per_s": HBM}
        write_results(args.json, meta, rows, "hf_generate.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
