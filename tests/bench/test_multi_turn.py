"""The multi-turn mode of `deltaserve bench serve`: the texts, the growing histories with the real answers, the
per-turn breakdown and the cached-token hit rate, against the fake server (a toy prefix cache reports
cached_tokens) and a server that fails."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from deltaserve.bench.metrics import RequestResult
from deltaserve.bench.multi_turn import (
    NOT_SENT_ERROR,
    MultiTurnOptions,
    TurnResult,
    sample_conversations,
    turn_breakdown,
)
from deltaserve.bench.serve_cli import parse_bench_args, run_bench
from deltaserve.bench.serve_record import summary

from .bench_helpers import WordTokenizer, serve_in_thread
from .fake_server import CHAT_BODIES, build_app

CHAT = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn"]
SYSTEM_LEN, USER_LEN, OUTPUT_LEN = 20, 5, 4
ANSWER_LEN = OUTPUT_LEN - 1  # the fake server's first chunk is the role chunk with an empty content


def mt_argv(url: str, num_clients: int, num_turns: int) -> list[str]:
    argv = ["--base-url", url, *CHAT, "--multi-turn-num-clients", str(num_clients)]
    argv += ["--multi-turn-turns", str(num_turns), "--multi-turn-system-len", str(SYSTEM_LEN)]
    argv += ["--multi-turn-user-len", str(USER_LEN), "--multi-turn-output-len", str(OUTPUT_LEN)]
    return argv + ["--temperature", "0", "--disable-tqdm", "--save-detailed", "--seed", "3"]


@pytest.fixture
def caching_server(word_model: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    app = build_app(word_model, ttft_ms=1.0, itl_ms=0.5, has_prefix_cache=True, is_answer_per_request=True)
    for url in serve_in_thread(app):
        yield url, app[CHAT_BODIES]


def test_conversations_are_seeded_exact_and_share_one_system_prompt(word_tokenizer: WordTokenizer) -> None:
    options = MultiTurnOptions(num_clients=3, num_turns=4, system_len=50, user_len=7, output_len=2)
    first = sample_conversations(word_tokenizer, options, seed=1)
    assert first == sample_conversations(word_tokenizer, options, seed=1)
    assert first != sample_conversations(word_tokenizer, options, seed=2)
    assert len(word_tokenizer.encode(first.system_prompt)) == 50
    assert [len(turns) for turns in first.user_messages] == [4, 4, 4]
    messages = [m for turns in first.user_messages for m in turns] + [first.warmup_message]
    assert all(len(word_tokenizer.encode(m)) == 7 for m in messages)
    assert len(set(messages)) == len(messages)
    special = set(word_tokenizer.all_special_ids)
    assert not special & set(word_tokenizer.encode(first.system_prompt + " " + " ".join(messages)))
    assert first.num_text_tokens == 50 + 12 * 7


def test_each_turn_resends_the_history_with_the_real_answers(
    patch_tokenizer: WordTokenizer, caching_server: tuple[str, list[dict[str, Any]]]
) -> None:
    url, bodies = caching_server
    num_clients, num_turns = 3, 3
    record = run_bench(parse_bench_args([*mt_argv(url, num_clients, num_turns), "--num-warmups", "1"]))
    assert record["completed"] == record["num_prompts"] == 9 and record["failed"] == 0
    assert len(bodies) == 1 + 9
    warmup, measured = bodies[0], bodies[1:]
    assert [m["role"] for m in warmup["messages"]] == ["user"]  # no system prompt: nothing for a cache to reuse

    system = {m["messages"][0]["content"] for m in measured}
    assert len(system) == 1 and len(patch_tokenizer.encode(system.pop())) == SYSTEM_LEN
    texts = record["generated_texts"]
    for body in measured:
        assert body["max_completion_tokens"] == OUTPUT_LEN and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    options = MultiTurnOptions(num_clients, num_turns, SYSTEM_LEN, USER_LEN, OUTPUT_LEN)
    conversations = sample_conversations(patch_tokenizer, options, seed=3)
    assert warmup["messages"][0]["content"] == conversations.warmup_message
    for client, users in enumerate(conversations.user_messages):
        # a client's bodies, in turn order: its first user message names the conversation
        mine = sorted(
            (b for b in measured if b["messages"][1]["content"] == users[0]), key=lambda b: len(b["messages"])
        )
        assert len(mine) == num_turns
        answers = texts[client * num_turns : (client + 1) * num_turns]
        for turn, body in enumerate(mine):
            roles = [m["role"] for m in body["messages"]]
            assert roles == ["system"] + ["user", "assistant"] * turn + ["user"]
            assert [m["content"] for m in body["messages"][1::2]] == users[: turn + 1]
            # every earlier answer, exactly as streamed, and the earlier turns' messages unchanged
            assert [m["content"] for m in body["messages"][2::2]] == answers[:turn]
            if turn:
                assert body["messages"][: len(mine[turn - 1]["messages"])] == mine[turn - 1]["messages"]
    assert len(set(texts)) == 9 and all(len(t.split()) == ANSWER_LEN for t in texts)

    # the server's prompt tokens: system + k user messages + (k - 1) answers, per client
    per_turn = [SYSTEM_LEN + USER_LEN * k + ANSWER_LEN * (k - 1) for k in range(1, num_turns + 1)]
    assert record["prompt_tokens_by_turn"] == [num_clients * n for n in per_turn]
    assert record["total_prompt_tokens_sent"] == record["total_input_tokens"] == num_clients * sum(per_turn)
    assert record["total_output_tokens"] == 9 * OUTPUT_LEN
    # the toy cache: a later turn hits exactly the previous turn's prompt (its answer was never a prompt)
    assert record["cached_tokens_by_turn"][1:] == [num_clients * n for n in per_turn[:-1]]
    assert record["num_requests_with_cached_tokens"] == 9 and record["num_empty_answers"] == 0
    assert record["prefix_cache_hit_rate"] == pytest.approx(
        record["total_cached_tokens"] / record["total_prompt_tokens_sent"]
    )
    assert len(record["median_ttft_ms_by_turn"]) == num_turns and all(t > 0 for t in record["median_ttft_ms_by_turn"])
    assert record["median_ttft_ms"] > 0 and record["median_tpot_ms"] > 0 and len(record["itls"][0]) == ANSWER_LEN
    assert record["multi_turn_num_clients"] == 3 and record["dataset_name"] == "multi-turn"
    assert "Median TTFT by turn (ms):" in summary(record) and "Prefix cache hit rate:" in summary(record)
    # the server's own counters (/metrics, summed over its engines) over the measured turns: the warm-up is left out
    assert record["server_prefix_cache_queries"] == record["total_prompt_tokens_sent"]
    assert record["server_prefix_cache_hits"] == record["total_cached_tokens"]
    assert record["server_prefix_cache_hit_rate"] == pytest.approx(record["prefix_cache_hit_rate"])
    assert "Server prefix cache hit rate:" in summary(record)


def test_without_cached_tokens_the_hit_rate_is_null(patch_tokenizer: WordTokenizer, fake_server: str) -> None:
    record = run_bench(parse_bench_args(mt_argv(fake_server, 2, 2)))
    assert record["completed"] == 4 and record["total_prompt_tokens_sent"] > 0
    assert record["total_cached_tokens"] is None and record["prefix_cache_hit_rate"] is None
    assert record["cached_tokens_by_turn"] == [None, None] and record["num_requests_with_cached_tokens"] == 0
    assert "Median TTFT by turn (ms):" in summary(record) and "hit rate" not in summary(record)
    # no /metrics with the counters: null, never a guessed 0
    assert record["server_prefix_cache_queries"] is None and record["server_prefix_cache_hit_rate"] is None


@pytest.fixture
def failing_server() -> Iterator[str]:
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no"}}, status=500)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    yield from serve_in_thread(app)


def test_a_failed_turn_ends_its_conversation(patch_tokenizer: WordTokenizer, failing_server: str) -> None:
    record = run_bench(parse_bench_args([*mt_argv(failing_server, 2, 3), "--model", "m", "--tokenizer", "t"]))
    assert record["completed"] == 0 and record["failed"] == 6
    assert [e == NOT_SENT_ERROR for e in record["errors"]] == [False, True, True] * 2
    assert record["median_ttft_ms_by_turn"] == [None, None, None]


def test_turn_breakdown_counts_a_response_without_details_as_no_hit() -> None:
    """Once a response of the run carried prompt_tokens_details, one without them hit nothing (vLLM and deltaserve
    leave them out at 0 cached tokens); with none carrying them, nothing is known."""

    def done(ttft: float, prompt: int, cached: int | None) -> RequestResult:
        return RequestResult(prompt_len=prompt, is_success=True, ttft=ttft, cached_tokens=cached)

    turns = [
        TurnResult(0, 0, done(0.4, 100, 0)),
        TurnResult(0, 1, done(0.1, 150, 100)),
        TurnResult(1, 0, done(0.2, 100, None)),
        TurnResult(1, 1, RequestResult(prompt_len=0, error="x")),
    ]
    breakdown = turn_breakdown(turns, 2)
    assert breakdown["median_ttft_ms_by_turn"] == pytest.approx([300.0, 100.0])
    assert breakdown["prompt_tokens_by_turn"] == [200, 150] and breakdown["total_prompt_tokens_sent"] == 350
    assert breakdown["cached_tokens_by_turn"] == [0, 100] and breakdown["total_cached_tokens"] == 100
    assert breakdown["num_requests_with_cached_tokens"] == 2
    assert breakdown["prefix_cache_hit_rate"] == pytest.approx(100 / 350)
    silent = turn_breakdown([TurnResult(0, 0, done(0.2, 100, None))], 1)
    assert silent["cached_tokens_by_turn"] == [None] and silent["prefix_cache_hit_rate"] is None


def test_flags_multi_turn_cannot_honour_are_refused(patch_tokenizer: WordTokenizer) -> None:
    base = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", "t"]
    with pytest.raises(ValueError, match="no --request-rate"):
        run_bench(parse_bench_args([*base, *CHAT, "--request-rate", "5"]))
    with pytest.raises(ValueError, match="needs --backend openai-chat"):
        run_bench(parse_bench_args([*base, "--dataset-name", "multi-turn"]))
    with pytest.raises(ValueError, match="turns must be at least 1"):
        run_bench(parse_bench_args([*base, *CHAT, "--multi-turn-turns", "0"]))


def test_against_deltaserves_api_with_prompt_tokens_details() -> None:
    """deltaserve's own chat surface (the FakeEngine behind the real app): the tiny chat template takes the system
    and assistant turns, ignore_eos makes every answer exact, and cached_tokens reaches the record."""
    from tests.api.fake_engine import FakeEngine, build_tokenizer
    from tests.api.server_thread import MODEL_NAME, serve

    tokenizer = build_tokenizer()
    engine = FakeEngine(tokenizer, step_delay=0.0)
    engine.num_cached_tokens = 6
    server = serve(engine, enable_prompt_tokens_details=True)
    try:
        argv = [*mt_argv(server.base_url, 2, 3), "--model", MODEL_NAME, "--tokenizer", "unused"]
        record = run_bench(parse_bench_args(argv), tokenizer=tokenizer)
    finally:
        server.stop()
    assert record["completed"] == 6 and record["failed"] == 0, record["errors"]
    assert record["total_output_tokens"] == 6 * OUTPUT_LEN
    assert record["cached_tokens_by_turn"] == [12, 12, 12] and record["total_cached_tokens"] == 36
    prompts = record["prompt_tokens_by_turn"]
    # the template's tokens on top of the texts; every later turn re-sends the earlier one and more
    assert prompts[0] > 2 * (SYSTEM_LEN + USER_LEN) and prompts[0] < prompts[1] < prompts[2]
    assert record["prefix_cache_hit_rate"] == pytest.approx(36 / sum(prompts))
    assert engine.last_params is not None and engine.last_params.ignore_eos
    last_prompt = tokenizer.decode(engine.last_prompt_ids)  # some client's third turn, with both its answers
    answers = record["generated_texts"]
    assert any(answers[3 * c] in last_prompt and answers[3 * c + 1] in last_prompt for c in range(2))


def test_the_stream_reads_cached_tokens_only_when_given() -> None:
    from deltaserve.bench.client import TimedStream

    def cached(details: object) -> int | None:
        result = RequestResult(prompt_len=1)
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": details}
        TimedStream(result, 0.0, is_chat=True).on_payload(json.dumps({"choices": [], "usage": usage}), 0.1)
        return result.cached_tokens

    assert cached(None) is None and cached({}) is None  # vLLM without --enable-prompt-tokens-details: null
    assert cached({"cached_tokens": 0}) == 0 and cached({"cached_tokens": 8}) == 8
