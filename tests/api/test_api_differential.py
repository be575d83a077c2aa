"""Every new feature exact against itself switched off, end to end: two real servers on one trained tiny checkpoint,
driven by the `openai` client with the seeded request waves of tests/api/differential.py.

A: --no-enable-prefix-caching, no speculation. B: the prefix cache (a checkpoint every 64 tokens), MTP speculation
with async verify, a 64-token step budget (prefills chunk) and a KV pool of 44 blocks (four ~300-token prompts at once
overflow it: a prompt waits for room for all of it, and each wave's long answer outgrows the pool while it decodes,
so sequences are preempted; two answers that together outgrow it make that certain). Greedy answers (tokens, text,
finish and stop reasons, usage, logprobs within differential.LOGPROB_ATOL) must be equal; seeded sampling only
repeats itself on each server. Afterwards B's /metrics shows prefix-cache hits, drafts and preemptions, and every KV
block and state slot free again.

CI runs the MoE checkpoint with k = 2 over SEEDS, a smoke run: the soak is where the coverage is.
DELTASERVE_DIFF_SOAK=N runs seeds 0..N-1 on dense, MoE and Next with k = 2 and 3 instead
(docs/differential-testing.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from deltaserve.config import ModelConfig
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.cache import bytes_per_block, bytes_per_slot, verify_row_bytes
from deltaserve.tiny.trained import trained_model_dir

from . import differential
from .differential import Case, Record
from .server_thread import ServerThread, metric_value, serve

SOAK = int(os.environ.get("DELTASERVE_DIFF_SOAK", "0"))
SEEDS = list(range(SOAK)) if SOAK else [0, 1, 2]
CONFIGS = [(v, k) for v in ("dense", "moe", "next") for k in (2, 3)] if SOAK else [("moe", 2)]
# the soak's traffic is heavier: more and larger waves (more preemption), longer answers (more verify steps)
TRAFFIC = {"num_waves": 6, "wave_size": 8, "max_tokens": 50} if SOAK else {}
NUM_BLOCKS = 44  # B's KV pool: 704 tokens, one 640-token request fits, four ~300-token ones do not
MAX_NUM_SEQS = 4
NUM_CHECKPOINT_SLOTS = 4


@dataclass
class Pair:
    a: openai.OpenAI
    b: openai.OpenAI
    b_url: str
    tokenizer: object
    num_seeds_sent: int = 0
    has_overflowed: bool = False  # the overflow test ran (its preemption is certain; the waves' is likely)


def start(model: str, k: int, is_b: bool) -> ServerThread:
    """A (everything off) or B (cache, MTP k with async verify, chunked prefill, a small KV pool)."""
    options: dict = {"enable_prefix_caching": False}
    if is_b:
        config = ModelConfig.from_pretrained(model)
        # the pool's blocks come after the live and checkpoint slots and the verify scratch (<= max_num_seqs rows,
        # runner/cache.py verify_row_bytes): sized so about NUM_BLOCKS remain
        slots = MAX_NUM_SEQS + NUM_CHECKPOINT_SLOTS
        budget = (
            NUM_BLOCKS * bytes_per_block(config, 16, torch.float32, has_mtp=True)
            + slots * bytes_per_slot(config, torch.float32, has_mtp=True)
            + MAX_NUM_SEQS * verify_row_bytes(config, torch.float32, k)
        )
        speculative = {"method": "mtp", "num_speculative_tokens": k, "async_verify": True}
        options = {"max_num_batched_tokens": 64, "cpu_kv_cache_bytes": budget, "prefix_cache_checkpoint_interval": 64,
                   "num_checkpoint_slots": NUM_CHECKPOINT_SLOTS, "speculative_config": speculative}  # fmt: skip
    config = EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=640, max_num_seqs=MAX_NUM_SEQS,
                          **options)  # fmt: skip
    # vLLM's Qwen3.5 recipe: reasoning parser and auto tool choice; cached tokens reported in usage
    return serve(AsyncEngine.from_config(config, multiprocess=True), enable_prompt_tokens_details=True,
                 reasoning_parser="qwen3", tool_call_parser="qwen3_coder", enable_auto_tool_choice=True)  # fmt: skip


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{v}-k{k}" for v, k in CONFIGS])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    variant, k = request.param
    model = str(trained_model_dir(variant))
    a, b = start(model, k, is_b=False), start(model, k, is_b=True)
    clients = [openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=120) for s in (a, b)]
    try:
        yield Pair(clients[0], clients[1], b.base_url, AutoTokenizer.from_pretrained(model))
    finally:
        a.stop()
        b.stop()


def hit_failures(records: list[tuple[Case, Record]], is_b: bool) -> list[str]:
    """B reports cached tokens on a repeat of a prompt past the first 64-token checkpoint; A never reports any."""
    out = []
    for i, (case, record) in enumerate(records):
        prompt_tokens = ((record.response or {}).get("usage") or {}).get("prompt_tokens", 0)
        if not is_b and record.cached_tokens:
            out.append(f"#{i} {case.name}: A reports {record.cached_tokens} cached tokens")
        if is_b and case.must_hit and prompt_tokens > 64 and not record.cached_tokens:
            out.append(f"#{i} {case.name}: a repeat of {prompt_tokens} prompt tokens hit nothing")
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_answers_are_equal_with_the_cache_and_mtp_on_and_off(pair: Pair, seed: int) -> None:
    waves = differential.make_waves(seed, pair.tokenizer, **TRAFFIC)
    a, b = differential.send_waves(pair.a, waves), differential.send_waves(pair.b, waves)
    pair.num_seeds_sent += 1
    failures = [f"A {line}" for line in differential.self_checks(a) + hit_failures(a, is_b=False)]
    failures += [f"B {line}" for line in differential.self_checks(b) + hit_failures(b, is_b=True)]
    failures += differential.compare(a, b)
    assert not failures, f"seed {seed}: {len(failures)} failures:\n" + "\n".join(line[:600] for line in failures)


def test_two_answers_that_outgrow_bs_pool_preempt_one_and_still_answer_the_same(pair: Pair) -> None:
    """Preemption made certain (the waves preempt only when their long answer overlaps enough of the others, and one CI
    run saw none): two 280-token prompts with 200-token answers, 960 tokens, in B's pool of NUM_BLOCKS x 16 = 704."""
    before = metric_value(httpx.get(pair.b_url + "/metrics").text, "vllm:num_preemptions_total")
    waves = differential.overflow_waves(pair.tokenizer)
    a, b = differential.send_waves(pair.a, waves), differential.send_waves(pair.b, waves)
    failures = differential.self_checks(a) + differential.self_checks(b) + differential.compare(a, b)
    assert not failures, "\n".join(line[:600] for line in failures)
    after = metric_value(httpx.get(pair.b_url + "/metrics").text, "vllm:num_preemptions_total")
    pair.has_overflowed = True
    assert after > before, f"B preempted nothing ({before} -> {after}) with 960 tokens to hold in 704"


def test_after_the_traffic_b_counted_hits_drafts_and_preemptions_and_freed_everything(pair: Pair) -> None:
    """Runs after the seeds and the overflow (pytest keeps file order; run alone, it sends seed 0's waves and the
    overflow first): the counters B's traffic must have moved, and the pools."""
    if not pair.num_seeds_sent:
        differential.send_waves(pair.b, differential.make_waves(0, pair.tokenizer))
    if not pair.has_overflowed:
        differential.send_waves(pair.b, differential.overflow_waves(pair.tokenizer))
    names = ("vllm:prefix_cache_hits_total", "vllm:spec_decode_num_drafts_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_preemptions_total")  # fmt: skip
    deadline = time.monotonic() + 10
    while True:  # the last steps in flight and pending checkpoints settle a moment after the last answer
        text = httpx.get(pair.b_url + "/metrics").text
        free = [metric_value(text, f"deltaserve:num_free_{pool}") for pool in ("kv_blocks", "state_slots")]
        total = [metric_value(text, f"deltaserve:num_total_{pool}") for pool in ("kv_blocks", "state_slots")]
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert free == total, f"free {free} of {total} (KV blocks, state slots) after every request ended"
    assert all(metric_value(text, name) > 0 for name in names), {name: metric_value(text, name) for name in names}
    assert metric_value(text, "vllm:num_requests_running") == 0


def test_the_comparison_finds_a_changed_token_a_moved_logprob_and_a_missing_field() -> None:
    base = {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5, -1.0]}, "stop_reason": 13}]}
    tol = differential.LOGPROB_ATOL
    assert differential.diff(base, base) == []
    near = {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5 + tol / 2, -1.0]},
                         "stop_reason": 13}]}  # fmt: skip
    assert differential.diff(base, near) == []
    # a low rank moves with last-bit rounding of the unlikely logits around it; a larger move does not pass
    ranked = [{"7": {"logprob": -9.0, "rank": 300}}, {"7": {"logprob": -9.0, "rank": 298}}]
    assert differential.diff(ranked[0], ranked[1]) == []
    ranked[1]["7"]["rank"] = 297
    assert differential.diff(ranked[0], ranked[1]) == [".7.rank: 300 != 297"]
    far = {"choices": [{"token_ids": [1, 3], "logprobs": {"token_logprobs": [-0.5 - 2 * tol, -1.0]}}]}
    assert differential.diff(base, far) == [
        f".choices[0].logprobs.token_logprobs[0]: -0.5 != {-0.5 - 2 * tol!r}",
        ".choices[0].stop_reason: only in A",
        ".choices[0].token_ids[1]: 2 != 3",
    ]


def test_a_stream_folds_into_one_answer_per_choice() -> None:
    name, arguments = [{"index": 0, "function": {"name": "f"}}], [{"index": 0, "function": {"arguments": "{}"}}]
    chunks = [
        {"choices": [{"index": 1, "text": "b", "token_ids": [5], "finish_reason": None}]},
        {
            "choices": [
                {"index": 0, "delta": {"content": "x", "tool_calls": name}, "logprobs": {"content": [{"token": "x"}]}}
            ]
        },  # fmt: skip
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "y", "tool_calls": arguments},
                    "logprobs": {"content": [{"token": "y"}]},
                    "finish_reason": "stop",
                }
            ]
        },  # fmt: skip
        {"choices": [{"index": 1, "text": "c", "token_ids": [6], "finish_reason": "length"}], "usage": {"total": 3}},
    ]
    assert differential._fold_stream(chunks) == {
        "choices": [
            {
                "index": 0,
                "content": "xy",
                "tool_calls": {0: {"name": "f", "arguments": "{}"}},
                "logprobs": {"content": [{"token": "x"}, {"token": "y"}]},
                "finish_reason": "stop",
            },  # fmt: skip
            {"index": 1, "text": "bc", "token_ids": [5, 6], "finish_reason": "length"},
        ],
        "usage": {"total": 3},
    }
