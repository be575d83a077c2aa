"""/metrics as Prometheus reads it, from the real engine on the tiny dense checkpoint: prometheus_client's own text
parser takes every family, every histogram is a valid one (cumulative buckets, +Inf bucket equal to _count), and
vllm:iteration_tokens_total counts what vLLM counts (a request's prompt once with its first token, then every
generated token: P + G per request, one observation per step that produced tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from deltaserve.engine_config import EngineConfig

from .server_thread import ServerThread, serve

NAME = "tiny"
ITERATION = "vllm:iteration_tokens_total"
# vLLM 0.26's CacheConfig.metrics_info labels that a dashboard reads, and the engine index vLLM adds
CACHE_CONFIG_LABELS = {"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_cpu_blocks", "num_gpu_blocks", "engine"}  # fmt: skip


@pytest.fixture(scope="module")
def metrics_http(tiny_dense: Path) -> Iterator[httpx.Client]:
    from deltaserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256))
    server: ServerThread = serve(engine, model_root=str(tiny_dense), served_model_names=[NAME])
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    server.stop()


def histograms(text: str) -> dict[str, list[Sample]]:
    """Every histogram family of the exposition, parsed by prometheus_client."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)
            if family.type == "histogram"}  # fmt: skip


def check_histogram(name: str, samples: list[Sample]) -> tuple[float, float]:
    """Asserts one valid histogram series (buckets rise with le and end at +Inf == _count); returns (count, sum)."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == name + "_bucket")
    (count,) = [s.value for s in samples if s.name == name + "_count"]
    (total,) = [s.value for s in samples if s.name == name + "_sum"]
    assert buckets and buckets[-1][0] == float("inf"), name
    values = [value for _, value in buckets]
    assert values == sorted(values), (name, "buckets are not cumulative", buckets)
    assert values[-1] == count, (name, "+Inf bucket != _count", values[-1], count)
    assert total >= 0, name
    return count, total


def test_every_histogram_is_valid_and_iteration_tokens_count_like_vllm(metrics_http: httpx.Client) -> None:
    before = histograms(metrics_http.get("/metrics").text)
    prompt = metrics_http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["count"]
    num_generated = 5
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": num_generated, "ignore_eos": True}
    assert metrics_http.post("/v1/completions", json=body).status_code == 200
    after = histograms(metrics_http.get("/metrics").text)
    assert len(after) >= 15, sorted(after)
    for name, samples in after.items():
        check_histogram(name, samples)
    count_before, sum_before = check_histogram(ITERATION, before[ITERATION])
    count_after, sum_after = check_histogram(ITERATION, after[ITERATION])
    # one step per generated token (the first one also carries the prompt), P + G tokens in all
    assert count_after - count_before == num_generated
    assert sum_after - sum_before == prompt + num_generated


def test_cache_config_info_has_vllms_labels(metrics_http: httpx.Client) -> None:
    families = {family.name: family for family in text_string_to_metric_families(metrics_http.get("/metrics").text)}
    (sample,) = families["vllm:cache_config_info"].samples
    assert set(sample.labels) >= CACHE_CONFIG_LABELS, sorted(sample.labels)
    assert sample.value == 1 and sample.labels["engine"] == "0" and sample.labels["num_cpu_blocks"] == "0"
    assert sample.labels["cache_dtype"] == "auto" and int(sample.labels["num_gpu_blocks"]) > 0
