"""`--dataset-name multi-turn`: N concurrent conversations that re-send their growing history, our own workload.

Each of `--multi-turn-num-clients` clients holds one conversation: a system prompt shared by every client (the same
text, `--multi-turn-system-len` tokens), then `--multi-turn-turns` user turns of `--multi-turn-user-len` tokens
each. Turn k is one streaming POST to /v1/chat/completions whose messages are the system prompt, every earlier user
message and the model's REAL earlier answers (the streamed `delta.content`, fed back verbatim), then the new user
message; so turn k+1 re-sends turn k's whole prompt and answer, the traffic a prefix cache serves. A client sends
its next turn as soon as the previous answer has arrived; the clients start together. `--multi-turn-output-len`
goes out as `max_completion_tokens` with `ignore_eos` (on unless --no-ignore-eos), so every answer has that length.
It needs `--backend openai-chat --endpoint /v1/chat/completions` and refuses a finite --request-rate (the pace is
the answers'); --max-concurrency, if given, caps the requests in flight; --num-prompts and the random-* flags do not
apply (the record's num_prompts is clients x turns). Example, against either engine:
`deltaserve bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name multi-turn
--multi-turn-num-clients 16 --multi-turn-turns 8 --multi-turn-system-len 2000 --multi-turn-user-len 200
--multi-turn-output-len 128 --temperature 0` (vLLM reports cached tokens with --enable-prompt-tokens-details).

Texts are drawn as the random dataset draws them (dataset.py): ids from the vocabulary minus the special ids,
decoded and re-encoded to the exact length with the local tokenizer, all from one `numpy.random.default_rng(seed)`:
the system prompt and each user message are independent random allowed ids (not the random dataset's consecutive
runs from a random offset: two offsets drawn alike would give two clients the same first message, a shared prefix
the workload does not mean to have).

Every turn is timed by the same client code (client.send_request) and enters the same metric code
(metrics.compute_metrics) as the other datasets. The record adds, per turn index, the median TTFT (turn 1 against
the later turns is what prefix caching moves), the prompt tokens the server counted (usage.prompt_tokens), and,
when the server returns `usage.prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details),
the cached tokens and the hit rate cached / prompt tokens; null where no response carried the field. Both vLLM and
deltaserve leave the details out of a response whose prompt hit nothing, so once any response of the run carried
them, a response without them counts as 0 cached tokens.

A conversation whose turn fails stops there (its next turn would need the missing answer): its unsent turns are
recorded as failed requests, so `completed + failed` is always clients x turns. Only `delta.content` is fed back,
as a chat client does: on a server with a reasoning parser, output streamed as reasoning is not re-sent (the record
counts the answers left empty, `num_empty_answers`). Warm-ups send an unrelated user
message without the system prompt, so they leave nothing in a prefix cache that the measured turns could hit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltaserve.bench.client import LoadOptions, SamplingOptions, client_session, send_request
from deltaserve.bench.dataset import Tokenizer, allowed_token_ids, decode_to_target_len
from deltaserve.bench.metrics import MS_PER_S, RequestResult

DATASET_NAME = "multi-turn"
NOT_SENT_ERROR = "not sent: an earlier turn of this conversation failed"


def add_multi_turn_arguments(group: argparse._ArgumentGroup) -> None:
    """The multi-turn flags (read only with --dataset-name multi-turn)."""
    group.add_argument("--multi-turn-num-clients", type=int, default=16, help="concurrent conversations")
    group.add_argument("--multi-turn-turns", type=int, default=8, help="user turns per conversation")
    group.add_argument("--multi-turn-system-len", type=int, default=2000, help="shared system prompt, tokens")
    group.add_argument("--multi-turn-user-len", type=int, default=200, help="each user message, tokens")
    group.add_argument("--multi-turn-output-len", type=int, default=128, help="each answer, tokens")


@dataclass(frozen=True)
class MultiTurnOptions:
    """The shape of the workload."""

    num_clients: int = 16
    num_turns: int = 8
    system_len: int = 2000
    user_len: int = 200
    output_len: int = 128

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_turns", "user_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"multi-turn {name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.system_len < 0:
            raise ValueError(f"multi-turn system-len must be non-negative, got {self.system_len}")

    def as_record(self) -> dict[str, int]:
        return {
            "multi_turn_num_clients": self.num_clients,
            "multi_turn_turns": self.num_turns,
            "multi_turn_system_len": self.system_len,
            "multi_turn_user_len": self.user_len,
            "multi_turn_output_len": self.output_len,
        }


def multi_turn_options(args: argparse.Namespace) -> MultiTurnOptions:
    """The options from parsed CLI flags."""
    return MultiTurnOptions(
        num_clients=args.multi_turn_num_clients,
        num_turns=args.multi_turn_turns,
        system_len=args.multi_turn_system_len,
        user_len=args.multi_turn_user_len,
        output_len=args.multi_turn_output_len,
    )


@dataclass(frozen=True)
class Conversations:
    """The texts of one run: the shared system prompt, user messages [client][turn], and a warm-up message."""

    system_prompt: str
    user_messages: list[list[str]]
    warmup_message: str
    num_text_tokens: int  # system prompt + every user message, counted with the local tokenizer


def sample_conversations(tokenizer: Tokenizer, options: MultiTurnOptions, seed: int = 0) -> Conversations:
    """The texts for `options`, reproducible from `seed` for a given tokenizer."""
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer.vocab_size, list(tokenizer.all_special_ids))
    num_allowed = len(allowed)
    system_prompt = ""
    num_tokens = 0
    if options.system_len > 0:
        system_ids = allowed[rng.integers(0, num_allowed, size=options.system_len)].tolist()
        system_prompt, ids, _ = decode_to_target_len(tokenizer, system_ids, options.system_len, rng)
        num_tokens += len(ids)
    # one more message than the run needs: the warm-up's, unrelated to every measured prompt
    num_messages = options.num_clients * options.num_turns + 1
    messages: list[str] = []
    for i in range(num_messages):
        run = allowed[rng.integers(0, num_allowed, size=options.user_len)].tolist()
        text, ids, _ = decode_to_target_len(tokenizer, run, options.user_len, rng)
        messages.append(text)
        if i < num_messages - 1:
            num_tokens += len(ids)
    per_client = [messages[c * options.num_turns : (c + 1) * options.num_turns] for c in range(options.num_clients)]
    return Conversations(system_prompt, per_client, messages[-1], num_tokens)


def turn_payload(
    model: str, history: list[dict[str, str]], max_tokens: int, sampling: SamplingOptions
) -> dict[str, Any]:
    """A streaming chat body with string contents (a history of plain turns, as chat clients send it)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": [dict(message) for message in history],
        "max_completion_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update(sampling.body_fields())
    return payload


@dataclass
class TurnResult:
    """One turn: its client and 0-based turn index next to the shared per-request result."""

    client: int
    turn: int
    result: RequestResult


async def run_conversations(
    conversations: Conversations,
    options: MultiTurnOptions,
    sampling: SamplingOptions,
    load: LoadOptions,
) -> tuple[list[TurnResult], float]:
    """Warm up, run every conversation to its end; returns (turns ordered by client then turn, duration in s)."""
    async with client_session(load) as session:
        # --max-concurrency still caps requests in flight; by default every client has one in flight
        semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

        async def send(history: list[dict[str, str]], prompt_len: int, request_id: str) -> RequestResult:
            payload = turn_payload(load.model, history, options.output_len, sampling)
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                return await send_request(session, load.api_url, payload, prompt_len, request_id, is_chat=True)

        if load.num_warmups > 0:
            warmup = [{"role": "user", "content": conversations.warmup_message}]
            prefix = load.request_id_prefix
            warm = await asyncio.gather(
                *(send(warmup, options.user_len, f"{prefix}warmup-{i}") for i in range(load.num_warmups))
            )
            num_failed = sum(1 for r in warm if not r.is_success)
            if num_failed:
                print(f"warning: {num_failed} of {load.num_warmups} warm-up requests failed", file=sys.stderr)

        async def converse(client: int) -> list[TurnResult]:
            history: list[dict[str, str]] = []
            prompt_len = 0
            if conversations.system_prompt:
                history.append({"role": "system", "content": conversations.system_prompt})
                prompt_len = options.system_len
            turns: list[TurnResult] = []
            for turn, message in enumerate(conversations.user_messages[client]):
                history.append({"role": "user", "content": message})
                prompt_len += options.user_len
                result = await send(history, prompt_len, f"{load.request_id_prefix}{client}-{turn}")
                turns.append(TurnResult(client, turn, result))
                if not result.is_success:
                    for rest in range(turn + 1, options.num_turns):
                        turns.append(TurnResult(client, rest, RequestResult(prompt_len=0, error=NOT_SENT_ERROR)))
                    break
                # the real answer goes back into the history, exactly as streamed
                history.append({"role": "assistant", "content": result.generated_text})
                prompt_len += options.output_len
            return turns

        if load.after_warmups is not None:
            await load.after_warmups()
        t_start = time.perf_counter()
        per_client = await asyncio.gather(*(converse(c) for c in range(options.num_clients)))
        duration = time.perf_counter() - t_start
    turns = [turn for conversation in per_client for turn in conversation]
    num_empty = sum(1 for t in turns if t.result.is_success and not t.result.generated_text)
    if num_empty:
        print(
            f"warning: {num_empty} answers had no delta.content (a reasoning parser?): their turns fed back ''",
            file=sys.stderr,
        )
    return turns, duration


def turn_breakdown(turns: list[TurnResult], num_turns: int) -> dict[str, Any]:
    """Per-turn-index TTFT medians, prompt and cached token totals, and the hit rate (None without the field)."""
    ttft_medians: list[float | None] = []
    prompt_by_turn: list[int] = []
    cached_by_turn: list[int | None] = []
    done = [t.result for t in turns if t.result.is_success]
    reported = [r for r in done if r.cached_tokens is not None]
    # a server that reports the field may leave it out when nothing was cached (vLLM before its PR #44383): 0 then
    is_reporting = bool(reported)
    for index in range(num_turns):
        done_at = [t.result for t in turns if t.turn == index and t.result.is_success]
        ttfts = [r.ttft for r in done_at]
        ttft_medians.append(float(np.median(ttfts) * MS_PER_S) if ttfts else None)
        prompt_by_turn.append(sum(r.prompt_len for r in done_at))
        cached_by_turn.append(sum(int(r.cached_tokens or 0) for r in done_at) if is_reporting else None)
    total_prompt = sum(r.prompt_len for r in done)
    total_cached = sum(int(r.cached_tokens or 0) for r in done) if is_reporting else None
    hit_rate = total_cached / total_prompt if total_cached is not None and total_prompt > 0 else None
    return {
        "median_ttft_ms_by_turn": ttft_medians,
        "prompt_tokens_by_turn": prompt_by_turn,
        "cached_tokens_by_turn": cached_by_turn,
        "total_prompt_tokens_sent": total_prompt,
        "total_cached_tokens": total_cached,
        "num_requests_with_cached_tokens": len(reported),
        "prefix_cache_hit_rate": hit_rate,
        # answers whose delta.content was empty: a reasoning parser on the server streams a model's whole output
        # as reasoning when it never closes its think block (dummy weights), and the history then lacks it
        "num_empty_answers": sum(1 for r in done if not r.generated_text),
    }


def multi_turn_fields(
    turns: list[TurnResult], options: MultiTurnOptions, conversations: Conversations, is_detailed: bool
) -> dict[str, Any]:
    """The record's multi-turn fields; with --save-detailed also each request's client, turn and cached tokens."""
    fields: dict[str, Any] = {**options.as_record(), "total_text_prompt_tokens": conversations.num_text_tokens}
    fields.update(turn_breakdown(turns, options.num_turns))
    if is_detailed:
        fields["turn_indices"] = [turn.turn for turn in turns]
        fields["client_indices"] = [turn.client for turn in turns]
        fields["cached_tokens"] = [turn.result.cached_tokens for turn in turns]
    return fields


def multi_turn_summary(record: dict[str, Any]) -> list[str]:
    """The summary block's multi-turn lines (none for other datasets)."""
    if "median_ttft_ms_by_turn" not in record:
        return []
    lines = [
        "{:-^60}".format("Multi-turn"),
        "{:<40} {:<10}".format("Total prompt tokens sent:", record["total_prompt_tokens_sent"]),
    ]
    if record["total_cached_tokens"] is not None:
        lines.append("{:<40} {:<10}".format("Total cached prompt tokens:", record["total_cached_tokens"]))
    if record["prefix_cache_hit_rate"] is not None:
        lines.append("{:<40} {:<10.4f}".format("Prefix cache hit rate:", record["prefix_cache_hit_rate"]))
    medians = ", ".join("-" if t is None else f"{t:.2f}" for t in record["median_ttft_ms_by_turn"])
    lines.append(f"{'Median TTFT by turn (ms):':<40} {medians}")
    return lines


def check_multi_turn(args: argparse.Namespace) -> None:
    """The flags multi-turn cannot honour are refused rather than ignored; raises ValueError."""
    if not math.isinf(args.request_rate):
        raise ValueError("--dataset-name multi-turn sends a turn when the previous answer arrives: no --request-rate")
    if args.backend != "openai-chat":
        raise ValueError("--dataset-name multi-turn needs --backend openai-chat --endpoint /v1/chat/completions")
    multi_turn_options(args)  # its bounds, before any connection is made
