"""The streaming client: SSE parsing, vLLM's timing rules, prompt alignment, and the saved JSON's fields."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from deltaserve.bench.client import SamplingOptions, SSEBuffer, TimedStream, completion_payload
from deltaserve.bench.dataset import SampleRequest, align_with_server, sample_random
from deltaserve.bench.metrics import RequestResult
from deltaserve.bench.serve_cli import parse_bench_args, run_bench
from deltaserve.bench.serve_record import summary

from .bench_helpers import WordTokenizer, serve_in_thread
from .fake_server import build_app

VLLM_FIELDS = [
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
]


def test_sse_buffer_reassembles_events_and_skips_comments() -> None:
    sse = SSEBuffer()
    assert sse.feed(b': ping\n\ndata: {"a"') == []
    assert sse.feed(b": 1}\n\ndata: [DONE]\r\n\r\n") == ['{"a": 1}', "[DONE]"]
    assert sse.feed(b"data: tail") == [] and sse.flush() == ["tail"]


def test_timing_rules_first_choice_event_usage_does_not_move_latency() -> None:
    result = RequestResult(prompt_len=5)
    stream = TimedStream(result, start=10.0)
    stream.on_payload(json.dumps({"choices": [], "usage": None}), 10.05)  # no choices: not a token
    stream.on_payload(json.dumps({"choices": [{"text": ""}]}), 10.1)  # empty text still sets TTFT
    stream.on_payload(json.dumps({"choices": [{"text": "a b"}]}), 10.3)  # multi-token chunk: one ITL gap
    usage = {"prompt_tokens": 7, "completion_tokens": 3}
    stream.on_payload(json.dumps({"choices": [], "usage": usage}), 11.0)
    stream.on_payload("[DONE]", 11.5)
    stream.finish()
    assert result.is_success
    assert result.ttft == pytest.approx(0.1)
    assert result.itl == pytest.approx([0.2])
    assert result.latency == pytest.approx(0.3)  # the usage chunk and [DONE] do not extend E2EL
    assert result.output_tokens == 3 and result.prompt_len == 7


def test_no_choice_event_is_a_failure_and_error_events_raise() -> None:
    result = RequestResult(prompt_len=1)
    stream = TimedStream(result, 0.0)
    stream.on_payload("[DONE]", 1.0)
    stream.finish()
    assert not result.is_success and "TTFT" in result.error
    with pytest.raises(RuntimeError, match="boom"):
        TimedStream(RequestResult(1), 0.0).on_payload(json.dumps({"error": {"message": "boom"}}), 0.1)


def test_completion_payload_matches_vllm() -> None:
    payload = completion_payload("m", "p", 16, SamplingOptions(temperature=0.0, is_ignore_eos=True))
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 16 and payload["repetition_penalty"] == 1.0
    assert payload["temperature"] == 0.0 and payload["ignore_eos"] is True
    assert "top_p" not in completion_payload("m", "p", 1, SamplingOptions())


def test_bench_serve_end_to_end_against_a_fake_server(
    fake_server: str, word_model: Path, patch_tokenizer: WordTokenizer, tmp_path: Path
) -> None:
    argv = [
        "--base-url", fake_server, "--random-input-len", "24", "--random-output-len", "6",
        "--num-prompts", "12", "--max-concurrency", "3", "--num-warmups", "2", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--goodput", "ttft:5000", "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm",
    ]  # fmt: skip
    record = run_bench(parse_bench_args(argv))
    for name in VLLM_FIELDS:
        assert name in record, name
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in record
    assert record["completed"] == 12 and record["failed"] == 0 and record["failed_errors"] == {}
    assert record["num_distinct_generated_texts"] == 1  # the fake streams " t0 t1 ..." to every request
    assert record["model_id"] == str(word_model) and record["tokenizer_id"] == str(word_model)  # from /v1/models
    assert record["total_input_tokens"] == 12 * 24 and record["total_output_tokens"] == 12 * 6
    assert record["request_rate"] == "inf" and record["max_concurrency"] == 3
    assert 1 <= record["max_concurrent_requests"] <= 3
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    assert record["is_server_tokenize_aligned"] is True and record["ignore_eos"] is True
    assert record["median_tpot_ms"] > 0.5  # the fake server sleeps 1 ms between tokens
    assert "peak_gpu_memory_gib" in record and "ttfts" not in record  # arrays only with --save-detailed
    saved = list(tmp_path.glob("vllm-infqps-concurrency3-model-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["completed"] == 12
    assert "Serving Benchmark Result" in summary(record)


def test_request_rate_and_failed_requests_are_recorded(
    word_model: Path, patch_tokenizer: WordTokenizer, fake_server: str
) -> None:
    argv = ["--base-url", fake_server, "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "6"]
    argv += ["--request-rate", "200", "--burstiness", "0.5", "--endpoint", "/v1/nothing", "--disable-tqdm"]
    argv += ["--save-detailed"]
    record = run_bench(parse_bench_args(argv))
    assert record["completed"] == 0 and record["failed"] == 6 and record["request_rate"] == 200.0
    assert all("404" in error for error in record["errors"])
    # why they failed stays in the record without --save-detailed (the grid drops the per-request arrays)
    record = run_bench(parse_bench_args(argv[:-1]))
    assert "errors" not in record and list(record["failed_errors"].values()) == [6]
    assert "404" in next(iter(record["failed_errors"]))


@pytest.fixture
def merging_server(word_model: Path) -> Iterator[str]:
    """A server whose tokenizer swallows the word "t7" (as a real BPE would merge it away)."""
    app = build_app(word_model, has_tokenize=False)
    tokenizer = WordTokenizer(word_model)

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": [i for i in tokenizer.encode(body["prompt"]) if i != 7]})

    async def detokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": tokenizer.decode(body["tokens"])})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    yield from serve_in_thread(app)


def test_server_alignment_rewrites_prompts_through_detokenize(merging_server: str, word_model: Path) -> None:
    tokenizer = WordTokenizer(word_model)
    words = " ".join(f"t{i}" for i in range(1, 13))  # 12 tokens locally, 11 on the server
    requests = [SampleRequest(words, 12, 4, 12, "0"), SampleRequest("t20 t21 t22", 3, 4, 3, "1")]

    async def align() -> tuple[list[SampleRequest], bool]:
        async with aiohttp.ClientSession() as session:
            return await align_with_server(session, merging_server, "m", requests, tokenizer)

    aligned, is_aligned = asyncio.run(align())
    assert is_aligned
    assert aligned[1] == requests[1]  # already exact: untouched
    assert aligned[0].prompt != words and "t7 " not in aligned[0].prompt + " "
    assert aligned[0].prompt_len == 12 and aligned[0].token_mismatch == 0


def test_server_without_tokenize_keeps_local_prompts(word_model: Path) -> None:
    tokenizer = WordTokenizer(word_model)
    requests = sample_random(tokenizer, 2, input_len=8, output_len=2)

    async def align(url: str) -> tuple[list[SampleRequest], bool]:
        async with aiohttp.ClientSession() as session:
            return await align_with_server(session, url, "m", requests, tokenizer)

    for url in serve_in_thread(build_app(word_model, has_tokenize=False)):
        aligned, is_aligned = asyncio.run(align(url))
    assert not is_aligned and aligned == requests


@pytest.mark.parametrize("dataset", ["random", "prefix_repetition"])
def test_distinct_warmups_share_no_prompt_with_the_measured_requests(
    word_model: Path, patch_tokenizer: WordTokenizer, dataset: str
) -> None:
    """vLLM's client warms up with the first measured prompt, which a server with prefix caching then answers from
    its cache; --warmup-distinct draws the warm-up prompts apart (for prefix_repetition, apart prefixes too)."""
    from .fake_server import COMPLETION_BODIES

    argv = ["--dataset-name", dataset, "--num-prompts", "8", "--max-concurrency", "2", "--num-warmups", "2"]
    argv += ["--random-input-len", "24", "--random-output-len", "2", "--disable-tqdm", "--seed", "5"]
    argv += ["--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "8"]
    argv += ["--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "2"]
    for is_distinct in (False, True):
        app = build_app(word_model, ttft_ms=1.0, itl_ms=0.0)
        bodies = app[COMPLETION_BODIES]
        for base_url in serve_in_thread(app):
            record = run_bench(
                parse_bench_args(["--base-url", base_url, *argv, *(["--warmup-distinct"] * is_distinct)])
            )
        assert record["completed"] == 8 and record["warmup_distinct"] is is_distinct
        warm = [body["prompt"].split() for body in bodies[:2]]
        measured = [body["prompt"].split() for body in bodies[2:]]
        assert len(measured) == 8
        if not is_distinct:  # vLLM's behaviour: both warm-ups re-send the first measured prompt
            assert warm[0] == warm[1] and warm[0] in measured
            continue
        head = 16 if dataset == "prefix_repetition" else 8  # no measured prompt starts like a warm-up
        assert all(w[:head] != m[:head] for w in warm for m in measured), (warm, measured)
        assert all(len(w) == len(measured[0]) for w in warm)  # the same shapes as the measured requests


def test_the_warmup_seed_moves_and_stays_in_numpys_legacy_range() -> None:
    """prefix_repetition draws with numpy's RandomState, which takes seeds below 2**32 only."""
    from deltaserve.bench.dataset import warmup_seed

    for seed in (0, 5, 2**31, 2**32 - 1):
        moved = warmup_seed(seed)
        assert 0 <= moved < 2**32 and moved != seed
