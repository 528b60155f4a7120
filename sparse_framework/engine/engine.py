"""`Engine`: requests in, tokens out — the scheduler, the runner and the sampler in a loop.

    engine = Engine(model, model_config, {"algorithm": "quest"}, EngineConfig(max_num_seqs=8))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():          # the requests that finished in this step
            print(out.rid, out.token_ids, out.finish_reason)

Each `step()` asks the scheduler for a plan (decode rows and prefill chunks within the token
budget; admissions, preemptions and resumptions already reserved through `RunnerBudget`),
runs it as one packed forward (`ModelRunner.execute`), samples a token for every decode row
and every prompt the step completed, and reports them back. A request that can never run
(too long, bad sampling values, larger than the pools) finishes at once with
`finish_reason == "error"` and a message; the others are not affected.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..common.errors import ConfigError, SparseFrameworkError
from ..common.flashmla_format import LATENT_DIM, NOPE_DIM
from ..config import SparseConfig, load_config
from .budget import RunnerBudget
from .memory import EngineMemoryPlan, plan_for
from .models import ModelConfig
from .prefill_attention import CHOICES as PREFILL_CHOICES
from .runner import DecodeRow, Model, ModelRunner
from .runner import PrefillChunk as RunnerChunk
from .sampling import Sampler, SamplingParams, finished
from .scheduler import FinishReason, Scheduler, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """How many requests and tokens one engine serves at once.

    max_num_seqs: requests running at once (the coordinator's request rows);
    max_num_batched_tokens: tokens per step (decode rows + prefill chunk tokens);
    max_prefill_chunk: the longest chunk of one prompt in a step (None: the token budget);
    max_model_len: prompt + generated tokens of one request (None: the model's
    max_position_embeddings); staging_tokens: prompt tokens staged at once during prefill
    (None: max_model_len, one longest prompt); device/host_capacity_tokens: the store's pools
    (None: the coordinator's sizing); decode_graphs: the coordinator's per-layer decode graphs
    (CUDA); cuda_graphs: whole decode-only steps replayed from CUDA graphs (CUDA;
    step_graphs.py); fused_ops: the model's fused projections and layer kernels
    (DecoderModel.use_fused_ops; None: on for a CUDA device when the model has them — Gemma's
    have none, `supports_fused_ops`); prefill_attention: "auto"
    (flash-attn's varlen kernel where installed, else SDPA), "flash_attn" (required) or "sdpa"
    (engine/prefill_attention.py); seed: the sampler's generator
    for requests without a seed of their own. kv_cache_dtype: "auto" (the KV store in the
    model's dtype) or "fp8" (MLA models with a 512 + 64 latent only: the store keeps FlashMLA's
    656-byte FP8 rows, quantising the model's latents as it writes them, on the device and the
    host; `kv_store_dtype` maps it).

    Memory (engine/memory.py, docs/engine.md "Memory"): gpu_memory_utilization (0 < u <= 1)
    sizes the pools from that fraction of the device's memory less the weights, one step's
    activations and the prefill staging, as vLLM does; max_num_seqs is then an upper bound and
    the engine takes as many request rows of max_model_len as fit on the device and in the host
    budget, host_memory_bytes (None: a fraction of MemAvailable). device_memory_bytes: the
    device memory the plan takes the fraction of (None: the CUDA device's; required on a CPU
    device, which has none of its own). None (the default): max_num_seqs x max_model_len."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None
    staging_tokens: int | None = None
    device_capacity_tokens: int | None = None
    host_capacity_tokens: int | None = None
    decode_graphs: bool = False
    cuda_graphs: bool = False
    fused_ops: bool | None = None
    prefill_attention: str = "auto"
    seed: int | None = 0
    gpu_memory_utilization: float | None = None
    host_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prefill_chunk", "max_model_len", "staging_tokens", "device_capacity_tokens", "host_capacity_tokens",
                     "host_memory_bytes", "device_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"EngineConfig.{name} must be None or >= 1, got {value}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.prefill_attention not in PREFILL_CHOICES:
            raise ConfigError(f"EngineConfig.prefill_attention must be one of {', '.join(PREFILL_CHOICES)}, "
                              f"got {self.prefill_attention!r}")
        u = self.gpu_memory_utilization
        if u is None:
            for name in ("host_memory_bytes", "device_memory_bytes"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"EngineConfig.{name} is a budget of the memory plan: set gpu_memory_utilization "
                                      "(0 < u <= 1) too")
            return
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"EngineConfig.gpu_memory_utilization must be None or in (0, 1] (a fraction of the "
                              f"device's memory), got {u!r}")
        for name in ("device_capacity_tokens", "host_capacity_tokens"):
            if getattr(self, name) is not None:
                raise ConfigError(f"EngineConfig.{name} and gpu_memory_utilization both size the pools: give one "
                                  "(with gpu_memory_utilization the pools follow from the memory plan)")


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_store_dtype(kv_cache_dtype: str, model_config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV store's dtype for EngineConfig.kv_cache_dtype: the model's `dtype` ("auto"), or
    float8_e4m3fn ("fp8"), which the store keeps in FlashMLA's 656-byte latent rows: an MLA
    model with kv_lora_rank 512 and qk_rope_head_dim 64 only (ConfigError otherwise)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype != "fp8":
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    mla = model_config.mla
    if mla is None or (mla.kv_lora_rank, mla.qk_rope_head_dim) != (NOPE_DIM, LATENT_DIM - NOPE_DIM):
        shape = "not an MLA model" if mla is None else f"latent {mla.kv_lora_rank} + {mla.qk_rope_head_dim}"
        raise ConfigError(f"kv_cache_dtype 'fp8' stores FlashMLA's 656-byte FP8 rows: it needs an MLA model with "
                          f"kv_lora_rank {NOPE_DIM} and qk_rope_head_dim {LATENT_DIM - NOPE_DIM} ({model_config.architecture}: "
                          f"{shape}); use kv_cache_dtype 'auto'")
    return torch.float8_e4m3fn


@dataclass
class RequestOutput:
    """A finished request: its tokens, why it ended, and its timings (seconds, perf_counter)."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    text: str | None = None  # filled in by `LLM` when it has a tokenizer
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to the first token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or len(self.token_ids) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.token_ids) - 1)

    def as_dict(self) -> dict[str, Any]:
        return {"rid": self.rid, "prompt_tokens": len(self.prompt_token_ids), "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason, "error": self.error, "ttft_s": self.ttft,
                "tpot_s": self.tpot, "num_preemptions": self.num_preemptions}


@dataclass
class _Live:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float
    first_token: float | None = None


class Engine:
    """Continuous batching of requests over one model and one SparseCoordinator."""

    def __init__(
        self,
        model: Model,
        model_config: ModelConfig,
        sparse_config: SparseConfig | dict[str, Any] | str,
        config: EngineConfig | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = model_config
        first = next(iter(model.parameters())) if hasattr(model, "parameters") else None  # type: ignore[attr-defined]
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        dtype = dtype or (first.dtype if first is not None else torch.float32)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        layout = model_config.kv_layout(kv_store_dtype(config.kv_cache_dtype, model_config, dtype), self.device,
                                        max_model_len)  # the store's: full-attention layers
        sparse_config = load_config(sparse_config)
        rows, device_tokens, host_tokens = config.max_num_seqs, config.device_capacity_tokens, config.host_capacity_tokens
        self.memory_plan: EngineMemoryPlan | None = None
        if config.gpu_memory_utilization is not None:
            params = model.parameters() if hasattr(model, "parameters") else ()  # type: ignore[attr-defined]
            self.memory_plan = plan = plan_for(
                params, model_config, layout, sparse_config, device=self.device, max_model_len=max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization, device_memory_bytes=config.device_memory_bytes,
                host_memory_bytes=config.host_memory_bytes, max_prefill_chunk=config.max_prefill_chunk,
                staging_tokens=config.staging_tokens, dtype=dtype,
            )
            log.info("%s", plan.describe())
            plan.check()
            rows, device_tokens, host_tokens = plan.num_seqs, plan.device_capacity_tokens, plan.host_capacity_tokens
        self.num_seqs = rows
        supported = getattr(model, "supports_fused_ops", hasattr(model, "use_fused_ops"))
        fused = config.fused_ops if config.fused_ops is not None else self.device.type == "cuda" and supported
        if fused:
            if not supported:
                why = getattr(model, "fused_ops_unsupported", "engine/models' DecoderModel has one")
                raise ConfigError(f"EngineConfig.fused_ops=True: the model ({type(model).__name__}) has no fused path: "
                                  f"{why}")
            model.use_fused_ops()  # type: ignore[attr-defined]
        self.runner = ModelRunner(
            model, layout, sparse_config,
            num_q_heads=model_config.num_heads, max_num_seqs=rows, max_model_len=max_model_len,
            staging_tokens=config.staging_tokens or max_model_len,
            device_capacity_tokens=device_tokens, host_capacity_tokens=host_tokens,
            decode_graphs=config.decode_graphs, cuda_graphs=config.cuda_graphs,
            prefill_attention=config.prefill_attention, model_config=model_config, mla=model_config.mla,
            compute_dtype=dtype,
        )
        self.budget = RunnerBudget(self.runner)
        self.scheduler = Scheduler(
            self.budget, max_num_batched_tokens=max(config.max_num_batched_tokens, rows),
            max_num_seqs=rows, max_prefill_chunk=config.max_prefill_chunk, max_model_len=max_model_len,
        )
        self.sampler = Sampler(config.seed)
        self.eos = model_config.eos_token_ids
        self.max_model_len = max_model_len
        self._live: dict[str, _Live] = {}
        self._rejected: list[RequestOutput] = []
        # per step run: (decode rows, prefill tokens, context tokens of the decode rows, seconds);
        # a step ends with its sampled tokens on the host, so the wall time is the step's
        self.step_log: list[tuple[int, int, int, float]] = []

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. One that can never run (empty prompt, tokens outside the
        vocabulary, prompt + max_tokens beyond max_model_len or the pools, bad sampling
        values) is not an exception: it comes back from the next `step()` with
        finish_reason "error" and the reason, and the others run on."""
        params = params or SamplingParams()
        now = time.perf_counter()
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already queued or running")
        error = self._check(prompt_ids, params)
        seq = Sequence(rid, list(prompt_ids), params)
        if error is None and self.scheduler.add(seq):
            self._live[rid] = _Live(seq, params, params.make_generator(self.device), now)
            return
        why = error or seq.error or "rejected"
        self._rejected.append(RequestOutput(rid, list(prompt_ids), [], FinishReason.ERROR.value, why,
                                            arrival_time=now, finish_time=now))

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> str | None:
        if not isinstance(params, SamplingParams):
            return f"sampling params must be a SamplingParams, got {type(params).__name__}"
        if len(prompt_ids) == 0:
            return "the prompt is empty"
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}"
        try:
            params.check(vocab)
        except SparseFrameworkError as exc:
            return str(exc)
        return None

    def abort(self, rid: str) -> RequestOutput | None:
        """Stop a request and free everything it holds; its output so far (None if unknown)."""
        live = self._live.pop(rid, None)
        seq = self.scheduler.abort(rid)
        if live is None or seq is None:
            return None
        return self._output(live, FinishReason.ABORT.value)

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    # -- a step --------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps run so far (plans with rows)."""
        return len(self.step_log)

    def step(self) -> list[RequestOutput]:
        """Run one step; the requests that finished in it (rejected ones included)."""
        outputs, self._rejected = self._rejected, []
        self.budget.begin_plan()
        plan = self.scheduler.schedule()
        for seq in plan.finished:
            live = self._live.pop(seq.rid)
            outputs.append(self._output(live, FinishReason.ERROR.value, seq.error))
        if plan.is_empty:
            return outputs
        started = time.perf_counter()
        context = sum(s.num_computed_tokens + 1 for s in plan.decode)
        decode = [DecodeRow(s.rid, s.last_token_id) for s in plan.decode]
        chunks = [RunnerChunk(c.seq.rid, tuple(c.seq.prompt_ids[c.start : c.end]), c.start, c.is_last) for c in plan.prefill]
        logits = self.runner.execute(decode, chunks)
        sampled = plan.sampled
        lives = [self._live[s.rid] for s in sampled]
        tokens = self.sampler.sample(logits, [x.params for x in lives], [x.generator for x in lives]).tolist() if sampled else []
        now = time.perf_counter()
        self.step_log.append((len(plan.decode), plan.num_tokens - len(plan.decode), context, now - started))
        new_tokens, stops = {}, {}
        for live, token in zip(lives, tokens):
            seq = live.seq
            new_tokens[seq.rid] = token
            if live.first_token is None:
                live.first_token = now
            reason = finished(live.params, token, len(seq.output_ids) + 1, self.eos or None)
            if reason is not None:
                stops[seq.rid] = reason
        for seq in self.scheduler.on_step_done(plan, new_tokens, stops):
            live = self._live.pop(seq.rid)
            outputs.append(self._output(live, str(seq.finish_reason.value), seq.error))
        return outputs

    def _output(self, live: _Live, reason: str, error: str | None = None) -> RequestOutput:
        seq = live.seq
        return RequestOutput(
            seq.rid, list(seq.prompt_ids), list(seq.output_ids), reason, error, arrival_time=live.arrival,
            first_token_time=live.first_token, finish_time=time.perf_counter(), num_preemptions=seq.num_preemptions,
        )

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until every request has finished; their outputs in finishing order."""
        done: list[RequestOutput] = []
        while self.has_unfinished():
            done.extend(self.step())
        return done
