"""The offline LLM.get_metrics (vLLM's snapshot of Counter / Gauge / Histogram / Vector records), on the trained tiny
dense checkpoint (fp32, CPU, greedy, a few tokens).

Off by default with vLLM's AssertionError; with LLM(disable_log_stats=False) the series have vLLM's names, types and
labels, and a generate moves each by what its outputs say (prompt and generated tokens, finished requests by reason,
prefix-cache queries and hits, the per-step token histogram); the gauges are read live (enqueued requests wait); the
spec-decode series exist only when speculating.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.engine.metrics_snapshot import Counter, Gauge, Histogram, Metric, Vector
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir

MODEL = trained_model_dir("dense")
SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + 5) % 900 for i in range(70)]}, "Once upon a time"]  # the first spans blocks


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, disable_log_stats=False, **SETTINGS)


def by_key(metrics: list[Metric]) -> dict[tuple[str, tuple], Metric]:
    """Each series by (name, its labels other than model_name and engine)."""
    out = {}
    for metric in metrics:
        assert metric.labels["model_name"] == str(MODEL) and metric.labels["engine"] == "0"
        extra = tuple(sorted((k, v) for k, v in metric.labels.items() if k not in ("model_name", "engine")))
        assert (metric.name, extra) not in out
        out[(metric.name, extra)] = metric
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))].value


def test_disabled_by_default() -> None:
    llm = LLM(MODEL, **SETTINGS)
    with pytest.raises(AssertionError, match="Stat logging disabled"):
        llm.get_metrics()


def test_names_and_types(llm: LLM) -> None:
    metrics = by_key(llm.get_metrics())
    counters = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                "vllm:num_preemptions", "vllm:prompt_tokens_cached")  # fmt: skip
    for name in counters:
        assert isinstance(metrics[(name, ())], Counter)
        assert isinstance(metrics[(name, ())].value, int)
    for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM's five, each from zero
        assert isinstance(metrics[("vllm:request_success", (("finished_reason", reason),))], Counter)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert isinstance(metrics[(name, ())], Gauge)
    histogram = metrics[("vllm:iteration_tokens_total", ())]
    assert isinstance(histogram, Histogram) and list(histogram.buckets)[-1] == "+Inf"
    assert histogram.buckets["+Inf"] == histogram.count
    assert not any(name.startswith("vllm:spec_decode") for name, _ in metrics)


def test_counts_move_with_a_generate(llm: LLM) -> None:
    before = by_key(llm.get_metrics())
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the same prompt: the prefix cache serves part of it
    after = by_key(llm.get_metrics())

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    outputs = first + again
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    assert num_generated == 12 and num_cached > 0
    assert moved("vllm:prompt_tokens") == num_prompt
    assert moved("vllm:generation_tokens") == num_generated
    assert moved("vllm:request_success", finished_reason="length") == 3
    assert moved("vllm:request_success", finished_reason="stop") == 0
    assert moved("vllm:prefix_cache_queries") == num_prompt  # every prompt token is looked up at admission
    assert moved("vllm:prefix_cache_hits") == num_cached
    assert moved("vllm:prompt_tokens_cached") == num_cached
    assert moved("vllm:prompt_tokens_by_source", source="local_cache_hit") == num_cached
    assert moved("vllm:prompt_tokens_by_source", source="local_compute") == num_prompt - num_cached
    assert moved("vllm:num_preemptions") == 0
    steps = after[("vllm:iteration_tokens_total", ())], before[("vllm:iteration_tokens_total", ())]
    assert steps[0].sum - steps[1].sum == num_prompt + num_generated  # vLLM's: P + G per request
    assert steps[0].count > steps[1].count
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0


def test_gauges_are_live(llm: LLM) -> None:
    llm.enqueue(PROMPTS, GREEDY, use_tqdm=False)
    waiting = by_key(llm.get_metrics())
    assert value(waiting, "vllm:num_requests_waiting") == 2
    assert value(waiting, "vllm:num_requests_running") == 0
    llm.wait_for_completion(use_tqdm=False)
    # the finished requests' blocks stay in the prefix cache, which counts them free, as vLLM does
    assert 0.0 <= value(by_key(llm.get_metrics()), "vllm:kv_cache_usage_perc") <= 1.0


def test_spec_decode_series(tmp_path: Path) -> None:
    k = 2
    llm = LLM(MODEL, disable_log_stats=False, speculative_config={"method": "mtp", "num_speculative_tokens": k},
              **SETTINGS)  # fmt: skip
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    metrics = by_key(llm.get_metrics())
    drafts = value(metrics, "vllm:spec_decode_num_drafts")
    draft_tokens = value(metrics, "vllm:spec_decode_num_draft_tokens")
    accepted = value(metrics, "vllm:spec_decode_num_accepted_tokens")
    per_pos = metrics[("vllm:spec_decode_num_accepted_tokens_per_pos", ())]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == k
    assert drafts > 0 and drafts <= draft_tokens <= k * drafts
    assert sum(per_pos.values) == accepted
    assert per_pos.values[0] >= per_pos.values[1]  # a position is accepted only after the one before it


def test_server_renders_the_same_engine_series(llm: LLM) -> None:
    """The server's /metrics collector renders the engine's series from the same records: every engine record of
    get_metrics() is a sample of the scrape with the same value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from deltaserve.api.metrics import EngineStatsCollector, generate_latest

    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(llm.engine, str(MODEL)))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    engine_names = {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                    "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:iteration_tokens_total"}  # fmt: skip
    checked = 0
    for metric in llm.get_metrics():
        if metric.name not in engine_names:
            continue
        labels = tuple(sorted(metric.labels.items()))
        if isinstance(metric, Histogram):
            assert samples[(metric.name + "_sum", labels)] == metric.sum
            assert samples[(metric.name + "_count", labels)] == metric.count
        else:
            suffix = "_total" if isinstance(metric, Counter) else ""
            assert samples[(metric.name + suffix, labels)] == metric.value
        checked += 1
    assert checked == len(engine_names)
