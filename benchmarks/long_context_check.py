"""Is a long-context failure the model's or the engine's? transformers' own `generate` and the
engine, both on the CPU in one dtype (float32 by default), greedy on the same RULER prompt, token for token.

RULER on Gemma 3 270M falls from 0.62 (8K) to 0.16 (16K) and 0.00 (32K) with dense attention on
the H200 (docs/ruler_32k.md), with degenerate answers ("10t. 10t. ..."). The engine was checked
against transformers on short prompts only (tests/test_gemma3_270m.py); this checks the long
ones: if transformers writes the same tokens, the collapse is the model's (a 270M base model in
its Q4_K_M quantization), not the engine's.

    python benchmarks/long_context_check.py --model gemma3-270m --task niah_single_1 \
        --contexts 8192,16384 --index 0 --new-tokens 24 --json benchmarks/results/long_context_check.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402


def prompt_ids(model: str, task: str, context: int, samples: int, index: int, chat: bool,
               without_bos: bool) -> tuple[Any, list[int], Any]:
    """The RULER runner's prompt (the cached lm-eval sample, raw or in the chat template, encoded
    as the engine encodes text); `without_bos`: as the runner encoded it before 2026-11-29
    (no special tokens), the encoding of the first Gemma cells on the H200."""
    from sparse_framework.engine.llm import load_tokenizer
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.ruler import prompt_ids as runner_ids
    from sparse_framework.eval.ruler import prompt_text, ruler_samples

    root = resolve_model(model)
    tok = load_tokenizer(root)
    sample = ruler_samples(root, task, context, samples, 0, tokenizer=tok)[index]
    ids = (list(tok.encode(prompt_text(sample, tok, chat), add_special_tokens=False)) if without_bos
           else runner_ids(sample, tok, chat))
    return root, ids, (tok, sample)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--contexts", default="8192", help="comma-separated RULER lengths")
    ap.add_argument("--samples", type=int, default=50, help="the cached draw the sample comes from")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both models' dtype")
    ap.add_argument("--without-bos", action="store_true", help="no special tokens (the runner's encoding before "
                    "2026-11-29, which left Gemma without its <bos>)")
    ap.add_argument("--chat", action="store_true", help="the chat template (the RULER runs used raw prompts)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    rows = [check(args, context) for context in (int(c) for c in args.contexts.split(","))]
    if args.json:
        write_results(str(args.json), {"what": "transformers generate vs the engine, CPU, greedy"}, rows,
                      "long_context_check.py", argv)
    return 0 if all(r["equal_tokens"] for r in rows) else 1


def check(args: argparse.Namespace, context: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from sparse_framework.engine.llm import LLM
    from sparse_framework.config import DENSE_CONFIG
    from sparse_framework.engine.models import load_model
    from sparse_framework.engine.sampling import SamplingParams

    root, ids, (tok, sample) = prompt_ids(args.model, args.task, context, args.samples, args.index, args.chat,
                                            args.without_bos)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(root, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)
    hf_tokens = out[0, len(ids):].tolist()
    t1 = time.perf_counter()
    del hf
    llm = LLM.from_model(load_model(root, dtype, "cpu"), DENSE_CONFIG, tokenizer=tok,
                         max_model_len=len(ids) + args.new_tokens + 64, max_num_seqs=1, max_num_batched_tokens=4096)
    engine_tokens = list(llm.generate([ids], SamplingParams(max_tokens=args.new_tokens, temperature=0))[0].token_ids)
    t2 = time.perf_counter()
    diff = next((i for i, (a, b) in enumerate(zip(hf_tokens, engine_tokens)) if a != b), None)
    row = {
        "model": args.model, "dtype": args.dtype, "bos": ids[:1] == [tok.bos_token_id], "task": args.task,
        "context": context, "index": args.index,
        "prompt_tokens": len(ids), "answer": list(sample.outputs),
        "transformers": tok.decode(hf_tokens), "engine": tok.decode(engine_tokens),
        "equal_tokens": diff is None and len(hf_tokens) == len(engine_tokens),
        "first_difference": diff, "transformers_s": round(t1 - t0, 1), "engine_s": round(t2 - t1, 1),
    }
    for key in ("context", "dtype", "bos", "answer", "transformers", "engine", "equal_tokens", "first_difference",
                "transformers_s", "engine_s"):
        print(f"{key:>16}: {row[key]!r}", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
