"""sparse-framework eval: experiment files, cells, metrics against dense, resume, errors, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparse_framework.common.errors import ConfigError
from sparse_framework.eval.experiment import DEFAULT_EXPERIMENT, budget_fraction, expand, load_experiment, top_k_for
from sparse_framework.eval.runner import AttentionProbe, kl_per_position
from sparse_framework.eval.sweep import read_results, run_sweep

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SMALL = {
    "name": "small",
    "algorithms": [{"algorithm": "dsa", "label": "exact", "extra": {"source": "keys"}}, {"algorithm": "quest", "extra": {"dense_first_layers": 0}}],
    "budgets": [1.0, 32],
    "contexts": [512],
    "workloads": [{"kind": "reference", "task": "passkey", "sequences": 1}],
    "base": {"store": "hierarchical"},  # the device buffer's fraction and traffic are measured
}


# -- experiment files ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"budgets": ["1/0"]}, "`budgets`"),
        ({"budgets": [0]}, "`budgets`"),
        ({"budgets": ["3/2"]}, "(0, 1]"),
        ({"contexts": [10]}, "`contexts`"),
        ({"workloads": [{"kind": "reference", "task": "sudoku"}]}, "task must be one of mqar, passkey"),
        ({"workloads": [{"kind": "nope"}]}, "`workloads.0`"),
        ({"workloads": [{"kind": "synthetic", "options": {"contexts": [5]}}]}, "comes from the experiment"),
        ({"workloads": [{"kind": "synthetic", "options": {"needles": -1}}]}, "needles"),
        ({"algorithms": []}, "`algorithms`"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"contxts": [512]}, "`contxts`: unknown option"),
    ],
)
def test_bad_experiments_name_the_key(change: dict, names: str) -> None:
    with pytest.raises(ConfigError, match="invalid experiment") as err:
        load_experiment({**SMALL, **change})
    assert names in str(err.value)


def test_bad_algorithm_settings_fail_before_anything_runs_naming_the_entry() -> None:
    exp = load_experiment({**SMALL, "algorithms": [{"algorithm": "quest", "extra": {"gqa_reduce": "median"}}]})
    with pytest.raises(ConfigError, match=r"(?s)algorithm 'quest', backend 'torch_ref', budget 1.0.*extra.gqa_reduce"):
        expand(exp)
    exp = load_experiment({**SMALL, "algorithms": ["quets"]})
    with pytest.raises(ConfigError, match="quest"):
        expand(exp)


def test_files_json_and_toml_and_their_errors(tmp_path: Path) -> None:
    toml = tmp_path / "exp.toml"
    toml.write_text(
        'name = "t"\nalgorithms = ["quest"]\nbudgets = ["1/4"]\ncontexts = [1024]\n'
        '[[workloads]]\nkind = "reference"\ntask = "mqar"\n'
    )
    assert load_experiment(toml).budgets == ["1/4"]
    (tmp_path / "exp.json").write_text(json.dumps(SMALL))
    assert load_experiment(tmp_path / "exp.json").name == "small"
    (tmp_path / "bad.toml").write_text("algorithms = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_experiment(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "missing.json")


def test_budgets_are_token_counts_or_fractions_of_the_context() -> None:
    assert budget_fraction(512) is None and top_k_for(512, 4096, 16) == 512
    assert top_k_for("1/16", 4096, 16) == 256 and top_k_for(0.25, 4096, 16) == 1024
    assert top_k_for("1/1024", 1024, 16) == 16  # never below one page


def test_cells_dense_first_ids_stable_and_distinct() -> None:
    exp = load_experiment(DEFAULT_EXPERIMENT)
    cells = expand(exp)
    per_context = 1 + len(exp.algorithms) * len(exp.backends) * len(exp.budgets)
    assert len(cells) == per_context * len(exp.contexts) * len(exp.workloads)
    assert cells[0].algorithm == "dense" and cells[0].config is None
    assert len({c.id for c in cells}) == len(cells)
    assert [c.id for c in expand(exp)] == [c.id for c in cells]
    # a result measured on another device is not taken as this device's
    on_gpu = expand(load_experiment({**DEFAULT_EXPERIMENT, "device": "cuda"}))
    assert not {c.id for c in on_gpu} & {c.id for c in cells}
    for c in cells[1:per_context]:  # buffer sized for the widest selection, in whole pages
        need = c.config.algorithm_class.max_selected_tokens(c.config)
        assert need <= c.config.device_buffer_tokens < need + c.config.page_size


# -- metrics --------------------------------------------------------------------------------
def test_kl_is_zero_for_equal_logits_and_positive_otherwise() -> None:
    a = torch.randn(3, 7, dtype=torch.float64)
    assert kl_per_position(a, a).abs().max() < 1e-12
    ref = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=a), torch.distributions.Categorical(logits=a.flip(-1))
    )
    assert torch.allclose(kl_per_position(a, a.flip(-1)), ref)


def test_full_budget_equals_dense_and_a_small_budget_is_measured(tmp_path: Path) -> None:
    records = run_sweep(load_experiment(SMALL), tmp_path / "r.jsonl", progress=False)
    assert [r.status for r in records] == ["ok"] * 5, [r.error for r in records]
    dense = records[0]
    assert dense.algorithm == "dense" and dense.metrics["accuracy"] >= 0.5
    for r in records[1:]:
        m = r.metrics
        assert m["decode_steps"] > 0 and m["ms_per_token"] > 0
        if r.budget == "1.0":  # budget >= context: sparse decode is dense decode
            assert m["recall"] > 1 - 1e-6 and m["rel_error"] < 1e-4 and m["kl"] < 1e-6
            assert m["accuracy"] == dense.metrics["accuracy"] and m["needle_hit_rate"] == 1.0
        else:
            assert r.top_k == 32 and m["device_kv_fraction"] < 0.5 and m["recall"] < 1


def test_probe_measures_recall_against_dense_attention() -> None:
    """A selection of everything has recall 1 and zero error; of nothing but one token, less."""
    from sparse_framework.common.batch import Batch, Request, Selection
    from sparse_framework.eval.metrics import dense_attention
    from sparse_framework.integrations.transformers import AttentionEvent

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(9, 2, 4, generator=gen), torch.randn(9, 2, 4, generator=gen)
    request = Request("r", 8)
    probe = AttentionProbe(1)
    probe(AttentionEvent(0, Batch([request], is_prefill=True), torch.randn(8, 4, 4), k[:8], v[:8]))
    request.seq_len = 9
    q = torch.randn(1, 4, 4, generator=gen)
    out, _ = dense_attention(q[0], k, v)
    everything = Selection(torch.arange(9, dtype=torch.int32)[None, None], torch.tensor([[9]], dtype=torch.int32))
    probe(AttentionEvent(0, Batch([request]), q, k[8:9], v[8:9], out[None].float(), everything))
    assert probe.result()["recall"] == pytest.approx(1.0) and probe.result()["rel_error"] < 1e-6


# -- the sweep ------------------------------------------------------------------------------
def test_an_interrupted_sweep_resumes_and_skips_finished_cells(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "r.jsonl"
    exp = load_experiment({**SMALL, "algorithms": [SMALL["algorithms"][0]], "budgets": [32]})
    first = run_sweep(exp, out, progress=False)
    with out.open("a") as f:
        f.write('{"id": "cut in the mid')  # what an interruption leaves behind
    calls = []
    monkeypatch.setattr("sparse_framework.eval.runner.Runner.run", lambda self, cell: calls.append(cell) or {})
    again = run_sweep(exp, out, progress=False)
    assert calls == [] and [r.metrics for r in again] == [r.metrics for r in first]
    assert len(read_results(out)) == 2
    run_sweep(exp, out, progress=False, fresh=True)
    assert len(calls) == 2


def test_shards_split_the_unfinished_cells_algorithm_major_and_together_cover_the_sweep(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """N shards, each from its own copy of the same partial results file, measure disjoint
    shares of the unfinished cells that together are all of them; each deals the dense cells
    first, then one algorithm at a time; concatenated, the files make the whole sweep."""
    exp = load_experiment({**SMALL, "contexts": [512, 1024], "budgets": [1.0, 32, 64]})
    cells = expand(exp)
    out = tmp_path / "r.jsonl"
    monkeypatch.setattr("sparse_framework.eval.runner.Runner.run", lambda self, cell: {"accuracy": 1.0})
    run_sweep(load_experiment({**SMALL, "contexts": [512], "budgets": [1.0], "algorithms": SMALL["algorithms"][:1]}),
              out, progress=False)  # 2 of the 14 cells finished
    before = out.read_text()
    assert len(read_results(out)) == 2
    measured: list[list] = []
    for index in range(3):
        copy = tmp_path / f"shard{index}.jsonl"
        copy.write_text(before)
        calls: list = []
        monkeypatch.setattr("sparse_framework.eval.runner.Runner.run",
                            lambda self, cell, calls=calls: calls.append(cell) or {"accuracy": 1.0})
        records = run_sweep(exp, copy, progress=False, shard=(index, 3))
        assert len(records) == 2 + len(calls)
        measured.append(calls)
    ids = [c.id for calls in measured for c in calls]
    assert len(ids) == len(set(ids)) == len(cells) - 2
    order = ["dense", "exact", "quest"]
    for calls in measured:
        ranks = [order.index(c.algorithm) for c in calls]
        assert ranks == sorted(ranks)
    merged = tmp_path / "merged.jsonl"
    merged.write_text("".join((tmp_path / f"shard{i}.jsonl").read_text() for i in range(3)))
    assert read_results(merged).keys() == {c.id for c in cells}


@pytest.mark.parametrize("text", ["1/1", "2", "a/b", "-1/2"])
def test_a_bad_shard_names_the_form(text: str) -> None:
    import argparse

    from sparse_framework.cli.eval import parse_shard

    with pytest.raises(argparse.ArgumentTypeError, match="I/N|0 <= I < N"):
        parse_shard(text)


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    exp = load_experiment({
        **SMALL, "algorithms": [SMALL["algorithms"][0]], "budgets": [32],
        "workloads": [{"kind": "hf", "model": str(tmp_path / "no-model"), "prompts": str(tmp_path / "none.txt")},
                      SMALL["workloads"][0]],
    })
    records = run_sweep(exp, tmp_path / "r.jsonl", progress=False)
    assert [r.status for r in records] == ["error", "error", "ok", "ok"]
    assert "cannot be loaded without the network" in records[0].error
    assert read_results(tmp_path / "r.jsonl").keys() == {r.id for r in records[2:]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of the triton backend")
def test_a_backend_that_cannot_run_here_stops_the_sweep_before_any_cell(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    exp = load_experiment({**SMALL, "backends": ["torch_ref", "triton"]})
    with pytest.raises(ConfigError, match="experiment `backends`: backend 'triton' .*CUDA"):
        run_sweep(exp, tmp_path / "r.jsonl", progress=False)
    assert not (tmp_path / "r.jsonl").exists()


def test_a_users_hf_model_and_prompts_file(tmp_path: Path) -> None:
    """A tiny Llama with a word-level tokenizer saved locally, run through the hf workload."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]"] + [f"w{i}" for i in range(62)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=1, eos_token_id=None, bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(f"w{i % 60}" for i in range(300)) + "\n" + json.dumps({"prompt": "w1 w2 " * 100}) + "\n")
    exp = load_experiment({
        "algorithms": [{"algorithm": "dsa", "extra": {"source": "keys"}}], "budgets": [1.0, 16], "contexts": [256],
        "workloads": [{"kind": "hf", "model": str(tmp_path / "m"), "prompts": str(prompts), "max_new_tokens": 4}],
        "base": {"store": "hierarchical"},
    })
    records = run_sweep(exp, None, progress=False)
    assert [r.status for r in records] == ["ok"] * 3, [r.error for r in records]
    full = records[1].metrics
    assert full["accuracy"] == 1.0 and full["kl"] < 1e-8 and full["recall"] > 1 - 1e-6
    assert records[2].metrics["device_kv_fraction"] < 1


def test_cli_plots_markdown_and_errors(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from sparse_framework.cli.main import main

    (tmp_path / "exp.json").write_text(json.dumps({**SMALL, "budgets": [32]}))
    page = tmp_path / "page.md"
    code = main(["eval", str(tmp_path / "exp.json"), "--out", str(tmp_path / "r.jsonl"), "--plots",
                 str(tmp_path / "plots"), "--markdown", str(page), "--no-progress"])
    assert code == 0
    for name in ("accuracy_vs_budget", "recall_vs_budget", "time_vs_context"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    text = page.read_text()
    assert "| exact |" in text and "| quest |" in text and "![accuracy_vs_budget](plots/accuracy_vs_budget.png)" in text
    assert "sparse-framework eval" in text
    (tmp_path / "bad.json").write_text(json.dumps({**SMALL, "budgets": ["lots"]}))
    assert main(["eval", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "`budgets`" in capsys.readouterr().out
    assert main(["eval", "--out", str(tmp_path / "no/dir/x.jsonl")]) == 2
    capsys.readouterr()
    assert main(["eval", "--show-default"]) == 0
    assert json.loads(capsys.readouterr().out) == DEFAULT_EXPERIMENT


def test_report_only_measures_nothing_and_says_what_is_missing(tmp_path: Path, monkeypatch, capsys) -> None:
    """--report-only renders the cells already in --out (measured elsewhere) and names the
    rest as missing; it never runs a cell, and refuses --fresh or a missing results file."""
    pytest.importorskip("matplotlib")
    from sparse_framework.cli.main import main

    out = tmp_path / "r.jsonl"
    one = {**SMALL, "algorithms": [SMALL["algorithms"][0]], "budgets": [32]}
    run_sweep(load_experiment(one), out, progress=False)  # 2 cells: dense, exact@32
    monkeypatch.setattr("sparse_framework.eval.runner.Runner.run", lambda self, cell: pytest.fail("a cell ran"))
    (tmp_path / "exp.json").write_text(json.dumps({**SMALL, "budgets": [32]}))  # 3 cells: + quest@32
    page = tmp_path / "page.md"
    args = ["eval", str(tmp_path / "exp.json"), "--out", str(out), "--markdown", str(page), "--no-progress"]
    assert main([*args, "--report-only"]) == 0
    text = page.read_text()
    assert "**Partial: 2 of 3 cells" in text and "| exact |" in text and "| quest |" not in text
    assert "--report-only" in text  # the reproducing command says so
    assert main([*args, "--report-only", "--fresh"]) == 2
    assert "--fresh would discard them" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "exp.json"), "--out", str(tmp_path / "none.jsonl"), "--report-only"]) == 2
    assert "does not exist" in capsys.readouterr().out
