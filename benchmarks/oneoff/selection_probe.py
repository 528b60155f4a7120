"""Per request, what the coordinator selected in its sparse layer-steps (a diagnostic, stop 53).

Why: on the H200 the defaults' RULER answers on Gemma 3 equalled dense even with sparse_policy
"always", except for the first requests of each cell, while a Quest cell with the same top_k
differed everywhere. This runs one config through the engine over RULER prompts (or random ids
on a tiny Gemma 3) and prints, per request, the decode batch sizes it ran in, and the selected
tokens / context / device slots of its first and last sparse layer-steps.

    python benchmarks/oneoff/selection_probe.py --ruler gemma3-270m:ruler_fwe --length 16384 \
        --samples 50 --requests 50 --device cuda --dtype bfloat16 --config '{"algorithm": "quest"}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cost_policy_cpu_check import add_prompt_args, prompt_batch  # noqa: E402
from helpers import run_batch  # noqa: E402
from sparse_framework.engine.engine import Engine  # noqa: E402
from sparse_framework.engine.engine_config import EngineConfig  # noqa: E402
from sparse_framework.engine.models import load_model  # noqa: E402
from sparse_framework.engine.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default='{"algorithm": "quest", "sparse_policy": "always", "min_sparse_prompt_len": 0}')
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--batched-tokens", type=int, default=32768)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    add_prompt_args(ap)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    path, batch = prompt_batch(ap, args)
    longest = max(len(b) for b in batch)
    model = load_model(path, dtype=dtype, device=args.device)
    engine = Engine(model, model.config, json.loads(args.config), EngineConfig(
        max_num_seqs=args.requests, max_model_len=longest + args.new_tokens + 64,
        max_num_batched_tokens=args.batched_tokens))
    coord = engine.runner.coord
    place = coord._select_and_place
    seen: dict[str, list[tuple[int, int, int, int]]] = {}

    def probe(layer, q, batch, inputs):  # type: ignore[no-untyped-def]
        sel, slots = place(layer, q, batch, inputs)
        if layer == max(0, coord.layout.num_layers - 1) and not coord._step_dense and batch.sparse_batch is not None:
            lens, used = sel.lengths[:, 0].tolist(), (slots[:, 0] >= 0).sum(-1).tolist()
            for i, r in enumerate(batch.requests):
                seen.setdefault(r.rid, []).append((len(batch), r.seq_len, int(lens[i]), int(used[i])))
        return sel, slots

    coord._select_and_place = probe
    out = run_batch(engine, batch, SamplingParams(max_tokens=args.new_tokens, temperature=0.0))
    print(f"config {coord.config.key() if hasattr(coord.config, 'key') else coord.config}")
    print(f"tally: {coord.dense_tally.summary()}")
    for rid in sorted(out, key=lambda s: int(s[1:])):
        v = seen.get(rid, [])
        first = f"{v[0][2]}/{v[0][1]} slots {v[0][3]}" if v else "-"
        last = f"{v[-1][2]}/{v[-1][1]} slots {v[-1][3]}" if v else "-"
        print(f"{rid:>4} sparse steps {len(v):3} batch {min((b for b, *_ in v), default=0)}-"
              f"{max((b for b, *_ in v), default=0)} first {first} last {last} tokens {out[rid][:6]}")


if __name__ == "__main__":
    main()
