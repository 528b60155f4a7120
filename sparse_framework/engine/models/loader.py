"""Build a `DecoderModel` (Llama family) or `GemmaDecoderModel` (Gemma 2/3) from a Hugging
Face checkpoint directory, the shipped reference model, or random weights.

The model is built on the meta device (no memory, no random init of billions of weights),
materialised on the target device and filled tensor by tensor from the safetensors files,
each tensor cast to the requested dtype on its way. Every parameter must be found with its
exact shape, and every stored tensor must be used: a checkpoint that does not match the config
is an error naming the tensor, never a silently half-initialised model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ...common.errors import ConfigError
from ...common.layout import check_device
from .config import CheckpointError, ModelConfig, read_config_json
from .deepseek_v32 import DeepseekV32Model
from .gemma import GemmaDecoderModel
from .llama import DecoderModel
from .tensor_parallel import TPShard, check_tensor_parallel, shard_index

EngineModel = DecoderModel | GemmaDecoderModel | DeepseekV32Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
# stored by some older checkpoints, recomputed here from the config
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def model_class(config: ModelConfig) -> type[DecoderModel] | type[GemmaDecoderModel] | type[DeepseekV32Model]:
    """The engine model of a config: DeepseekV32Model for MLA, GemmaDecoderModel for Gemma 2/3,
    else the Llama family's DecoderModel."""
    if config.mla is not None:
        return DeepseekV32Model
    return GemmaDecoderModel if config.is_gemma else DecoderModel


def build_model(
    config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    tp: TPShard | None = None,
) -> EngineModel:
    """The model class of the config's family, built with `dtype` on `device` ("meta": no
    memory); `tp`: one rank's shard of a tensor-parallel Llama-family model (tensor_parallel.py)."""
    if tp is not None and tp.world_size > 1:
        check_tensor_parallel(config, tp.world_size)
        return DecoderModel(config, dtype=dtype, device=device, tp=tp)
    return model_class(config)(config, dtype=dtype, device=device)


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are slow and inexact)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _resolve(dtype: torch.dtype | str | None, device: str | torch.device) -> tuple[torch.dtype, torch.device]:
    try:
        dev = check_device(device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dtype is None:
        return default_dtype(dev), dev
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ConfigError(f"model dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return resolved, dev  # type: ignore[return-value]


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
    tp: TPShard | None = None,
) -> EngineModel:
    """The checkpoint in directory `path` (config.json + *.safetensors, single file or sharded
    with model.safetensors.index.json) on `device` in `dtype` (None: bfloat16 on a GPU,
    float32 on the CPU), in eval mode. Raises CheckpointError / UnsupportedModelError. `tp`:
    load only this rank's slices of the full tensors (tensor_parallel.py; each tensor is
    checked against its full shape, then sliced as it is read)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model directory not found: {root}" + (" (it is a file)" if root.exists() else ""))
    config = ModelConfig.from_hf(read_config_json(root))
    return _build(config, _weight_files(root), dtype, device, tp)


def load_reference(dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu") -> EngineModel:
    """The shipped reference model (sparse_framework/reference) through the same loader."""
    from ...toy_model.model import WEIGHTS

    if not WEIGHTS.is_file():
        raise CheckpointError(f"reference weights not found at {WEIGHTS}; reinstall the package")
    return _build(reference_config(), {WEIGHTS: None}, dtype, device)


def reference_config() -> ModelConfig:
    """The reference model's ModelConfig, from the ARCHITECTURE its transformers twin is built from."""
    from ...toy_model.model import ARCHITECTURE

    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **ARCHITECTURE})


def random_model(
    config: ModelConfig, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu", seed: int = 0,
    tp: TPShard | None = None,
) -> EngineModel:
    """Random weights for benchmarks: N(0, 0.02) matrices and biases (transformers' default
    initializer range), unit norms (zero LayerNorm biases and router correction biases); drawn
    on `device` from `seed`, so the same seed gives the same model on the same kind of device.
    For a DeepSeek-V3.2 config a benchmark may pass one with a shrunk MoE
    a checkpoint always loads with the experts its config names.

    `tp`: this rank's slices of the very weights a lone rank draws from `seed` (each full
    tensor drawn in turn, one at a time, then sliced), so TP=N computes TP=1's model."""
    dtype, dev = _resolve(dtype, device)
    model = build_model(config, dtype=dtype, device="meta", tp=tp)
    model.to_empty(device=dev)
    model.tie_weights()
    sharded = tp is not None and tp.world_size > 1
    full_shapes = {n: tuple(p.shape) for n, p in build_model(config, device="meta").named_parameters()} if sharded else {}
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is listed once
            target = torch.empty(full_shapes[name], dtype=dtype, device=dev) if sharded else param
            if name.endswith("norm.weight"):  # unit norms: Gemma's scale by 1 + weight
                target.fill_(0.0 if config.is_gemma else 1.0)
            elif name.endswith(("norm.bias", "e_score_correction_bias")):
                target.zero_()
            else:
                target.normal_(0.0, 0.02, generator=gen)
            if sharded:
                assert tp is not None
                index = shard_index(name, full_shapes[name], tp)
                if index is None:
                    param.zero_()
                else:
                    param.copy_(target[index])
    return model.eval()


def _weight_files(root: Path) -> dict[Path, set[str] | None]:
    """safetensors file -> the tensor names the index assigns it (None: whatever it holds)."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} has no readable 'weight_map': {exc!r}") from exc
        shards: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(root / file, set()).add(name)
        missing = sorted(str(f.name) for f in shards if not f.is_file())
        if missing:
            raise CheckpointError(f"{index} names shard files that are not in {root}: {', '.join(missing)}")
        return dict(shards)
    found = sorted(root.glob("*.safetensors"))
    if not found:
        others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise CheckpointError(f"no *.safetensors weights in {root}{hint}")
    return {f: None for f in found}


def _build(
    config: ModelConfig, files: dict[Path, set[str] | None], dtype: torch.dtype | str | None, device: str | torch.device,
    tp: TPShard | None = None,
) -> EngineModel:
    from safetensors import safe_open

    dtype, dev = _resolve(dtype, device)
    model = build_model(config, dtype=dtype, device="meta", tp=tp)
    model.to_empty(device=dev)
    model.tie_weights()
    params = dict(model.named_parameters())  # a tied LM head appears once, as the embedding
    sharded = tp is not None and tp.world_size > 1
    full = {n: tuple(p.shape) for n, p in build_model(config, device="meta").named_parameters()} if sharded else {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file, names in files.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in sorted(names if names is not None else f.keys()):
                    if name not in params:
                        if not _ignorable(name, config):
                            unexpected.append(name)
                        continue
                    stored = f.get_slice(name)
                    shape = tuple(stored.get_shape())
                    expected = full[name] if sharded else tuple(params[name].shape)
                    if shape != expected:
                        raise CheckpointError(
                            f"tensor {name!r} in {file.name} has shape {list(shape)}, but the config "
                            f"({config.architecture}) needs {list(expected)}"
                        )
                    index = shard_index(name, shape, tp) if sharded and tp is not None else None
                    if not sharded:
                        params[name].copy_(f.get_tensor(name))
                    elif index is None:  # a row-parallel bias outside rank 0
                        params[name].zero_()
                    else:  # read only this rank's slice of the stored tensor
                        params[name].copy_(stored[index])
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) the config needs: {_some(missing)}")
    if unexpected:
        raise CheckpointError(
            f"the checkpoint has {len(unexpected)} tensor(s) a {config.architecture} of this config does not "
            f"use (a config mismatch?): {_some(unexpected)}"
        )
    return model.eval()


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Stored tensors the model does not need: RoPE tables, a tied head saved anyway, and
    DeepSeek's multi-token-prediction layers (stored as layers num_layers.., not run; as
    transformers skips them)."""
    if config.mla is not None and config.mla.num_nextn_predict_layers and name.startswith("model.layers."):
        index = name.split(".")[2]
        if index.isdigit() and int(index) >= config.num_layers:
            return True
    return name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


def _some(names: Iterable[str], limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
