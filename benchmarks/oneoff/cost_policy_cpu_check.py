"""Does the cost policy's decode differ from dense where it says it went sparse? (stop 52)

On the H200 the defaults (`{"algorithm": "quest"}`: sparse_policy "cost") equalled dense in
every Gemma 3 RULER cell, at 16K/32K too, while reporting 92-99.7 % sparse layer-steps
(docs/ruler_gemma3.md). This runs the same question on the CPU with a tiny random Gemma 3
(1 KV head of 256, window 64, full layers 2 and 5) through the engine: dense, Quest with
sparse_policy "always", the cost policy, and the cost policy with its overhead at 0 (then
every step pays sparse, so it must equal "always"), printing per request whether the greedy
tokens equal dense's and "always"'s, and the coordinator's dense tally.

    python benchmarks/oneoff/cost_policy_cpu_check.py --length 12000 --requests 8   # ~40 min, 2 cores
    python benchmarks/oneoff/cost_policy_cpu_check.py --length 5000 --requests 4 --top-k 512

Stop 52 saw: 12000 x 8, top_k 1024: "always" and the cost policy (55 % of layer-steps sparse)
both differ from dense in 8 of 8; 5000 x 4, top_k 512: the cost policy with overhead 0 equals
"always" in 4 of 4. So the CPU path does what its tally says; the GPU's equality is open.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import run_batch  # noqa: E402
from sparse_framework.engine.engine import Engine  # noqa: E402
from sparse_framework.engine.engine_config import EngineConfig  # noqa: E402
from sparse_framework.engine.models import load_model  # noqa: E402
from sparse_framework.engine.sampling import SamplingParams  # noqa: E402
from sparse_framework.config import DENSE_CONFIG  # noqa: E402

S, F = "sliding_attention", "full_attention"


def tiny_gemma3(path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=16384, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, sliding_window=64, query_pre_attn_scalar=16, layer_types=[S, S, F, S, S, F],
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                         F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1 + w): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)


def add_prompt_args(ap: argparse.ArgumentParser) -> None:
    """--ruler and --samples: the prompts `prompt_batch` draws (this script's and selection_probe.py's)."""
    ap.add_argument("--ruler", metavar="MODEL:TASK", help="a catalog model and RULER task instead of the tiny "
                    "model (e.g. gemma3-270m:niah_single_1): --requests prompts of --length tokens, raw")
    ap.add_argument("--samples", type=int, help="--ruler: the cached prompt set to draw from (default: --requests)")


def prompt_batch(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Path, list[list[int]]]:
    """(checkpoint folder, --requests prompts): the first of a cached RULER set (--ruler), or
    random ids of --length on a tiny Gemma 3 saved to a temporary folder."""
    if not args.ruler:
        path = Path(tempfile.mkdtemp()) / "gemma3"
        tiny_gemma3(path)
        g = torch.Generator().manual_seed(1)
        return path, [torch.randint(0, 96, (args.length,), generator=g).tolist() for _ in range(args.requests)]
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.experiment import RulerWorkload
    from sparse_framework.eval.ruler_runner import RulerRunner

    if args.ruler.count(":") != 1:
        ap.error(f"--ruler takes MODEL:TASK (e.g. gemma3-270m:niah_single_1), got {args.ruler!r}")
    name, task = args.ruler.split(":")
    workload = RulerWorkload(kind="ruler", task=task, model=name, samples=args.samples or args.requests,
                             chat_template=False)
    runner = RulerRunner(args.device, getattr(torch, args.dtype), 0)
    return resolve_model(name), runner.prompts(workload, args.length)[1][: args.requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=12000, help="prompt tokens")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="torch_ref", help="triton: run with TRITON_INTERPRET=1 on the CPU")
    add_prompt_args(ap)
    args = ap.parse_args()
    path, batch = prompt_batch(ap, args)
    args.length = max(len(b) for b in batch)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)

    def run(sparse: dict) -> tuple[dict, str]:
        model = load_model(path, dtype=getattr(torch, args.dtype), device=args.device)
        engine = Engine(model, model.config, sparse, EngineConfig(
            max_num_seqs=args.requests, max_model_len=args.length + 64, max_num_batched_tokens=max(8192, args.length + 64)))
        algo = engine.runner.coord.algorithm
        calls = [0]
        select = algo.select

        def counted(*a, **k):  # how many selections ran (each sparse layer-step batch)
            calls[0] += 1
            return select(*a, **k)

        algo.select = counted
        out = run_batch(engine, batch, params)
        return out, f"{engine.runner.coord.dense_tally.summary()}; select calls {calls[0]}"

    quest = {"algorithm": "quest", "top_k": args.top_k, "store": "resident", "backend": args.backend}
    dense, _ = run({**DENSE_CONFIG, "backend": args.backend})
    always, tally = run({**quest, "sparse_policy": "always", "min_sparse_prompt_len": 0,
                         "extra": {"dense_first_layers": 0}})
    print(f"always: equal to dense {sum(always[k] == dense[k] for k in dense)} of {len(dense)} | {tally}")
    for name, extra in (("cost", {}), ("cost, overhead 0", {"policy_overhead_us": 0, "policy_overhead_growth_us": 0})):
        out, tally = run({**quest, **extra})
        print(f"{name}: equal to dense {sum(out[k] == dense[k] for k in dense)}, to always "
              f"{sum(out[k] == always[k] for k in dense)} of {len(dense)} | {tally}")


if __name__ == "__main__":
    main()
