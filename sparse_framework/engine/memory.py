"""The engine's memory plan: how many requests fit on this device and host, and the store's pools.

vLLM sizes its KV cache from a fraction of the GPU (`gpu_memory_utilization`) less what the
model needs to run; the engine does the same for the SparseCoordinator's pools:

    device budget = gpu_memory_utilization x total device memory
                    - weights - activations of one step - prefill staging
                    - captured decode graphs (cuda_graphs / decode_graphs: `graph_bytes`)
                    - memory already taken by others (CUDA context, other processes)
    requests by device = device budget // device bytes of one request row
    requests by host   = host budget // host bytes of one request row
    request rows       = min(max_num_seqs, requests by device, requests by host)

A request row is what the coordinator allocates per `max_requests` at `max_seq_len =
max_model_len` (`layout`: the store's, full-attention layers only), plus its row of the
sliding-window layers' ring (`ModelConfig.sliding_ring_bytes`: window slots per sliding
layer, device only): its share of the device pools (a sparse layer's buffer, a dense layer's whole
context; every token in every layer for the resident store), the algorithm's representations
and the store's maps on the device, and its whole KV on the host (the hierarchical store; the
resident store has no host pool). Those bytes are footprint.py's `coordinator_parts` for one
row — the estimate the coordinator checks itself against — so the plan counts the same pools
the coordinator allocates (each part is linear in max_requests). Rows are planned for requests
of max_model_len tokens: N rows always hold N requests to their full length, so admission
never waits on a pool that the plan said had room.

The host budget is `host_memory_bytes`, or HOST_MEMORY_FRACTION of the host's MemAvailable.

The hybrid store (`"store": "hybrid"`) is planned as the hierarchical store — a row is what a
spilled request needs: its buffer on the device, its whole KV on the host — so it admits as
many requests as the host tier can hold; then every byte of the device budget left over goes
to its sparse layers' pool (`device_capacity_tokens`, at most every row whole), where requests
stay whole until admission needs the room (kv_store/spills.py).

`plan_for` takes those inputs from a loaded model and a device (the weights from its
parameters, the device's memory from CUDA or a given `device_memory_bytes`): it is what the
engine runs with `gpu_memory_utilization`, and what `bench` and benchmarks/engine_sweep.py
report as the memory-bound maximum, so the three never disagree on what fits.

Activations are estimated, not measured: the peak of one step of `max_num_batched_tokens`
packed tokens through one layer (residual stream, q/k/v and their rotated copies, the MLP's
three intermediate tensors, the float32 norm statistics, the boolean mask of a prefill chunk
over a max_model_len prefix and its additive form, the selection scores of the decode rows) or
of the logits rows and the sampler's working set, or of the hand-over of a whole prompt to the
store, whichever is largest (an MLA layer's attention is its own term, `mla_attention_bytes`:
a prefill chunk expands its whole staged prefix per head). They do not depend on
the device type, so `sparse-framework plan --engine` and an engine on the GPU agree; on the CPU
the math SDPA also materialises the chunk's scores, which the estimate leaves out (the CPU
runs the tiny test models).

Graphs are estimated too (`graph_bytes`, docs/engine.md "Warm start"): captured graphs draw
from memory pools of their own that eager steps cannot reuse, so they are a term beside the
activations, not inside them. Every whole-step capture shares one pool (step_graphs.py), which
grows to the largest capture's peak: a decode-only step of max_num_seqs rows (the largest
batch bucket the warm-up captures), plus the float32 logits buffer the graphs write into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from ..common.arith import cdiv
from ..common.errors import CapacityError, ConfigError
from ..common.layout import KVLayout
from ..config import SparseConfig, dense_layer_set
from ..coordinator.footprint import coordinator_parts
from ..kv_store.device_pools import RESIDENT, SPARSE_LAYERS, size_device_pools
from ..kv_store.pinned import meminfo_bytes
from .models import ModelConfig
from .models.mla import INDEX_SCORE_BYTES
from .prefix_cache import swa_limit_pages
from .staging import PrefillStaging

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # `plan --engine`'s and the benchmarks' fraction when none is given
HOST_MEMORY_FRACTION = 0.8  # of MemAvailable, when no host_memory_bytes is given
SAMPLER_BYTES_PER_LOGIT = 64  # a full sort of int64 keys and the float32 scratch of top-k/top-p
SELECTION_BYTES_PER_UNIT = 8  # a decode row's float32 score and int32 index per selection unit
LAYER_GRAPHS_PER_LAYER = 4  # the coordinator's per-layer decode graphs kept (its max_graphs default)


@dataclass(frozen=True)
class EngineMemoryPlan:
    """Every term of the plan (bytes unless named otherwise); see the module docstring."""

    max_model_len: int
    max_num_batched_tokens: int  # tokens of the step the activations are estimated for
    max_num_seqs: int  # the upper bound asked for
    gpu_memory_utilization: float
    device_total_bytes: int
    device_other_bytes: int  # taken on the device by others (context, other processes)
    weight_bytes: int
    layer_activation_bytes: int  # one layer's peak in a full step
    logits_bytes: int  # logits rows and the sampler's working set
    handover_bytes: int  # a max_model_len prompt handed to the store (the algorithm's build)
    activation_bytes: int  # the largest of the three: one phase runs at a time
    staging_tokens: int
    staging_bytes: int  # prefill staging K/V and the prompt queries the algorithm keeps
    device_budget_bytes: int  # left for the store's device pools (may be negative)
    device_bytes_per_request: int
    host_budget_bytes: int
    host_budget_source: str
    host_bytes_per_request: int  # 0: the store keeps no host pool (resident)
    requests_by_device: int
    requests_by_host: int | None  # None: the host does not bound (no host pool)
    max_requests: int  # the memory-bound maximum: min of the two
    limited_by: str  # "device" or "host"
    num_seqs: int  # request rows the engine takes: min(max_num_seqs, max_requests)
    device_capacity_tokens: int | None  # the sparse layers' (resident store's) pool, per layer
    host_capacity_tokens: int | None
    device_pool_bytes: int
    host_pool_bytes: int
    prefix_cache_host_bytes: int = 0  # what a prefix cache keeps beside the host pool (its limit)
    graph_bytes: int = 0  # captured decode graphs' memory pools (an estimate: `graph_bytes`); 0 without graphs
    host_kv_dtype: str = "auto"  # the host tier's rows (SparseConfig.host_kv_dtype): fp8_e4m3 counts ~half the bytes

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        """CapacityError when not one request fits, naming the settings and the bytes."""
        if self.num_seqs > 0:
            return
        host = ""
        if self.requests_by_host == 0:
            host = (f"; and its KV needs {_gib(self.host_bytes_per_request)} of host memory, more than the "
                    f"{_gib(self.host_budget_bytes)} of the host budget ({self.host_budget_source})")
        budget = self.device_budget_bytes
        left = f"leaves {_gib(budget)}" if budget >= 0 else f"leaves nothing ({_gib(-budget)} short)"
        advice = ("Raise gpu_memory_utilization (at most 1) or host_memory_bytes, or lower max_model_len or "
                  "max_num_batched_tokens" + (" (or max_num_seqs: the captured graphs are sized for it)"
                                              if self.graph_bytes else ""))
        if self.weight_bytes >= self.gpu_memory_utilization * self.device_total_bytes:
            advice = (f"The weights alone need more than the {_gib(self.gpu_memory_utilization * self.device_total_bytes)} "
                      "the plan may use: a device with more memory, or tensor_parallel_size > 1")
        raise CapacityError(
            f"no request of max_model_len={self.max_model_len} fits: gpu_memory_utilization="
            f"{self.gpu_memory_utilization:g} of {_gib(self.device_total_bytes)} device memory {left} "
            f"for the store after the weights ({_gib(self.weight_bytes)}), "
            f"activations ({_gib(self.activation_bytes)}), prefill staging ({_gib(self.staging_bytes)}), "
            f"captured graphs ({_gib(self.graph_bytes)}) and memory "
            f"in use by others ({_gib(self.device_other_bytes)}); one request needs "
            f"{_gib(self.device_bytes_per_request)} of device pools{host}. {advice}"
        )

    def describe(self) -> str:
        """The plan in a few lines of at most 100 columns, for logs and the CLI."""
        if self.requests_by_host is None:
            host = "no host pool (resident store): the host does not bound"
        else:
            rows = "" if self.host_kv_dtype == "auto" else f" ({self.host_kv_dtype} rows)"
            host = (f"{_gib(self.host_budget_bytes)} ({self.host_budget_source}) / "
                    f"{_gib(self.host_bytes_per_request)} per request{rows} = {self.requests_by_host}")
        bound = "max_num_seqs" if self.num_seqs < self.max_requests else self.limited_by
        host_tokens = "-" if self.host_capacity_tokens is None else f"{self.host_capacity_tokens:,}"
        device_tokens = "-" if self.device_capacity_tokens is None else f"{self.device_capacity_tokens:,}"
        return "\n".join([
            f"memory plan: requests of max_model_len {self.max_model_len:,}, {self.max_num_batched_tokens:,} tokens "
            f"per step",
            f"  device  {self.gpu_memory_utilization:g} x {_gib(self.device_total_bytes)}"
            f" = {_gib(int(self.gpu_memory_utilization * self.device_total_bytes))}",
            f"          - weights {_gib(self.weight_bytes)} - activations {_gib(self.activation_bytes)}"
            f" - others {_gib(self.device_other_bytes)}",
            *([f"          - captured graphs {_gib(self.graph_bytes)} (estimated: the largest decode bucket)"]
              if self.graph_bytes else []),
            f"          - prefill staging {_gib(self.staging_bytes)} ({self.staging_tokens:,} tokens)"
            + (f" = {_gib(self.device_budget_bytes)} for the store" if self.device_budget_bytes >= 0
               else f": {_gib(-self.device_budget_bytes)} short, nothing for the store"),
            f"          / {_gib(self.device_bytes_per_request)} per request = {self.requests_by_device}",
            f"  host    {host}",
            f"  requests: memory-bound maximum {self.max_requests} ({self.limited_by}), max_num_seqs "
            f"{self.max_num_seqs}: {self.num_seqs} rows ({bound})",
            f"  pools   device {_gib(self.device_pool_bytes)} (device_capacity_tokens {device_tokens}),",
            f"          host {_gib(self.host_pool_bytes)} (host_capacity_tokens {host_tokens})",
            *([f"          prefix cache beside the host pool {_gib(self.prefix_cache_host_bytes)}"]
              if self.prefix_cache_host_bytes else []),
        ])


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def activation_bytes(
    model: ModelConfig, itemsize: int, *, tokens: int, logits_rows: int, chunk_tokens: int, max_model_len: int,
    selection_units: int,
) -> tuple[int, int, int]:
    """Peaks of the three phases of a step, in bytes: one layer of the forward over `tokens`
    packed tokens (prefill chunks of at most `chunk_tokens` over a prefix of at most
    `max_model_len`, `selection_units` score entries per decode row); the LM head and the
    sampler over `logits_rows` rows; the hand-over of a max_model_len prompt to the store (the
    algorithm's build reads one layer's keys at a time: their cast and Quest's padded min/max
    inputs, about three copies)."""
    t, h, i = tokens, model.hidden_size, model.intermediate_size
    qkv = model.num_heads + 2 * model.num_kv_heads
    residual = 2 * t * h * itemsize  # the stream and the sum that replaces it
    norm = 3 * t * h * 4 + t * h * itemsize  # float32 statistic and its temporaries, the normed copy
    attention = (
        2 * t * qkv * model.head_dim * itemsize  # q, k, v and their rotated copies
        + 2 * t * model.num_heads * model.head_dim * itemsize  # the attention output and its packed copy
        + chunk_tokens * max_model_len * (1 + itemsize)  # the chunk's mask over its prefix, bool and additive
        + min(logits_rows, t) * selection_units * SELECTION_BYTES_PER_UNIT
    )
    if model.mla is not None:
        attention = mla_attention_bytes(model, itemsize, tokens=t, chunk_tokens=chunk_tokens,
                                        max_model_len=max_model_len, decode_rows=min(logits_rows, t),
                                        selection_units=selection_units)
    mlp = 3 * t * i * itemsize  # silu(gate), up and their product
    layer = residual + norm + max(attention, mlp)
    logits = t * h * itemsize + logits_rows * model.vocab_size * (itemsize + 4 + SAMPLER_BYTES_PER_LOGIT)
    handover = 3 * max_model_len * model.num_kv_heads * model.head_dim * itemsize
    return layer, logits, handover


def graph_bytes(
    model: ModelConfig, layout: KVLayout, itemsize: int, *, rows: int, selection_units: int, selected_tokens: int,
    streams: int, cuda_graphs: bool, decode_graphs: bool,
) -> int:
    """Device bytes captured decode graphs keep (an estimate; 0 with neither switch on).

    Whole decode steps (cuda_graphs, engine/step_graphs.py): every capture draws from one
    memory pool shared by all of them (a capture reuses what the captures before it freed), so
    the pool grows to the largest capture's peak, a decode-only step of `rows` rows (the
    largest batch bucket: max_num_seqs; the warm-up captures it first). That peak is taken
    from `activation_bytes` for `rows` tokens with no prefill chunk (no chunk mask, no MLA
    prefix expanded): one layer's working set, or the LM head's (the hidden rows, the logits
    in the model's dtype and in float32), whichever is larger. Beside the pool: the one
    float32 [rows, vocab] buffer every step graph writes its logits into.

    Per-layer decode graphs (decode_graphs, and cuda_graphs too, whose steps with prefill
    chunks run their decode rows through them; decode_graphs.py): one more shared pool, at
    most one layer's working set, and each graph kept (LAYER_GRAPHS_PER_LAYER per layer)
    keeps its attention output, [rows, heads, head_dim], and its metadata: per row and stream
    the selection's `selected_tokens` slots and the adaptor's plan over them (int32 each).

    Assumptions (what a GPU run must check against `Engine.warm_up_report`): a captured step
    frees each layer's temporaries before the next layer's, as an eager step does, so the
    pool peaks at one layer as the activations do; kernels' own workspaces (cuBLAS, Triton
    scratch) and the graphs' small per-capture tensors (inputs, host-write offsets) are not
    counted, nor an algorithm's decode scratch beyond its selection scores."""
    if not (cuda_graphs or decode_graphs):
        return 0
    # a decode-only step: no prefill chunk, so no chunk mask and (MLA) no expanded prefix
    layer, _, _ = activation_bytes(model, itemsize, tokens=rows, logits_rows=rows, chunk_tokens=0, max_model_len=0,
                                   selection_units=selection_units)
    kept = rows * (model.num_heads * layout.head_dim * itemsize + streams * selected_tokens * 2 * 4)
    total = layer + LAYER_GRAPHS_PER_LAYER * layout.num_layers * kept
    if cuda_graphs:
        head = rows * model.hidden_size * itemsize + rows * model.vocab_size * (itemsize + 4)
        total += max(layer, head) + rows * model.vocab_size * 4
    return total


def mla_attention_bytes(
    model: ModelConfig, itemsize: int, *, tokens: int, chunk_tokens: int, max_model_len: int, decode_rows: int,
    selection_units: int,
) -> int:
    """The attention phase of one MLA layer (engine/models/mla.py) over `tokens` packed tokens.
    A prefill chunk expands its whole staged prefix (up to max_model_len rows) through
    kv_b_proj: per head the keys (nope + rope) and the values, from one [m, H, nope + v]
    product — that expansion, not the chunk, is the peak at long contexts (DeepSeek-V3.2 at
    128K: about 15 GiB in bf16). Then each block of queries' float32 index scores (at most
    INDEX_SCORE_BYTES, with their ReLU and the masked copy the top-k reads) and its mask.
    Besides: the step's projections (q in both forms, the latent row, the indexer's queries)
    and the decode rows' selection scores."""
    m = model.mla
    assert m is not None
    heads, nope, rope, v = model.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    prefix = max_model_len  # a last chunk's prefix, itself included
    expanded = prefix * heads * ((nope + v) + (nope + rope)) * itemsize  # kv product, then the keys' cat
    per_query = 4 * m.index_n_heads * prefix  # one query's float32 index scores over the prefix
    block = max(1, min(256, INDEX_SCORE_BYTES // max(1, per_query), chunk_tokens))
    scores = 3 * block * per_query + block * prefix * (1 + 4)  # scores, ReLU, masked copy; mask and top-k values
    latent = m.kv_lora_rank + rope
    projections = tokens * (
        2 * heads * (nope + rope) + latent + m.index_n_heads * (m.index_head_dim + 1) + 2 * heads * v
    ) * itemsize
    absorbed = 2 * decode_rows * heads * latent * itemsize  # decode: absorbed queries, latent-form outputs
    return projections + absorbed + expanded + scores + decode_rows * selection_units * SELECTION_BYTES_PER_UNIT


def prefix_cache_host_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype, max_model_len: int) -> int:
    """Host bytes per request row that a prefix cache keeps outside the store's host pool
    (engine/prefix_cache.py): an MLA + indexer model's indexer key of every token the row's
    host pages may hold (a cached page keeps its keys), and a hybrid model's sliding-window
    copies at the engine's limit (`prefix_cache.swa_limit_pages` for one row), in `dtype` (the
    staging's and the ring's)."""
    tokens = cdiv(max_model_len, page_size) * page_size
    index = model.num_layers * model.mla.index_head_dim * dtype.itemsize * tokens if model.mla is not None else 0
    layers = model.layer_map(max_model_len)
    swa = 0
    if layers.sliding:
        assert layers.window is not None
        per_token = model.sliding_ring_bytes(dtype, max_model_len) // layers.window
        swa = swa_limit_pages(1, layers.window, page_size) * page_size * per_token
    return index + swa


def request_bytes(config: SparseConfig, layout: KVLayout, max_model_len: int) -> tuple[int, int]:
    """(device, host) bytes of one request row of a coordinator with max_seq_len =
    max_model_len: `coordinator_parts` for max_requests=1 (each part is linear in it)."""
    parts = coordinator_parts(config, layout, max_requests=1, max_seq_len=max_model_len)
    return sum(p.bytes for p in parts if not p.host), sum(p.bytes for p in parts if p.host)


def host_budget(host_memory_bytes: int | None) -> tuple[int, str]:
    """The host budget and where it came from: `host_memory_bytes`, or HOST_MEMORY_FRACTION of
    MemAvailable (a CapacityError where the host does not say)."""
    if host_memory_bytes is not None:
        return host_memory_bytes, "host_memory_bytes"
    available = meminfo_bytes("MemAvailable")
    if available is None:
        raise CapacityError("host_memory_bytes: this host does not report MemAvailable (/proc/meminfo); "
                            "give host_memory_bytes (the host KV pool's budget) explicitly")
    return int(HOST_MEMORY_FRACTION * available), f"{HOST_MEMORY_FRACTION:g} x MemAvailable {_gib(available)}"


def plan_engine_memory(
    model: ModelConfig,
    layout: KVLayout,
    config: SparseConfig,
    *,
    weight_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    device_total_bytes: int,
    device_free_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    max_prefill_chunk: int | None = None,
    staging_tokens: int | None = None,
    dtype: torch.dtype | None = None,
    prefix_caching: bool = False,
    cuda_graphs: bool = False,
    decode_graphs: bool = False,
) -> EngineMemoryPlan:
    """The engine's pools for a model, its KV layout and a sparse config (module docstring).

    weight_bytes: the model's parameter bytes; device_total_bytes: the device's memory (on CUDA
    `torch.cuda.mem_get_info`'s total; tests and `plan` give one); device_free_bytes: free now,
    with the weights loaded (None: nothing but the weights is on the device); host_memory_bytes:
    the host budget (None: HOST_MEMORY_FRACTION of MemAvailable). The other arguments are the
    EngineConfig's. dtype: the model's (activations, prefill staging and the sliding ring; None:
    the layout's, bfloat16 for an fp8 one, whose rows only the store keeps). prefix_caching: the
    ring keeps a page beyond the window, and each request row's host bytes include what the
    cache keeps outside the host pool (`prefix_cache_host_bytes`). cuda_graphs / decode_graphs:
    the captured graphs' pools are reserved (`graph_bytes`, sized for max_num_seqs rows: the
    row count the plan is choosing cannot size them). Not one request fitting is not an error
    here: `EngineMemoryPlan.check`."""
    tokens = max(max_num_batched_tokens, max_num_seqs)  # the scheduler's step never exceeds this
    rows_sampled = min(max_num_seqs, tokens)
    chunk = min(max_prefill_chunk or tokens, tokens, max_model_len)
    algo = config.algorithm_class
    unit = config.page_size if algo.granularity == "page" else 1
    streams = layout.num_kv_heads if algo.per_kv_head else 1
    compute_dtype = dtype or (torch.bfloat16 if layout.is_fp8 else layout.dtype)
    compute = layout if compute_dtype == layout.dtype else dataclasses.replace(layout, dtype=compute_dtype)
    itemsize = compute_dtype.itemsize
    layer, logits, handover = activation_bytes(
        model, itemsize, tokens=tokens, logits_rows=rows_sampled, chunk_tokens=chunk, max_model_len=max_model_len,
        selection_units=streams * cdiv(max_model_len, unit),
    )
    staged = staging_tokens or max_model_len
    index_dim = model.mla.index_head_dim if model.mla is not None else 0
    staging = staged * PrefillStaging.bytes_per_token(compute, index_dim) + _query_tail_bytes(config, model, compute, staged)
    other = 0 if device_free_bytes is None else max(0, device_total_bytes - device_free_bytes - weight_bytes)
    activations = max(layer, logits, handover)
    graphs = graph_bytes(model, compute, itemsize, rows=max_num_seqs,
                         selection_units=streams * cdiv(max_model_len, unit),
                         selected_tokens=min(algo.max_selected_tokens(config), max_model_len), streams=streams,
                         cuda_graphs=cuda_graphs, decode_graphs=decode_graphs)
    budget = int(gpu_memory_utilization * device_total_bytes) - weight_bytes - activations - staging - other - graphs
    hybrid = config.store == "hybrid"
    if hybrid:  # rows as the hierarchical store's (a spilled request's needs); the rest: hybrid_pool
        config = config.model_copy(update={"store": "hierarchical"})
    per_device, per_host = request_bytes(config, layout, max_model_len)
    per_device += model.sliding_ring_bytes(  # sliding layers' ring row
        compute_dtype, max_model_len, config.page_size if prefix_caching else 0)
    pool_per_host = per_host
    side = prefix_cache_host_bytes(model, config.page_size, compute_dtype, max_model_len) if prefix_caching else 0
    if per_host:  # (no host pool, no cache: the engine refuses the cache there)
        per_host += side
    host_bytes, source = host_budget(host_memory_bytes)
    by_device = max(0, budget) // per_device
    by_host = host_bytes // per_host if per_host else None
    most = by_device if by_host is None else min(by_device, by_host)
    rows = min(max_num_seqs, most)
    device_tokens, host_tokens = _capacity_tokens(config, layout, rows, max_model_len)
    extra = 0
    if hybrid and rows and device_tokens is not None:
        device_tokens, extra = hybrid_pool(config, layout, rows, max_model_len, device_tokens, budget - rows * per_device)
    return EngineMemoryPlan(
        max_model_len=max_model_len, max_num_batched_tokens=tokens, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization, device_total_bytes=device_total_bytes,
        device_other_bytes=other, weight_bytes=weight_bytes, layer_activation_bytes=layer, logits_bytes=logits,
        handover_bytes=handover,
        activation_bytes=activations, staging_tokens=staged, staging_bytes=staging, device_budget_bytes=budget,
        device_bytes_per_request=per_device, host_budget_bytes=host_bytes, host_budget_source=source,
        host_bytes_per_request=per_host, requests_by_device=by_device, requests_by_host=by_host, max_requests=most,
        limited_by="device" if by_host is None or by_device <= by_host else "host", num_seqs=rows,
        device_capacity_tokens=device_tokens, host_capacity_tokens=host_tokens,
        device_pool_bytes=rows * per_device + extra, host_pool_bytes=rows * pool_per_host,
        prefix_cache_host_bytes=rows * side if pool_per_host else 0, graph_bytes=graphs,
        host_kv_dtype=config.host_kv_dtype,
    )


def device_memory(device: torch.device, device_memory_bytes: int | None) -> tuple[int, int | None]:
    """(total, free now) of the device the plan takes its fraction of. CUDA: measured, the
    blocks torch's caching allocator holds but no tensor uses counted as free; a given
    `device_memory_bytes` replaces the total (free stays measured, so what others hold,
    total - free - weights floored at 0, is counted against the given total). Another device
    has no memory of its own to measure: `device_memory_bytes` is the total, nothing is in use
    (free None)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return device_memory_bytes or total, free
    if device_memory_bytes is None:
        raise ConfigError(f"gpu_memory_utilization on a {device.type} device: it has no device memory of its "
                          "own to measure; give EngineConfig.device_memory_bytes (the memory to plan for; "
                          "--device-memory-gib on the command line), or run on a CUDA device")
    return device_memory_bytes, None


def weight_bytes_of(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of a model's parameters (what the plan reserves for the weights)."""
    return sum(p.numel() * p.element_size() for p in parameters)


def plan_for(
    parameters: Iterable[torch.Tensor],
    model: ModelConfig,
    layout: KVLayout,
    config: SparseConfig,
    *,
    device: torch.device,
    device_memory_bytes: int | None = None,
    **settings: int | float | None,
) -> EngineMemoryPlan:
    """`plan_engine_memory` for a loaded model on `device`: the weights from its parameters,
    the device's total and free memory from `device_memory` (call it with the weights loaded
    and before the pools are allocated, so that free memory counts neither twice). `settings`
    are plan_engine_memory's EngineConfig arguments (max_model_len, max_num_batched_tokens,
    max_num_seqs, gpu_memory_utilization, host_memory_bytes, max_prefill_chunk,
    staging_tokens, dtype, prefix_caching, cuda_graphs, decode_graphs); the Engine calls this
    with its own."""
    total, free = device_memory(torch.device(device), device_memory_bytes)
    return plan_engine_memory(model, layout, config, weight_bytes=weight_bytes_of(parameters),
                              device_total_bytes=total, device_free_bytes=free, **settings)  # type: ignore[arg-type]


def _query_tail_bytes(config: SparseConfig, model: ModelConfig, layout: KVLayout, staged: int) -> int:
    """The prompt queries the runner keeps while prompts prefill (runner.py `_q_tails`), for
    algorithms whose build reads them: at most one row per staged token (SnapKV keeps a window
    of each prompt, never more than the prompt), every layer."""
    if not config.algorithm_class.needs_prefill_queries:
        return 0
    return staged * layout.num_layers * model.num_heads * layout.head_dim * layout.dtype.itemsize


def hybrid_pool(
    config: SparseConfig, layout: KVLayout, rows: int, max_model_len: int, share_tokens: int, left_bytes: int
) -> tuple[int, int]:
    """(device_capacity_tokens, bytes beyond the rows' shares) of a hybrid store's sparse layers'
    pool: the rows' buffer shares (`share_tokens`) plus what `left_bytes` of device budget
    holds, at most `rows` whole requests."""
    p = config.page_size
    sparse_layers = layout.num_layers - len(dense_layer_set(config, layout))
    per_token = sparse_layers * layout.bytes_per_token_per_layer
    whole = rows * cdiv(max_model_len, p) * p
    more = (max(0, left_bytes) // per_token) // p * p if per_token else 0
    tokens = min(whole, share_tokens + more)
    return tokens, (tokens - share_tokens) * per_token


def _capacity_tokens(config: SparseConfig, layout: KVLayout, rows: int, max_model_len: int) -> tuple[int | None, int | None]:
    """(device_capacity_tokens, host_capacity_tokens) of `rows` request rows: the sizes the
    store would choose for max_requests = rows (passed explicitly, so the pools are the plan's
    whatever the store's defaults become). None where the store has no such pool."""
    p = config.page_size
    resident = config.store == "resident"
    pools = size_device_pools(
        num_layers=layout.num_layers, dense_layers=dense_layer_set(config, layout), page_size=p,
        device_buffer_tokens=config.device_buffer_tokens, min_sparse_prompt_len=config.min_sparse_prompt_len,
        max_requests=rows, max_seq_len=max_model_len, resident_only=resident,
    )
    device = next((pool.tokens for pool in pools if pool.kind in (SPARSE_LAYERS, RESIDENT)), None)
    host = None if resident else rows * cdiv(max_model_len, p) * p
    return device, host
