"""Tensor parallelism of the Llama-family model: which slice of each Hugging Face tensor a rank holds.

Megatron's split, one all-reduce per attention and one per MLP:

  q/k/v_proj   column-parallel: rank r holds its num_heads / N query heads and num_kv_heads / N
               KV heads (rows of the weight, and of the bias); the GQA groups stay whole, since
               rank r's query heads r·Hq/N.. read KV heads r·Hkv/N.. at TP=1 too
  o_proj       row-parallel: the columns of its heads; the partial outputs are summed across
               ranks (the all-reduce) and its bias is held by rank 0 only (zeros elsewhere)
  gate/up_proj column-parallel over intermediate_size / N
  down_proj    row-parallel, then the all-reduce (bias on rank 0 only, as o_proj)
  everything else (embeddings, norms, q/k norms, the LM head) replicated: the simplest
               choice, at the price of the vocabulary matrix on every rank (1 GiB of Llama-3-8B's
               bf16 weights per rank; vocab-parallel embeddings and head are not built)

Each rank's model is built from `local_config(config, N)`: a ModelConfig with its own head,
KV head and MLP counts, which is also what its KV layout, coordinator and store are sized
from (each rank holds only its own KV heads). This module is pure shapes and slicing; the
process group lives in engine/parallel.py, which hands the model a `TPShard` with its
all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...common.errors import ConfigError
from .config import GEMMA_FAMILIES, ModelConfig

COLUMN = "column"  # rows of the weight (dim 0) and of the bias
ROW = "row"  # columns of the weight (dim 1); the bias on rank 0 only
REPLICATED = "replicated"

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPShard:
    """A rank's place in a tensor-parallel group: `reduce(x)` sums x across the ranks in place
    and returns it (None: a lone rank, for tests of the slicing alone)."""

    rank: int
    world_size: int
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"TPShard: rank must be in 0..world_size-1, got rank {self.rank} of {self.world_size}")


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Refuse, naming the setting, what this split cannot run: another family, or counts of
    heads, KV heads or MLP columns that N does not divide."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return
    if config.mla is not None or config.family in GEMMA_FAMILIES:
        raise ConfigError(
            f"tensor_parallel_size={world_size}: tensor parallelism is built for the Llama family only "
            f"(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), got {config.architecture}; "
            "use tensor_parallel_size=1"
        )
    if config.num_heads % world_size or config.num_kv_heads % world_size:
        raise ConfigError(
            f"tensor_parallel_size={world_size} must divide both num_heads ({config.num_heads}) and num_kv_heads "
            f"({config.num_kv_heads}): each rank holds whole KV heads and their query heads"
        )
    if config.intermediate_size % world_size:
        raise ConfigError(
            f"tensor_parallel_size={world_size} must divide intermediate_size ({config.intermediate_size}) "
            "(the MLP's columns are split evenly)"
        )


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's model: its heads, KV heads and MLP columns (head_dim and the
    attention scale unchanged, since the scale follows head_dim or query_pre_attn_scalar)."""
    check_tensor_parallel(config, world_size)
    if world_size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def split_kind(name: str) -> str:
    """COLUMN, ROW or REPLICATED for a Hugging Face parameter name of the Llama family."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _COLUMN_PARALLEL:
        return COLUMN
    if len(parts) >= 2 and parts[-2] in _ROW_PARALLEL:
        return ROW
    return REPLICATED


def shard_index(name: str, full_shape: tuple[int, ...], shard: TPShard) -> tuple[slice, ...] | None:
    """The index of rank `shard.rank`'s part of tensor `name` of shape `full_shape` (None: the
    rank holds zeros of the bias's shape: a row-parallel bias outside rank 0)."""
    kind, n, r = split_kind(name), shard.world_size, shard.rank
    if kind == REPLICATED or n == 1:
        return tuple(slice(None) for _ in full_shape)
    if kind == ROW and len(full_shape) == 1:  # the bias of a row-parallel linear
        return tuple(slice(None) for _ in full_shape) if r == 0 else None
    dim = 0 if kind == COLUMN else 1
    size = full_shape[dim] // n
    index = [slice(None)] * len(full_shape)
    index[dim] = slice(r * size, (r + 1) * size)
    return tuple(index)


def take_shard(name: str, full: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Rank `shard.rank`'s part of the full tensor `name` (a view, or zeros for a row-parallel
    bias outside rank 0)."""
    index = shard_index(name, tuple(full.shape), shard)
    return torch.zeros_like(full) if index is None else full[index]
