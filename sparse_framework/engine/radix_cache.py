"""A page-aligned radix tree over token ids: the prefix cache of a (hybrid) model's KV.

The tree stores *which* token prefixes have KV somewhere and hands back the caller's handles
for it; it allocates and frees nothing itself (pure Python, no torch, no store). Each node
covers whole pages (`page_size` tokens; a partial last page is never inserted) and holds, per
page, one opaque handle for the full-attention layers' KV (e.g. a host page id) in `values`,
and, for a model with sliding-window layers (`window` set), one handle per page for those
layers' KV in `swa`. A node whose sliding-window KV was freed keeps its full values and its
place in the tree with `swa = None`: a *tombstone*. Without a window `swa` is `[]` (nothing to
hold) and nothing is ever a tombstone.

Which prefix matches (`match_prefix`). A prefix of p pages is usable only if the sliding-window
layers still have the KV the next token attends to: the last `w = ceil(window / page_size)`
pages of the prefix (all of it when p < w) must hold their sliding-window KV, i.e. no tombstone
among them. Tombstones are whole nodes, so the longest such prefix ends either where the token
match ends or where a tombstone node starts; the match walks the path once, counting the pages
since the last tombstone. A match that ends inside a node splits it there, so a match always
ends on a node boundary and its node can be locked.

Locks (`lock` / `unlock`). A request using a matched prefix takes the *full* lock on every node
from its match's node to the root, and the *SWA* lock only on the nodes covering the prefix's
last `w` pages (from the deepest node up, stopping at `w` pages or at a tombstone, which only a
node from `insert`, or from a match older than an `evict_swa`, can have there). Hence full
lock >= SWA lock on every node, and a full-locked leaf is always SWA-locked. `lock` returns a
handle that records how many pages it SWA-locked: a later split keeps the original node object
as the *lower* part, so walking up from the handle's node over that many pages reaches exactly
the nodes it locked.

Eviction (two LRU orders over one logical clock; `match_prefix` and `insert` touch their path
root first, so a parent is older than the child touched with it):

- `evict(n)` frees full-attention KV: it removes the least recently used *unlocked leaf* (its
  full and sliding-window handles are returned) until n full pages are freed. Leaves only,
  because a node's KV is useful only together with all of its ancestors' (attention reads the
  whole prefix, and a match walks from the root): removing an inner node would strand its
  subtree, whose pages could never be matched again. Removing a leaf may expose its parent as a
  leaf; a tombstone parent exposed so is removed at once (a tombstone leaf can end no match, so
  keeping it would only hold memory), a live one becomes a candidate with its own access time.
- `evict_swa(n)` frees sliding-window KV only: the least recently used node holding it with SWA
  lock 0 (inner nodes included) becomes a tombstone, until n SWA pages are freed. Tombstones
  exist because the sliding-window layers need only the last window of a prefix: the KV of an
  older page is dead weight for them, while its full-attention KV is still needed by every
  longer prefix. Freeing just that part keeps the long prefixes matchable (their windows lie
  further down) at a fraction of the memory. A leaf tombstoned so is removed entirely, with its
  full values (and tombstone ancestors exposed as leaves), for the reason above.

Each order is a binary heap of (access stamp, page offset, sequence, node) entries. Entries are
never searched for: a touch, an unlock, a split or a newly exposed leaf pushes a fresh entry,
and a popped entry counts only if it is still current (node alive, same stamp and page offset,
still a candidate: an unlocked leaf for the full order, an unlocked node holding
sliding-window KV for the SWA order). So a touch is O(log n), eviction never scans locked or
inner nodes, and a tombstone can never be taken from the SWA order. The heaps are rebuilt from
the tree when stale entries outnumber nodes 4 to 1. Equal stamps (a node split in two) order
the upper part first.

Ownership. Every handle given to `insert` is either kept by the tree (and later returned by
exactly one eviction) or handed back at once in `InsertResult.unused_values` /
`unused_swa_values` (a page already cached, or a new tail with no sliding-window KV that would
be a tombstone leaf); the caller frees what it gets back. `evictable_size()` (full pages of
unlocked nodes: exactly what `evict` can free), `protected_size()`, `evictable_swa_size()`,
`protected_swa_size()` are running counters.

For the caller: a prefix is reusable only where the tree holds the window that ends it. A
request that inserts sliding-window KV for its own last window only makes none of its shorter
prefixes reusable: 64 requests sharing a 16K-token prompt (page 16, window 4096) that each
insert SWA handles for their last 256 pages hit 0 pages; inserting them for every page, 1024
pages per request after the first (measured driving this tree alone; 1.4 ms per match + lock
+ insert + unlock of 16.9K tokens in CPython). So insert, with its window, at the
points worth reusing (the end of each prefill chunk, of a shared system prompt), as SGLang
does after every chunk.

Differences from SGLang's SWA radix cache (python/sglang/srt/mem_cache/swa_radix_cache.py),
read for its facts:
- SGLang counts the window in tokens along nodes of page-aligned keys; here every size is in
  pages and the window is rounded up to whole pages (exact at a page-aligned prefix end). The
  rule is stated on the prefix ("no tombstone in its last w pages") rather than as SGLang's
  "no tombstone on the path, or at least a window of tokens since the last one" (the same set).
- SGLang tags the top node of a lock's SWA span with a uuid (inherited on split) to know where
  to stop unlocking; here the lock handle records the SWA-locked page count.
- SGLang keeps doubly linked lists of all nodes (full) and of non-tombstone nodes (SWA) and
  walks past locked or inner nodes to find a victim; here the heaps hold candidates only.
- SGLang's `evict` takes full and SWA token counts together and frees through its allocator,
  and its `insert` frees duplicate indices itself; here there are two calls, and every freed
  or duplicate handle is returned to the caller.
- SGLang's insert passes `swa_evicted_seqlen`; here `swa_values` covers the last pages.
  Reviving a tombstone, SGLang replaces the node's full indices with the caller's (or keeps
  them when locked); here the node always keeps its full values, adopts the caller's
  sliding-window handles, and the caller's full values come back as duplicates.
- Not done here: SGLang's early release of the SWA lock once a request decodes past its
  window (`dec_swa_lock_only`), node-chain compaction, host backup values, KV events.

Why this module is long: the nodes, their locks, the page counts and the two LRU orders are one
state that every operation (match, insert, lock, evict) keeps consistent at once, and this
docstring, with its comparison to SGLang, is a sixth of it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..common.arith import cdiv
from ..common.errors import ConfigError, LockError


class RadixNode:
    """One edge of the tree: `pages` whole pages of tokens and their KV handles.

    `tokens`: the node's token ids (pages * page_size); `values[i]`: the full-attention handle of
    its page i; `swa`: per-page sliding-window handles, None for a tombstone, [] for a tree
    without a window. `full_lock` / `swa_lock`: lock references; `stamp`: last access (logical
    clock); `start`: pages before this node on its path. Read-only for callers.
    """

    __slots__ = ("uid", "parent", "children", "tokens", "values", "swa", "full_lock", "swa_lock",
                 "stamp", "start", "alive")

    def __init__(self, uid: int, parent: RadixNode | None, tokens: tuple[int, ...], values: list[int],
                 swa: list[int] | None, start: int) -> None:
        self.uid = uid
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page's tokens -> child
        self.tokens = tokens
        self.values = values
        self.swa = swa
        self.full_lock = 0
        self.swa_lock = 0
        self.stamp = 0
        self.start = start
        self.alive = True

    @property
    def pages(self) -> int:
        return len(self.values)

    @property
    def tombstone(self) -> bool:
        """Its sliding-window KV was freed (never true in a tree without a window)."""
        return self.swa is None

    def __repr__(self) -> str:
        state = "tomb" if self.tombstone else "live"
        return (f"RadixNode(uid={self.uid}, start={self.start}, pages={self.pages}, {state}, "
                f"full_lock={self.full_lock}, swa_lock={self.swa_lock}, stamp={self.stamp})")


@dataclass(frozen=True)
class Match:
    """The longest usable cached prefix of a token sequence.

    `node`: its last node (the root when nothing matched): lock it while the prefix is used;
    `num_pages`: its length; `values`: its full-attention handles, one per page;
    `swa_values`: the sliding-window handles of its last min(window pages, num_pages) pages
    ([] without a window); `raw_pages`: pages the tokens matched before the window rule (>=
    num_pages; the difference is a hit lost to freed sliding-window KV).
    """

    node: RadixNode
    num_pages: int
    values: list[int]
    swa_values: list[int]
    raw_pages: int


@dataclass(frozen=True)
class InsertResult:
    """What `insert` did. `node`: the last node of the inserted path now in the tree (lock it
    through a `match_prefix`); `num_pages`: that path's length; `prefix_pages`: pages that were
    already cached; `unused_values` / `unused_swa_values`: the caller's handles the tree did not
    keep (duplicates, or a tail without sliding-window KV): the caller frees them."""

    node: RadixNode
    num_pages: int
    prefix_pages: int
    unused_values: list[int]
    unused_swa_values: list[int]


@dataclass
class EvictResult:
    """Handles freed by an eviction, for the caller to release: full-attention ones and
    sliding-window ones (a node removed entirely gives both)."""

    values: list[int] = field(default_factory=list)
    swa_values: list[int] = field(default_factory=list)


@dataclass(eq=False)
class LockHandle:
    """A lock taken by `RadixCache.lock`; give it back to `unlock` exactly once.
    `swa_pages`: pages SWA-locked, counted up from `node`."""

    node: RadixNode
    swa_pages: int
    released: bool = False


class _LruOrder:
    """Candidates for one kind of eviction, least recently used first (module docstring)."""

    def __init__(self, is_candidate: Callable[[RadixNode], bool]) -> None:
        self.is_candidate = is_candidate
        self._heap: list[tuple[int, int, int, RadixNode]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.stamp, node.start, next(self._seq), node))

    def _current(self, entry: tuple[int, int, int, RadixNode]) -> bool:
        node = entry[3]
        return node.alive and (node.stamp, node.start) == entry[:2] and self.is_candidate(node)

    def pop_oldest(self) -> RadixNode | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._current(entry):
                return entry[3]
        return None

    def members(self) -> list[RadixNode]:
        """The current candidates, oldest first (each once)."""
        seen: set[int] = set()
        out = []
        for entry in sorted(self._heap, key=lambda e: e[:3]):
            if self._current(entry) and entry[3].uid not in seen:
                seen.add(entry[3].uid)
                out.append(entry[3])
        return out

    def rebuild(self, nodes: Iterator[RadixNode]) -> None:
        self._heap = [(n.stamp, n.start, next(self._seq), n) for n in nodes if self.is_candidate(n)]
        heapq.heapify(self._heap)


class RadixCache:
    """Page-aligned radix tree of cached token prefixes (module docstring).

    `page_size`: tokens per page (>= 1); `window`: the sliding-window layers' window in tokens
    (the past tokens the next one attends to), or None for a model without such layers.
    """

    def __init__(self, page_size: int, window: int | None = None) -> None:
        if page_size < 1:
            raise ConfigError(f"RadixCache.page_size must be >= 1, got {page_size}")
        if window is not None and window < 1:
            raise ConfigError(f"RadixCache.window must be None (no sliding window) or >= 1 tokens, "
                              f"got {window}")
        self.page_size = page_size
        self.window = window
        self.window_pages = 0 if window is None else cdiv(window, page_size)
        self._uids = itertools.count(1)
        self._clock = 0
        self.root = RadixNode(0, None, (), [], [], 0)
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0
        self._evictable_swa = 0
        self._protected_swa = 0
        self._full_lru = _LruOrder(lambda n: not n.children and n.full_lock == 0)
        self._swa_lru = _LruOrder(lambda n: bool(n.swa) and n.swa_lock == 0)

    # -- sizes (pages) ------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Full-attention pages of unlocked nodes: what `evict` can free."""
        return self._evictable

    def protected_size(self) -> int:
        """Full-attention pages of full-locked nodes."""
        return self._protected

    def evictable_swa_size(self) -> int:
        """Sliding-window pages held with SWA lock 0: what `evict_swa` can free."""
        return self._evictable_swa

    def protected_swa_size(self) -> int:
        """Sliding-window pages of SWA-locked nodes."""
        return self._protected_swa

    def num_nodes(self) -> int:
        return self._num_nodes

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def full_lru(self) -> list[RadixNode]:
        """Candidates of `evict` (unlocked leaves), least recently used first."""
        return self._full_lru.members()

    def swa_lru(self) -> list[RadixNode]:
        """Candidates of `evict_swa` (unlocked nodes holding sliding-window KV), oldest first."""
        return self._swa_lru.members()

    # -- lookup and insertion -----------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> Match:
        """The longest cached prefix of `tokens` (whole pages; a partial last page is ignored)
        whose last window still has its sliding-window KV. Touches the prefix's nodes; may split
        the last one so the prefix ends on a node boundary."""
        n = len(tokens) // self.page_size
        w = self.window_pages
        node, pos = self.root, 0
        run = float("inf")  # pages since the last tombstone on the path (inf: none since the root)
        best, best_pages, raw = self.root, 0, 0
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            k = self._common_pages(child, tokens, pos, n)
            raw = pos + k
            if child.tombstone:
                if run >= w:
                    best, best_pages = node, pos
                run = 0
            else:
                run += k
            diverged = k < child.pages
            if diverged:
                if child.tombstone or run < w:
                    break  # this node's part cannot end a usable prefix: leave it whole
                child = self._split(child, k)
            node, pos = child, pos + k
            if diverged:
                break
        if run >= w and pos > best_pages:
            best, best_pages = node, pos
        path = self._path(best)
        self._touch(path)
        values = [v for n_ in path for v in n_.values]
        return Match(best, best_pages, values, self._tail_swa(path, min(w, best_pages)), raw)

    def insert(self, tokens: Sequence[int], values: Sequence[int],
               swa_values: Sequence[int] | None = None) -> InsertResult:
        """Cache `tokens` (whole pages) with one full-attention handle per page in `values`, and
        sliding-window handles for the LAST len(swa_values) pages (a request keeps only its
        window; None or [] without a window). Returns the handles not kept (module docstring)."""
        p = self.page_size
        if len(tokens) % p:
            raise ConfigError(f"insert: tokens must be whole pages of page_size={p}, got {len(tokens)} "
                              f"tokens; keep the partial last page out of the cache")
        n = len(tokens) // p
        if len(values) != n:
            raise ConfigError(f"insert: values must have one handle per page ({n} for {len(tokens)} "
                              f"tokens), got {len(values)}")
        swa = list(swa_values or [])
        if self.window is None and swa:
            raise ConfigError("insert: swa_values must be None or empty in a cache without a window "
                              f"(window=None), got {len(swa)}")
        if len(swa) > n:
            raise ConfigError(f"insert: swa_values may cover at most the {n} pages inserted, got {len(swa)}")
        swa_start = n - len(swa) if self.window is not None else n  # first page with SWA handles
        unused: list[int] = []
        unused_swa: list[int] = []
        node, pos = self.root, 0
        path: list[RadixNode] = []
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            k = self._common_pages(child, tokens, pos, n)
            if k < child.pages:
                child = self._split(child, k)
            end = pos + k
            unused.extend(values[pos:end])
            if child.tombstone and swa_start < end:
                if swa_start > pos:  # only the lower part gets its window back
                    path.append(self._split(child, swa_start - pos))
                self._revive(child, swa[max(pos, swa_start) - swa_start:end - swa_start])
            elif not child.tombstone and swa_start < end:
                unused_swa.extend(swa[max(pos, swa_start) - swa_start:end - swa_start])
            path.append(child)
            node, pos = child, end
        prefix_pages = pos
        if pos < n:
            if self.window is None:
                node = self._new_child(node, tokens, pos, n, values, [])
                path.append(node)
            elif swa_start >= n:
                unused.extend(values[pos:])  # it would be a tombstone leaf: it can end no match
            else:
                lo = max(pos, swa_start)
                if lo > pos:
                    node = self._new_child(node, tokens, pos, lo, values, None)
                    path.append(node)
                node = self._new_child(node, tokens, lo, n, values, swa[lo - swa_start:])
                path.append(node)
        self._touch(path)
        self._maybe_compact()
        num_pages = node.start + node.pages if node is not self.root else 0
        return InsertResult(node, num_pages, prefix_pages, unused, unused_swa)

    # -- locks --------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> LockHandle:
        """Protect the prefix ending at `node` (a match's node): full lock on the path to the
        root, SWA lock on its last window. The root gives a handle that locks nothing."""
        if node is self.root:
            return LockHandle(node, 0)
        if not node.alive:
            raise LockError(f"lock: {node!r} was evicted; lock the node of a fresh match_prefix")
        if node.tombstone:
            raise LockError(f"lock: {node!r} is a tombstone (its sliding-window KV was freed); "
                            "lock the node of a match_prefix, which never ends on one")
        for n in self._up(node):
            if n.full_lock == 0:
                self._evictable -= n.pages
                self._protected += n.pages
            n.full_lock += 1
        swa_pages = 0
        for n in self._up(node):
            if swa_pages >= self.window_pages or n.tombstone:
                break
            if n.swa_lock == 0:
                self._evictable_swa -= len(n.swa)
                self._protected_swa += len(n.swa)
            n.swa_lock += 1
            swa_pages += n.pages
        return LockHandle(node, swa_pages)

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by `lock`; its nodes become evictable again when no other lock
        holds them."""
        if handle.released:
            raise LockError(f"unlock: this lock on {handle.node!r} was already released")
        swa_nodes = self._swa_span(handle)
        for n in self._up(handle.node):  # check everything before changing anything
            if n.full_lock < 1 or (n in swa_nodes and (n.swa_lock < 1 or n.tombstone)):
                raise LockError(f"unlock: {n!r} would go below zero (or lost its sliding-window KV "
                                "while SWA-locked); each lock must be released once")
        for n in self._up(handle.node):
            n.full_lock -= 1
            if n.full_lock == 0:
                self._evictable += n.pages
                self._protected -= n.pages
                if not n.children:
                    self._full_lru.push(n)
        for n in swa_nodes:
            n.swa_lock -= 1
            if n.swa_lock == 0:
                self._evictable_swa += len(n.swa)
                self._protected_swa -= len(n.swa)
                self._swa_lru.push(n)
        handle.released = True

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_pages: int) -> EvictResult:
        """Remove least recently used unlocked leaves until `num_pages` full-attention pages are
        freed (or nothing is left to evict). Returns every handle freed."""
        if num_pages < 0:
            raise ConfigError(f"evict: num_pages must be >= 0, got {num_pages}")
        out = EvictResult()
        freed = 0
        while freed < num_pages:
            node = self._full_lru.pop_oldest()
            if node is None:
                break
            freed += self._remove_leaf(node, out)
        self._maybe_compact()
        return out

    def evict_swa(self, num_pages: int) -> EvictResult:
        """Free the sliding-window KV of least recently used nodes with SWA lock 0 until
        `num_pages` such pages are freed; each becomes a tombstone, or is removed with its full
        values when it is a leaf. Returns every handle freed. A no-op without a window."""
        if num_pages < 0:
            raise ConfigError(f"evict_swa: num_pages must be >= 0, got {num_pages}")
        out = EvictResult()
        freed = 0
        while freed < num_pages:
            node = self._swa_lru.pop_oldest()
            if node is None:
                break
            freed += len(node.swa)
            if node.children or node.full_lock:
                out.swa_values.extend(node.swa)
                self._evictable_swa -= len(node.swa)
                node.swa = None
            else:
                self._remove_leaf(node, out)
        self._maybe_compact()
        return out

    # -- internals ----------------------------------------------------------------------------

    def _page_key(self, tokens: Sequence[int], page: int) -> tuple[int, ...]:
        return tuple(tokens[page * self.page_size:(page + 1) * self.page_size])

    def _common_pages(self, node: RadixNode, tokens: Sequence[int], pos: int, n: int) -> int:
        """Whole pages node.tokens shares with tokens from page `pos` (its first page matches)."""
        p = self.page_size
        k = 1
        while k < node.pages and pos + k < n and \
                node.tokens[k * p:(k + 1) * p] == tuple(tokens[(pos + k) * p:(pos + k + 1) * p]):
            k += 1
        return k

    def _up(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not self.root:
            yield node
            node = node.parent

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """Root's child .. node (empty for the root)."""
        return list(self._up(node))[::-1]

    def _tail_swa(self, path: list[RadixNode], pages: int) -> list[int]:
        out: list[int] = []
        for n in reversed(path):
            if len(out) >= pages:
                break
            out[:0] = n.swa
        return out[len(out) - pages:] if pages else []

    def _swa_span(self, handle: LockHandle) -> list[RadixNode]:
        nodes, pages = [], 0
        for n in self._up(handle.node):
            if pages >= handle.swa_pages:
                break
            nodes.append(n)
            pages += n.pages
        return nodes

    def _touch(self, path: list[RadixNode]) -> None:
        for n in path:  # root side first: ancestors end up older than their descendants
            self._clock += 1
            n.stamp = self._clock
            if self._full_lru.is_candidate(n):
                self._full_lru.push(n)
            if self._swa_lru.is_candidate(n):
                self._swa_lru.push(n)

    def _new_child(self, parent: RadixNode, tokens: Sequence[int], lo: int, hi: int,
                   values: Sequence[int], swa: list[int] | None) -> RadixNode:
        p = self.page_size
        node = RadixNode(next(self._uids), parent, tuple(tokens[lo * p:hi * p]), list(values[lo:hi]),
                         swa, lo)
        parent.children[node.tokens[:p]] = node
        self._num_nodes += 1
        self._evictable += node.pages
        if node.swa:
            self._evictable_swa += len(node.swa)
        return node

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after its first k pages; the new upper node is returned and `node` keeps
        the rest (so lock handles pointing at it stay valid). Locks and stamp are copied."""
        p = self.page_size
        upper = RadixNode(next(self._uids), node.parent, node.tokens[:k * p], node.values[:k],
                          None if node.swa is None else node.swa[:k], node.start)
        upper.full_lock, upper.swa_lock, upper.stamp = node.full_lock, node.swa_lock, node.stamp
        node.parent.children[upper.tokens[:p]] = upper
        node.tokens, node.values = node.tokens[k * p:], node.values[k:]
        node.swa = None if node.swa is None else node.swa[k:]
        node.start += k
        node.parent = upper
        upper.children[node.tokens[:p]] = node
        self._num_nodes += 1
        for order in (self._full_lru, self._swa_lru):  # entries carry `start`: renew node's
            for n in (upper, node):
                if order.is_candidate(n):
                    order.push(n)
        return upper

    def _revive(self, node: RadixNode, swa: list[int]) -> None:
        """A tombstone takes the caller's sliding-window handles (touched by the caller)."""
        node.swa = list(swa)
        self._evictable_swa += len(node.swa)  # a tombstone is never SWA-locked

    def _remove_leaf(self, node: RadixNode, out: EvictResult) -> int:
        """Remove an unlocked leaf, then its tombstone ancestors left as leaves; returns the full
        pages freed. A live parent left as a leaf becomes a candidate of `evict`."""
        freed = 0
        while True:
            out.values.extend(node.values)
            self._evictable -= node.pages
            freed += node.pages
            if node.swa:
                out.swa_values.extend(node.swa)
                self._evictable_swa -= len(node.swa)
            parent = node.parent
            del parent.children[node.tokens[:self.page_size]]
            node.alive = False
            self._num_nodes -= 1
            node = parent
            if node is self.root or node.children or node.full_lock:
                break
            if not node.tombstone:
                self._full_lru.push(node)
                break
        return freed

    def _maybe_compact(self) -> None:
        limit = 4 * self._num_nodes + 64
        if len(self._full_lru) > limit:
            self._full_lru.rebuild(self.iter_nodes())
        if len(self._swa_lru) > limit:
            self._swa_lru.rebuild(self.iter_nodes())
