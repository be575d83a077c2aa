"""The prefix cache's vLLM surface on the server: its flags, POST /reset_prefix_cache (dev mode only, as in vLLM),
`usage.prompt_tokens_details.cached_tokens` through the `openai` client, vllm:prefix_cache_queries / _hits on
/metrics and the periodic stats line with its hit rate.

The flag and route checks run against the FakeEngine; the cached-token and counter checks run a real engine (the
tiny dense checkpoint, its core in a process of its own) with the cache on, and one with --no-enable-prefix-caching.
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

from deltaserve.api import cli
from deltaserve.api.stat_logger import LoggingStatLogger, PrefixHitRate
from deltaserve.engine_config import EngineConfig

from .fake_engine import FakeEngine
from .server_thread import MODEL_NAME, ServerThread, metric_value, serve
from .test_api_flags import parse

# A system prompt of ~190 tokens (the tiny tokenizer's): long enough for the cache's 64-token checkpoint grid to cover
# most of it. Each test puts its own tag in front, so no test hits what another one cached.
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and cite rule {i}." for i in range(8))


# -- flags -------------------------------------------------------------------------------------------------


def test_the_cache_is_on_by_default_and_its_flags_reach_the_engine_config() -> None:
    config = cli.build_engine_config(parse("m"), "m", "cpu")
    assert config.enable_prefix_caching
    assert config.prefix_cache_checkpoint_interval == EngineConfig("m").prefix_cache_checkpoint_interval
    assert config.num_checkpoint_slots is None
    argv = ("m", "--no-enable-prefix-caching", "--prefix-cache-checkpoint-interval", "1024",
            "--num-checkpoint-slots", "6")  # fmt: skip
    config = cli.build_engine_config(parse(*argv), "m", "cpu")
    assert (config.enable_prefix_caching, config.prefix_cache_checkpoint_interval, config.num_checkpoint_slots) == (
        False, 1024, 6,
    )  # fmt: skip
    assert cli.build_engine_config(parse("m", "--enable-prefix-caching"), "m", "cpu").enable_prefix_caching
    # vLLM's YAML spelling
    assert not cli.build_engine_config(parse("m", "--enable_prefix_caching", "--no-enable_prefix_caching"), "m",
                                       "cpu").enable_prefix_caching  # fmt: skip
    with pytest.raises(ValueError, match="prefix_cache_checkpoint_interval"):
        cli.build_engine_config(parse("m", "--prefix-cache-checkpoint-interval", "-64"), "m", "cpu")


def test_the_hash_algo_takes_vllms_values_and_is_logged(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert parse("m", "--prefix-caching-hash-algo", algo).prefix_caching_hash_algo == algo
    with pytest.raises(SystemExit):
        parse("m", "--prefix-caching-hash-algo", "md5")
    assert "invalid choice: 'md5'" in capsys.readouterr().err
    caplog.set_level(logging.INFO)
    # a start that fails on another flag after the checks: the hash algo's line is logged before
    assert cli.run(parse("m", "--prefix-caching-hash-algo", "xxhash", "-tp", "0")) == 2
    assert any(r.getMessage().startswith("ignoring --prefix-caching-hash-algo xxhash") for r in caplog.records)


def test_dev_mode_and_log_stats_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = cli.build_settings(parse("m"), "m")
    assert not settings.server_dev_mode and not settings.disable_log_stats and settings.log_stats_interval_s == 10.0
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    settings = cli.build_settings(parse("m", "--disable-log-stats"), "m")
    assert settings.server_dev_mode and settings.disable_log_stats and settings.log_stats_interval_s == 2.5
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
        cli.build_settings(parse("m"), "m")


# -- the reset route (FakeEngine) ----------------------------------------------------------------------------


def test_reset_route_exists_only_in_dev_mode(http: httpx.Client, fake_engine: FakeEngine) -> None:
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 404 and response.json()["error"]["code"] == 404
    assert fake_engine.num_prefix_cache_resets == 0
    server = serve(fake_engine, server_dev_mode=True)
    try:
        before = fake_engine.num_prefix_cache_resets
        for query in ("", "?reset_running_requests=false&reset_external=true", "?reset_running_requests=true"):
            response = httpx.post(server.base_url + "/reset_prefix_cache" + query)
            assert (response.status_code, response.json()) == (200, {"success": True})  # vLLM 0.26's body
        assert fake_engine.num_prefix_cache_resets == before + 3
        fake_engine.is_prefix_cache_reset_whole = False
        try:
            assert httpx.post(server.base_url + "/reset_prefix_cache").json() == {"success": False}
        finally:
            fake_engine.is_prefix_cache_reset_whole = True
        response = httpx.post(server.base_url + "/reset_prefix_cache?reset_external=maybe")
        assert response.status_code == 400 and "reset_external" in response.json()["error"]["message"]
        assert httpx.get(server.base_url + "/reset_prefix_cache").status_code == 405
        for route in ("/reset_mm_cache", "/reset_encoder_cache"):  # nothing kept to drop: 200, as vLLM's
            assert (httpx.post(server.base_url + route).status_code, http.post(route).status_code) == (200, 404)
    finally:
        server.stop()


# -- the periodic stats line ----------------------------------------------------------------------------------


def test_hit_rate_window_keeps_about_the_last_thousand_requests() -> None:
    window = PrefixHitRate(max_recent_requests=1000)
    assert window.hit_rate == 0.0
    window.observe(600, 6000, 6000)  # all hits
    window.observe(0, 0, 0)  # an idle interval changes nothing
    window.observe(600, 6000, 0)  # all misses: 1,200 requests, the first interval is dropped
    assert window.hit_rate == 0.0
    window.observe(100, 1000, 1000)
    assert window.hit_rate == pytest.approx(1000 / 7000)
    window.reset()
    assert window.hit_rate == 0.0


def test_the_stats_line_reads_like_vllms(fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    from deltaserve.api.metrics import ServerMetrics

    metrics = ServerMetrics(fake_engine, MODEL_NAME, 512)
    stat_logger = LoggingStatLogger(fake_engine, metrics, 10.0)
    caplog.set_level(logging.DEBUG, logger="deltaserve.api.stat_logger")
    stat_logger.log()  # idle after idle: DEBUG
    assert caplog.records[-1].levelname == "DEBUG"
    metrics.track(100, 1, 8, 0.0)
    metrics.num_prompt_tokens_total += 100
    metrics.num_generation_tokens_total += 8
    fake_engine.prefix_cache_queries += 100
    fake_engine.prefix_cache_hits += 64
    stat_logger.log()
    record = caplog.records[-1]
    assert record.levelname == "INFO"
    message = record.getMessage()
    assert message.startswith("Engine 000: Avg prompt throughput: ")
    assert " tokens/s, Avg generation throughput: " in message
    # the FakeEngine reports 2 deferred waiting requests
    assert ", Running: 0 reqs, Waiting: 0 reqs, Deferred: 2 reqs, GPU KV cache usage: 0.0%, " in message
    assert message.endswith("Prefix cache hit rate: 64.0%")
    stat_logger.reset_prefix_hit_rate()
    stat_logger.log()  # the interval after a busy one still logs at INFO
    assert caplog.records[-1].levelname == "INFO"
    assert caplog.records[-1].getMessage().endswith("Prefix cache hit rate: 0.0%")


def test_the_server_logs_the_line_unless_disabled(fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    import time

    caplog.set_level(logging.DEBUG, logger="deltaserve.api.stat_logger")
    for is_disabled in (False, True):
        caplog.clear()
        server = serve(fake_engine, disable_log_stats=is_disabled, log_stats_interval_s=0.05)
        try:
            time.sleep(0.3)
        finally:
            server.stop()
        lines = [r for r in caplog.records if r.getMessage().startswith("Engine 000: ")]
        assert bool(lines) is not is_disabled


# -- a real engine: cached tokens, counters, reset -------------------------------------------------------------


def start_real(model: Path, **engine: Any) -> ServerThread:
    from deltaserve.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(model), device="cpu", max_model_len=512, max_num_seqs=4, **engine)
    return serve(AsyncEngine.from_config(config), enable_prompt_tokens_details=True, server_dev_mode=True,
                 disable_log_stats=True)  # fmt: skip


@pytest.fixture(scope="module")
def cached_server(tiny_dense: Path) -> Iterator[ServerThread]:
    server = start_real(tiny_dense)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def uncached_server(tiny_dense: Path) -> Iterator[ServerThread]:
    server = start_real(tiny_dense, enable_prefix_caching=False)
    yield server
    server.stop()


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def counters(server: ServerThread) -> tuple[float, float]:
    text = httpx.get(server.base_url + "/metrics").text
    return metric_value(text, "vllm:prefix_cache_queries_total"), metric_value(text, "vllm:prefix_cache_hits_total")


def cached_tokens(usage: Any) -> int:
    """usage.prompt_tokens_details.cached_tokens, there on every reply under --enable-prompt-tokens-details (0 when
    nothing was cached, as vLLM reports it)."""
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens


def chat(client: openai.OpenAI, tag: str, stream: bool) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one greedy chat request with the tagged system prompt."""
    messages = [{"role": "system", "content": f"[{tag}] {SYSTEM}"}, {"role": "user", "content": "Which rule?"}]
    options: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0}
    if not stream:
        usage = client.chat.completions.create(**options).usage
    else:
        chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    return usage.prompt_tokens, cached_tokens(usage)


def completion(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[int, int]:
    options: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    if not stream:
        usage = client.completions.create(**options).usage
    else:
        chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    return usage.prompt_tokens, cached_tokens(usage)


@pytest.mark.parametrize("stream", [False, True])
def test_a_longer_completion_prompt_hits_the_shorter_ones_checkpoint(cached_server: ServerThread, stream: bool) -> None:
    """The second request of a shared prefix: its cached tokens in usage, and the counters on /metrics."""
    client = openai_client(cached_server)
    head = f"[completion stream={stream}] {SYSTEM}"
    queries, hits = counters(cached_server)
    num_head, first = completion(client, head, stream)
    assert first == 0  # nothing cached shares this prompt's head yet
    assert counters(cached_server) == (queries + num_head, hits)
    num_longer, cached = completion(client, head + " And one more sentence to go past the end.", stream)
    assert num_longer > num_head and cached > 0
    # a state checkpoint inside the shared head (the shorter prompt's end, or its 64-token grid below it), never
    # into the new tail
    assert 0 < (num_head - 1) // 64 * 64 <= cached <= num_head
    assert counters(cached_server) == (queries + num_head + num_longer, hits + cached)


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_chat_prompt_reports_its_cached_tokens(cached_server: ServerThread, stream: bool) -> None:
    """The same chat request sent again: from its second sighting it hits the first one's repeat point, the deepest
    64-token grid position before the prompt's last token (which always runs), and every hit is counted on
    /metrics."""
    client = openai_client(cached_server)
    tag = f"chat stream={stream}"
    queries, hits = counters(cached_server)
    replies = [chat(client, tag, stream) for _ in range(3)]
    num_prompt = replies[0][0]
    assert {num for num, _ in replies} == {num_prompt}
    assert [cached for _, cached in replies] == [0] + [(num_prompt - 1) // 64 * 64] * 2
    assert counters(cached_server) == (queries + 3 * num_prompt, hits + 2 * replies[1][1])


def test_the_responses_api_reports_cached_input_tokens(cached_server: ServerThread) -> None:
    client = openai_client(cached_server)
    options: dict[str, Any] = {"model": MODEL_NAME, "instructions": f"[responses] {SYSTEM}", "input": "Which rule?",
                               "max_output_tokens": 2, "temperature": 0.0}  # fmt: skip
    usages = [client.responses.create(**options).usage for _ in range(3)]
    assert all(usage is not None for usage in usages)
    cached = [usage.input_tokens_details.cached_tokens for usage in usages]  # type: ignore[union-attr]
    assert cached[0] == 0  # vLLM reports the 0 here too
    assert cached[1] == cached[2] == (usages[0].input_tokens - 1) // 64 * 64 > 0  # type: ignore[union-attr]


def test_cache_salt_keeps_prefixes_apart(cached_server: ServerThread) -> None:
    """vLLM's per-request `cache_salt`: the same chat request hits only what a request of the same salt cached (the
    repeat point from its second sighting), never an unsalted or otherwise salted request's; the same through the
    Responses API (a salt it dropped would let the second salt hit the first one's checkpoints)."""
    client = openai_client(cached_server)
    messages = [{"role": "system", "content": f"[salt] {SYSTEM}"}, {"role": "user", "content": "Which rule?"}]
    options: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0}

    def cached(salt: str | None) -> int:
        extra = {"extra_body": {"cache_salt": salt}} if salt is not None else {}
        return cached_tokens(client.chat.completions.create(**options, **extra).usage)

    assert cached("tenant-a") == 0
    repeat = cached("tenant-a")
    assert repeat > 0  # its own salt: the repeat point
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, and none: nothing shared
    assert cached("tenant-b") == repeat and cached(None) == repeat  # each from its own second sighting
    request = {"model": MODEL_NAME, "instructions": f"[salt] {SYSTEM}", "input": "Which rule?",
               "max_output_tokens": 2, "temperature": 0.0}  # fmt: skip
    usages = [client.responses.create(**request, extra_body={"cache_salt": salt}).usage for salt in "ccd"]
    hits = [usage.input_tokens_details.cached_tokens for usage in usages]  # type: ignore[union-attr]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0


def test_a_reset_makes_the_next_shared_prefix_request_miss(cached_server: ServerThread) -> None:
    client = openai_client(cached_server)
    head = f"[reset] {SYSTEM}"
    longer = head + " And one more sentence to go past the end."
    completion(client, head, stream=False)
    response = httpx.post(cached_server.base_url + "/reset_prefix_cache")
    assert (response.status_code, response.json()) == (200, {"success": True})  # nothing running held an entry
    assert completion(client, longer, stream=False)[1] == 0  # would hit without the reset (the test above)
    completion(client, head, stream=False)
    assert completion(client, longer, stream=False)[1] > 0  # cached again from the requests after it


def test_the_cache_config_gauge_says_it_is_on(cached_server: ServerThread, uncached_server: ServerThread) -> None:
    for server, expected in ((cached_server, "True"), (uncached_server, "False")):
        text = httpx.get(server.base_url + "/metrics").text
        line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
        assert f'enable_prefix_caching="{expected}"' in line


def test_with_the_cache_off_nothing_is_cached_or_counted(uncached_server: ServerThread) -> None:
    client = openai_client(uncached_server)
    before = counters(uncached_server)
    for stream in (False, True):
        for _ in range(2):
            # vLLM's test_single_completion: details on and the cache off, cached_tokens is 0
            assert chat(client, "off", stream)[1] == 0
            assert completion(client, SYSTEM, stream)[1] == 0
    assert counters(uncached_server) == before == (0.0, 0.0)


def test_created_cache_tokens_are_the_prompt_tokens_the_prefill_left_cached(
    cached_server: ServerThread, uncached_server: ServerThread
) -> None:
    """vLLM's usage.prompt_tokens_details.created_cache_tokens (chat): the prompt tokens past the hits that the
    request's prefill left in the cache. The first sighting saves its prompt end (all of it); the repeat hits the
    repeat point and finds the end saved (the rest). With the cache off nothing is created. Streamed, the final usage
    chunk carries the same (its null multimodal_tokens left out, as vLLM's exclude_none)."""
    messages = [{"role": "system", "content": f"[created] {SYSTEM}"}, {"role": "user", "content": "Which rule?"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0}

    def details(server: ServerThread, stream: bool) -> tuple[int, dict[str, Any]]:
        url = server.base_url + "/v1/chat/completions"
        if not stream:
            usage = httpx.post(url, json=body, timeout=60).json()["usage"]
        else:
            extra = {"stream": True, "stream_options": {"include_usage": True}}
            lines = httpx.post(url, json={**body, **extra}, timeout=60).text.split("\n\n")
            usage = json.loads([line for line in lines if line.startswith("data: {")][-1][len("data: ") :])["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]

    num_prompt, first = details(cached_server, stream=False)
    assert first == {"cached_tokens": 0, "created_cache_tokens": num_prompt, "multimodal_tokens": None}
    num_prompt, second = details(cached_server, stream=True)
    hit = (num_prompt - 1) // 64 * 64
    assert second == {"cached_tokens": hit, "created_cache_tokens": num_prompt - hit}
    assert details(uncached_server, stream=False)[1] == {
        "cached_tokens": 0, "created_cache_tokens": 0, "multimodal_tokens": None,
    }  # fmt: skip
