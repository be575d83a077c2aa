"""Issue 38's details where deltaserve differed from vLLM 0.26, most on the real engine (tiny dense checkpoint, one
server for the module).

/metrics as Prometheus reads it: prometheus_client's own text parser takes every family, every histogram is a valid
one (cumulative buckets, +Inf bucket equal to _count), and vllm:iteration_tokens_total counts what vLLM counts (a
request's prompt once with its first token, then every generated token: P + G per request, one observation per step
that produced tokens); vllm:cache_config_info carries vLLM's labels. Then the request fields: best_of is ignored with
vLLM's warning (vLLM removed it, PR #29090), continuous usage counts each chunk's own choice, a named tool_choice
finishes with "stop", an echoed prompt's first top_logprobs entry is null; and the serve flags whose absence a user
notices (speculative decoding among them) are logged as warnings, and --host binds every interface by default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from deltaserve.api import cli
from deltaserve.api.compat import check_compat
from deltaserve.api.server import _listen_address
from deltaserve.api.settings import ServerSettings
from deltaserve.engine_config import EngineConfig

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve
from .test_api_chat import TOOL_OUTPUT, TOOLS, USER
from .test_api_flags import parse

NAME = "tiny"
ITERATION = "vllm:iteration_tokens_total"
# vLLM 0.26's CacheConfig.metrics_info labels that a dashboard reads, and the engine index vLLM adds
CACHE_CONFIG_LABELS = {"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "kv_cache_memory_bytes", "num_cpu_blocks", "num_gpu_blocks", "kv_cache_size_tokens",
                       "kv_cache_max_concurrency", "engine"}  # fmt: skip
KV_CACHE_BYTES = 64 * 2**20  # the server's --kv-cache-memory-bytes: the cache_config_info label carries it


@pytest.fixture(scope="module")
def metrics_http(tiny_dense: Path) -> Iterator[httpx.Client]:
    from deltaserve.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES)
    engine = AsyncEngine.from_config(config)
    server: ServerThread = serve(engine, model_root=str(tiny_dense), served_model_names=[NAME])
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    server.stop()


def histograms(text: str) -> dict[str, list[Sample]]:
    """Every histogram family of the exposition, parsed by prometheus_client."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)
            if family.type == "histogram"}  # fmt: skip


def check_histogram(name: str, samples: list[Sample]) -> tuple[float, float]:
    """Asserts every series of a histogram family valid (buckets rise with le and end at +Inf == _count); returns
    (count, sum) over its series. The vllm:* families have one series each; http_request_duration_seconds has one
    per handler and method."""
    series: dict[tuple[tuple[str, str], ...], list[Sample]] = {}
    for sample in samples:
        series.setdefault(tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le")), []).append(sample)
    assert series, name
    count_all = total_all = 0.0
    for labels, group in series.items():
        buckets = sorted((float(s.labels["le"]), s.value) for s in group if s.name == name + "_bucket")
        (count,) = [s.value for s in group if s.name == name + "_count"]
        (total,) = [s.value for s in group if s.name == name + "_sum"]
        assert buckets and buckets[-1][0] == float("inf"), (name, labels)
        values = [value for _, value in buckets]
        assert values == sorted(values), (name, labels, "buckets are not cumulative", buckets)
        assert values[-1] == count, (name, labels, "+Inf bucket != _count", values[-1], count)
        assert total >= 0, (name, labels)
        count_all, total_all = count_all + count, total_all + total
    return count_all, total_all


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
    assert sample.labels["kv_cache_memory_bytes"] == str(KV_CACHE_BYTES)  # vLLM's str() of the field, "None" unset
    # vLLM's test_metrics_exist: the capacity labels carry numbers (tokens the blocks hold; requests of
    # max_model_len that fit at once)
    num_blocks, block_size = int(sample.labels["num_gpu_blocks"]), int(sample.labels["block_size"])
    assert int(sample.labels["kv_cache_size_tokens"]) == num_blocks * block_size
    max_model_len = metrics_http.get("/v1/models").json()["data"][0]["max_model_len"]
    blocks_per_request = -(-max_model_len // block_size)
    assert float(sample.labels["kv_cache_max_concurrency"]) == pytest.approx(num_blocks / blocks_per_request)


def test_best_of_is_ignored_with_vllms_warning(metrics_http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for n in (1, 2):
        body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "best_of": 3, "n": n}
        response = metrics_http.post("/v1/completions", json=body)
        assert response.status_code == 200 and len(response.json()["choices"]) == n
    warning = "The following fields were present in the request but ignored: {'best_of'}"
    assert any(r.getMessage() == warning and r.levelname == "WARNING" for r in caplog.records)


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_counts_each_choice(metrics_http: httpx.Client, route: str) -> None:
    body: dict[str, Any] = {"model": NAME, "n": 2, "max_tokens": 4, "ignore_eos": True, "seed": 1, "stream": True,
                            "return_token_ids": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    body |= {"prompt": "Once upon a time"} if route == "/v1/completions" else {"messages": USER}
    chunks = sse_chunks(metrics_http.post(route, json=body))
    num_prompt = chunks[-1]["usage"]["prompt_tokens"]
    counts = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        counts[choice["index"]] += len(choice.get("token_ids") or [])
        expected = counts[choice["index"]]
        assert chunk["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": expected,
                                  "total_tokens": num_prompt + expected}, chunk  # fmt: skip
    assert counts == {0: 4, 1: 4} and chunks[-1]["usage"]["completion_tokens"] == 8


def test_echoed_prompts_first_top_logprobs_is_null(metrics_http: httpx.Client) -> None:
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 2, "echo": True, "logprobs": 1}
    for stream in (False, True):
        response = metrics_http.post("/v1/completions", json=body | {"stream": stream})
        if stream:
            logprobs = sse_chunks(response)[0]["choices"][0]["logprobs"]
        else:
            logprobs = response.json()["choices"][0]["logprobs"]
        assert logprobs["top_logprobs"][0] is None and logprobs["token_logprobs"][0] is None, logprobs
        assert all(isinstance(top, dict) and top for top in logprobs["top_logprobs"][1:])


def test_named_tool_choice_finishes_with_stop(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, expected in ((named, "stop"), ("auto", "tool_calls")):
        fake_engine.scripts.append([TOOL_OUTPUT])
        completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS,
                                                    tool_choice=tool_choice)  # fmt: skip
        (choice,) = completion.choices
        assert choice.message.tool_calls[0].function.name == "get_weather" and choice.finish_reason == expected
        fake_engine.scripts.append([TOOL_OUTPUT])
        stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS,
                                                tool_choice=tool_choice, stream=True)  # fmt: skip
        reasons = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
        assert reasons[-1] == expected and reasons.count(expected) == 1


def test_visible_features_are_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    check_compat(parse("m", "--enable-sleep-mode", "--enable-prompt-embeds", "--enable-return-routed-experts",
                       "--stream-interval", "4", "--enable-dbo", "--enable-prefix-caching"))  # fmt: skip
    levels = {record.getMessage().split(":")[0]: record.levelname for record in caplog.records}
    for flag in ("--enable-sleep-mode", "--enable-prompt-embeds", "--enable-return-routed-experts"):
        (level,) = [level for message, level in levels.items() if f" {flag}" in message]
        assert level == "WARNING", (flag, levels)
    assert levels["ignoring --enable-dbo"] == "INFO"
    # the prefix cache (issue 36) and the stream interval are implemented: their flags are the engine's own, neither
    # warned about nor ignored
    assert not [message for message in levels if "--enable-prefix-caching" in message or "--stream-interval" in message]


def test_vllms_speculative_shorthand_sets_the_speculative_config(caplog: pytest.LogCaptureFixture) -> None:
    """`--spec-method mtp --spec-tokens 3` (vLLM's aliases of three --speculative-config keys) serves MTP with k = 3,
    merged with --speculative-config's other keys; a key set both ways, a draft model or another method is refused
    by name (exit 2 before anything loads), and none of the three is warned about as unread."""
    caplog.set_level(logging.INFO)
    args = parse("m", "--spec-method", "mtp", "--spec-tokens", "3")
    check_compat(args)
    assert not [r for r in caplog.records if "--spec-" in r.getMessage()]
    spec = cli.build_engine_config(args, "m", "cpu").speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 3)
    rates = '{"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.8]}'
    args = parse("m", "--speculative-config", rates, "--spec-method", "qwen3_5_mtp", "--spec-tokens", "2")
    spec = cli.build_engine_config(args, "m", "cpu").speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.rejection_sample_method) == ("mtp", 2, "synthetic")
    assert spec.synthetic_acceptance_rates == (0.9, 0.8)
    assert cli.build_engine_config(parse("m"), "m", "cpu").speculative_config is None
    refusals = {
        ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}', "--spec-tokens", "2"): "exclusive",
        ("--spec-method", "mtp", "--spec-model", "some/draft", "--spec-tokens", "3"): "`model`",
        ("--spec-method", "eagle", "--spec-tokens", "3"): "'eagle'",
        # without a method and no --spec-method to complete it: refused once the flags are merged
        ("--speculative-config", '{"num_speculative_tokens": 3}'): "no `method`",
    }
    for argv, message in refusals.items():
        args = parse("m", *argv)
        with pytest.raises(ValueError, match=message):
            cli.build_engine_config(args, "m", "cpu")
        caplog.clear()
        assert cli.run(parse("m", *argv)) == 2
        assert any(message.strip("`'") in record.getMessage() for record in caplog.records), caplog.text


def test_host_defaults_to_every_interface_as_vllm() -> None:
    assert parse("m").host is None  # vLLM's default: bind every interface
    assert cli.uvicorn_config_options(parse("m"))["host"] == "0.0.0.0"
    assert cli.build_settings(parse("m"), "m").host == "0.0.0.0"
    assert cli.uvicorn_config_options(parse("m", "--host", "127.0.0.1"))["host"] == "127.0.0.1"
    # the ready line's address when no uvicorn server was handed over; IPv6 in brackets, as vLLM writes it
    settings = ServerSettings(model_root="m", served_model_names=["m"], host="::1", port=5)
    assert _listen_address(None, settings) == "http://[::1]:5"
