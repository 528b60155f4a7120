"""serve/metrics.py: what `/metrics` exposes, read with Prometheus's own text parser from a
real server process (the reference model, prefix caching on): the request gauges, the
preemption and step totals, the prefix cache's hit tokens, the device buffer's hit rate and
the TTFT / TPOT histograms, each with values that follow from the requests sent."""

from __future__ import annotations

import json
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_server import HIERARCHICAL_CONFIG, reference_server

from sparse_framework.serve.loop import STATS_INTERVAL_S

PREFIX = "sparse_framework"


def scrape(url: str) -> dict[str, list]:  # family name -> its samples
    text = httpx.get(url + "/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list], name: str, suffix: str = "") -> float:
    (sample,) = [s for s in families[f"{PREFIX}_{name}"] if s.name == f"{PREFIX}_{name}{suffix}"]
    return sample.value


def test_metrics_expose_the_gauges_totals_and_latency_histograms() -> None:
    server = reference_server("--max-num-seqs", "4", "--enable-prefix-caching", "--config",
                              json.dumps(HIERARCHICAL_CONFIG))
    try:
        client = server.client()
        rng = random.Random(1)
        shared = [rng.randrange(1, 500) for _ in range(200)]  # a prefix of whole pages, sent twice
        # the third decodes sparsely (the request's `sparse` field): the store's buffer is looked up
        prompts = [shared + [7, 8, 9], shared + [10, 11], [rng.randrange(1, 500) for _ in range(480)]]
        for prompt in prompts:  # one after the other: the second finds the first's prefix cached
            client.completions.create(model="reference", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"sparse": len(prompt) > 400})
        time.sleep(STATS_INTERVAL_S + 0.5)  # the idle loop refreshes the store's counters
        m = server.wait_metrics(lambda m: m[f"{PREFIX}_requests_running"] == 0)
        families = scrape(server.url)
    finally:
        assert server.stop() == 0
    for gauge in ("requests_running", "requests_waiting", "requests_preempted"):
        assert value(families, gauge) == 0.0
    assert value(families, "preemptions", "_total") == 0.0
    assert value(families, "engine_steps", "_total") >= len(prompts) * 6
    assert value(families, "engine_ready") == 1.0
    (info,) = families[f"{PREFIX}_sparse_config_info"]  # the config as resolved: "auto" named
    assert info.value == 1.0 and info.labels["backend"] == "torch_ref" and info.labels["store"] == "hierarchical"
    assert value(families, "prefix_cache_hit_tokens", "_total") >= 192  # the shared pages of the second prompt
    assert value(families, "prefix_cache_prompt_tokens", "_total") >= sum(len(p) for p in prompts)
    rate = value(families, "device_buffer_hit_rate")
    assert 0.0 <= rate <= 1.0 and m[f"{PREFIX}_device_buffer_hits_total"] + m[f"{PREFIX}_device_buffer_misses_total"] > 0
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        samples = families[f"{PREFIX}_{hist}"]
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
        assert counts == sorted(counts), f"{hist}: buckets are cumulative"
        (count,) = [s.value for s in samples if s.name.endswith("_count")]
        (total,) = [s.value for s in samples if s.name.endswith("_sum")]
        assert counts[-1] == count == len(prompts) and total > 0
