"""Plugin discovery through entry points: built-ins, unknown / broken / duplicate / wrong-kind
plugins (fake `*.dist-info` directories on sys.path), and one real `pip install` of the toy
plugin distribution in tests/plugins/toy_plugin, run end to end through the coordinator."""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import sys
from pathlib import Path

import pytest
import torch

from sparse_framework import Batch, ConfigError, KVLayout, PluginError, Request, load_config, registry
from sparse_framework.adaptors.base import BackendAdaptor
from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor
from sparse_framework.algorithms.base import SparseAlgorithm
from sparse_framework.algorithms.quest import Quest
from sparse_framework.backends.base import AttentionBackend
from sparse_framework.backends.torch_ref import TorchRefBackend
from sparse_framework.config import config_schema
from helpers import SMALL_QUEST, pip_install_to_target

TOY_PLUGIN_SRC = Path(__file__).parent / "plugins" / "toy_plugin"
ALGO_GROUP = "sparse_framework.algorithms"

SMALL = {k: v for k, v in SMALL_QUEST.items() if k not in ("algorithm", "extra")}


@pytest.fixture(autouse=True)
def clean_registry():
    """Every test starts and ends with a registry that re-reads entry points, so a fake
    distribution put on sys.path by one test is invisible to the next. (Autouse fixtures are
    set up first and torn down last, i.e. after monkeypatch has restored sys.path.)"""
    registry.refresh()
    modules = set(sys.modules)
    yield
    for name in set(sys.modules) - modules:
        if name.startswith("fake_"):
            del sys.modules[name]
    registry.refresh()
    importlib.invalidate_caches()


def make_dist(
    root: Path,
    dist_name: str,
    entry_points: dict[str, dict[str, str]],
    modules: dict[str, str] | None = None,
) -> None:
    """Write an installed-distribution record (`<name>-<ver>.dist-info`) and flat modules."""
    info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(source)


def install_fake(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.syspath_prepend(str(root))  # also invalidates import caches
    registry.refresh()


# -- built-ins ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, name, cls, base",
    [
        ("algorithm", "quest", Quest, SparseAlgorithm),
        ("backend", "torch_ref", TorchRefBackend, AttentionBackend),
        ("adaptor", "flash_attention", FlashAttentionAdaptor, BackendAdaptor),
    ],
)
def test_builtins_are_discovered_through_entry_points(kind, name, cls, base):
    assert name in registry.names(kind)
    loaded = registry.load(kind, name)
    assert loaded is cls and issubclass(loaded, base)
    # registered by this project's own distribution, like any third-party plugin
    (info,) = [i for i in registry.describe(kind) if i.name == name]
    assert info.distribution == registry.BUILTIN == "sparse-decode-framework"
    assert info.target == f"{cls.__module__}:{cls.__name__}"
    assert info.error is None
    eps = importlib.metadata.entry_points(group=registry.GROUPS[kind])
    assert any(ep.name == name and ep.value == info.target for ep in eps)


def test_names_are_sorted_and_unknown_kind_is_rejected():
    for kind in registry.GROUPS:
        assert registry.names(kind) == sorted(registry.names(kind))
    with pytest.raises(PluginError, match=r"unknown plugin kind 'algorithms'.*algorithm, adaptor, backend"):
        registry.names("algorithms")
    with pytest.raises(PluginError, match="unknown plugin kind"):
        registry.load("scheduler", "quest")


def test_describe_rejects_unknown_kind_with_plugin_error():
    with pytest.raises(PluginError, match="unknown plugin kind"):
        registry.describe("algorithms")


# -- unknown names ------------------------------------------------------------------------
def test_unknown_name_lists_registered_and_suggests_closest():
    with pytest.raises(PluginError) as info:
        registry.load("algorithm", "qeust")
    msg = str(info.value)
    assert "unknown algorithm 'qeust'" in msg
    assert "registered algorithms:" in msg and "quest" in msg.split("registered algorithms:")[1]
    assert "Did you mean 'quest'?" in msg

    with pytest.raises(PluginError) as info:
        registry.load("backend", "torchref")
    assert "registered backends: flash_attn, flashmla, torch_ref, triton" in str(info.value)
    assert "Did you mean 'torch_ref'?" in str(info.value)


def test_unknown_name_far_from_everything_gets_no_suggestion():
    with pytest.raises(PluginError) as info:
        registry.load("algorithm", "zzzzzzzz")
    assert "registered algorithms:" in str(info.value)
    assert "Did you mean" not in str(info.value)


# -- a newly installed plugin needs refresh() ---------------------------------------------
def test_refresh_picks_up_a_plugin_installed_at_run_time(tmp_path, monkeypatch):
    make_dist(tmp_path, "fake-late", {ALGO_GROUP: {"late_quest": "sparse_framework.algorithms.quest:Quest"}})
    assert "late_quest" not in registry.names("algorithm")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late_quest" not in registry.names("algorithm")  # cached until refreshed
    registry.refresh()
    assert "late_quest" in registry.names("algorithm")
    assert registry.load("algorithm", "late_quest") is Quest


# -- an algorithm's twin inside vLLM --------------------------------------------------------
MY_QUEST = """\
from sparse_framework.algorithms.quest import Quest
from sparse_framework.integrations.vllm.paged import PagedQuest
class MyQuest(Quest):
    pass
class MyPagedQuest(PagedQuest):
    pass
"""


def test_a_third_party_algorithm_runs_inside_vllm_through_the_twin_it_registers(tmp_path, monkeypatch):
    """The vLLM plugin finds an algorithm's twin (`sparse_framework.vllm` group) by the
    algorithm's name: without one the rebuild bridge runs the algorithm; with one the plugin
    builds the twin."""
    from sparse_framework.integrations.vllm.paged import load_vllm_config, paged_algorithm

    config = {"algorithm": "myquest", "min_sparse_prompt_len": 0, "top_k": 64}
    make_dist(tmp_path / "a", "fake-myquest", {ALGO_GROUP: {"myquest": "fake_myquest:MyQuest"}},
              {"fake_myquest": MY_QUEST})
    install_fake(monkeypatch, tmp_path / "a")
    assert registry.names("vllm") == ["dsa", "quest"]
    # without a twin the rebuild bridge runs it (the next test); a registered twin wins over it
    assert type(paged_algorithm(load_vllm_config(config, block_size=16))).__name__ == "PagedBridge"
    make_dist(tmp_path / "b", "fake-myquest-vllm", {"sparse_framework.vllm": {"myquest": "fake_myquest:MyPagedQuest"}})
    install_fake(monkeypatch, tmp_path / "b")
    algo = paged_algorithm(load_vllm_config(config, block_size=16))
    assert type(algo).__name__ == "MyPagedQuest" and algo.budget_units == 4
    # a twin must be a PagedAlgorithm
    make_dist(tmp_path / "c", "fake-bad-twin", {"sparse_framework.vllm": {"badtwin": "fake_myquest:MyQuest"}})
    install_fake(monkeypatch, tmp_path / "c")
    with pytest.raises(PluginError, match="not a subclass of PagedAlgorithm"):
        registry.load("vllm", "badtwin")


KEY_DOT = """\
import torch
from sparse_framework.algorithms.base import ScoringAlgorithm, SparseAlgorithm

class KeyDot(ScoringAlgorithm):  # tokens ranked by their largest q·k over the query heads, per request
    granularity = "token"
    per_kv_head = False

    def __init__(self, config, layout, max_requests, max_seq_len):
        super().__init__(config, layout, max_requests, max_seq_len)
        self.keys = torch.zeros(layout.num_layers, max_requests, max_seq_len, layout.num_kv_heads, layout.head_dim,
                                dtype=layout.dtype, device=layout.device)

    def build(self, layer, request, keys, queries=None, *, inputs=None):
        self.keys[layer, request.slot, : keys.shape[0]] = keys.to(self.keys.dtype)

    def append(self, layer, batch, keys, *, inputs=None):
        self.keys[layer, batch.slot_ids, batch.seq_lens.long() - 1] = keys.to(self.keys.dtype)

    def score(self, layer, queries, batch, *, inputs=None):
        k = self.keys[layer, batch.slot_ids, : batch.max_seq_len].float()  # [B, n, Hkv, D]
        b, hq, d = queries.shape
        q = queries.float().view(b, k.shape[2], hq // k.shape[2], d)
        return torch.einsum("bkgd,bnkd->bkgn", q, k).flatten(1, 2).amax(1, keepdim=True)  # [B, 1, n]

    def release(self, request):
        pass

class OwnSelect(SparseAlgorithm):  # selects by itself (no `score`): the bridge has nothing to pool
    def build(self, *args, **kwargs): pass
    def append(self, *args, **kwargs): pass
    def select(self, *args, **kwargs): raise NotImplementedError
    def release(self, request): pass
"""


def test_a_third_party_scoring_algorithm_runs_inside_vllm_through_the_rebuild_bridge(tmp_path, monkeypatch):
    """A third-party ScoringAlgorithm registered only as an algorithm (no twin) runs inside
    vLLM unchanged through the rebuild bridge: from paged writes (shuffled blocks, prefill
    chunks, padding slots) it selects what the algorithm itself selects over contiguous keys,
    pooled to blocks (`vllm_cases.rebuilt_selection`). An algorithm with its own `select` is
    refused, naming what it needs."""
    from vllm_cases import fill, paged_case, rebuilt_selection

    from sparse_framework.integrations.vllm.paged import CONFIG_ENV, load_vllm_config, paged_algorithm
    from sparse_framework.integrations.vllm.paged_bridge import PagedBridge

    algorithms = {"keydot": "fake_keydot:KeyDot", "ownselect": "fake_keydot:OwnSelect"}
    make_dist(tmp_path, "fake-keydot", {ALGO_GROUP: algorithms}, {"fake_keydot": KEY_DOT})
    install_fake(monkeypatch, tmp_path)
    bs, lens, hkv = 16, [300, 45, 1, 130], 2
    config = load_vllm_config({"algorithm": "keydot", "min_sparse_prompt_len": 0, "top_k": 48, "sink_tokens": 8,
                               "recent_tokens": 8}, block_size=bs)
    bridge = paged_algorithm(config)
    assert type(bridge) is PagedBridge
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, 3, 32, bs, 40, seed=2)
    state = fill(bridge, lens, keys, values, table, k_cache, v_cache, bs, chunk=29)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = bridge.select(state, q, table, seq_lens)
    want = rebuilt_selection(config, lens, keys, q)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.lengths, want.lengths)
    assert got.lengths.shape == (4, 1) and bool((got.lengths[:, 0] < seq_lens).any())
    with pytest.raises(ConfigError) as info:
        load_vllm_config({"algorithm": "ownselect", "min_sparse_prompt_len": 0, "top_k": 48}, block_size=bs)
    msg = str(info.value)
    assert msg.startswith(CONFIG_ENV) and "`algorithm` = 'ownselect'" in msg and "not a ScoringAlgorithm" in msg


# -- a broken plugin ----------------------------------------------------------------------
BROKEN_SOURCE = """\
from pathlib import Path
Path(__file__).with_suffix(".imported").touch()  # proves when the module was imported
raise ImportError("fake_broken_dep is not installed")
"""


def test_broken_plugin_is_reported_by_name_only_when_requested(tmp_path, monkeypatch):
    make_dist(
        tmp_path,
        "fake-broken-plugin",
        {ALGO_GROUP: {"broken_algo": "fake_broken_mod:Broken"}},
        {"fake_broken_mod": BROKEN_SOURCE},
    )
    marker = tmp_path / "fake_broken_mod.imported"
    install_fake(monkeypatch, tmp_path)

    # listed without being imported; the others keep working
    assert {"broken_algo", "quest"} <= set(registry.names("algorithm"))
    assert registry.load("algorithm", "quest") is Quest
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", **SMALL})
    assert cfg.algorithm_class is Quest
    assert not marker.exists(), "the broken plugin was imported although nobody asked for it"
    # the schema imports every plugin to read its options; it skips the broken one
    schema = config_schema()
    assert "extra_quest" in schema["$defs"] and "extra_broken_algo" not in schema["$defs"]
    assert marker.exists()

    # requested: the error names the plugin, its distribution and the exception
    with pytest.raises(PluginError) as info:
        registry.load("algorithm", "broken_algo")
    msg = str(info.value)
    assert marker.exists()
    assert "'broken_algo'" in msg and "fake-broken-plugin" in msg and "fake_broken_mod:Broken" in msg
    assert "ImportError: fake_broken_dep is not installed" in msg
    assert isinstance(info.value.__cause__, ImportError)

    # listed with its error
    infos = {i.name: i for i in registry.describe("algorithm")}
    assert infos["broken_algo"].distribution == "fake-broken-plugin"
    assert infos["broken_algo"].error is not None
    assert "ImportError: fake_broken_dep is not installed" in infos["broken_algo"].error
    assert infos["quest"].error is None

    # choosing it in a config is a ConfigError carrying the same reason
    with pytest.raises(ConfigError, match="fake_broken_dep is not installed"):
        load_config({"algorithm": "broken_algo", **SMALL})
    assert registry.load("algorithm", "quest") is Quest
    assert "extra_broken_algo" not in config_schema()["$defs"]


def test_broken_plugin_disappears_after_refresh_once_uninstalled(tmp_path, monkeypatch):
    make_dist(
        tmp_path,
        "fake-broken-two",
        {ALGO_GROUP: {"broken_two": "fake_broken_two_mod:Broken"}},
        {"fake_broken_two_mod": BROKEN_SOURCE},
    )
    install_fake(monkeypatch, tmp_path)
    assert "broken_two" in registry.names("algorithm")
    monkeypatch.undo()  # "uninstall": off sys.path again
    registry.refresh()
    assert "broken_two" not in registry.names("algorithm")
    assert "quest" in registry.names("algorithm")


# -- duplicates ---------------------------------------------------------------------------
def test_same_name_from_two_distributions_names_both(tmp_path, monkeypatch):
    """Two third-party distributions, one name: the bare name is refused naming both and how
    to choose; each stays usable and listed by its full "distribution:name"."""
    target = "sparse_framework.algorithms.quest:Quest"  # loadable: the only problem is the clash
    make_dist(tmp_path, "fake-dup-one", {ALGO_GROUP: {"dup_algo": target}})
    make_dist(tmp_path, "fake-dup-two", {ALGO_GROUP: {"dup_algo": target}})
    install_fake(monkeypatch, tmp_path)

    assert registry.names("algorithm").count("dup_algo") == 1
    assert {"fake-dup-one:dup_algo", "fake-dup-two:dup_algo"} <= set(registry.names("algorithm"))
    with pytest.raises(PluginError) as info:
        registry.load("algorithm", "dup_algo")
    msg = str(info.value)
    assert "'dup_algo'" in msg and "more than one distribution" in msg
    assert "fake-dup-one" in msg and "fake-dup-two" in msg and "'fake-dup-one:dup_algo'" in msg
    assert registry.load("algorithm", "fake-dup-two:dup_algo") is Quest

    rows = {i.name: i for i in registry.describe("algorithm") if "dup_algo" in i.name}
    assert set(rows) == {"fake-dup-one:dup_algo", "fake-dup-two:dup_algo"}
    assert rows["fake-dup-one:dup_algo"].distribution == "fake-dup-one" and rows["fake-dup-one:dup_algo"].error is None
    assert registry.load("algorithm", "quest") is Quest
    with pytest.raises(PluginError, match="distribution 'fake-dup-three' registers no algorithm 'dup_algo'"):
        registry.load("algorithm", "fake-dup-three:dup_algo")


def test_third_party_shadowing_a_builtin_loses_to_it_and_stays_selectable(tmp_path, monkeypatch):
    """A second distribution registering `quest` used to disable the built-in everywhere and
    vanish from `schema`. The rule (docs/plugins.md): the built-in wins the bare name; the
    other is "fake-shadow:quest", listed by `plugins` and `schema`, never dropped."""
    from sparse_framework.algorithms.snapkv import SnapKV

    make_dist(tmp_path, "fake-shadow", {ALGO_GROUP: {"quest": "sparse_framework.algorithms.snapkv:SnapKV"}})
    install_fake(monkeypatch, tmp_path)
    assert registry.load("algorithm", "quest") is Quest
    assert registry.load("algorithm", "fake-shadow:quest") is SnapKV
    assert registry.load("algorithm", "sparse-decode-framework:quest") is Quest
    assert load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", **SMALL}).algorithm_class is Quest
    assert load_config({"algorithm": "fake-shadow:quest", **SMALL}).algorithm_class is SnapKV

    rows = [(i.name, i.distribution, i.error) for i in registry.describe("algorithm") if i.name.endswith("quest")]
    assert rows == [("quest", registry.BUILTIN, None), ("fake-shadow:quest", "fake-shadow", None)]
    schema = config_schema()
    assert {"quest", "fake-shadow:quest"} <= set(schema["properties"]["algorithm"]["enum"])
    assert "extra_quest" in schema["$defs"] and "extra_fake-shadow:quest" in schema["$defs"]
    # the built-ins' reference (docs/config.md) does not depend on what else is installed
    assert "fake-shadow:quest" not in config_schema(registry.BUILTIN)["properties"]["algorithm"]["enum"]


# -- wrong kind of object -----------------------------------------------------------------
NOT_ALGO_SOURCE = """\
class NotAnAlgorithm:
    def select(self, *args):
        return None

NUMBER = 3
"""


@pytest.mark.parametrize(
    "target, shown",
    [
        ("fake_not_algo_mod:NotAnAlgorithm", "NotAnAlgorithm"),
        ("fake_not_algo_mod:NUMBER", "3"),
        ("sparse_framework.backends.torch_ref:TorchRefBackend", "TorchRefBackend"),  # wrong kind
    ],
)
def test_entry_point_to_a_non_algorithm_is_rejected(tmp_path, monkeypatch, target, shown):
    make_dist(
        tmp_path, "fake-not-algo", {ALGO_GROUP: {"not_algo": target}}, {"fake_not_algo_mod": NOT_ALGO_SOURCE}
    )
    install_fake(monkeypatch, tmp_path)
    with pytest.raises(PluginError) as info:
        registry.load("algorithm", "not_algo")
    msg = str(info.value)
    assert "'not_algo'" in msg and target in msg and shown in msg
    assert "not a subclass of SparseAlgorithm" in msg
    (entry,) = [i for i in registry.describe("algorithm") if i.name == "not_algo"]
    assert entry.error is not None and "not a subclass of SparseAlgorithm" in entry.error


# -- a real installed third-party distribution (slowest: one pip call per session) ---------
@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    """`pip install` the toy plugin distribution into a private target directory.

    The source is copied first so that the in-tree build leaves nothing in the repository."""
    return pip_install_to_target(TOY_PLUGIN_SRC, tmp_path_factory.mktemp("toy_plugin"))


@pytest.fixture
def toy_installed(toy_site, monkeypatch):
    monkeypatch.syspath_prepend(str(toy_site))
    registry.refresh()
    yield toy_site
    sys.modules.pop("toy_sparse_plugin", None)


def test_installed_plugin_is_discovered(toy_installed):
    dist = importlib.metadata.distribution("sparse-framework-toy-plugin")
    assert dist.version == "0.0.1"
    assert not dist.requires  # installs without pulling in torch
    assert "toy_recent" in registry.names("algorithm")
    cls = registry.load("algorithm", "toy_recent")
    assert issubclass(cls, SparseAlgorithm)
    assert cls.__name__ == "ToyRecent" and cls.granularity == "token" and cls.per_kv_head is False
    # the installed copy, not the source tree
    assert Path(sys.modules[cls.__module__].__file__).resolve().is_relative_to(toy_installed.resolve())
    infos = {i.name: i for i in registry.describe("algorithm")}
    assert infos["toy_recent"].distribution == "sparse-framework-toy-plugin"
    assert infos["toy_recent"].target == "toy_sparse_plugin:ToyRecent"
    assert infos["toy_recent"].error is None and infos["quest"].error is None
    schema = config_schema()
    assert "toy_recent" in schema["properties"]["algorithm"]["enum"]
    assert schema["$defs"]["extra_toy_recent"]["properties"]["bias"]["default"] == 0.0


def test_installed_plugin_config(toy_installed):
    cfg = load_config({"algorithm": "toy_recent", "extra": {"bias": 1.0}, **SMALL})
    assert cfg.algorithm_class.__name__ == "ToyRecent"
    assert cfg.extra_config.bias == 1.0
    assert load_config({"algorithm": "toy_recent", **SMALL}).extra_config.bias == 0.0
    # the minimum config from the brief, with framework defaults
    assert load_config({"algorithm": "toy_recent", "extra": {"bias": 1.0}}).extra_config.bias == 1.0

    with pytest.raises(ConfigError) as info:
        load_config({"algorithm": "toy_recent", "extra": {"bias": "high"}, **SMALL})
    assert "`extra.bias` = 'high'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({"algorithm": "toy_recent", "extra": {"bais": 1.0}, **SMALL})
    assert "`extra.bais`: unknown option; allowed options: bias" in str(info.value)
    # quest's options are not toy_recent's
    with pytest.raises(ConfigError, match=r"`extra\.gqa_reduce`"):
        load_config({"algorithm": "toy_recent", "extra": {"gqa_reduce": "max"}, **SMALL})
    # token-granular: top_k below page_size is fine for it, not for page-granular quest
    assert load_config({**SMALL, "algorithm": "toy_recent", "top_k": 2, "page_size": 16}).top_k == 2
    with pytest.raises(ConfigError, match="page-granular"):
        load_config({**SMALL, "algorithm": "quest", "top_k": 2, "page_size": 16})


def _reference_attention(q, keys, values, selected):
    """q [Hq, D]; keys/values [T, Hkv, D]; selected: token ids. Float64 softmax attention."""
    hq, d = q.shape
    group = hq // keys.shape[1]
    k = keys[selected].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
    v = values[selected].double().repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,nhd->hn", q.double(), k) / math.sqrt(d)).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def test_installed_plugin_runs_through_the_coordinator(toy_installed):
    from sparse_framework.coordinator.core import SparseCoordinator

    torch.manual_seed(0)
    config = load_config({"algorithm": "toy_recent", "extra": {"bias": 1.0}, **SMALL})
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    coord = SparseCoordinator(config, layout, max_requests=4, max_seq_len=512)
    algo = coord.algorithm
    assert type(algo).__name__ == "ToyRecent" and algo.options.bias == 1.0

    prompt_lens = {"a": 100, "b": 70}
    reqs = [Request(rid, prompt_len=n) for rid, n in prompt_lens.items()]
    for r in reqs:
        coord.on_request_begin(r)
    slots = [r.slot for r in reqs]
    assert len(set(slots)) == 2
    history = {(r.rid, layer): ([], []) for r in reqs for layer in range(2)}

    # prefill both requests in one packed batch
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    total = sum(prompt_lens.values())
    for layer in range(2):
        q, k, v = torch.randn(total, 8, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
        offset = 0
        for r in reqs:
            history[r.rid, layer][0].append(k[offset : offset + r.prompt_len])
            history[r.rid, layer][1].append(v[offset : offset + r.prompt_len])
            offset += r.prompt_len
        meta = coord.attention_begin(layer, q, k, v, batch)
        out = coord.attend(layer, q, meta)
        coord.attention_end(layer, out, batch)
    coord.forward_end(batch)
    for layer in range(2):
        assert algo.tokens_seen[layer, slots].tolist() == [100, 70]  # build ran per request

    width = 4 + 32 + 8 + 1  # sink + top_k + recent + 1 (token-granular max_selected_tokens)
    for step in range(1, 4):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        lens = [n + step for n in prompt_lens.values()]
        assert batch.seq_lens.tolist() == lens
        for layer in range(2):
            q, k, v = torch.randn(2, 8, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
            for i, r in enumerate(reqs):
                history[r.rid, layer][0].append(k[i : i + 1])
                history[r.rid, layer][1].append(v[i : i + 1])
            meta = coord.attention_begin(layer, q, k, v, batch)
            sel = meta.selection
            assert sel is not None and sel.page_size == 1
            assert tuple(sel.indices.shape) == (2, 1, width)  # per request, token-granular
            sel.validate(batch.seq_lens)
            for i, n in enumerate(lens):
                # sinks + the newest top_k + recent tokens: the newest 40 tokens in all
                want = list(range(4)) + list(range(n - 40, n))
                got = sel.indices[i, 0, : sel.lengths[i, 0]].tolist()
                assert got == want, f"request {i} step {step} layer {layer}"
                assert (sel.indices[i, 0, len(want) :] == -1).all()
            out = coord.attend(layer, q, meta)
            assert out.shape == q.shape and out.dtype == q.dtype
            for i, (r, n) in enumerate(zip(reqs, lens)):
                keys = torch.cat(history[r.rid, layer][0])
                values = torch.cat(history[r.rid, layer][1])
                assert keys.shape[0] == n
                ref = _reference_attention(q[i], keys, values, list(range(4)) + list(range(n - 40, n)))
                torch.testing.assert_close(out[i].double(), ref, rtol=1e-4, atol=1e-5)
            coord.attention_end(layer, out, batch)
        coord.forward_end(batch)
        for layer in range(2):
            assert algo.tokens_seen[layer, slots].tolist() == lens  # append ran per step

    coord.on_request_end(reqs[0])
    assert algo.tokens_seen[:, slots[0]].tolist() == [0, 0]  # release reset it
    assert algo.tokens_seen[:, slots[1]].tolist() == [73, 73]  # the other request is untouched
    coord.on_request_end(reqs[1])
    assert int(algo.tokens_seen.sum()) == 0


def test_installed_backend_plugin_is_selected_by_name_and_matches_torch_ref(toy_installed):
    """A third-party attention backend from the installed distribution, chosen by `backend`
    in the config, runs every decode step and gives torch_ref's outputs."""
    from sparse_framework.coordinator.core import SparseCoordinator

    assert "toy_sdpa" in registry.names("backend")
    assert "toy_sdpa" in config_schema()["properties"]["backend"]["enum"]
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    outputs = {}
    for backend in ("toy_sdpa", "torch_ref"):
        torch.manual_seed(1)
        config = load_config({**SMALL_QUEST, "backend": backend})
        coord = SparseCoordinator(config, layout, max_requests=2, max_seq_len=512)
        reqs = [Request("a", prompt_len=300), Request("b", prompt_len=200)]
        for r in reqs:
            coord.on_request_begin(r)
        batch = Batch(reqs, is_prefill=True)
        coord.forward_begin(batch)
        k, v = torch.randn(500, 2, 16), torch.randn(500, 2, 16)
        meta = coord.attention_begin(0, torch.randn(500, 8, 16), k, v, batch)
        coord.attention_end(0, None, batch)
        coord.forward_end(batch)
        outs = []
        for _ in range(3):
            batch = Batch(reqs)
            coord.forward_begin(batch)
            q, k, v = torch.randn(2, 8, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
            meta = coord.attention_begin(0, q, k, v, batch)
            outs.append(coord.attend(0, q, meta))
            coord.attention_end(0, outs[-1], batch)
            coord.forward_end(batch)
        outputs[backend] = torch.stack(outs)
        if backend == "toy_sdpa":
            assert type(coord.backend).__name__ == "ToySDPABackend" and coord.backend.calls == 3
    torch.testing.assert_close(outputs["toy_sdpa"], outputs["torch_ref"], rtol=1e-5, atol=1e-5)
