"""benchmarks/fwe_analysis.py's marking and kept-share arithmetic on hand-built examples (no
checkpoint): whole-word occurrences split over several tokens, the shares a selection keeps,
and the token top-k / SnapKV selections' forced tokens."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from helpers import load_benchmark as _load

fa = _load("fwe_analysis")

# " foo bar foo,foox foo": tokens " f" "oo" " bar" " f" "oo" "," "foox" " foo"
TEXT = " foo bar foo,foox foo"
OFFSETS = [(0, 2), (2, 4), (4, 8), (8, 10), (10, 12), (12, 13), (13, 17), (17, 21)]


def test_word_spans_are_whole_words_only() -> None:
    spans = fa.word_spans(TEXT, ["foo", "bar"])
    assert spans["foo"] == [(1, 4), (9, 12), (18, 21)]  # not the "foo" inside "foox"
    assert spans["bar"] == [(5, 8)]


def test_occurrence_tokens_cover_every_piece_of_the_word() -> None:
    spans = fa.word_spans(TEXT, ["foo"])["foo"]
    assert fa.span_tokens(OFFSETS, spans) == [[0, 1], [3, 4], [7]]


def test_occurrences_through_a_real_fast_tokenizer_shape() -> None:
    class Tok:  # the two fields `occurrences` reads from a fast tokenizer's encoding
        def __call__(self, text: str, **kw: object):  # type: ignore[no-untyped-def]
            assert kw.get("return_offsets_mapping")
            return type("Enc", (), {"input_ids": list(range(len(OFFSETS))), "offset_mapping": OFFSETS})()

    ids, occ = fa.occurrences(Tok(), TEXT, ("foo", "bar"))
    assert ids == list(range(8))
    assert occ == {"foo": [[0, 1], [3, 4], [7]], "bar": [[2]]}


def test_kept_shares_hand_counted() -> None:
    occ = [[0, 1], [3, 4], [7]]  # 5 marked tokens, 3 occurrences
    keep = torch.zeros(2, 8, dtype=torch.bool)
    keep[0, [0, 1, 3, 6]] = True  # head 0: tokens 0,1,3 of 5; occurrence 1 whole only
    keep[1, [0, 1, 3, 4, 7]] = True  # head 1: everything
    mass = torch.zeros(2, 8)
    mass[0, [0, 1, 3, 4, 7]] = torch.tensor([0.1, 0.1, 0.2, 0.4, 0.2])
    mass[1, 2] = 1.0  # head 1 puts no mass on the marked tokens
    s = fa.kept_shares(keep, occ, mass)
    assert torch.allclose(s.token, torch.tensor([3 / 5, 1.0]))
    assert torch.allclose(s.occurrence, torch.tensor([1 / 3, 1.0]))
    assert math.isclose(float(s.mass[0]), 0.4 / 1.0, rel_tol=1e-6)
    assert math.isnan(float(s.mass[1]))


def test_token_topk_forces_sink_recent_newest_and_keeps_the_best() -> None:
    t, n = 19, 20
    scores = torch.zeros(1, n)
    scores[0, [5, 9, 12]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 0] = 100.0  # a sink token's score takes no budget place
    keep = fa.token_topk(scores, t, budget=2, sink=2, recent=4)
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 5, 9, 16, 17, 18, 19]


def test_snapkv_keeps_votes_then_the_window_and_decoded_tokens() -> None:
    votes = torch.zeros(1, 10)
    votes[0, 7] = 5.0
    keep = fa.snapkv_keep(votes, window_start=10, t=15, budget=1, sink=1, recent=2)
    assert keep[0].nonzero().flatten().tolist() == [0, 7, 10, 11, 12, 13, 14, 15]


# -- the capture on a hybrid (sliding-window) model: benchmarks/quest_analysis.py --model ----------
qa = _load("quest_analysis")


def test_model_option_defaults_to_smollm2_and_takes_a_name() -> None:
    ap = qa.common_args(qa.__doc__, "2048", 4, "8,16", "/tmp/x.json")
    assert ap.parse_args([]).model == qa.MODEL == "smollm2-135m-instruct"
    assert ap.parse_args(["--model", "gemma3-270m"]).model == "gemma3-270m"
    prov = qa.provenance("quest_analysis.py", ["--model", "gemma3-270m"])
    assert prov["command"] == "python benchmarks/quest_analysis.py --model gemma3-270m" and "commit" in prov
    assert qa.provenance("fwe_analysis.py", ["--selections", "mid sum"])["command"].endswith("--selections 'mid sum'")


def test_recorder_keeps_the_sliding_window_and_only_full_layers_are_analysed(tmp_path: Path) -> None:
    """A tiny random Gemma 3 (window 8, layers sliding, sliding, full): the recording attention
    gives eager's logits past the window, prefill and a teacher-forced chunk after a cache."""
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        max_position_embeddings=128, query_pre_attn_scalar=16)
    assert qa.full_layers(cfg) == [2]
    assert qa.full_layers(transformers.LlamaConfig(num_hidden_layers=3)) == [0, 1, 2]
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path)
    ref = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    rec = qa.Recorder()
    transformers.AttentionInterface.register("quest_analysis_test", rec)
    model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="quest_analysis_test").eval()
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.allclose(model(ids).logits, want, atol=1e-5)
        out = model(ids[:, :24], use_cache=True)
        step = model(ids[:, 24:], past_key_values=out.past_key_values, use_cache=True)
    assert torch.allclose(step.logits, want[:, 24:], atol=1e-5)
    assert rec.k[2].shape[1] == 30  # the full layer's keys: every position
    # the capture the analyses share: the prompt densely, the answer teacher-forced after it
    t = qa.teacher_forced(model, rec, ids[0, :24].tolist(), ids[0, 24:30].tolist(), "cpu", voters=4)
    assert t.layers == [2] and t.first == int(want[0, 23].argmax())
    assert t.keys[0].shape == (29, 1, 16) and t.queries[0].shape == (5, 4, 16) and t.voters[0].shape == (4, 4, 16)
    assert t.cache.get_seq_length() == 24  # the answer ran on a copy
