"""`PrefixCache`: the engine's radix prefix cache over the hierarchical store's host pages.

A new request reuses the K/V of the longest cached prefix of its prompt instead of
recomputing it; `EngineConfig.enable_prefix_caching` turns it on.

What is cached. The tree (radix_cache.py, page-aligned on the store's page size) maps token
prefixes to host page ids of the store's host pool: every layer's K/V of those tokens, as
stored. The tree owns those pages; nobody writes them. Pages enter the tree two ways:

- a request that keeps its K/V on the host (a sparse request of the hierarchical store)
  *lends* its own pages: once its prompt is prefilled (`on_prefilled`: its whole pages are
  inserted, so requests arriving while it decodes already hit), and when it finishes
  (`on_finished`: prompt and generated tokens, up to the last whole page whose K/V it
  wrote). The request goes on reading the lent pages; its host pool `free` skips them.
- a request that keeps nothing on the host (dense mode: prompts below
  `min_sparse_prompt_len`; every request of the resident store) has its device K/V of the
  pages not yet cached *exported* to newly allocated host pages at the same two points, as
  far as the host pool has room beyond what running requests were promised.

A page the tree already held comes back from `insert` and stays the request's (freed with
it). The cache never holds device memory.

Reuse. At admission (`match`, called by the budget) the prompt's longest cached prefix is
looked up — at most `prompt_len - 1` tokens (the last prompt token must run to give the
first output's logits), and fewer when the algorithm's build reads the prompt's last queries
(SnapKV's window: those tokens must be computed) — and its path is locked. The runner copies
the prefix's host pages into the request's staging span (one copy per tensor; the chunks
attend to the prefix there) and the store maps them read-only as the request's first host
pages; the scheduler starts the prompt at `num_computed_tokens = cached`. When the last
chunk runs, the hand-over passes the whole staged prompt to the coordinator as before: the
device buffer (sink, recent window, dense layers) and the algorithm's representations
(Quest page bounds, PQ codes, DSA-on-keys) are *recomputed* from the staged prefix K/V rather
than stored in the tree, which keeps one kind of value in the tree and needs nothing of
the algorithm. What that costs per layer, from benchmarks/prefix_cache_build_cost.py on the
CPU (4096 tokens, 8 KV heads x 128, float32; benchmarks/results/prefix_cache_build_cost_cpu.json),
against the layer's projections and MLP that the hit saves (Llama-3-8B shape, FLOPs-scaled):
Quest 0.1%, SnapKV's votes 0.6%, DSA on keys < 0.1%, PQCache's k-means 8.5% (4.4x the K
projection alone). Only the host offload of the prefix is skipped. Storing would not even be
exact for two of them: PQCache's codebooks are fitted to the whole prompt's keys and SnapKV's
votes come from the prompt's last queries, so a prefix's codes or votes under another
prompt differ; Quest's page bounds and DSA's keys are the prefix's own (the indexer keys of
an MLA model are stored, below, because the prefill itself needs them).

Locks and eviction. A request that keeps its K/V on the host holds one lock from admission
to its end (moved down to the node of its inserted prompt at `on_prefilled`), so no page it
reads is evicted; one that keeps nothing there drops it once its prefix is staged
(`on_admitted`: the copy is queued on the device before any later write to those pages); a request
preempted while prefilling drops its lock and looks its prefix up again when it resumes.
The budget evicts least recently used unlocked leaves (`evict`) when an admission, a
resumption or a decode row's growth needs host pages: cache before preemption. Its host
check counts the cache's evictable pages as free.

Hybrid sliding-window models. A sliding layer keeps only its last `window` keys, in the
runner's device ring (kv_store/sliding_window.py; a request's row is its coordinator slot),
and nothing on the host; yet a prefix is reusable only with the window that ends it (the
next token attends to it). So the tree is built with the window and, beside the full
layers' host pages, gets *SWA values*: `SwaPages` handles, one per page, each a host copy of
that page's tokens in every sliding layer, for the last ceil(window / page) pages before an
insertion point. The tree's match rule then accepts a prefix only if those pages of its own
end are held. Because a prefix can only end where a window was snapshot (the tree's
finding: insert windows at the points worth reusing), windows are taken
- at the end of every prompt chunk but the last (`on_chunk`, the runner's `chunk_hook`, at
  the chunk's last page boundary; held per request and inserted with the prompt at
  `on_prefilled`, shortest first): a later prompt sharing only a system prompt finds the
  window of the last chunk end inside it;
- at the prompt's last whole page (`on_prefilled`) and at the end of the request's K/V
  (`on_finished`): prompt extensions and multi-turn chat.
The window at a page boundary up to a page behind the row's length must still be in the
ring: with the cache on the ring keeps `window + page_size` slots per row
(`ModelRunner(ring_page_slack=True)`; attention masks the extra ones). A snapshot the ring no
longer covers (an export cut short by the host room) is skipped: that tail is not cached.
Snapshots are copied to pinned host memory without waiting for the device (the host waits
on an event only before it reads them: `_wait_copies`), since on_chunk runs inside a step.
On a hit the window's pages are gathered at `match` (a window whose oldest page was copied
only in part, as the first page of a window that is not a whole number of pages, and is now
needed whole, makes the lookup a miss: `stats.swa_lost_pages`) and written into the new
request's ring row, zeroed first, at `on_admitted`, right after the runner admitted it and
before its first chunk reads the ring. `evict_swa` frees least recently used windows (their
nodes become tombstones that keep the full layers' pages for longer prefixes; the match
falls back to an earlier window or none), called when the SWA pages held exceed
`swa_limit_pages` (the engine's: `swa_limit_pages()`, SWA_WINDOWS_PER_ROW windows per request
row), before a snapshot; a snapshot that still finds no room is skipped. `evict` frees a
removed leaf's SWA pages with its host pages. SWA pages are plain host tensors outside the
store's host pool; the memory plan counts them at that limit (`memory.prefix_cache_host_bytes`),
beside the ring's page of slack per row.

MLA models with a lightning indexer (DeepSeek-V3.2). The host pages hold the latent rows;
the prefill of the chunks after a cached prefix also needs the prefix's indexer keys (each
query attends to its indexer top-k of the staged prefix), and so does DSA's build at the
hand-over. The cache keeps them beside the pages: one host tensor [layers, page, index_dim]
per tree page, copied from the staging when the prompt is handed over (`on_commit`, the
runner's commit hook) — the model's own values, not DSA's stored form, which FP8 keys would
round — and written into a new request's staging span at `on_admitted`. A generated token's
key is the model's own in DSA's representation when DSA stores keys in the model's dtype: the
engine then gives an `index_reader` and `on_finished` caches generated tokens as for other
models (read after the step, a host copy that waits for the device). With FP8 keys (V3.2's
deployment) it is rounded there and kept nowhere else: only prompt pages are cached, and a
multi-turn chat reuses each turn's prompt, not its answer. The keys are index_dim x dtype bytes per token and layer (DeepSeek-V3.2: 128 x 2
beside a 576 x 2 latent row, +22%), host memory outside the store's pool, freed with their
pages; the memory plan counts them for every host pool page (`memory.prefix_cache_host_bytes`).

Not supported (refused by name in `check_supported`): algorithms with prefill inputs other
than the staged indexer keys, fp8 KV (the staged prefix would be the stored, rounded values:
outputs would differ from the cache off), algorithms reading every prompt query, and the
resident store without a host pool (nothing to hold the cache).

Differences from SGLang's radix cache: SGLang's values are device KV indices (its HiCache
adds a host tier behind them); here they are host pages, since the hierarchical store keeps
every request's full K/V on the host anyway and the device holds only a per-request buffer —
so a hit costs one host->device copy into staging, never device memory while cached.
SGLang inserts after every prefill chunk; here at the end of the prompt and of the request
(a request preempted mid-prefill loses its staged chunks anyway), with, for a hybrid, the
windows of the chunk ends snapshot as they pass and inserted with the prompt. SGLang's
sliding-window KV stays in its device pool while cached; here it is copied to the host (the
ring is per request row and is overwritten by the row's next request). SGLang skips prefix
matching for a request whose prompt is all cached by leaving one token; same rule here.

Why this module is long: a fifth of it is this docstring, and the rest is one piece of state,
the host pages the tree holds and what rides on them (each request's lock, the SWA windows, the
indexer keys, the copies in flight), which every hook reads and updates together; the tree
itself is radix_cache.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..common.batch import Request
from ..common.errors import ConfigError
from ..common.transfer import copy_to_host
from ..kv_store.hierarchical import HierarchicalKVStore
from ..kv_store.sliding_window import SlidingWindowKV
from .staging import PrefillStaging
from .radix_cache import EvictResult, InsertResult, LockHandle, RadixCache, RadixNode


@dataclass
class PrefixStats:
    """Counters since the engine started: admissions looked up, prompt tokens admitted, of
    which taken from the cache (prefill tokens saved), pages inserted and evicted."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    inserted_pages: int = 0
    evicted_pages: int = 0
    swa_evicted_pages: int = 0
    swa_lost_pages: int = 0  # pages of token matches not usable: their window was freed (or partial)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens admitted."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate,
                "inserted_pages": self.inserted_pages, "evicted_pages": self.evicted_pages,
                "swa_evicted_pages": self.swa_evicted_pages, "swa_lost_pages": self.swa_lost_pages}


def check_supported(store: HierarchicalKVStore, *, prefill_inputs: Sequence[str], query_rows: int | None,
                    algorithm: str, ring: SlidingWindowKV | None = None, staged_index_keys: bool = False) -> None:
    """Refuse, by name, configurations the prefix cache does not handle (module docstring).
    `ring`: a hybrid model's sliding-window ring, which must keep a page beyond the window
    (`ModelRunner(ring_page_slack=True)`) for its windows to be snapshot at page boundaries.
    `staged_index_keys`: the prefill staging keeps an indexer key per token (an MLA + indexer
    model), which the cache then keeps beside its pages: the one prefill input it can give."""
    what = "EngineConfig.enable_prefix_caching=True"
    if ring is not None and ring.slots < ring.window + store.page_size:
        raise ConfigError(f"{what}: the sliding-window ring keeps {ring.slots} slots per row, fewer than window + "
                          f"page_size ({ring.window} + {store.page_size}); build the runner with ring_page_slack=True")
    missing = set(prefill_inputs) - ({"index_k"} if staged_index_keys else set())
    if missing:
        raise ConfigError(f"{what}: algorithm {algorithm!r} needs prefill inputs {sorted(missing)} that a "
                          "cached prefix does not have; use another algorithm or turn prefix caching off")
    if query_rows is None:
        raise ConfigError(f"{what}: algorithm {algorithm!r} reads every prompt query at build; a cached prefix "
                          "has none; turn prefix caching off")
    if store.layout.is_fp8:
        raise ConfigError(f"{what}: fp8 KV is not supported (a cached prefix would be attended in its rounded "
                          "stored form, unlike the same prompt computed afresh); use a 16/32-bit kv dtype")
    if store.host_alloc.num_pages == 0:
        raise ConfigError(f"{what}: the store has no host pool to hold cached pages (store 'resident', the default, "
                          "sizes none); use store 'hierarchical' (e.g. --config '{\"algorithm\": \"quest\", \"store\": "
                          "\"hierarchical\"}') or set host_capacity_tokens")


SWA_WINDOWS_PER_ROW = 4  # sliding windows the engine's prefix cache may hold per request row


def swa_limit_pages(rows: int, window: int, page_size: int) -> int:
    """The SWA pages the engine lets its prefix cache hold (and the memory plan counts):
    SWA_WINDOWS_PER_ROW windows per request row, each ceil(window / page) + 1 pages (a window
    not starting on a page boundary spans one more)."""
    return rows * SWA_WINDOWS_PER_ROW * (-(-window // page_size) + 1)


class SwaPages:
    """Host copies of sliding-window K/V, one handle per page (the tree's SWA values).

    A page holds `page_size` tokens of every sliding layer, k and v [layers, page, kv_heads,
    head_dim] on the host; `valid_from` is its first token the ring still had when it was
    snapshot (0 but for the oldest page of a window that is not a whole number of pages: its
    first tokens lay before the window). Handles are freed by the prefix cache when the tree
    hands them back; `len()` counts the pages held."""

    def __init__(self) -> None:
        self._pages: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, k: torch.Tensor, v: torch.Tensor, valid_from: int) -> int:
        self._next += 1
        self._pages[self._next] = (k, v, valid_from)
        return self._next

    def get(self, handle: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self._pages[handle]

    def free(self, handles: Sequence[int]) -> None:
        for h in handles:
            del self._pages[h]


class PrefixCache:
    """The engine's prefix cache (module docstring). `store`: the coordinator's store;
    `query_rows`: prompt tokens at the end that must be computed (the algorithm's
    `prefill_query_rows`); `headroom()`: free host pages not promised to admitted requests
    (the budget's), what an export may take. `ring`: a hybrid model's sliding-window ring
    (None for a model without sliding layers); `swa_limit_pages`: sliding-window pages the
    cache may hold before `evict_swa` frees the least recently used (None: as many as the
    host pool has pages)."""

    def __init__(self, store: HierarchicalKVStore, *, query_rows: int = 0,
                 headroom: Callable[[], int] | None = None, ring: SlidingWindowKV | None = None,
                 swa_limit_pages: int | None = None, index_staging: PrefillStaging | None = None) -> None:
        self.store = store
        self.page = store.page_size
        self.ring = ring
        self.tree = RadixCache(self.page, None if ring is None else ring.window)
        self.swa = SwaPages()
        self.swa_limit_pages = store.host_alloc.num_pages if swa_limit_pages is None else swa_limit_pages
        self.query_rows = query_rows
        self.headroom = headroom or (lambda: store.host_alloc.free)
        self._locks: dict[str, LockHandle] = {}
        self._windows: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # rid -> (end, k, v) to restore
        self._chunk_windows: dict[str, dict[int, list[int]]] = {}  # rid -> {pages: SWA handles} of chunk ends
        self.stats = PrefixStats()
        # an MLA + indexer model: the indexer key of every cached token, per host page id
        self.index_staging = index_staging
        self._index_pages: dict[int, torch.Tensor] = {}  # host page id -> [layers, page, index_dim] on the host
        self._prompt_index: dict[str, torch.Tensor] = {}  # rid -> its prompt's whole pages' keys, until inserted
        self._hit_pages: dict[str, list[int]] = {}  # rid -> the cached prefix's page ids, to stage at on_admitted
        self._pending: torch.cuda.Event | None = None  # the last device -> host copies issued
        # (request, start, stop) -> indexer keys [layers, stop - start, index_dim] of its tokens as
        # the model computed them, where the algorithm keeps them losslessly (the engine sets it:
        # DSA with keys in the model's dtype); None: only prompt pages can be cached
        self.index_reader: Callable[[Request, int, int], torch.Tensor] | None = None

    # -- admission --------------------------------------------------------------------------
    def usable_tokens(self, prompt_len: int) -> int:
        """The longest prefix of a prompt that may come from the cache (whole pages)."""
        return max(0, prompt_len - max(1, self.query_rows)) // self.page * self.page

    def match(self, rid: str, prompt_ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """Look a prompt's cached prefix up and lock it for request `rid`: (tokens, host page
        ids), (0, None) on a miss. `release(rid)` undoes it when the admission fails; for a
        hybrid model `on_admitted` then restores the prefix's window into the request's ring row."""
        if rid in self._locks:
            raise RuntimeError(f"request {rid!r} already holds a prefix lock")
        limit = self.usable_tokens(len(prompt_ids))
        if limit == 0:
            return 0, None
        m = self.tree.match_prefix(prompt_ids[:limit])
        self.stats.swa_lost_pages += m.raw_pages - m.num_pages
        if m.num_pages == 0:
            return 0, None
        if self.ring is not None:
            window = self._gather_window(m.num_pages * self.page, m.swa_values)
            if window is None:  # a page of the window was snapshot partially: compute it afresh
                self.stats.swa_lost_pages += m.num_pages
                return 0, None
            self._windows[rid] = window
        if self.index_staging is not None:
            self._hit_pages[rid] = list(m.values)
        self._locks[rid] = self.tree.lock(m.node)
        return m.num_pages * self.page, torch.tensor(m.values, dtype=torch.int64)

    def on_admitted(self, rid: str, request: Request) -> None:
        """The request has its ring row (`request.slot`) and staging span: write its cached
        prefix's window into the row and its indexer keys into the span, as the prefill chunks
        of the prefix would have left them. A request that keeps nothing on the host has its
        prefix in the staging now and never reads the pages again: its lock goes at once."""
        if not self.store.keeps_host(request):
            handle = self._locks.pop(rid, None)
            if handle is not None:
                self.tree.unlock(handle)
        pages = self._hit_pages.pop(rid, None)
        if pages:
            staging = self.index_staging
            assert staging is not None and staging.index_k is not None
            self._wait_copies()
            keys = torch.cat([self._index_pages[p] for p in pages], 1)  # [layers, tokens, index_dim]
            base = staging.spans[rid][0]
            staging.index_k[:, base:base + keys.shape[1]] = keys.to(staging.index_k.device)
        window = self._windows.pop(rid, None)
        if window is None:
            return
        assert self.ring is not None
        end, k, v = window
        k, v = k.to(self.ring.k.device), v.to(self.ring.v.device)  # one host -> device copy each
        self.ring.reset_row(request.slot)
        for layer in range(self.ring.num_layers):
            self.ring.write_prefill(layer, request.slot, k[layer], v[layer], start=end - k.shape[1])

    def count(self, prompt_len: int, cached: int) -> None:
        """An admission went through with `cached` of its `prompt_len` tokens from the cache."""
        self.stats.lookups += 1
        self.stats.hits += cached > 0
        self.stats.prompt_tokens += prompt_len
        self.stats.hit_tokens += cached

    def release(self, rid: str) -> None:
        """Drop the request's lock (its pages become evictable when no one else holds them)
        and the windows it snapshot and did not insert."""
        self._windows.pop(rid, None)
        self._hit_pages.pop(rid, None)
        self._prompt_index.pop(rid, None)
        for handles in self._chunk_windows.pop(rid, {}).values():
            self.swa.free(handles)
        handle = self._locks.pop(rid, None)
        if handle is not None:
            self.tree.unlock(handle)

    # -- sliding windows ------------------------------------------------------------------------
    def on_chunk(self, rid: str, request: Request, done: int) -> None:
        """A prompt chunk that is not the last ran (`done` prompt tokens in the ring row):
        snapshot the window at its last page boundary, inserted with the prompt at
        `on_prefilled` — so a later prompt sharing only a part of this one (a system prompt)
        finds a window inside that part."""
        pages = done // self.page
        mine = self._chunk_windows.setdefault(rid, {})
        if self.ring is None or pages == 0 or pages in mine:
            return
        self._swa_room(self.tree.window_pages)
        handles = self._snapshot(request, pages, done)
        if handles is not None:
            mine[pages] = handles

    # -- device -> host copies ------------------------------------------------------------------
    def _copied(self) -> None:
        """After issuing copies to the host (`copy_to_host`): on CUDA, an event the host waits
        on before it reads any of them (`_wait_copies`). The copies are taken inside a step
        (a chunk's window, the hand-over's indexer keys) and read at a later admission or after
        the step: not waiting for them there keeps the step's launch ahead of the GPU (async
        scheduling)."""
        device = self.ring.k.device if self.ring is not None else (
            self.index_staging.k.device if self.index_staging is not None else torch.device("cpu"))
        if device.type == "cuda":
            self._pending = torch.cuda.Event()
            self._pending.record(torch.cuda.current_stream(device))

    def _wait_copies(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def _swa_room(self, pages: int) -> None:
        """Evict least recently used windows until `pages` more SWA pages fit the limit (or no
        unlocked window is left). Called before snapshots, never inside an insertion sequence
        (an eviction may remove a leaf that sequence just inserted)."""
        excess = len(self.swa) + pages - self.swa_limit_pages
        if excess > 0:
            self.evict_swa(excess)

    def _snapshot(self, request: Request, pages: int, length: int | None = None) -> list[int] | None:
        """SWA handles of the last min(window pages, pages) pages of the prefix ending at page
        `pages`, copied from the request's ring row to the host; None when the ring no longer
        has that window (the prefix ends more than a page before the row's `length`, by
        default the request's) or when the SWA pages held would pass `swa_limit_pages` (the
        bound the memory plan counts: that prefix end is then not reusable)."""
        ring = self.ring
        assert ring is not None
        end = pages * self.page
        length = request.seq_len if length is None else length
        lo = max(0, length - ring.slots)  # the oldest position the row still has
        if end > length or lo > max(0, end - ring.window):
            return None
        first = pages - min(self.tree.window_pages, pages)
        if len(self.swa) + pages - first > self.swa_limit_pages:
            return None
        start = max(first * self.page, lo)
        ks, vs = zip(*(ring.read(layer, request.slot, start, end) for layer in range(ring.num_layers)))
        k, v = torch.stack(ks), torch.stack(vs)  # [layers, end - start, kv_heads, head_dim], on the ring's device
        handles = []
        for p in range(first, pages):
            a, b = p * self.page, (p + 1) * self.page
            valid = max(a, start)
            page_kv = [x[:, valid - start:b - start] for x in (k, v)]
            if valid > a:  # the first tokens lay before the window: zeros in front (on the device)
                pad = k.new_zeros((k.shape[0], valid - a, *k.shape[2:]))
                page_kv = [torch.cat([pad, x], 1) for x in page_kv]
            pk, pv = (copy_to_host(x) for x in page_kv)  # no device sync: read after `_wait_copies`
            handles.append(self.swa.put(pk, pv, valid - a))
        self._copied()
        return handles

    def _gather_window(self, end: int, handles: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """The window before position `end` from its pages' SWA handles: (end, k, v [layers,
        min(end, window), kv_heads, head_dim]); None when a token the next one attends to was
        not snapshot."""
        assert self.ring is not None
        self._wait_copies()
        n = min(end, self.ring.window)
        need_from = max(0, end - self.ring.window + 1)  # position end - window is masked out
        first = end // self.page - len(handles)
        ks, vs = [], []
        for i, h in enumerate(handles):
            k, v, valid_from = self.swa.get(h)
            if valid_from and (first + i) * self.page + valid_from > need_from:
                return None
            ks.append(k)
            vs.append(v)
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)
        return end, k[:, k.shape[1] - n:], v[:, v.shape[1] - n:]

    # -- indexer keys ----------------------------------------------------------------------------
    def on_commit(self, rid: str, request: Request) -> None:
        """The runner's commit hook: the prompt was handed over and its staging is about to be
        released; copy the indexer keys of its whole pages to the host, to go into the tree
        beside their pages at `on_prefilled`. They are the model's own values, as the staging
        held them (not DSA's stored form, which FP8 keys round), so a prefix served from the
        cache feeds the next chunks' indexer exactly what computing it would."""
        staging = self.index_staging
        assert staging is not None and staging.index_k is not None
        n = request.prompt_len // self.page * self.page
        if n:
            base = staging.spans[rid][0]
            self._prompt_index[rid] = copy_to_host(staging.index_k[:, base:base + n])  # read at on_prefilled
            self._copied()

    def _reads_index(self, request: Request) -> bool:
        """Whether the algorithm holds this request's keys for `index_reader`: a sparse request
        (a dense-mode one builds no representation)."""
        return self.index_reader is not None and not request.dense

    def _index_limit(self, request: Request, pages: int) -> int:
        """How many of a request's first `pages` pages can be inserted: all without an indexer
        or where `index_reader` reads its keys (the algorithm keeps them losslessly); else those
        whose keys `on_commit` copied (its prompt's whole pages, until they are inserted: a
        generated token's exact indexer key is then kept nowhere)."""
        if self.index_staging is None or self._reads_index(request):
            return pages
        keys = self._prompt_index.get(request.rid)
        return 0 if keys is None else min(pages, keys.shape[1] // self.page)

    def _attach_index(self, request: Request, ids: Sequence[int], positions: Sequence[int]) -> None:
        """Keep the indexer keys of page `positions[i]` of `request` for host page `ids[i]`:
        from the prompt's copy, or read from the algorithm (`index_reader`) past it."""
        if self.index_staging is None:
            return
        self._wait_copies()
        prompt = self._prompt_index.get(request.rid)
        have = 0 if prompt is None else prompt.shape[1] // self.page
        for page_id, p in zip(ids, positions):
            a, b = p * self.page, (p + 1) * self.page
            if p < have:
                assert prompt is not None
                self._index_pages[page_id] = prompt[:, a:b].clone()
            else:
                assert self.index_reader is not None and self._reads_index(request), "a page past the prompt's keys"
                self._index_pages[page_id] = self.index_reader(request, a, b).to("cpu")  # after a step: may wait

    def _free_evicted(self, out: EvictResult) -> None:
        for page_id in out.values:
            self._index_pages.pop(page_id, None)
        self.store.release_host_pages(torch.tensor(out.values, dtype=torch.int64))
        self.swa.free(out.swa_values)
        self.stats.evicted_pages += len(out.values)
        self.stats.swa_evicted_pages += len(out.swa_values)

    def evict_swa(self, num_pages: int) -> int:
        """Free the sliding-window pages of at least `num_pages` least recently used unlocked
        nodes (they become tombstones, or leave the tree when leaves); returns the SWA pages freed."""
        if num_pages <= 0:
            return 0
        out = self.tree.evict_swa(num_pages)
        self._free_evicted(out)
        return len(out.swa_values)

    # -- insertion ----------------------------------------------------------------------------
    def on_prefilled(self, rid: str, request: Request, prompt_ids: Sequence[int]) -> None:
        """The prompt was handed to the store: cache its whole pages."""
        self._cache(rid, request, prompt_ids, keep_lock=self.store.keeps_host(request))
        self._prompt_index.pop(rid, None)

    def on_finished(self, rid: str, request: Request | None, token_ids: Sequence[int], retracted: bool) -> None:
        """Before the request's memory is freed: cache its prompt and generated tokens whose
        K/V it wrote (none when it never finished its prefill or is retracted), then unlock."""
        if request is not None and request.seq_len > 0 and not retracted:
            known = len(token_ids)
            for i, t in enumerate(token_ids):
                if t < 0:  # an output token still on the device (async scheduling): unknown
                    known = i
                    break
            self._cache(rid, request, token_ids[:known], keep_lock=False)
        self.release(rid)

    def _cache(self, rid: str, request: Request, token_ids: Sequence[int], keep_lock: bool) -> None:
        full = self._index_limit(request, min(len(token_ids), request.seq_len) // self.page)
        if self.ring is not None and full:
            self._swa_room(self.tree.window_pages)  # for the window of the end (chunk ends hold theirs)
        node: RadixNode | None = None
        for pages, handles in sorted(self._chunk_windows.pop(rid, {}).items()):
            if pages < full:  # windows inside the prompt, shortest first (each may export pages)
                tokens = list(token_ids[: pages * self.page])
                inserted = self._insert_host(request, tokens, handles) if self.store.keeps_host(request) \
                    else self._insert_export(request, tokens, handles)
                node = node if inserted is None or inserted.tombstone else inserted
            else:
                self.swa.free(handles)
        if full:
            tokens = list(token_ids[: full * self.page])
            last = self._insert_host(request, tokens) if self.store.keeps_host(request) \
                else self._insert_export(request, tokens)
            node = last if last is not None and not last.tombstone else node
        old = self._locks.pop(rid, None)
        if keep_lock and node is not None:
            self._locks[rid] = self.tree.lock(node)
        elif keep_lock and old is not None:
            self._locks[rid], old = old, None
        if old is not None:
            self.tree.unlock(old)

    def _insert(self, request: Request, tokens: list[int], values: list[int],
                swa: list[int] | None = None) -> InsertResult:
        """tree.insert with, for a hybrid model, the window of the prefix's end (`swa`, or
        snapshot from the ring now); the SWA handles the tree did not keep are freed here."""
        if self.ring is not None and swa is None:
            swa = self._snapshot(request, len(tokens) // self.page)
        result = self.tree.insert(tokens, values, swa)
        self.swa.free(result.unused_swa_values)
        return result

    def _insert_host(self, request: Request, tokens: list[int], swa: list[int] | None = None) -> RadixNode:
        """The request's own host pages join the tree (those it did not already hold)."""
        ids = self.store.host_page_ids(request)[: len(tokens) // self.page].tolist()
        result = self._insert(request, tokens, ids, swa)
        unused = set(result.unused_values)
        kept = [v for v in ids if v not in unused]
        self._attach_index(request, kept, [p for p, v in enumerate(ids) if v not in unused])
        self.store.lend_host_pages(request, torch.tensor(kept, dtype=torch.int64))
        self.stats.inserted_pages += len(kept)
        return result.node

    def _insert_export(self, request: Request, tokens: list[int], swa: list[int] | None = None) -> RadixNode | None:
        """Copy the device K/V of the pages the tree lacks to new host pages, as many as the
        host pool can spare, and insert them."""
        m = self.tree.match_prefix(tokens)
        have = m.raw_pages  # pages cached, usable or not (a tombstone's full values stand)
        total = len(tokens) // self.page
        take = max(0, min(total - have, self.headroom(), self.store.host_alloc.free))
        if take == 0 and (self.ring is None or have < total):
            self.swa.free(swa or [])
            return None  # nothing new (with every page cached, a hybrid still gives its window)
        if have + take < total and swa is not None:  # the window given ends beyond what is inserted
            self.swa.free(swa)
            swa = None
        known = self._path_values(tokens, have)
        ids = self.store.export_pages(request, have, take).tolist() if take else []
        end = (have + take) * self.page
        result = self._insert(request, tokens[:end], known + ids, swa)
        mine = set(ids)
        back = [v for v in result.unused_values if v in mine]
        unused = set(back)
        self._attach_index(request, [v for v in ids if v not in unused],
                           [have + i for i, v in enumerate(ids) if v not in unused])
        self.store.release_host_pages(torch.tensor(back, dtype=torch.int64))
        self.stats.inserted_pages += take - len(back)
        return None  # nothing of the request's own is borrowed: no lock to keep

    def _path_values(self, tokens: list[int], pages: int) -> list[int]:
        """Full-attention handles of the first `pages` pages of `tokens` (all cached)."""
        out: list[int] = []
        node, pos = self.tree.root, 0
        while pos < pages:
            node = node.children[tuple(tokens[pos * self.page:(pos + 1) * self.page])]
            out.extend(node.values)
            pos += node.pages
        return out[:pages]

    # -- eviction -----------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        return self.tree.evictable_size()

    def cached_pages(self) -> int:
        return self.tree.evictable_size() + self.tree.protected_size()

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from least recently used unlocked leaves (or
        all that can be), with their sliding-window pages; returns the host pages freed."""
        if num_pages <= 0:
            return 0
        out = self.tree.evict(num_pages)
        self._free_evicted(out)
        return len(out.values)

    def clear(self) -> int:
        """Evict everything not locked; returns the pages freed."""
        return self.evict(self.tree.evictable_size())

    def locked(self) -> list[str]:
        """Requests holding a lock."""
        return list(self._locks)
