"""The `sparse-framework` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparse_framework.cli.main import main

QUICK = ["--steps", "1", "--contexts", "40,200", "--no-progress"]
CFG = json.dumps({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 32, "page_size": 8, "min_sparse_prompt_len": 100, "device_buffer_tokens": 256})


def test_run_prints_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert main(["run", "--config", CFG, "--json", str(out), *QUICK]) == 0
    printed = capsys.readouterr().out
    for text in ("quest top_k=32 on torch_ref", "context", "mode", "rel err", "recall", "needles", "KV read", "ms/step"):
        assert text in printed
    data = json.loads(out.read_text())
    assert [r["context"] for r in data["results"]] == [40, 200]
    assert [r["mode"] for r in data["results"]] == ["dense", "sparse"]
    assert data["workload"]["decode_steps"] == 1


def test_run_takes_a_config_file_and_several_configs(tmp_path, capsys) -> None:
    path = tmp_path / "c.json"
    path.write_text(CFG)
    out = tmp_path / "r.json"
    assert main(["run", "--config", str(path), "--config", CFG.replace("32", "64"), "--json", str(out), *QUICK]) == 0
    assert [r["top_k"] for r in json.loads(out.read_text())["results"]] == [32, 32, 64, 64]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", '{"algorithm": "qest"}'], "Did you mean 'quest'?"),
        (["--config", '{"top_k": 0}'], "`top_k` = 0"),
        (["--config", "missing.json"], "neither a JSON object nor an existing file"),
        (["--contexts", "10,x"], "--contexts must be comma-separated integers"),
        (["--workload", '{"num_q_heads": 3}'], "must be a multiple of num_kv_heads"),
        (["--workload", '{"heads": 3}'], "`heads`: unknown option"),
        (["--dtype", "int4"], "dtype must be one of"),
        (["--device", "foo"], "device must be a torch device such as 'cpu'"),
        (["--json", "/nonexistent/dir/x.json"], "does not exist"),
        (["--decode-graphs", "--device", "cpu"], "decode_graphs=True needs a CUDA layout device"),
    ],
)
def test_run_bad_input_exits_2_with_a_clear_message(args, message, capsys) -> None:
    assert main(["run", *args, "--no-progress"]) == 2
    assert message in " ".join(capsys.readouterr().out.split())


def test_schema_is_json_with_algorithm_extras(capsys, tmp_path) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "quest" in schema["properties"]["algorithm"]["enum"]
    assert "gqa_reduce" in schema["$defs"]["extra_quest"]["properties"]
    assert main(["schema", "--output", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == schema


def test_plugins_lists_builtins(capsys) -> None:
    assert main(["plugins"]) == 0
    printed = capsys.readouterr().out
    for name in ("quest", "flash_attention", "torch_ref"):
        assert name in printed


def test_console_script_help() -> None:
    done = subprocess.run([sys.executable, "-m", "sparse_framework.cli.main", "run", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--config" in done.stdout and "embedded default" in done.stdout


def test_plan_prints_resident_vs_hierarchical(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3-8b", "--context", "16384,32768", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resident" in printed and "buffer 2,144 (min)" in printed and "KV-only" in printed
    plans = json.loads(out.read_text())
    assert [p["context_len"] for p in plans] == [16384, 16384, 32768, 32768]
    assert plans[1]["device_buffer_tokens"] == 2144  # the smallest buffer for top_k 2048
    assert plans[1]["kv_only_gain"] > 7.5
    layout = '{"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}'
    assert main(["plan", "--layout", layout, "--context", "4096", "--config", '{"top_k": 256, "device_buffer_tokens": 512}']) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "lama"], "Did you mean 'llama-3-8b'?"),
        (["--layout", '{"num_layers": 2}'], "invalid --layout"),
        (["--layout", '{"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "int8"}'], "--layout dtype must be one of"),
        (["--context", "0"], "--context needs positive integers"),
        (["--gpu-gb", "-1"], "--gpu-gb and --host-gb must be > 0"),
        (["--json", "/nonexistent/dir/p.json"], "does not exist"),
        (["--config", '{"top_k": "many"}'], "`top_k` = 'many'"),
    ],
)
def test_plan_bad_input(args, message, capsys) -> None:
    assert main(["plan", *args]) == 2
    assert message in " ".join(capsys.readouterr().out.split())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_run_on_cuda_without_cuda_is_a_clear_error(capsys) -> None:
    assert main(["run", "--device", "cuda", "--no-progress"]) == 2
    assert "CUDA is not available here" in " ".join(capsys.readouterr().out.split())


def test_schema_into_a_missing_directory_is_a_clear_error(capsys) -> None:
    assert main(["schema", "--output", "/nonexistent/dir/s.json"]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_run_notes_when_every_layer_is_dense(capsys) -> None:
    """Quest's recipe keeps its first two layers dense: on the two-layer workload that is every
    layer, which the run says instead of silently reporting dense numbers as sparse."""
    assert main(["run", "--config", '{"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest"}', "--contexts", "2048", "--steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "every layer of the 2-layer workload attends densely" in out and "dense_first_layers" in out


def test_plan_engine_equals_the_engines_own_plan(tmp_path, capsys) -> None:
    """`plan --engine` and an engine built with the same inputs plan the same (every term); the
    engine then runs exactly that many requests at once (tests/test_engine_memory.py)."""
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
    from sparse_framework.engine.engine import Engine
    from sparse_framework.engine.engine_config import EngineConfig
    from sparse_framework.engine.models import ModelConfig, random_model

    sparse = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 16, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
              "device_buffer_tokens": 32, "min_sparse_prompt_len": 0}
    total, host = 2 * 2**20 + 12345, 5 * 2**20 + 7  # room for 3 requests of 64 tokens, 1 of 128
    out = tmp_path / "engine_plan.json"
    assert main(["plan", "--engine", "--model", "tiny", "--dtype", "float32", "--gpu-memory-gib", repr(total / 2**30),
                 "--gpu-memory-utilization", "0.5", "--host-memory-gib", repr(host / 2**30), "--max-num-batched-tokens",
                 "32", "--max-num-seqs", "8", "--context", "64,128", "--config", json.dumps(sparse), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "memory-bound maximum" in printed and "prefill staging" in printed
    planned = json.loads(out.read_text())
    model = random_model(ModelConfig.from_hf(RANDOM_MODELS["tiny"]), "float32", "cpu")
    for row, context in zip(planned, (64, 128)):
        engine = Engine(model, model.config, sparse, EngineConfig(
            max_num_seqs=8, max_num_batched_tokens=32, max_model_len=context, gpu_memory_utilization=0.5,
            device_memory_bytes=total, host_memory_bytes=host))
        assert engine.memory_plan is not None
        assert {k: v for k, v in row.items() if k not in ("model", "config", "tensor_parallel_size")} == \
            engine.memory_plan.as_dict()
        assert engine.num_seqs == row["num_seqs"] > 0
    assert planned[0]["num_seqs"] > planned[1]["num_seqs"]  # longer requests, fewer of them


def test_plan_engine_llama_3_8b_on_an_h100(capsys) -> None:
    assert main(["plan", "--engine", "--gpu-memory-gib", "80", "--gpu-memory-utilization", "0.9", "--host-memory-gib",
                 "128", "--max-num-batched-tokens", "16384", "--context", "16384,131072",
                 "--config", '{"algorithm": "quest", "store": "hierarchical"}']) == 0
    printed = capsys.readouterr().out
    assert "0.9 x 80.00 GiB = 72.00 GiB" in printed and "128.00 GiB (host_memory_bytes)" in printed
    assert "weights 14.96 GiB" in printed  # 8.03 B parameters in bfloat16


def test_plan_engine_for_one_rank_of_a_tensor_parallel_group(tmp_path, capsys, monkeypatch) -> None:
    """--tensor-parallel-size N plans one rank as the engine does under TP: the rank's weight
    shard (embeddings and head whole), num_kv_heads / N per request, 1/N of the host budget."""
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
    from sparse_framework.engine.models import ModelConfig
    from sparse_framework.engine.models.tensor_parallel import local_config

    rows = {}
    for n in (1, 4):
        out = tmp_path / f"tp{n}.json"
        assert main(["plan", "--engine", "--host-memory-gib", "400", "--context", "32768", "--max-num-seqs", "1024",
                     "--tensor-parallel-size", str(n), "--json", str(out)]) == 0
        (rows[n],) = json.loads(out.read_text())
    capsys.readouterr()
    full = ModelConfig.from_hf(RANDOM_MODELS["llama-3-8b"])
    assert rows[4]["weight_bytes"] == local_config(full, 4).num_parameters() * 2 < rows[1]["weight_bytes"] // 2
    assert rows[4]["device_bytes_per_request"] < rows[1]["device_bytes_per_request"] // 3
    assert rows[4]["host_bytes_per_request"] == rows[1]["host_bytes_per_request"] // 4
    assert rows[4]["host_budget_bytes"] == 400 * 2**30 // 4 == rows[1]["host_budget_bytes"] // 4
    assert rows[4]["max_requests"] > rows[1]["max_requests"] and rows[4]["tensor_parallel_size"] == 4
    # without --host-memory-gib the default budget (a share of this host's memory) is split too
    from sparse_framework.engine import memory

    monkeypatch.setattr(memory, "meminfo_bytes", lambda key: 64 * 2**30)  # a fixed MemAvailable
    out = tmp_path / "default.json"
    assert main(["plan", "--engine", "--context", "32768", "--tensor-parallel-size", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["host_budget_bytes"] == int(memory.HOST_MEMORY_FRACTION * 64 * 2**30) // 4
    assert main(["plan", "--engine", "--host-memory-gib", "64", "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 must divide" in " ".join(capsys.readouterr().out.split())


def test_plan_engine_reserves_the_captured_graphs_when_asked(tmp_path, capsys) -> None:
    """--cuda-graphs / --decode-graphs plan as an engine built with them: the graphs' estimated
    pools leave the store less room (engine/memory.py `graph_bytes`)."""
    rows = {}
    for flags in ((), ("--decode-graphs",), ("--cuda-graphs",)):
        out = tmp_path / f"plan{len(rows)}.json"
        assert main(["plan", "--engine", "--host-memory-gib", "400", "--context", "16384", "--max-num-seqs", "64",
                     *flags, "--json", str(out)]) == 0
        (rows[flags],) = json.loads(out.read_text())
    assert "captured graphs" in capsys.readouterr().out
    plain, layer, step = rows[()], rows[("--decode-graphs",)], rows[("--cuda-graphs",)]
    assert plain["graph_bytes"] == 0 < layer["graph_bytes"] < step["graph_bytes"]
    assert plain["device_budget_bytes"] - step["device_budget_bytes"] == step["graph_bytes"]


def test_plan_engine_with_the_prefix_cache_shows_its_host_copies(capsys, tmp_path) -> None:
    """DeepSeek-V3.2 mini: with --enable-prefix-caching each request row's host bytes grow by
    its tokens' indexer keys (6 layers x 128 x 2 bytes per token), printed as their own line."""
    args = ["plan", "--engine", "--model", "deepseek-v3.2-mini", "--host-memory-gib", "64", "--context", "32768",
            "--config", '{"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"index_heads": 64, "index_dim": 128}}']
    assert main([*args, "--json", str(tmp_path / "off.json")]) == 0
    off = capsys.readouterr().out
    assert main([*args, "--enable-prefix-caching", "--json", str(tmp_path / "on.json")]) == 0
    on = capsys.readouterr().out
    assert "prefix cache beside the host pool" in on and "prefix cache" not in off
    (a,), (b,) = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("off", "on"))
    assert b["host_bytes_per_request"] - a["host_bytes_per_request"] == 6 * 128 * 2 * 32768
    assert b["prefix_cache_host_bytes"] == b["num_seqs"] * 6 * 128 * 2 * 32768 and a["prefix_cache_host_bytes"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama-3-405b"], "--engine plans a model shape of `bench --random`"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--gpu-memory-gib", "0"], "--gpu-memory-gib and --host-memory-gib must be > 0"),
        (["--gpu-memory-gib", "16"], "no request of max_model_len=16384 fits"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    ],
)
def test_plan_engine_bad_input(args, message, capsys) -> None:
    assert main(["plan", "--engine", "--host-memory-gib", "64", *args]) == 2
    assert message in " ".join(capsys.readouterr().out.split())


def test_plan_engine_on_a_device_too_small_prints_no_negative_size(capsys) -> None:
    """The plan printed before the error says how far short the device is, never a negative
    store size (`plan --engine --gpu-memory-gib 0.1` printed "= -19.02 GiB for the store")."""
    assert main(["plan", "--engine", "--gpu-memory-gib", "0.1", "--host-memory-gib", "64"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "GiB short, nothing for the store" in out and "-1" not in out.replace("- ", "")
    assert "The weights alone need more than" in out


# -- the distribution's name (PyPI's `sparse-framework` is someone else's project) -------------
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


TAKEN_ON_PYPI = {"sparse-framework", "sparse_framework"}  # an unrelated project (1.2.0, 2024)


def _project() -> tuple[str, set[str]]:
    """pyproject.toml's [project] name and its extras."""
    text = (ROOT / "pyproject.toml").read_text()
    project = text[text.index("[project]\n"):]
    name = __import__("re").search(r'^name = "([^"]+)"', project, __import__("re").M).group(1)
    extras_block = text[text.index("[project.optional-dependencies]"):text.index("[project.scripts]")]
    extras = set(__import__("re").findall(r"^([\w-]+) = \[", extras_block, __import__("re").M))
    return name, extras


def test_the_distribution_is_ours_and_registers_the_builtins() -> None:
    import importlib.metadata

    from sparse_framework import registry

    name, _ = _project()
    assert name == registry.BUILTIN == "sparse-decode-framework"
    assert "sparse-framework[" not in (ROOT / "pyproject.toml").read_text()  # `dev` names its extras by ours
    groups = {ep.group for ep in importlib.metadata.distribution(name).entry_points}
    assert set(registry.GROUPS.values()) <= groups  # installed under this name (pip install -e . after a rename)
    assert registry.describe("algorithm")[0].distribution == name


def test_no_install_hint_names_a_distribution_that_is_not_ours() -> None:
    """Every `pip install` in the package, the README and docs/ that installs this project
    installs it from the checkout (`pip install -e ".[extra]"`) or by the distribution's own
    name, with extras that exist: never `sparse-framework[...]`, an unrelated PyPI project."""
    import re

    name, extras = _project()
    assert name not in TAKEN_ON_PYPI
    files = [*sorted((ROOT / "sparse_framework").rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command in re.findall(r"pip install([^`\n]*)", line):
                command = re.split(r"&&|;|\||, | or ", command)[0]  # this pip command's own arguments
                for token in command.split():
                    target = token.strip("\"'`(),:\\")
                    if not re.fullmatch(r"[\w.-]+(\[[\w,-]*\])?", target):
                        continue  # an option's value, a path or prose, not a requirement
                    base, _, extra = target.partition("[")
                    ours = re.fullmatch(r"(?i)sparse[-_.]?framework", base) or base in (".", name)
                    if not ours and not re.search(r"(?i)sparse[-_.]?framework", base):
                        continue
                    if base not in (".", name) or any(e.strip() not in extras for e in extra.rstrip("]").split(",") if extra):
                        wrong.append(f"{path.relative_to(ROOT)}:{number}: {token}")
    assert not wrong, wrong
