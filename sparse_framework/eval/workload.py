"""A synthetic long-context decode workload in which selection matters.

Every request hides a few "needle" tokens in its prompt (per layer). For KV head h, a needle's
key points along a random direction u_h (norm √dim, scaled by `needle_strength`); decode
queries of h's query heads point along u_h too, plus unit noise. Dense attention therefore
puts much of its mass on the needles, and an algorithm that misses them shows it in the
output error, the recall and the needle hit rate. Everything else is standard normal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..common.layout import check_device

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_dtype_name(name: str) -> str:
    """`name` if it is a key of DTYPES (pydantic validators raise this ValueError as the field's error)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


class WorkloadConfig(BaseModel):
    """Shape and content of the synthetic workload (one request per context length)."""

    model_config = ConfigDict(extra="forbid")

    contexts: list[int] = Field([1024, 4096, 8192], min_length=1, description="prompt length of each request")
    decode_steps: int = Field(16, ge=1, description="batched decode steps")
    num_layers: int = Field(2, ge=1, description="attention layers (all alike)")
    num_q_heads: int = Field(8, ge=1, description="query heads")
    num_kv_heads: int = Field(2, ge=1, description="KV heads (num_q_heads must be a multiple)")
    head_dim: int = Field(64, ge=1, description="dimension of a head")
    needles: int = Field(4, ge=0, description="needle tokens per request and layer")
    needle_strength: float = Field(1.25, gt=0, description="needle key scale along the query direction")
    seed: int = Field(0, description="seed of every random draw")
    dtype: str = Field("float32", description="KV dtype: " + ", ".join(DTYPES))
    device: str = Field("cpu", description="torch device of the KV and the attention")

    @field_validator("contexts")
    @classmethod
    def _positive(cls, contexts: list[int]) -> list[int]:
        if any(c < 1 for c in contexts):
            raise ValueError(f"every context length must be >= 1, got {contexts}")
        return contexts

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        check_device(name)
        return name

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, name: str) -> str:
        return check_dtype_name(name)

    @model_validator(mode="after")
    def _heads(self) -> WorkloadConfig:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class RequestData:
    """One request's generated tensors (float32, on the workload device).

    keys/values: per layer [prompt_len, kv_heads, dim]; prompt_queries: per layer
    [prompt_len, q_heads, dim]; needles: per layer int64 [needles] positions;
    directions: per layer [kv_heads, dim].
    """

    context: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prompt_queries: list[torch.Tensor]
    needles: list[torch.Tensor]
    directions: list[torch.Tensor]


class SyntheticWorkload:
    """Generates prompts and, per decode step, queries and new K/V, all seeded."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.cfg.device)

    def _query(self, direction: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, q_heads, dim]: query head j follows its KV head's direction, plus noise."""
        group = self.cfg.num_q_heads // self.cfg.num_kv_heads
        base = direction.repeat_interleave(group, dim=0)  # [q_heads, dim]
        return base.unsqueeze(0) + self._randn(rows, self.cfg.num_q_heads, self.cfg.head_dim)

    def request(self, context: int) -> RequestData:
        c = self.cfg
        data = RequestData(context, [], [], [], [], [])
        for _ in range(c.num_layers):
            direction = self._randn(c.num_kv_heads, c.head_dim)
            direction = direction / direction.norm(dim=-1, keepdim=True) * c.head_dim**0.5
            keys = self._randn(context, c.num_kv_heads, c.head_dim)
            n = min(c.needles, context)
            needles = torch.randperm(context, generator=self.gen)[:n].sort().values.to(c.device)
            keys[needles] = direction.unsqueeze(0) * c.needle_strength + 0.1 * self._randn(n, c.num_kv_heads, c.head_dim)
            data.keys.append(keys)
            data.values.append(self._randn(context, c.num_kv_heads, c.head_dim))
            data.prompt_queries.append(self._query(direction, context))
            data.needles.append(needles)
            data.directions.append(direction)
        return data

    def model_inputs(
        self, algorithm: str, specs: dict[str, tuple[int, ...]], keys: torch.Tensor, queries: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Synthetic values of the extra inputs an algorithm declares (name -> shape after
        the token dimension), for rows of keys [T, kv_heads, dim] and queries [T, q_heads, dim]."""
        known = ("index_q", "index_weights", "index_k")
        unknown = [n for n in specs if n not in known]
        if unknown:
            raise ValueError(
                f"the synthetic workload cannot provide the input(s) {unknown} that algorithm {algorithm!r} "
                f"needs; it knows {', '.join(known)} (DeepSeek's indexer)"
            )
        if not specs:
            return {}
        if "index_k" not in specs and "index_q" not in specs:
            raise ValueError(f"algorithm {algorithm!r}: index_weights without index_q or index_k has no dimension")
        dim = specs["index_k"][0] if "index_k" in specs else specs["index_q"][1]
        proj = self._index_projection(keys.shape[1] * keys.shape[2], dim, keys.device)
        out: dict[str, torch.Tensor] = {}
        if "index_k" in specs:
            out["index_k"] = keys.float().flatten(1) @ proj
        if "index_q" in specs or "index_weights" in specs:
            heads = specs["index_q"][0] if "index_q" in specs else specs["index_weights"][0]
            if queries is None:
                raise ValueError("indexer queries need the attention queries")
            t, hq, d = queries.shape
            hk = keys.shape[1]
            source = torch.arange(heads, device=keys.device) % hq  # query head of each indexer head
            placed = torch.zeros(t, heads, hk, d, device=keys.device)
            placed[:, torch.arange(heads), source // (hq // hk)] = queries.float()[:, source]
            out["index_q"] = placed.flatten(2) @ proj
            out["index_weights"] = torch.full((t, heads), (heads * dim) ** -0.5, device=keys.device)
        return {n: out[n] for n in specs}

    def _index_projection(self, width: int, dim: int, device: torch.device) -> torch.Tensor:
        """[width, dim]: identity when width == dim, else a fixed Gaussian map (norms kept in
        expectation)."""
        if width == dim:
            return torch.eye(dim, device=device)
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        return (torch.randn(width, dim, generator=gen) / dim**0.5).to(device)

    def decode_inputs(self, reqs: list[RequestData], layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step's q [B, q_heads, dim] and new k, v [B, kv_heads, dim] for a layer."""
        c = self.cfg
        q = torch.cat([self._query(r.directions[layer], 1) for r in reqs])
        k = self._randn(len(reqs), c.num_kv_heads, c.head_dim)
        v = self._randn(len(reqs), c.num_kv_heads, c.head_dim)
        return q, k, v
