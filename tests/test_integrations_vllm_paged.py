"""sparse_framework.integrations.vllm.paged and paged_keys: the plugin's core in plain torch (no
vLLM needed): the config inside vLLM, the per-block representations written as vLLM writes K,
the selection against the framework's own Quest and float64 references, the static
(full-graph) path, the counters and the step's row plan."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_cases import (
    BASE,
    assert_selects_everything_and_attends_densely,
    fill,
    framework_quest_selection,
    paged_case,
    reference_attention,
)

from sparse_framework.common.errors import ConfigError
from sparse_framework.integrations.vllm import check_engine_config
from sparse_framework.integrations.vllm.paged import (
    CONFIG_ENV,
    PagedQuest,
    attend_reference,
    decode_rows,
    folded_page_table,
    load_vllm_config,
    paged_algorithm,
    sparse_layers,
)

# -- config ------------------------------------------------------------------------------------


def test_config_gets_vllm_defaults() -> None:
    config = load_vllm_config(json.dumps({**BASE, "top_k": 64}), block_size=32)
    assert config.page_size == 32 and config.store == "resident"
    assert config.top_k == 64 and isinstance(paged_algorithm(config), PagedQuest)
    # a top_k far above any buffer passes: nothing is swapped inside vLLM
    assert load_vllm_config({**BASE, "top_k": 1_000_000}, block_size=32).top_k == 1_000_000


def test_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps({**BASE, "top_k": 128, "extra": {"gqa_reduce": "max"}}))
    config = load_vllm_config(str(path), block_size=64)
    assert config.extra_config.gqa_reduce == "max" and config.page_size == 64


@pytest.mark.parametrize(
    "source, field",
    [
        ('{"algorithm": "quest", "top_k": 0}', "`top_k`"),
        ('{"algorithm": "quest", "store": "hierarchical"}', "`store`"),
        ('{"algorithm": "quest", "page_size": 16}', "`page_size`"),
        ('{"algorithm": "snapkv"}', "`algorithm`"),
        ('{"algorithm": "dsa"}', "`extra.source` = 'indexer'"),
        ('{"algorithm": "no-such-algorithm"}', "algorithm"),
        ('{"algorithm": "quest", "extra": {"gqa_reduce": "median"}}', "extra.gqa_reduce"),
        ('{"algorithm": "quest", "top_k": 64', "not valid JSON"),
        ("/no/such/file.json", "neither a JSON object nor an existing file"),
    ],
)
def test_bad_config_names_the_variable_and_the_field(source: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_vllm_config(source, block_size=32)
    assert str(info.value).startswith(CONFIG_ENV) and field in str(info.value)


def engine_config(block_size: int, user_specified: bool = True, hybrid: bool = False) -> SimpleNamespace:
    """What `check_engine_config` reads of vLLM's VllmConfig (after the platform's check)."""
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size, user_specified_block_size=user_specified),
                           model_config=SimpleNamespace(is_hybrid=hybrid))


@pytest.mark.parametrize("config, vllm_config, says", [
    ({"page_size": 64, "top_k": 512}, engine_config(32),
     ["`page_size` = 64", "vLLM's KV block size (32)", 'Allowed: "page_size": 32', "--block-size 64"]),
    ({"page_size": 48, "top_k": 512}, engine_config(32), ["`page_size` = 48", 'Allowed: "page_size": 32']),
    ({"top_k": 16}, engine_config(32), ["`top_k` = 16", "one KV block (32 tokens)", "Allowed: `top_k` >= 32"]),
    ({"algorithm": "pqcache", "top_k": 16}, engine_config(32), ["`top_k` = 16", "Allowed: `top_k` >= 32"]),
    # the CPU platform's own default block (128) when --block-size is not given
    ({"top_k": 64}, engine_config(128, user_specified=False), ["`top_k` = 64", "Allowed: `top_k` >= 128"]),
])
def test_the_engine_config_is_checked_in_the_front_end(config: dict, vllm_config: SimpleNamespace,
                                                       says: list[str]) -> None:
    """A page_size other than vLLM's block size, or a top_k below one block, fails in vLLM's
    front-end process (the LLM, the API server) as soon as its engine config exists, with the
    field and the values allowed, not in a worker after start-up (issue: first contact)."""
    environ = {CONFIG_ENV: json.dumps({**BASE, **config})}
    with pytest.raises(ConfigError) as info:
        check_engine_config(vllm_config, platform_is_cpu=True, environ=environ)
    message = str(info.value)
    assert message.startswith(CONFIG_ENV) and "\n" not in message
    for part in says:
        assert part in message


def test_the_front_end_check_waits_where_the_block_size_is_not_settled() -> None:
    environ = {CONFIG_ENV: json.dumps({**BASE, "page_size": 64, "top_k": 512})}
    assert check_engine_config(engine_config(16), platform_is_cpu=True, environ={}) is None  # variable unset
    # CUDA without --block-size: the attention backend picks the block in the worker; a hybrid
    # model's block is aligned there on any platform: the worker's check stays the only one
    for vllm_config, cpu in ((engine_config(16, user_specified=False), False), (engine_config(32, hybrid=True), True)):
        assert check_engine_config(vllm_config, platform_is_cpu=cpu, environ=environ).page_size == 64
    with pytest.raises(ConfigError, match="`page_size` = 64"):  # CUDA with --block-size: known up front
        check_engine_config(engine_config(16), platform_is_cpu=False, environ=environ)
    config = check_engine_config(engine_config(64), platform_is_cpu=True, environ=environ)
    assert config.page_size == 64 and config.top_k == 512


def test_register_hooks_the_check_into_vllms_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """`register()`'s hook on `EngineArgs.create_engine_config` (vLLM stood in for by a module
    with that one class): the VllmConfig it makes is checked after it is made, once however
    often the hook is installed, and left alone while the variable is unset."""
    import sparse_framework.integrations.vllm as plugin

    class EngineArgs:
        def __init__(self, block_size: int) -> None:
            self.block_size = block_size

        def create_engine_config(self, usage_context: object = None) -> SimpleNamespace:
            return engine_config(self.block_size)

    fake = ModuleType("vllm.engine.arg_utils")
    fake.EngineArgs = EngineArgs  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.engine"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", fake)
    plugin._check_engine_configs(platform_is_cpu=True)
    hooked = EngineArgs.create_engine_config
    plugin._check_engine_configs(platform_is_cpu=True)
    assert EngineArgs.create_engine_config is hooked
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert EngineArgs(16).create_engine_config().cache_config.block_size == 16
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 64}))
    assert EngineArgs(32).create_engine_config("usage").cache_config.block_size == 32
    with pytest.raises(ConfigError, match=r"`top_k` = 64 .*Allowed: `top_k` >= 128"):
        EngineArgs(128).create_engine_config()


def test_dense_layers() -> None:
    config = load_vllm_config({**BASE, "dense_layers": [5], "extra": {"dense_first_layers": 2}}, block_size=32)
    assert sparse_layers(config, 8) == {2, 3, 4, 6, 7}



CASES = [
    # lens, Hkv, G, D, block, top_k, sink, recent, extra
    ([300, 45, 200], 3, 3, 64, 32, 64, 16, 32, {}),
    ([513, 97], 2, 4, 32, 16, 48, 0, 0, {"min_pages": 1}),
    ([1000, 1, 64, 257], 1, 8, 16, 32, 128, 32, 64, {"gqa_reduce": "max", "newest_in_top_k": False}),
    ([130, 700], 4, 1, 64, 64, 128, 16, 0, {"range_weight": 0.5}),
]


@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k, sink, recent, extra", CASES)
def test_selection_and_attention_match_quest_and_float64(lens, hkv, group, dim, bs, top_k, sink, recent, extra) -> None:
    config = load_vllm_config(
        {**BASE, "top_k": top_k, "sink_tokens": sink, "recent_tokens": recent, "extra": extra}, block_size=bs
    )
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=len(lens) + bs)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=37)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    selection = algo.select(state, q, table, seq_lens)
    selection.validate(seq_lens)
    expected = framework_quest_selection(config, lens, keys, q)
    assert torch.equal(selection.indices, expected.indices) and torch.equal(selection.lengths, expected.lengths)
    assert bool((selection.lengths < seq_lens.view(-1, 1)).any()), "the budget must leave some blocks out"

    metadata = folded_page_table(selection, table, hkv, bs)
    assert metadata.page_table.shape[0] == len(lens) * hkv
    scale = 1 / math.sqrt(dim)
    got = attend_reference(q, k_cache, v_cache, metadata, scale=scale)
    torch.testing.assert_close(got.double(), reference_attention(q, keys, values, selection, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k, sink, recent, extra", CASES)
def test_budget_covering_the_context_is_dense(lens, hkv, group, dim, bs, top_k, sink, recent, extra) -> None:
    # top_k counts whole pages (top_k // page_size): the context's pages, rounded up
    covering = -(-max(lens) // bs) * bs
    config = load_vllm_config({**BASE, "top_k": covering, "sink_tokens": sink, "recent_tokens": recent,
                               "extra": extra}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=7)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=bs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert_selects_everything_and_attends_densely(algo.select(state, q, table, seq_lens), seq_lens, q, keys, values,
                                                  table, k_cache, v_cache, bs)


def test_a_reused_block_forgets_its_old_keys() -> None:
    config = load_vllm_config({**BASE, "top_k": 32}, block_size=4)
    algo = paged_algorithm(config)
    state = algo.new_state(3, 1, 2, torch.float32, "cpu")
    algo.write(state, torch.arange(4, 8), torch.full((4, 1, 2), 9.0))  # block 1, full
    algo.write(state, torch.tensor([4, 5]), torch.tensor([[[1.0, -1.0]], [[2.0, -3.0]]]))  # reused from offset 0
    assert state.page_min[1].tolist() == [[1.0, -3.0]] and state.page_max[1].tolist() == [[2.0, -1.0]]
    algo.write(state, torch.tensor([6]), torch.tensor([[[0.0, 5.0]]]))  # the next token of the same block
    assert state.page_min[1].tolist() == [[0.0, -3.0]] and state.page_max[1].tolist() == [[2.0, 5.0]]


def test_select_with_a_host_bound_of_the_lengths_selects_the_same() -> None:
    config = load_vllm_config({**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}, block_size=16)
    algo = paged_algorithm(config)
    lens = [300, 45, 200]
    q, keys, values, table, k_cache, v_cache = paged_case(lens, 2, 2, 16, 16, 40, seed=5)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, 16, chunk=50)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    exact = algo.select(state, q, table, seq_lens)
    bound = algo.select(state, q, table, seq_lens, max_seq_len=10_000)  # clamped to the table's width
    assert torch.equal(exact.indices, bound.indices) and torch.equal(exact.lengths, bound.lengths)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    hkv=st.sampled_from([1, 2]),
    bs=st.sampled_from([8, 16]),
    top_k=st.sampled_from([16, 48, 96]),
    min_len=st.sampled_from([0, 1, 64, 200, 10_000]),
    padding=st.integers(0, 2),
    seed=st.integers(0, 50),
)
def test_static_selection_equals_the_planned_one_and_short_rows_are_dense(
    lens, hkv, bs, top_k, min_len, padding, seed
) -> None:
    """select_static (full CUDA graphs: every block of the table scored, no host bound, rows
    below min_sparse_prompt_len kept whole) selects what select does for the rows the host
    plan takes, every token of the shorter rows, and nothing for padding rows (length 0)."""
    config = load_vllm_config({**BASE, "top_k": top_k, "sink_tokens": 8, "recent_tokens": 16,
                               "min_sparse_prompt_len": min_len}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, 2, 16, bs, num_blocks, seed=seed)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=29)
    # a graph's batch: `padding` rows of length 0 after the real ones, the table wider than needed
    table = torch.cat([table, torch.zeros(padding, table.shape[1], dtype=table.dtype)])
    table = torch.cat([table, torch.zeros(table.shape[0], 3, dtype=table.dtype)], dim=1)
    q = torch.cat([q, torch.randn(padding, *q.shape[1:])])
    seq_lens = torch.tensor(lens + [0] * padding, dtype=torch.int32)
    static = algo.select_static(state, q, table, seq_lens, min_len)
    for i, n in enumerate(lens + [0] * padding):
        got = static.indices[i, :, : int(static.lengths[i].max())]
        if n == 0:
            assert int(static.lengths[i].max()) == 0
        elif n < max(min_len, 1):  # dense: every token
            assert bool((static.lengths[i] == n).all()) and torch.equal(got, torch.arange(n, dtype=got.dtype).expand_as(got))
        else:
            planned = algo.select(state, q[i : i + 1], table[i : i + 1], seq_lens[i : i + 1])
            assert torch.equal(static.lengths[i], planned.lengths[0])
            width = int(planned.lengths.max())
            assert torch.equal(static.indices[i, :, :width], planned.indices[0, :, :width])


def block_mass_f64(q, keys, lens, bs):  # type: ignore[no-untyped-def]
    """float64 [B, Hkv, n_blocks]: per KV head, its group's softmax mass (q·k / √D over the
    tokens before the newest) summed over each logical block's tokens."""
    b, hq, d = q.shape
    hkv = keys[0].shape[1]
    g = hq // hkv
    n_blocks = max(-(-n // bs) for n in lens)
    out = torch.zeros(b, hkv, n_blocks, dtype=torch.float64)
    for i, n in enumerate(lens):
        for h in range(hkv):
            k = keys[i][: n - 1, h].double()
            for head in range(h * g, (h + 1) * g):
                probs = torch.softmax(k @ q[i, head].double() / math.sqrt(d), dim=0)
                for t in range(n - 1):
                    out[i, h, t // bs] += probs[t]
    return out


@pytest.mark.parametrize("lens, hkv, group, bs, top_k", [([300, 45, 200], 3, 2, 16, 64), ([513, 97], 1, 4, 32, 96)])
def test_dsa_keys_ranks_blocks_by_their_keys_attention_mass(lens, hkv, group, bs, top_k) -> None:
    """DSA over the real keys inside vLLM (`paged_keys.PagedKeyMass`): the keys copied per
    physical slot (shuffled blocks that first held another request's keys, prefill chunks,
    padding slots), each block scored by the float64 mass of its tokens, the top blocks kept
    beside the forced ones; the static (full-graph) path selects the same; a covering budget
    is dense attention."""
    d = 16
    config = load_vllm_config({**BASE, "algorithm": "dsa", "top_k": top_k, "sink_tokens": bs, "recent_tokens": bs,
                               "extra": {"source": "keys"}}, block_size=bs)
    algo = paged_algorithm(config)
    assert type(algo).__name__ == "PagedKeyMass" and algo.budget_units == top_k // bs
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, d, bs, num_blocks, seed=3)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=37)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    n_blocks = max(-(-n // bs) for n in lens)
    want = block_mass_f64(q, keys, lens, bs)
    got = algo.score(state, q, table, n_blocks, seq_lens)
    if hkv == 1:
        assert got.shape == (len(lens), 1, n_blocks)
    for i, n in enumerate(lens):  # blocks past a request's length are never ranked (valid mask)
        used = -(-n // bs)
        torch.testing.assert_close(got[i, :, :used].double(), want[i, :, :used], atol=1e-5, rtol=1e-4)
    selection = algo.select(state, q, table, seq_lens)
    selection.validate(seq_lens)
    static = algo.select_static(state, q, table, seq_lens, 0)
    assert torch.equal(static.lengths, selection.lengths)
    for i, n in enumerate(lens):
        last = (n - 1) // bs
        forced = {u for u in range(last + 1) if u * bs < bs or u >= (n - bs) // bs or u == last}
        for h in range(selection.indices.shape[1]):
            kept = {int(t) // bs for t in selection.indices[i, h, : selection.lengths[i, h]]}
            assert torch.equal(static.indices[i, h, : static.lengths[i, h]], selection.indices[i, h, : selection.lengths[i, h]])
            free = [u for u in range(last + 1) if u not in forced]
            chosen = [u for u in free if u in kept]
            assert len(chosen) == min(top_k // bs, len(free))
            if chosen and len(chosen) < len(free):  # every kept block outranks every one left out
                assert min(want[i, h, u] for u in chosen) >= max(want[i, h, u] for u in free if u not in kept) - 1e-9
    covering = load_vllm_config({**BASE, "algorithm": "dsa", "top_k": n_blocks * bs, "extra": {"source": "keys"}},
                                block_size=bs)
    assert_selects_everything_and_attends_densely(paged_algorithm(covering).select(state, q, table, seq_lens),
                                                  seq_lens, q, keys, values, table, k_cache, v_cache, bs)


def test_device_counters_accumulate_in_place_across_resets() -> None:
    """A full CUDA graph that captured a counter's addition replays it into the same tensor:
    the counters must be added to in place and `reset` must zero that tensor, not replace it."""
    from sparse_framework.integrations.vllm.paged import VllmStats

    stats = VllmStats()
    stats.add_device("sparse_rows", torch.tensor(3), "cpu")
    held = stats._device["sparse_rows"]
    stats.add_device("sparse_rows", 2, "cpu")
    stats.forward_calls += 4
    assert stats.as_dict()["sparse_rows"] == 5 and stats.as_dict()["forward_calls"] == 4
    stats.reset()
    assert stats.as_dict()["sparse_rows"] == 0 and stats.as_dict()["forward_calls"] == 0
    held.add_(7)  # what a replay of a captured addition does
    assert stats.as_dict()["sparse_rows"] == 7
    # made inside vLLM's forward (inference mode), reset from the caller's code outside it
    with torch.inference_mode():
        stats.add_device("kv_writes", 5, "cpu")
    stats.reset()
    assert stats.as_dict()["kv_writes"] == 0


def test_the_worker_report_is_plain_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """`WorkerReport` (vLLM's `--worker-extension-cls`): what a server's `/collective_rpc`
    (VLLM_SERVER_DEV_MODE=1) returns for `sparse_framework_report` must be a plain JSON object,
    device counters read as ints; `sparse_framework_reset` zeroes them."""
    from sparse_framework.integrations import vllm as plugin
    from sparse_framework.integrations.vllm.paged import DIAGNOSTICS, STATS

    worker = plugin.WorkerReport()
    worker.rank = 1
    monkeypatch.setitem(DIAGNOSTICS, "kv_cache_shape", [182, 3, 32, 128])
    monkeypatch.setitem(DIAGNOSTICS, "kv_cache_dtype", "torch.float32")
    STATS.reset()
    try:
        STATS.add_device("selected_tokens", torch.tensor(64), "cpu")
        STATS.forward_calls += 2
        report = json.loads(json.dumps(worker.sparse_framework_report()))
        assert report["rank"] == 1 and report["diagnostics"]["kv_cache_shape"] == [182, 3, 32, 128]
        assert report["stats"]["selected_tokens"] == 64 and report["stats"]["forward_calls"] == 2
        worker.sparse_framework_reset()
        assert not any(worker.sparse_framework_report()["stats"].values())
    finally:
        STATS.reset()
    assert plugin.WORKER_EXTENSION == f"{plugin.WorkerReport.__module__}.{plugin.WorkerReport.__qualname__}"


def test_decode_rows_plans_one_token_rows_long_enough() -> None:
    starts = torch.tensor([0, 1, 5, 6, 7, 8])  # query lengths 1, 4, 1, 1, 1
    lens = torch.tensor([10, 100, 3, 50, 0, 99])  # (a row past the requests is ignored)
    plan = decode_rows(starts, lens, 5, "cpu")
    assert plan.rows.tolist() == [0, 3] and plan.tokens.tolist() == [0, 6]
    assert (plan.count, plan.decode_rows, plan.max_seq_len) == (2, 4, 50)
    # a padded row (one token, empty context) never decodes sparsely
    assert decode_rows(starts, lens, 0, "cpu").rows.tolist() == [0, 2, 3]
    # without the lengths on the host: every one-token row, the bound given
    plan = decode_rows(starts, None, 0, "cpu", max_seq_len=128)
    assert plan.rows.tolist() == [0, 2, 3, 4] and plan.max_seq_len == 128
    with pytest.raises(ValueError):
        decode_rows(starts, None, 1024, "cpu", max_seq_len=128)


