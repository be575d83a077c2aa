"""/metrics has every metric vLLM 0.26 always exports (vllm/v1/metrics/loggers.py), with vLLM's types, fed from
engine.stats() and from each request's outputs (RequestOutput.num_cached_tokens and .metrics)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .fake_engine import FakeEngine

# name -> type, for every metric vLLM 0.26 registers without an opt-in (LoRA, spec decode, KV residency sampling,
# MFU and NaN counting are opt-in there). The 20 after the first 14 are the ones issue 15 found missing.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:num_requests_waiting_by_reason": "gauge", "vllm:engine_sleep_state": "gauge",
    "vllm:cache_config_info": "gauge", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter", "vllm:external_prefix_cache_hits": "counter",
    "vllm:mm_cache_queries": "counter", "vllm:mm_cache_hits": "counter", "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter", "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram", "vllm:request_num_preemptions": "histogram",
}  # fmt: skip


def scrape(http: httpx.Client) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """family name -> {(sample name, sorted labels): value}."""
    families = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = {"type": family.type, "samples": samples}
    return families


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    base = {"model_name": "fake-qwen", "engine": "0", **labels}
    return families[family]["samples"][(sample, tuple(sorted(base.items())))]


def test_every_vllm_metric_is_exported(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    families = scrape(http)
    # prometheus_client names counters without their _total suffix.
    names = {name.removesuffix("_total") if info["type"] == "counter" else name: info["type"]
             for name, info in families.items()}  # fmt: skip
    for name, kind in VLLM_METRICS.items():
        key = name if kind != "counter" else name
        assert names.get(key) == kind, (name, names.get(key))
    assert len(VLLM_METRICS) == 34


def test_engine_stats_series(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.iteration_tokens.clear()
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    families = scrape(http)
    steps = list(fake_engine.iteration_tokens)
    name = "vllm:iteration_tokens_total"
    assert value(families, name, name + "_count") == len(steps) and value(families, name, name + "_sum") == sum(steps)
    assert value(families, name, name + "_bucket", le="1.0") == sum(1 for tokens in steps if tokens <= 1)
    reason = "vllm:num_requests_waiting_by_reason"
    assert value(families, reason, reason, reason="capacity") == 1
    assert value(families, reason, reason, reason="deferred") == 2
    sleep = "vllm:engine_sleep_state"
    assert value(families, sleep, sleep, sleep_state="awake") == 1
    info = families["vllm:cache_config_info"]["samples"]
    ((_, labels),) = info
    assert dict(labels)["block_size"] == "16" and dict(labels)["num_gpu_blocks"] == str(fake_engine.num_total_kv_blocks)


PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
          "vllm:request_inference_time_seconds", "vllm:request_num_preemptions")  # fmt: skip


def phase_counts(http: httpx.Client) -> dict[str, float]:
    families = scrape(http)
    return {name: value(families, name, name + "_count") for name in PHASES}


def test_phase_histograms_come_from_engine_timestamps(http: httpx.Client, fake_engine: FakeEngine) -> None:
    before = phase_counts(http)
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert phase_counts(http) == before  # no RequestOutput.metrics: nothing observed
    fake_engine.is_reporting_metrics = True
    fake_engine.num_preemptions = 3
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    after = phase_counts(http)
    assert all(after[name] == before[name] + 1 for name in PHASES)
    families = scrape(http)
    preempt = "vllm:request_num_preemptions"
    assert value(families, preempt, preempt + "_sum") >= 3
    queue = "vllm:request_queue_time_seconds"
    assert 0 < value(families, queue, queue + "_sum") < 60


def test_prefix_cache_and_prompt_sources(http: httpx.Client, fake_engine: FakeEngine) -> None:
    num_prompt = len(fake_engine.tokenizer.encode("Hello there friend"))
    fake_engine.num_cached_tokens = 2
    before = scrape(http)
    http.post("/v1/completions", json={"prompt": "Hello there friend", "max_tokens": 2})
    after = scrape(http)

    def delta(family: str, sample: str, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == num_prompt
    assert delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 2
    assert delta("vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total") == 2
    source = "vllm:prompt_tokens_by_source"
    assert delta(source, source + "_total", source="local_cache_hit") == 2
    assert delta(source, source + "_total", source="local_compute") == num_prompt - 2
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert delta(computed, computed + "_sum") == num_prompt - 2
    tpot = "vllm:request_time_per_output_token_seconds"
    assert delta(tpot, tpot + "_count") == 1


def test_request_success_has_every_vllm_finish_reason(http: httpx.Client) -> None:
    """vLLM creates vllm:request_success_total for each FinishReason (stop, length, abort, error, repetition)."""
    success = "vllm:request_success"
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(scrape(http), success, success + "_total", finished_reason=reason) >= 0


def test_process_and_python_families_are_exported(http: httpx.Client) -> None:
    """vLLM's /metrics is prometheus_client's default registry: process_*, python_gc_* and python_info with it."""
    families = scrape(http)
    assert families["process_resident_memory_bytes"]["type"] == "gauge"
    assert families["process_cpu_seconds"]["type"] == "counter"
    assert families["python_gc_collections"]["type"] == "counter"
    assert families["python_info"]["type"] == "gauge"


def test_time_per_output_token_counts_one_token_requests(http: httpx.Client) -> None:
    """vLLM observes mean_time_per_output_token for every finished request, 0 when it made one token."""
    tpot = "vllm:request_time_per_output_token_seconds"
    before = scrape(http)
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    after = scrape(http)
    assert value(after, tpot, tpot + "_count") - value(before, tpot, tpot + "_count") == 1
    assert value(after, tpot, tpot + "_sum") == value(before, tpot, tpot + "_sum")
