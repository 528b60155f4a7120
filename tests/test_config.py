"""`load_config` / `SparseConfig`: every source form, one clear ConfigError per mistake, the
JSON schema, and a round-trip property."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError, SparseConfig, config_schema, load_config
from sparse_framework.algorithms.quest import Quest, QuestOptions
from sparse_framework.backends.torch_ref import TorchRefBackend
from helpers import SMALL_QUEST

SMALL = SMALL_QUEST
# quest is page-granular: sink 1 page + top_k 8 pages + recent 2 pages + 1 misaligned page
SMALL_MAX_SELECTED = (1 + 8 + 2 + 1) * 4


def check_small(cfg: SparseConfig) -> None:
    assert isinstance(cfg, SparseConfig)
    for key, value in SMALL.items():
        assert getattr(cfg, key) == value, key
    assert cfg.algorithm_class is Quest
    assert cfg.backend_class is TorchRefBackend
    assert cfg.adaptor_name == "flash_attention"  # the backend's metadata format by default
    assert isinstance(cfg.extra_config, QuestOptions) and cfg.extra_config.gqa_reduce == "sum"


def config_error(source) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert isinstance(info.value, ValueError)  # ConfigError is a ValueError for callers
    return str(info.value)


# -- sources ------------------------------------------------------------------------------
def test_from_dict():
    check_small(load_config(SMALL))


def test_from_json_string():
    check_small(load_config(json.dumps(SMALL)))
    check_small(load_config("\n  " + json.dumps(SMALL, indent=2)))  # leading whitespace is fine


def test_from_json_file(tmp_path):
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps(SMALL))
    check_small(load_config(path))  # PathLike
    check_small(load_config(str(path)))  # str path


def test_from_existing_config_is_returned_as_is():
    cfg = load_config(SMALL)
    assert load_config(cfg) is cfg
    check_small(SparseConfig(**SMALL))  # constructing in Python validates too


def test_defaults_and_extra_options():
    cfg = load_config({})
    assert (cfg.algorithm, cfg.backend, cfg.adaptor) == ("quest", "auto", None)
    # the defaults that win on the device (issue 43): resident store, the cost policy, Quest's midpoint
    assert (cfg.store, cfg.sparse_policy, cfg.extra_config.range_weight) == ("resident", "cost", 0.0)
    assert cfg.resolved("cpu").backend == "torch_ref" and cfg.resolved("cpu").key()["backend"] == "torch_ref"
    assert cfg.top_k == 2048 and cfg.page_size == 16 and cfg.dense_layers == [] and cfg.extra == {}
    assert load_config({**SMALL, "extra": {"gqa_reduce": "mean"}}).extra_config.gqa_reduce == "mean"
    assert load_config({**SMALL, "dense_layers": [3, 0, 1]}).dense_layers == [0, 1, 3]  # sorted


def test_config_is_frozen():
    cfg = load_config(SMALL)
    with pytest.raises(Exception):
        cfg.top_k = 64  # type: ignore[misc]
    assert cfg.top_k == 32


# -- one clear error per mistake ------------------------------------------------------------
def test_unknown_algorithm_suggests_closest():
    msg = config_error({**SMALL, "algorithm": "qeust"})
    assert "`algorithm` = 'qeust'" in msg
    assert "registered algorithms:" in msg and "Did you mean 'quest'?" in msg
    assert "backend" not in msg  # only the one mistake is reported


def test_unknown_backend():
    msg = config_error({**SMALL, "backend": "flashinfer"})
    assert "`backend` = 'flashinfer'" in msg and "registered backends:" in msg and "torch_ref" in msg


def test_unknown_adaptor():
    msg = config_error({**SMALL, "adaptor": "flashinfer"})
    assert "`adaptor` = 'flashinfer'" in msg and "flash_attention" in msg and "flashmla" in msg


def test_two_mistakes_give_one_line_each():
    msg = config_error({**SMALL, "algorithm": "qeust", "backend": "torch"})
    lines = msg.splitlines()
    assert lines[0] == "invalid sparse config:"
    assert len(lines) == 3
    assert "`algorithm` = 'qeust'" in lines[1] and "`backend` = 'torch'" in lines[2]


@pytest.mark.parametrize("field", ["top_k", "page_size", "device_buffer_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes(field, value):
    msg = config_error({**SMALL, field: value})
    assert f"`{field}` = {value}" in msg and "greater than or equal to 1" in msg


@pytest.mark.parametrize("field", ["sink_tokens", "recent_tokens", "min_sparse_prompt_len"])
def test_negative_counts(field):
    assert f"`{field}` = -1" in config_error({**SMALL, field: -1})
    assert getattr(load_config({**SMALL, field: 0}), field) == 0


def test_wrong_type():
    msg = config_error({**SMALL, "top_k": "lots"})
    assert "`top_k` = 'lots'" in msg and "integer" in msg


def test_unknown_top_level_key_lists_allowed():
    msg = config_error({**SMALL, "topk": 5})
    assert "`topk`: unknown option" in msg
    allowed = msg.split("allowed options:")[1]
    for field in SparseConfig.model_fields:
        assert field in allowed


def test_bad_extra_value_for_quest():
    msg = config_error({**SMALL, "extra": {"gqa_reduce": "min"}})
    assert "algorithm 'quest'" in msg
    assert "`extra.gqa_reduce` = 'min'" in msg
    assert all(choice in msg for choice in ("'max'", "'sum'", "'mean'"))


def test_unknown_extra_key():
    msg = config_error({**SMALL, "extra": {"gqa": "max"}})
    assert "`extra.gqa`: unknown option; allowed options: gqa_reduce" in msg


def test_top_k_smaller_than_page_size():
    msg = config_error({**SMALL, "top_k": 8, "page_size": 16})
    assert "top_k (8) must be >= page_size (16)" in msg and "'quest'" in msg
    assert load_config({**SMALL, "top_k": 16, "page_size": 16}).top_k == 16  # boundary is fine


def test_device_buffer_too_small():
    msg = config_error({**SMALL, "device_buffer_tokens": SMALL_MAX_SELECTED - 1})
    assert f"device_buffer_tokens ({SMALL_MAX_SELECTED - 1})" in msg
    assert f"at least {SMALL_MAX_SELECTED}" in msg
    cfg = load_config({**SMALL, "device_buffer_tokens": SMALL_MAX_SELECTED})  # exactly enough
    assert Quest.max_selected_tokens(cfg) == SMALL_MAX_SELECTED


def test_a_top_k_too_large_is_refused_by_name_with_its_bound():
    """top_k 1e12 was answered "raise device_buffer_tokens to at least 1000000000096": now the
    message names top_k, says it can never be used (no context is that long) and gives the
    largest top_k the buffer holds; a top_k merely too wide for the buffer gets both ways out."""
    msg = config_error({"top_k": 1e12})
    assert "`top_k` = 1000000000000 can never be used" in msg and "2147483647 tokens" in msg
    assert "lower top_k to at most 4000" in msg and "raise device_buffer_tokens" not in msg
    msg = config_error({"top_k": 8192})
    assert "`top_k` = 8192" in msg and "up to 8288 tokens" in msg and "lower top_k to at most 4000" in msg
    assert "raise device_buffer_tokens to at least 8288" in msg and "max_model_len buys nothing" in msg
    assert Quest.max_selected_tokens(load_config({"top_k": 4000})) <= 4096  # the bound given fits
    msg = config_error({"algorithm": "dsa", "top_k": 5000, "extra": {"source": "keys"}})
    assert "`top_k` = 5000" in msg and "lower top_k to at most 4015" in msg
    load_config({"algorithm": "dsa", "top_k": 4015, "extra": {"source": "keys"}})


def test_bad_json_string():
    msg = config_error('{"algorithm": "quest",')
    assert msg.startswith("config JSON string is not valid JSON:")


def test_bad_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"top_k": 32,,}')
    msg = config_error(path)
    assert f"config file {str(path)!r} is not valid JSON" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    msg = config_error(path)
    assert msg == f"config {str(path)!r} is neither a JSON object nor an existing file"
    # a directory is not a config file either, and the message says it is a directory
    assert config_error(tmp_path) == f"config {str(tmp_path)!r} is a directory; give a JSON file or a JSON object ({{...}})"


def test_non_object_json():
    # a JSON array, string or number given as text is named as such, not taken for a path
    assert config_error("[1, 2]") == "config must be a JSON object ({...}), got '[1, 2]'"
    assert config_error("42") == "config must be a JSON object ({...}), got '42'"
    # ... while an array in a file, or passed as a Python list, is named as such
    assert config_error([1, 2]) == "config must be a JSON object, got list"


def test_non_object_json_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert config_error(path) == "config must be a JSON object, got list"


@pytest.mark.parametrize(
    "layers, problem", [([-1], "must be >= 0"), ([2, 0, 2], "must be unique")]
)
def test_dense_layers_invalid(layers, problem):
    msg = config_error({**SMALL, "dense_layers": layers})
    assert f"`dense_layers` = {layers}" in msg and problem in msg


# -- schema ---------------------------------------------------------------------------------
def test_schema_has_quest_extra_and_algorithm_enum():
    schema = config_schema()
    assert schema["additionalProperties"] is False
    assert "quest" in schema["properties"]["algorithm"]["enum"]
    assert "torch_ref" in schema["properties"]["backend"]["enum"]
    quest = schema["$defs"]["extra_quest"]
    assert quest["additionalProperties"] is False
    assert quest["properties"]["gqa_reduce"]["enum"] == ["max", "sum", "mean"]
    assert quest["properties"]["gqa_reduce"]["default"] == "sum"
    rule = {
        "if": {"properties": {"algorithm": {"const": "quest"}}},
        "then": {"properties": {"extra": {"$ref": "#/$defs/extra_quest"}}},
    }
    assert rule in schema["allOf"]
    json.dumps(schema)  # serialisable as is


# -- property ---------------------------------------------------------------------------------
@st.composite
def valid_configs(draw):
    page = 2 ** draw(st.integers(0, 6))  # powers of two, 1..64
    top_k = draw(st.integers(page, 4096))
    sink = draw(st.integers(0, 256))
    recent = draw(st.integers(0, 256))
    # the widest selection of Quest, in whole pages (at least min_pages = 3 budget pages)
    need = (-(-sink // page) + max(3, top_k // page) + -(-recent // page) + 1) * page
    buffer = need + draw(st.integers(0, 1024))
    return {
        "algorithm": "quest",
        "top_k": top_k,
        "page_size": page,
        "sink_tokens": sink,
        "recent_tokens": recent,
        "device_buffer_tokens": buffer,
        "min_sparse_prompt_len": draw(st.integers(0, 10_000)),
        "dense_layers": draw(st.lists(st.integers(0, 63), unique=True, max_size=4)),
        "extra": {"gqa_reduce": draw(st.sampled_from(["max", "sum", "mean"]))},
    }, need


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_valid_configs_parse_and_round_trip(case):
    data, need = case
    cfg = load_config(data)
    assert Quest.max_selected_tokens(cfg) == need
    again = load_config(cfg.model_dump_json())
    assert again.model_dump() == cfg.model_dump()
    assert again == cfg
    assert again.extra_config == cfg.extra_config
    assert again.dense_layers == sorted(data["dense_layers"])
    # one token less of device buffer than the widest selection is rejected
    with pytest.raises(ConfigError, match=f"at least {need}"):
        load_config({**data, "device_buffer_tokens": need - 1})


@pytest.mark.parametrize("page_size", [3, 6, 24, 100])
def test_page_size_must_be_a_power_of_two(page_size):
    """page_size 3 used to be accepted; only powers of two are accepted (the sizes the kernels are tested with)."""
    with pytest.raises(ConfigError, match=rf"`page_size` = {page_size}: page_size must be a power of two"):
        load_config({"page_size": page_size, "top_k": 256})
    for ok in (1, 2, 4, 64):
        assert load_config({"page_size": ok, "top_k": 256}).page_size == ok
