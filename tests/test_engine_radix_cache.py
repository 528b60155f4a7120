"""The prefix cache's radix tree (engine/radix_cache.py): hand-computed cases, then a state
machine against a plain reference model.

The reference (`RefCache`) knows nothing of nodes: it is a dict from every cached page, named by
the tokens of the whole prefix it ends, to that page's (full handle, sliding-window handle or
None), plus per-page lock counts. Matching, insertion and which handles come back are computed
from it page by page; the tree must agree and keep its own invariants after every step.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_framework.common.errors import ConfigError, LockError
from sparse_framework.engine.radix_cache import RadixCache, RadixNode


def pages_of(tree: RadixCache) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """page key (tokens of the prefix it ends) -> (full handle, SWA handle or None)."""
    p = tree.page_size
    out = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(c, ()) for c in tree.root.children.values()]
    while stack:
        node, before = stack.pop()
        for j in range(node.pages):
            swa = None if node.swa is None or tree.window is None else node.swa[j]
            out[before + node.tokens[:(j + 1) * p]] = (node.values[j], swa)
        stack.extend((c, before + node.tokens) for c in node.children.values())
    return out


def node_keys(tree: RadixCache, node: RadixNode) -> list[tuple[int, ...]]:
    """Page keys of the path root .. node, in order."""
    path = []
    n = node
    while n is not tree.root:
        path.append(n)
        n = n.parent
    tokens: tuple[int, ...] = ()
    for n in reversed(path):
        tokens += n.tokens
    p = tree.page_size
    return [tokens[:(i + 1) * p] for i in range(len(tokens) // p)]


def toks(*pages: int, p: int = 1) -> list[int]:
    """One distinct token per page (repeated page_size times)."""
    return [t for t in pages for _ in range(p)]


# -- hand-computed cases -------------------------------------------------------------------------


def test_insert_match_and_split_without_window():
    tree = RadixCache(page_size=2)
    r = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13])
    assert (r.prefix_pages, r.num_pages, r.unused_values, r.unused_swa_values) == (0, 4, [], [])
    assert tree.num_nodes() == 1 and tree.evictable_size() == 4
    m = tree.match_prefix([1, 2, 3, 4, 9, 9, 7])  # diverges in page 2; the odd 7th token is ignored
    assert (m.num_pages, m.values, m.swa_values, m.raw_pages) == (2, [10, 11], [], 2)
    assert tree.num_nodes() == 2  # the match split the node at its end
    assert m.node.tokens == (1, 2, 3, 4) and m.node.children
    r = tree.insert([1, 2, 3, 4, 9, 9], [20, 21, 22])
    assert (r.prefix_pages, r.num_pages, r.unused_values) == (2, 3, [20, 21])  # duplicates back
    assert tree.num_nodes() == 3 and tree.evictable_size() == 5
    assert tree.match_prefix([1, 2, 3, 4, 9, 9]).values == [10, 11, 22]

    r = tree.insert([1, 2], [30])  # ends inside a node: split so the path ends on a boundary
    assert r.unused_values == [30] and r.node.tokens == (1, 2) and tree.num_nodes() == 4
    assert tree.match_prefix([1, 2, 3]).num_pages == 1  # the partial page is never matched
    assert tree.match_prefix([2, 2]).num_pages == 0


def test_bad_input_raises_clear_errors():
    with pytest.raises(ConfigError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ConfigError, match="window"):
        RadixCache(page_size=2, window=0)
    tree = RadixCache(page_size=2, window=4)
    with pytest.raises(ConfigError, match="whole pages of page_size=2"):
        tree.insert([1, 2, 3], [10, 11])
    with pytest.raises(ConfigError, match="one handle per page"):
        tree.insert([1, 2, 3, 4], [10])
    with pytest.raises(ConfigError, match="at most the 2 pages"):
        tree.insert([1, 2, 3, 4], [10, 11], [1, 2, 3])
    with pytest.raises(ConfigError, match="num_pages"):
        tree.evict(-1)
    with pytest.raises(ConfigError, match="window=None"):
        RadixCache(page_size=2).insert([1, 2], [10], [20])
    assert tree.num_nodes() == 0


def test_window_rule_on_match():
    # page 2, window 4 tokens = 2 pages; SWA kept only for the last 2 of 4 pages
    tree = RadixCache(page_size=2, window=4)
    tree.insert(toks(1, 2, 3, 4, p=2), [10, 11, 12, 13], [22, 23])
    tomb, live = tree.root.children[(1, 1)], None
    assert tomb.tombstone and tomb.pages == 2
    live = next(iter(tomb.children.values()))
    assert not live.tombstone and live.swa == [22, 23]
    m = tree.match_prefix(toks(1, 2, 3, 4, 5, p=2))
    assert (m.num_pages, m.values, m.swa_values, m.raw_pages) == (4, [10, 11, 12, 13], [22, 23], 4)
    # 3 pages: the window (pages 1, 2) includes tombstone page 1; so do all shorter ones
    m = tree.match_prefix(toks(1, 2, 3, p=2))
    assert (m.num_pages, m.raw_pages, m.node) == (0, 3, tree.root)
    assert tree.num_nodes() == 2  # no split for a prefix that cannot be used


def test_match_stops_before_a_tombstone_and_splits_after_one():
    tree = RadixCache(page_size=1, window=2)
    tree.insert([1, 2], [10, 11], [20, 21])
    tree.insert([1, 2, 3, 4, 5, 6], [0, 0, 12, 13, 14, 15], [0, 0, 22, 23, 24, 25])
    a = tree.root.children[(1,)]
    assert a.stamp < next(iter(a.children.values())).stamp  # the insert touched the root side first
    freed = tree.evict_swa(1)  # LRU: a, the older node, loses its window
    assert (freed.values, freed.swa_values) == ([], [20, 21]) and a.tombstone
    assert tree.match_prefix([1, 2]).num_pages == 0
    assert tree.match_prefix([1, 2, 3]).num_pages == 0  # window = pages 1, 2: page 1 is freed
    m = tree.match_prefix([1, 2, 3, 4, 9])
    assert (m.num_pages, m.values, m.swa_values) == (4, [10, 11, 12, 13], [22, 23])
    assert m.node.tokens == (3, 4) and m.node.parent is a  # the live node was split after page 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).num_pages == 6


def test_lock_covers_the_path_and_the_window():
    tree = RadixCache(page_size=1, window=2)
    tree.insert([1], [10], [20])
    tree.insert([1, 2], [0, 11], [0, 21])
    tree.insert([1, 2, 3], [0, 0, 12], [0, 0, 22])
    m = tree.match_prefix([1, 2, 3])
    c = m.node
    b, a = c.parent, c.parent.parent
    h = tree.lock(c)
    assert [(n.full_lock, n.swa_lock) for n in (a, b, c)] == [(1, 0), (1, 1), (1, 1)]
    assert (tree.evictable_size(), tree.protected_size()) == (0, 3)
    assert (tree.evictable_swa_size(), tree.protected_swa_size()) == (1, 2)
    assert tree.evict(10).values == []
    freed = tree.evict_swa(10)  # only a's window is free to go
    assert (freed.values, freed.swa_values) == ([], [20]) and a.tombstone
    assert tree.match_prefix([1, 2, 3]).num_pages == 3  # its window (pages 1, 2) is intact
    tree.unlock(h)
    with pytest.raises(LockError, match="already released"):
        tree.unlock(h)
    freed = tree.evict(10)  # c, then b (now a leaf), then a as a tombstone leaf with it
    assert (freed.values, freed.swa_values) == ([12, 11, 10], [22, 21])
    assert tree.num_nodes() == 0 and tree.evictable_size() == tree.evictable_swa_size() == 0


def test_lock_refuses_tombstones_and_evicted_nodes():
    tree = RadixCache(page_size=1, window=1)
    tree.insert([1, 2], [10, 11], [21])
    a = tree.root.children[(1,)]
    with pytest.raises(LockError, match="tombstone"):
        tree.lock(a)
    leaf = tree.match_prefix([1, 2]).node
    tree.evict(1)
    with pytest.raises(LockError, match="evicted"):
        tree.lock(leaf)
    assert tree.lock(tree.root).swa_pages == 0  # the root locks nothing


def test_split_of_a_locked_node_keeps_lock_spans():
    tree = RadixCache(page_size=1, window=2)
    tree.insert([1, 2, 3], [10, 11, 12], [20, 21, 22])
    h = tree.lock(tree.match_prefix([1, 2, 3]).node)
    assert h.swa_pages == 3  # one node of 3 pages covers the 2-page window
    tree.insert([1, 2, 9], [0, 0, 13], [0, 0, 23])  # splits the locked node after page 2
    upper = tree.root.children[(1,)]
    assert upper.pages == 2 and (upper.full_lock, upper.swa_lock) == (1, 1)
    assert (tree.protected_size(), tree.protected_swa_size()) == (3, 3)
    tree.unlock(h)
    assert (tree.protected_size(), tree.protected_swa_size()) == (0, 0)
    assert (tree.evictable_size(), tree.evictable_swa_size()) == (4, 4)


def test_full_eviction_is_lru_over_leaves():
    tree = RadixCache(page_size=1)
    for t in (1, 2, 3):
        tree.insert([t], [10 + t])
    tree.match_prefix([1])  # 1 becomes the most recent
    assert [n.tokens for n in tree.full_lru()] == [(2,), (3,), (1,)]
    assert [tree.evict(1).values for _ in range(4)] == [[12], [13], [11], []]


def test_evict_swa_removes_a_leaf_and_its_tombstone_ancestors():
    tree = RadixCache(page_size=1, window=1)
    tree.insert([1, 2], [10, 11], [21])  # page 1 a tombstone, page 2 live
    freed = tree.evict_swa(1)
    assert (freed.values, freed.swa_values) == ([11, 10], [21])
    assert tree.num_nodes() == 0


def test_insert_revives_a_tombstone():
    tree = RadixCache(page_size=1, window=2)
    tree.insert([1, 2, 3], [10, 11, 12], [22])  # pages 1-2 a tombstone node, page 3 live
    assert tree.match_prefix([1, 2]).num_pages == 0
    r = tree.insert([1, 2], [30, 31], [41])  # SWA for page 2 only: split, revive page 2
    assert (r.unused_values, r.unused_swa_values) == ([30, 31], [])
    a = tree.root.children[(1,)]
    assert a.pages == 1 and a.tombstone and next(iter(a.children.values())).swa == [41]
    assert tree.match_prefix([1, 2]).num_pages == 0  # window = pages 1, 2: page 1 still freed
    r = tree.insert([1], [50], [51])
    assert (r.unused_values, r.unused_swa_values) == ([50], []) and a.swa == [51]
    m = tree.match_prefix([1, 2, 3])
    assert (m.num_pages, m.values, m.swa_values) == (3, [10, 11, 12], [41, 22])
    r = tree.insert([1, 2, 3], [60, 61, 62], [71, 72])  # all cached with SWA: all duplicates
    assert (r.unused_values, r.unused_swa_values, r.prefix_pages) == ([60, 61, 62], [71, 72], 3)
    assert tree.evictable_swa_size() == 3


def test_a_new_tail_without_window_is_not_inserted():
    tree = RadixCache(page_size=1, window=1)
    r = tree.insert([1, 2], [10, 11])
    assert (r.node, r.num_pages, r.unused_values) == (tree.root, 0, [10, 11])
    assert tree.num_nodes() == 0


def test_no_window_mode_ignores_swa():
    tree = RadixCache(page_size=2)
    tree.insert([1, 1, 2, 2], [10, 11])
    h = tree.lock(tree.match_prefix([1, 1, 2, 2]).node)
    assert (h.swa_pages, tree.evictable_swa_size(), tree.protected_swa_size()) == (0, 0, 0)
    assert tree.evict_swa(5) == tree.evict(0)  # both empty
    assert tree.swa_lru() == []
    tree.unlock(h)
    assert tree.evict(5).values == [10, 11]


def test_stale_lru_entries_are_compacted():
    tree = RadixCache(page_size=1)
    tree.insert([1], [10])
    for _ in range(500):
        tree.match_prefix([1])
    tree.insert([2], [11])  # insert and evict compact
    assert len(tree._full_lru) <= 4 * tree.num_nodes() + 64 + 1
    assert tree.evict(2).values == [10, 11]


# -- state machine against a reference model ----------------------------------------------------

Key = tuple[int, ...]


class RefCache:
    """Which pages are cached (by prefix), with which handles, and how locked."""

    def __init__(self, page_size: int, window: int | None) -> None:
        self.p = page_size
        self.window = window
        self.w = 0 if window is None else -(-window // page_size)
        self.pages: dict[Key, tuple[int, int | None]] = {}
        self.full_locks: dict[Key, int] = {}
        self.swa_locks: dict[Key, int] = {}

    def keys(self, tokens: list[int]) -> list[Key]:
        return [tuple(tokens[:(i + 1) * self.p]) for i in range(len(tokens) // self.p)]

    def cached_run(self, keys: list[Key]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def usable(self, keys: list[Key], p: int) -> bool:
        return all(self.pages[k][1] is not None for k in keys[max(0, p - self.w):p]) if self.w else True

    def match(self, tokens: list[int]) -> tuple[int, list[int], list[int], int]:
        keys = self.keys(tokens)
        raw = self.cached_run(keys)
        best = next(p for p in range(raw, -1, -1) if self.usable(keys, p))
        tail = keys[best - min(self.w, best):best]
        return best, [self.pages[k][0] for k in keys[:best]], [self.pages[k][1] for k in tail], raw

    def insert(self, tokens: list[int], values: list[int],
               swa: list[int]) -> tuple[int, list[int], list[int]]:
        keys = self.keys(tokens)
        n = len(keys)
        swa_start = n - len(swa) if self.window is not None else n
        pos = self.cached_run(keys)
        unused, unused_swa = list(values[:pos]), []
        for i in range(pos):
            if i >= swa_start:
                full, old = self.pages[keys[i]]
                if old is None:
                    self.pages[keys[i]] = (full, swa[i - swa_start])
                else:
                    unused_swa.append(swa[i - swa_start])
        if pos < n and self.window is not None and swa_start >= n:
            unused += values[pos:]
        else:
            for i in range(pos, n):
                self.pages[keys[i]] = (values[i], swa[i - swa_start] if i >= swa_start else None)
        return pos, unused, unused_swa


class RadixMachine(RuleBasedStateMachine):
    """insert / match / lock / unlock / evict / evict_swa on a tree and on `RefCache`."""

    @initialize(page_size=st.integers(1, 3), window=st.sampled_from([None, 1, 2, 3, 5, 7]))
    def setup(self, page_size: int, window: int | None) -> None:
        self.tree = RadixCache(page_size, window)
        self.ref = RefCache(page_size, window)
        self.ids = itertools.count(1)
        self.out_full: set[int] = set()  # handles handed to the tree and not given back yet
        self.out_swa: set[int] = set()
        self.matches: list[RadixNode] = []
        self.seqs: list[list[int]] = []  # recent token sequences, to draw shared prefixes from
        self.held: list[tuple[object, list[Key], list[Key]]] = []  # handle, full keys, swa keys
        self.released: list[object] = []

    def tokens(self, data: st.DataObject) -> list[int]:
        """Whole pages: often a cut of an earlier sequence plus new pages, so prefixes are shared
        and nodes get split; pages mostly of one repeated token (3 kinds), at times mixed."""
        p = self.tree.page_size
        base: list[int] = []
        if self.seqs and data.draw(st.integers(0, 2)):
            base = data.draw(st.sampled_from(self.seqs))
            cut = len(base) // p - data.draw(st.integers(0, len(base) // p))  # drawn small: long cuts
            base = base[:cut * p]
        page = st.one_of(st.integers(0, 2).map(lambda t: [t] * p),
                         st.lists(st.integers(0, 2), min_size=p, max_size=p))
        extra = data.draw(st.lists(page, min_size=0 if base else 1, max_size=4))
        tokens = base + [t for pg in extra for t in pg]
        self.seqs = (self.seqs + [tokens])[-8:]
        return tokens

    def give_back(self, values: list[int], swa: list[int]) -> None:
        """Each handle must come back once, and only one the tree held."""
        for v in values:
            assert v in self.out_full, f"full handle {v} returned twice or never given"
            self.out_full.remove(v)
        for s in swa:
            assert s in self.out_swa, f"SWA handle {s} returned twice or never given"
            self.out_swa.remove(s)

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self.tokens(data)
        n = len(tokens) // self.tree.page_size
        values = [next(self.ids) for _ in range(n)]
        k = n - data.draw(st.integers(0, n)) if self.tree.window is not None else 0  # SWA pages
        swa = [-next(self.ids) for _ in range(k)]
        self.out_full.update(values)
        self.out_swa.update(swa)
        r = self.tree.insert(tokens, values, swa or None)
        prefix, unused, unused_swa = self.ref.insert(tokens, values, swa)
        assert (r.prefix_pages, r.unused_values, r.unused_swa_values) == (prefix, unused, unused_swa)
        self.give_back(r.unused_values, r.unused_swa_values)

    @precondition(lambda self: self.tree.num_nodes())  # an empty tree matches nothing
    @rule(data=st.data(), then_lock=st.booleans())
    def match(self, data: st.DataObject, then_lock: bool) -> None:
        tokens = self.tokens(data) + data.draw(st.lists(st.integers(0, 2), max_size=self.tree.page_size - 1))
        m = self.tree.match_prefix(tokens)
        assert (m.num_pages, m.values, m.swa_values, m.raw_pages) == self.ref.match(tokens)
        assert len(node_keys(self.tree, m.node)) == m.num_pages
        if m.node is not self.tree.root:
            self.matches = (self.matches + [m.node])[-8:]
            if then_lock:  # the engine's order: match, then lock what matched
                self.lock(len(self.matches) - 1)

    @precondition(lambda self: self.matches)
    @rule(i=st.integers(0, 7))
    def lock(self, i: int) -> None:
        node = self.matches[i % len(self.matches)]
        if not node.alive or node.tombstone:
            with pytest.raises(LockError):
                self.tree.lock(node)
            return
        keys = node_keys(self.tree, node)
        h = self.tree.lock(node)
        swa_keys = keys[len(keys) - h.swa_pages:]
        assert all(self.ref.pages[k][1] is not None for k in swa_keys)  # no tombstone SWA-locked
        if self.ref.usable(keys, len(keys)):  # a window still whole is locked whole
            assert h.swa_pages >= min(self.ref.w, len(keys))
        for k in keys:
            self.ref.full_locks[k] = self.ref.full_locks.get(k, 0) + 1
        for k in swa_keys:
            self.ref.swa_locks[k] = self.ref.swa_locks.get(k, 0) + 1
        self.held.append((h, keys, swa_keys))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7))
    def unlock(self, i: int) -> None:
        h, keys, swa_keys = self.held.pop(i % len(self.held))
        self.tree.unlock(h)
        for k in keys:
            self.ref.full_locks[k] -= 1
        for k in swa_keys:
            self.ref.swa_locks[k] -= 1
        self.released.append(h)

    @precondition(lambda self: self.released)
    @rule()
    def unlock_twice(self) -> None:
        with pytest.raises(LockError):
            self.tree.unlock(self.released[-1])

    def forget(self, values: list[int], swa: list[int]) -> tuple[set[Key], set[Key]]:
        """Drop returned handles from the reference; the keys whose page / window went."""
        by_full = {v: k for k, (v, _) in self.ref.pages.items()}
        by_swa = {s: k for k, (_, s) in self.ref.pages.items() if s is not None}
        gone = {by_full[v] for v in values}
        windows = {by_swa[s] for s in swa}
        for k in gone:
            assert self.ref.full_locks.get(k, 0) == 0, f"evicted a locked page {k}"
        for k in windows:
            assert self.ref.swa_locks.get(k, 0) == 0, f"freed the window of a SWA-locked page {k}"
        for k in windows:
            self.ref.pages[k] = (self.ref.pages[k][0], None)
        for k in gone:
            assert self.ref.pages[k][1] is None, "a removed page's window was not returned"
            del self.ref.pages[k]
        self.give_back(values, swa)
        return gone, windows

    @precondition(lambda self: self.tree.num_nodes())
    @rule(n=st.integers(1, 4), swa_only=st.booleans())
    def evict(self, n: int, swa_only: bool) -> None:
        """`evict` (full) or `evict_swa`: one rule, so that eviction is not drawn twice as often
        as insertion and the tree has something in it most of the time."""
        if swa_only:
            before = self.tree.evictable_swa_size()
            r = self.tree.evict_swa(n)
            _, windows = self.forget(r.values, r.swa_values)
            assert len(windows) >= min(n, before)  # stops short only when nothing is left
        else:
            before = self.tree.evictable_size()
            r = self.tree.evict(n)
            self.forget(r.values, r.swa_values)
            assert len(r.values) >= min(n, before)

    @invariant()
    def tree_matches_reference(self) -> None:
        tree, ref = self.tree, self.ref
        assert pages_of(tree) == ref.pages
        assert all(k[:-tree.page_size] in ref.pages for k in ref.pages if len(k) > tree.page_size)
        assert {v for v, _ in ref.pages.values()} == self.out_full  # no leak: held or given back
        assert {s for _, s in ref.pages.values() if s is not None} == self.out_swa

    @invariant()
    def locks_and_counters(self) -> None:
        tree, ref = self.tree, self.ref
        ev = pr = ev_swa = pr_swa = 0
        nodes = list(tree.iter_nodes())
        assert len(nodes) == tree.num_nodes()
        for node in nodes:
            assert node.full_lock >= node.swa_lock >= 0
            assert not (node.swa_lock and node.tombstone)
            assert node.children or not node.tombstone or node.full_lock, "an unlocked tombstone leaf"
            for k in node_keys(tree, node)[-node.pages:]:
                assert (ref.full_locks.get(k, 0), ref.swa_locks.get(k, 0)) == (node.full_lock, node.swa_lock)
            if node.full_lock:
                pr += node.pages
            else:
                ev += node.pages
            if not node.tombstone:
                if node.swa_lock:
                    pr_swa += len(node.swa)
                else:
                    ev_swa += len(node.swa)
        assert (tree.evictable_size(), tree.protected_size()) == (ev, pr)
        assert (tree.evictable_swa_size(), tree.protected_swa_size()) == (ev_swa, pr_swa)
        full_lru, swa_lru = tree.full_lru(), tree.swa_lru()
        assert not any(n.tombstone for n in swa_lru)
        assert {n.uid for n in full_lru} == {n.uid for n in nodes if not n.children and not n.full_lock}
        assert {n.uid for n in swa_lru} == {n.uid for n in nodes if n.swa and not n.swa_lock}
        assert [n.stamp for n in full_lru] == sorted(n.stamp for n in full_lru)

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for h, _, _ in self.held:
            self.tree.unlock(h)
        r = self.tree.evict(10**6)
        self.give_back(r.values, r.swa_values)
        assert self.tree.num_nodes() == 0 and not self.out_full and not self.out_swa
        assert self.tree.evictable_size() == self.tree.evictable_swa_size() == 0


RadixMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                                          database=None, suppress_health_check=[HealthCheck.too_slow])
test_radix_machine = RadixMachine.TestCase
