"""Shared test constants and helpers."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from sparse_framework import Batch, Request


# The store and rule the tests written before issue 43 assume, now one option away from the
# defaults (store "resident", sparse_policy "cost"): full K/V on the host with a device buffer, and
# every prompt from min_sparse_prompt_len on decoding sparsely.
HIERARCHICAL_ALWAYS = {"store": "hierarchical", "sparse_policy": "always"}

# A Quest config small enough for CPU tests: 8 pages of 4 tokens per selection, plus one sink
# page and the recent window, in a 256-token device buffer; every prompt and layer decodes sparsely.
SMALL_QUEST = {
    **HIERARCHICAL_ALWAYS,
    "algorithm": "quest",
    "top_k": 32,
    "page_size": 4,
    "sink_tokens": 4,
    "recent_tokens": 8,
    "min_sparse_prompt_len": 0,
    "device_buffer_tokens": 256,
    "extra": {"dense_first_layers": 0},
}


def batch_of(reqs: list[Request]) -> Batch:
    """The step tensors forward_begin would fill in, for algorithm tests without a coordinator."""
    b = Batch(reqs)
    b.seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    b.slot_ids = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    b.max_seq_len = max(r.seq_len for r in reqs)
    return b


def pip_install_to_target(source: Path, base: Path) -> Path:
    """`pip install` a plugin distribution at `source` into `base / "site"` (no deps, no index)
    and return that directory, for tests to put on sys.path. The source is copied to
    `base / "src"` first so that the build leaves nothing in the repository."""
    src = base / "src"
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = base / "site"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--no-index", "--target", str(target), str(src),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    return target


def run_interpreted(script: str, marker: str, *, timeout: int = 900) -> None:
    """Run `script` in a fresh Python under TRITON_INTERPRET=1 (Triton reads it at import,
    so it cannot be switched on inside this process) and assert that it exits cleanly and
    prints `marker`. The tests directory is importable there, and the literal TESTS_DIR in
    the script becomes its path."""
    tests_dir = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    script = script.replace("TESTS_DIR", repr(tests_dir))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert marker in done.stdout, done.stdout[-3000:]


def dense_attention_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain formula, in float64, a loop over query heads: q [Hq, D], k [L, Hk, D],
    v [L, Hk, Dv] -> [Hq, Dv]. Query head h reads KV head h // (Hq // Hk); logits
    s = scale q.k, soft-capped to softcap * tanh(s / softcap) when softcap is set; with
    sinks [Hq], out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m)) for
    m = max(sink, max_j s_j); no tokens gives zeros."""
    hq, hk = q.shape[0], k.shape[1]
    out = torch.zeros(hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        s = kh @ q[h].double() * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        sink = None if sinks is None else float(sinks[h])
        if k.shape[0] == 0:
            continue
        m = s.max() if sink is None else torch.maximum(s.max(), torch.tensor(sink, dtype=torch.float64))
        e = torch.exp(s - m)
        den = e.sum() + (0.0 if sink is None else math.exp(sink - float(m)))
        out[h] = (e @ vh) / den
    return out


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):  # type: ignore[no-untyped-def]
    """A script of benchmarks/ (not a package) imported as a module, registered under its name
    so that its dataclasses and pickles resolve."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_batch(engine, batch: list[list[int]], params, prefix: str = "r") -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Add every prompt of `batch` to `engine` as `{prefix}{i}` with `params`, run them all to
    completion and return each request's tokens; every request must have run to its length
    (a failed one is reported with its error)."""
    for i, p in enumerate(batch):
        engine.add_request(f"{prefix}{i}", p, params)
    outs = engine.run_to_completion()
    assert all(o.finish_reason == "length" for o in outs), [(o.request_id, o.error) for o in outs]
    return {o.request_id: o.token_ids for o in outs}


# A tiny Llama for the engine's end-to-end tests (tests/test_engine_engine.py, test_engine_spills.py):
# saved once per module by `tiny_llama_checkpoint`, prompts of random ids by `random_prompts`.
TINY_LLAMA_VOCAB = 96
TINY_LLAMA = dict(vocab_size=TINY_LLAMA_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10_000.0,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny_llama_checkpoint(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(the transformers model, its saved directory): seeded, so every module gets the same."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def random_prompts(lens: list[int], seed: int = 0, vocab: int = TINY_LLAMA_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def tiny_engine(path, sparse: dict, max_model_len: int, **config):  # type: ignore[no-untyped-def]
    """An Engine over a saved checkpoint in float32 on the CPU, 4 request rows by default."""
    from sparse_framework.engine.engine import Engine
    from sparse_framework.engine.engine_config import EngineConfig
    from sparse_framework.engine.models import load_model

    model = load_model(path, dtype=torch.float32)
    return Engine(model, model.config, sparse, EngineConfig(**{"max_num_seqs": 4, "max_model_len": max_model_len, **config}))


def dense_loop_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [Hq, D], k [L, Hk, D], v [L, Hk, Dv] -> [Hq, Dv] in float64, by a loop over heads.
    An empty sequence (L = 0) gives zeros."""
    hq, hk = q.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[0] == 0:
        return torch.zeros(hq, v.shape[-1], dtype=torch.float64)
    out = []
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        p = (kh @ q[h].double() * scale).softmax(0)
        out.append(p @ vh)
    return torch.stack(out)


# the sliding-window hybrids' tiny shape (tests/test_engine_hybrid.py, test_engine_prefix_cache_hybrid.py)
TINY_HYBRID = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None,
                   bos_token_id=None, pad_token_id=None)


def tiny_hf_model(config_cls: str, model_cls: str, extra: dict):
    """A transformers model of the TINY_HYBRID shape (seed 0), its norms' weights drawn too."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**TINY_HYBRID, **extra)).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1 + w): make them matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
    return model
