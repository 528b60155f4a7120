"""The shipped reference model: a 3M-parameter Llama trained on `tasks` (no download needed).

It is an ordinary `transformers.LlamaForCausalLM` built from `reference_config()`, so sparse
decode is measured on it through the same transformers integration as on any user's model.
The weights (bf16 safetensors, ~6 MB) are package data; `benchmarks/train_reference.py` makes
them reproducibly on one GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..common.errors import SparseFrameworkError
from .tasks import BOS, PAD, VOCAB_SIZE

WEIGHTS = Path(__file__).with_name("weights") / "reference.safetensors"

# The architecture. RoPE with a large base keeps its slowest frequencies nearly still over
# tens of thousands of tokens, so content matching learnt at 8K still works further out.
ARCHITECTURE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # GQA: 4 query heads per KV head
    "head_dim": 32,
    "max_position_embeddings": 65536,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": BOS,
    "pad_token_id": PAD,
    "eos_token_id": None,
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise SparseFrameworkError(
            'the reference model is a transformers model: pip install -e ".[eval]" (in a checkout of the repository)'
        ) from exc
    return transformers


def reference_config() -> Any:
    """The model's `LlamaConfig`."""
    return _transformers().LlamaConfig(**ARCHITECTURE)


def new_reference_model() -> Any:
    """A randomly initialised reference model (what training starts from)."""
    transformers = _transformers()
    return transformers.LlamaForCausalLM(reference_config())


def save_weights(model: Any, path: Path, metadata: dict[str, Any]) -> None:
    """bf16 safetensors of the model's own tensors (the tied LM head is not stored twice)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"sparse_framework": json.dumps(metadata, sort_keys=True)})


def weights_metadata(path: Path = WEIGHTS) -> dict[str, Any]:
    """The training record stored in the weights file (seed, steps, held-out accuracy, ...)."""
    from safetensors import safe_open

    with safe_open(str(_existing(path)), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("sparse_framework", "{}"))


def load_reference_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", path: Path = WEIGHTS
) -> Any:
    """The trained reference model in eval mode (weights stored in bf16, cast to `dtype`)."""
    from safetensors.torch import load_file

    model = new_reference_model()
    state = load_file(str(_existing(path)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SparseFrameworkError(
            f"{path} does not match the reference architecture (missing {sorted(missing)}, unexpected {sorted(unexpected)})"
        )
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise SparseFrameworkError(
            f"reference weights not found at {path}; train them with benchmarks/train_reference.py "
            "(or reinstall the package)"
        )
    return path
