"""Clear errors instead of allocator tracebacks and wrong messages (issue 19, item 6): sizes
checked before anything is allocated, request limits as capacity errors, the resident
store's retract."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.cli.main import main
from sparse_framework.config import load_config
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.common.errors import CapacityError, LimitError
from sparse_framework.coordinator import footprint
from helpers import SMALL_QUEST

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


# -- sizes checked up front -------------------------------------------------------------------
def test_huge_max_seq_len_is_a_capacity_error_naming_the_settings() -> None:
    """10**9 tokens of 8 requests: terabytes, more than any machine; it used to end in the
    CPU allocator's RuntimeError from inside Quest's constructor."""
    with pytest.raises(CapacityError) as info:
        SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=8, max_seq_len=10**9)
    msg = str(info.value)
    assert "max_seq_len=1000000000" in msg and "max_requests=8" in msg
    assert "device KV pool" in msg and "host KV pool" in msg and "device_capacity_tokens" in msg


@pytest.mark.parametrize("store", ["hierarchical", "resident"])
@pytest.mark.parametrize("algorithm, extra", [("quest", {"dense_first_layers": 0}), ("snapkv", {}), ("pqcache", {})])
def test_footprint_estimate_matches_what_is_allocated(store, algorithm, extra) -> None:
    """The estimate of each pool against the bytes of the tensors the coordinator built."""
    cfg = {**SMALL_QUEST, "algorithm": algorithm, "extra": extra, "store": store}
    if algorithm == "pqcache":
        cfg["top_k"] = 64
    coord = SparseCoordinator(cfg, LAYOUT, max_requests=3, max_seq_len=300)
    estimate = footprint.coordinator_parts(coord.config, LAYOUT, max_requests=3, max_seq_len=300)
    parts = {p.what.split(" ")[0]: p for p in estimate}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    device = sum(p.bytes for p in estimate if p.what.startswith("device KV pool"))
    assert device == sum(nbytes(pool.tensors) for pool in coord.store.pools)
    assert parts["host"].bytes == nbytes(coord.store.host)
    representation = [t for t in vars(coord.algorithm).values() if isinstance(t, torch.Tensor) and t.dim() >= 4]
    # the per-token terms; per-request constants (PQCache's codebooks) are not counted
    assert parts["algorithm"].bytes <= nbytes(representation)
    assert parts["algorithm"].bytes > 0


def test_footprint_checks_each_device_against_its_memory(monkeypatch) -> None:
    cfg = load_config(SMALL_QUEST)
    parts = footprint.coordinator_parts(cfg, LAYOUT, max_requests=4, max_seq_len=4096)
    need = sum(p.bytes for p in parts)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: need)
    SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=4, max_seq_len=4096)  # fits exactly
    monkeypatch.setattr(footprint, "available_bytes", lambda device: need - 1)
    with pytest.raises(CapacityError, match=r"max_requests=4, max_seq_len=4096 need .* on cpu"):
        SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=4, max_seq_len=4096)
    # smaller pools through the capacity settings fit again
    SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=4, max_seq_len=4096,
                      device_capacity_tokens=2048, host_capacity_tokens=2048)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: None)  # unknown: not checked
    SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=4, max_seq_len=4096)


def test_available_bytes_of_the_host_is_physical_memory() -> None:
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert abs(footprint.available_bytes("cpu") - total) < 2**30  # sysconf and meminfo agree


def test_allocator_failures_become_capacity_errors(monkeypatch) -> None:
    """The last resort when the estimate let through what the allocator refuses."""
    from sparse_framework.algorithms.quest import Quest

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(Quest, "__init__", refuse)
    with pytest.raises(CapacityError, match=r"algorithm 'quest' representations: .*can't allocate.*max_seq_len"):
        SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=2, max_seq_len=64)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(Quest, "__init__", broken)
    with pytest.raises(RuntimeError, match="a bug") as info:
        SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=2, max_seq_len=64)
    assert not isinstance(info.value, CapacityError)


def test_run_with_a_huge_context_names_contexts(capsys) -> None:
    assert main(["run", "--contexts", "1000000000", "--steps", "1", "--no-progress"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("error: the workload does not fit")
    assert "--contexts" in out and "max_seq_len=1000000002" in out and "Traceback" not in out


# -- request limits ---------------------------------------------------------------------------
def test_exceeding_max_requests_is_a_capacity_error() -> None:
    coord = SparseCoordinator(SMALL_QUEST, LAYOUT, max_requests=1, max_seq_len=64)
    coord.on_request_begin(Request("a", 8))
    with pytest.raises(CapacityError, match=r"request 'b': all 1 request rows are in use \(max_requests=1\)") as info:
        coord.on_request_begin(Request("b", 8))
    assert isinstance(info.value, ValueError) and isinstance(info.value, LimitError)  # what callers caught before
    with pytest.raises(CapacityError, match="prompt_len 64 leaves no room .* max_seq_len 64"):
        coord.on_request_begin(Request("c", 64))


# -- command-line inputs ----------------------------------------------------------------------
def test_config_naming_a_directory_says_so(tmp_path, capsys) -> None:
    assert main(["run", "--config", str(tmp_path), "--steps", "1", "--no-progress"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"config '{tmp_path}' is a directory; give a JSON file or a JSON object" in out


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".txt"])
def test_experiment_file_of_another_type_is_refused_by_its_suffix(tmp_path, suffix) -> None:
    """A .yaml experiment was parsed as JSON and then reported as "not valid YAML"."""
    from sparse_framework.common.errors import ConfigError
    from sparse_framework.eval.experiment import load_experiment

    path = tmp_path / f"exp{suffix}"
    path.write_text("name: small\ncontexts: [256]\n")
    with pytest.raises(ConfigError, match=rf"unsupported file type '{suffix}'; allowed: .json, .toml") as info:
        load_experiment(path)
    assert "not valid" not in str(info.value)
    with pytest.raises(ConfigError, match="is a directory"):
        load_experiment(tmp_path)


def test_plan_of_a_context_no_request_fits_is_an_error(capsys) -> None:
    assert main(["plan", "--context", "100000000000"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("error: --context 100000000000: not one request fits")
    assert "--gpu-gb 60" in out and "gain" not in out


def test_plan_gain_is_not_a_ratio_over_zero_resident_requests(tmp_path, capsys) -> None:
    """1M tokens: no request fits resident in 60 GiB, some do hierarchically; the gain column
    must not divide by a clamped zero."""
    import json

    out_json = tmp_path / "plan.json"
    assert main(["plan", "--context", "1000000", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert rows[0]["resident_requests"] == 0 and rows[0]["hierarchical_requests"] > 0
    assert rows[0]["gain"] is None
    table = capsys.readouterr().out.splitlines()
    resident = next(line for line in table if "1,000,000" in line)
    buffers = [line for line in table if line.strip().startswith("buffer")]
    assert resident.split()[-2:] == ["-", "1.00x"]
    assert buffers and all(line.split()[-2] == "-" for line in buffers)  # gain, then KV-only gain


# -- retract on the resident store --------------------------------------------------------------
def test_resident_store_retract_names_host_capacity_tokens() -> None:
    """The resident store's host pool is empty by default: retract used to fail with "host KV
    pool full… 0 of 0 pages". It now says why and names the setting, and changes nothing; with
    host_capacity_tokens the same retract/resume works (attention as if never retracted)."""
    cfg = {**SMALL_QUEST, "store": "resident"}
    gen = torch.Generator().manual_seed(0)
    n, heads = 40, 4
    prompt = [torch.randn(n, 2, 16, generator=gen) for _ in range(3)]  # k, v, q-ish
    q_dec = torch.randn(1, heads, 16, generator=gen)
    k_dec, v_dec = torch.randn(1, 2, 16, generator=gen), torch.randn(1, 2, 16, generator=gen)

    def prefill(coord: SparseCoordinator) -> Request:
        r = Request("r", n)
        coord.on_request_begin(r)
        b = Batch([r], is_prefill=True)
        coord.forward_begin(b)
        q = torch.cat([prompt[2], prompt[2]], 1)
        for layer in range(LAYOUT.num_layers):
            coord.attention_begin(layer, q, prompt[0], prompt[1], b)
            coord.attention_end(layer, None, b)
        coord.forward_end(b)
        return r

    def decode(coord: SparseCoordinator, r: Request) -> list[torch.Tensor]:
        b = Batch([r])
        coord.forward_begin(b)
        outs = []
        for layer in range(LAYOUT.num_layers):
            meta = coord.attention_begin(layer, q_dec, k_dec, v_dec, b)
            outs.append(coord.attend(layer, q_dec, meta))
            coord.attention_end(layer, outs[-1], b)
        coord.forward_end(b)
        return outs

    coord = SparseCoordinator(cfg, LAYOUT, max_requests=2, max_seq_len=64)
    r = prefill(coord)
    with pytest.raises(CapacityError, match=r"cannot retract request 'r' \(40 tokens\).*resident store keeps no "
                                            r"host copy.*host_capacity_tokens") :
        coord.on_request_retract(r)
    assert not coord.retracted
    reference = decode(coord, r)  # the failed retract changed nothing

    coord = SparseCoordinator(cfg, LAYOUT, max_requests=2, max_seq_len=64, host_capacity_tokens=64)
    r = prefill(coord)
    coord.on_request_retract(r)
    coord.on_request_resume(r)
    for got, want in zip(decode(coord, r), reference):
        assert torch.equal(got, want)
