"""Hugging Face transformers: prefill dense, decode through the `SparseCoordinator`.

    from sparse_framework.integrations.transformers import sparse

    with sparse(model, {"algorithm": "quest", "top_k": 2048}, max_seq_len=32768) as handle:
        out = model.generate(**inputs, max_new_tokens=64)   # unchanged call
    print(handle.stats())                                    # what the decode steps read

Works with decoder models whose attention goes through transformers' attention-function
registry (`AttentionInterface`: Llama, Qwen2/3, Mistral, Gemma, ...) on transformers
>= 4.56 (`MIN_TRANSFORMERS`; tested with 4.56.2 and 5.24.0).

How it plugs in
  `enable(model, config)` builds a coordinator whose `KVLayout` comes from the model config
  (its full-attention layers, num_key_value_heads KV heads, head_dim, the model's dtype and device),
  registers an attention function and the sdpa mask function under the name
  "sparse_framework" (`AttentionInterface` / `AttentionMaskInterface`), switches the model to
  it (`set_attn_implementation`) and gives `model.generate` a thin wrapper (an attribute of
  this model instance) that passes a fresh `SparseCache` as the cache argument (`cache` from
  transformers 5.24, which deprecates `past_key_values`; `past_key_values` before: see
  `cache_kwarg`) and closes it when generation returns. `disable()` (or leaving the `with` block) undoes all three.

  A cache_implementation in the model's own generation_config (Gemma's "hybrid" from the
  hub) is set aside for the sparse generate; one the caller passes to generate is refused.
  `torch.compile`: enable the uncompiled model or the compiled wrapper (its `_orig_mod` is
  patched); the cache updates and the attention function run eagerly (graph breaks).

  Per layer the model applies RoPE, calls `cache.update(k, v, layer)` and then the attention
  function. `SparseCache.update` only counts tokens (transformers derives positions and mask
  sizes from the cache's length, which includes left padding) and returns this step's K/V
  unchanged: it holds no K/V itself. The attention function recognises the step as the
  cache's own (the `key` it receives is the tensor `update` returned) and drives the
  coordinator with it:
    prefill  attention_begin with the packed prompt (pad tokens stripped, so the store
             holds post-RoPE keys of real tokens only), dense attention over the padded
             batch with the sdpa mask (exactly what the sdpa model computes), attention_end.
    decode   attention_begin (store the new K/V, select, make resident, plan) + attend (the
             configured backend) + attention_end, one query token per row.
  Layer 0 of a forward opens the step (`forward_begin`), the last layer closes it
  (`forward_end`). The cache sets the model's q·k scaling (Gemma's query_pre_attn_scalar, say)
  as each full layer's coordinator option `scale`, so queries pass as computed. Calls that do
  not come through a SparseCache (`model(...)` with no cache or a DynamicCache,
  `use_cache=False`) get transformers' sdpa attention: dense, unchanged, and counted as dense
  layer-steps in `handle.stats()["dense"]` with the reason.

Hybrid sliding-window models
  A sliding-window layer (Mistral with `sliding_window`, Qwen2 with `use_sliding_window`
  from layer `max_window_layers` on, Gemma 3's local layers; `LayerMap.of` reads the
  config's `layer_types`) whose window is shorter than `max_seq_len` does not go through the
  coordinator: its token t attends densely to positions (t - window, t], transformers'
  convention in every family, and only that window is kept, on the device, in a ring of
  `window` slots per request row (`kv_store/sliding_window.py`: `SlidingWindowKV`; nothing
  of it on the host). Prefill: dense sdpa with the model's own sliding mask, then each row's
  last `window` real tokens into the ring; decode: the new token into slot position %
  window, attention over the ring's valid slots with the model's scale. The coordinator's
  `KVLayout` counts the full-attention layers only (store layer i is model layer
  `handle.layers.full[i]`: `dense_layers` in the config counts in store layers, Quest's
  `dense_first_layers` in model layers, `KVLayout.model_layers`), so its store and host pool hold no sliding-window KV; a model whose every
  layer slides has a layout of 0 layers (the coordinator then only tracks the requests).
  The last model layer, sliding or not, closes the step. A window >= max_seq_len never
  binds: such layers stay full layers. The observer and `last_selections` see the full
  layers only (under their model layer index); `stats()` counts the sliding layers apart.

Logit soft-capping and attention sinks (Gemma 2, GPT-OSS)
  Gemma 2 passes its attention function `softcap` (`attn_logit_softcapping`: logits s become
  softcap * tanh(s / softcap)), GPT-OSS `s_aux` (the attention module's `sinks`, one learned
  logit per query head in the softmax's denominator, with no value); both attend eagerly
  by default, since sdpa cannot express either (transformers 4.56 still defaulted Gemma 2 to
  sdpa, which there drops the soft-cap: the integration applies it, as eager attention does,
  on every version). The integration applies them on every path:
  enable gives each full layer's soft-cap and sinks to the coordinator
  (`set_attention_options`, under the store layer index), so its backend applies them at
  decode (`torch_ref` and `triton` do; a backend that cannot is refused at enable); the
  sliding-window ring takes them per call (`SlidingWindowKV.attend`); and the prefill, and
  forwards without a SparseCache, run the models' eager formula with the sdpa mask instead of
  sdpa (`eager_attention.py`), so a full budget equals the model's own dense generate.
  The sinks are read at enable: a float32 parameter is used in place, another dtype's is
  copied to float32 (enable again after loading new weights).

Requests and padding
  The first forward through a SparseCache is its prefill: each batch row becomes a
  `Request` whose prompt is the row's attended tokens (from the attention mask: left
  padding is stripped), begun with `on_request_begin`. Every later forward must bring one
  token per row (what `generate` does); rows that finished early keep decoding pad tokens
  with mask 1, exactly as in the dense model. The requests end (`on_request_end`) when
  `generate` returns or raises, when the cache is `close()`d or `reset()`, when it is
  garbage-collected, or when the integration is disabled.

Not supported (clear errors): beam search and assisted decoding (the cache cannot reorder or
crop requests), several tokens per row after the prefill (chunked prefill, multi-turn reuse
of a cache: start a new cache), layer types other than full and sliding attention (e.g.
chunked attention), a backend that cannot apply a model's soft-cap or sinks (refused at
enable: `flash_attn` without the library's support, `flashmla`), MLA models other than those
with DSA's indexer (DeepSeek-V3.2 and GLM-MoE-DSA: mla.py), algorithms that need
extra model inputs on other models (DSA's lightning indexer; DSA with `extra.source = "keys"`
works), multimodal models. One forward at a time per handle (no thread safety).

The modules, each with the state it owns
  compat.py      transformers itself, the version gate, the cache keyword, the error (no state)
  model_info.py  the decoder config, MLA or not, full and sliding layers (`LayerMap`) (no state)
  attention.py   the registered attention function; attention module -> handle (`_HANDLES`)
  cache.py       `SparseCache`: its requests, open step and layer lengths; `AttentionEvent`
  generate.py    the generate wrapper (no state of its own)
  handle.py      `SparseHandle`: per-model counters, stats, disable; model -> handle (`_ENABLED`)
  enabling.py    `enable` / `sparse`: builds the coordinator and the handle (no state)
  mla.py         MLA + DSA models (DeepSeek-V3.2, GLM-MoE-DSA): imported by `enable` when it
                 meets an MLA config (`family_enabler`), not by importing the package
"""

from __future__ import annotations

# compat first: its version check runs before the other modules import transformers' internals
from .compat import MIN_TRANSFORMERS, NAME, UnsupportedModelError, cache_kwarg, check_transformers_version
from .model_info import LayerMap, is_mla
from .attention import sparse_attention_forward
from .cache import AttentionEvent, SparseCache
from .handle import SparseHandle
from .enabling import enable, family_enabler, sparse

__all__ = [
    "MIN_TRANSFORMERS",
    "NAME",
    "AttentionEvent",
    "LayerMap",
    "SparseCache",
    "SparseHandle",
    "UnsupportedModelError",
    "cache_kwarg",
    "check_transformers_version",
    "enable",
    "family_enabler",
    "is_mla",
    "sparse",
    "sparse_attention_forward",
]
