"""The API-level differential driver: seeded request waves sent through the `openai` client to two servers of one
checkpoint, the answers reduced to comparable records, and every difference between the two listed.

`make_waves(seed, tokenizer)` builds the traffic of one seed: waves of requests, each wave sent at once (so batches
mix) and the waves one after another (so a multi-turn chat can feed its answer back and a repeated request finds the
first one's cache). The kinds cover the request surface vLLM users send: greedy completions and chats over shared
system prompts and prefixes, n > 1, stop strings and stop token ids, min / max tokens, ignore_eos, logprobs, echo
(max_tokens 0 / 1, what lm-eval sends), prompt logprobs, token-id and batch prompts, streaming with usage,
structured outputs, logit_bias, bad_words, penalties, a forced tool call, seeded sampling and a client disconnect.

`send_waves(client, waves)` sends them and returns one `Record` per request: the response as a plain dict (a stream
folded into the shape of a whole response, since the two servers cut their chunks differently), without the fields
that differ by design (ids, timestamps, cached-token details). `compare(a, b)` lists every difference, floats (the
logprobs) within `LOGPROB_ATOL`. What "equal" means per kind and why is in docs/differential-testing.md.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai

from deltaserve.tiny.mtp import corpus_split

from .server_thread import MODEL_NAME

# fp32 on the CPU: the two servers run the same ops over other batch shapes and chunk grids (B's 64-token budget,
# shared with the batch's decodes, splits a prefill off the GDN's 64-token chunk grid; a verify scores 1 + k tokens
# at once), so a logprob moves: by ~1e-6 at most positions, by up to ~6e-4 at a few ill-conditioned ones, where
# either grid is that far from an fp64 transformers forward (docs/differential-testing.md). Greedy tokens may not move
LOGPROB_ATOL = 1e-3
# a logprob's rank counts the tokens above it: among a vocabulary's many near-equal unlikely logits, last-bit
# rounding moves a low rank by one or two (the greedy token's rank 1 is pinned by the token itself)
RANK_SLACK = 2
# fields that differ between any two answers by design: ids, clocks, and the cache's own accounting
VOLATILE_KEYS = frozenset({"id", "created", "system_fingerprint", "prompt_tokens_details", "service_tier"})

PARAGRAPHS = [p for p in corpus_split()[0].split("\n\n") if p.strip()]  # the text the tiny checkpoints learned


@dataclass
class Case:
    """One request: `kind` completion or chat, the keyword arguments of the openai call, and how to check it."""

    name: str
    kind: str  # "completion" | "chat"
    body: dict[str, Any]
    seeded: bool = False  # random sampling with a seed: compared only with itself repeated (same server)
    abort_after: int | None = None  # a stream the client closes after this many chunks (nothing to compare)
    must_hit: bool = False  # a repeat of an earlier request: the cache-on server must report cached tokens
    is_quiet: bool = False  # sent alone after the waves (so no other request evicts what its repeat must hit)
    follow_up: Case | None = None  # sent in the next wave (a multi-turn chat's: with this case's answer fed back)
    repeat_of: str | None = None  # a seeded repeat: the name of the case whose tokens it must give again


@dataclass
class Record:
    name: str
    response: dict[str, Any] | None  # None: aborted on purpose
    cached_tokens: int = 0
    error: str | None = None


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefix(rng: random.Random, shared: list[str]) -> str:
    return rng.choice(shared)[: rng.randrange(40, 800)]


def make_waves(
    seed: int, tokenizer: Any, num_waves: int = 4, wave_size: int = 6, max_tokens: int = 25
) -> list[list[Case]]:
    """The seed's traffic: `num_waves` waves of about `wave_size` concurrent requests and one long answer, then the
    follow-ups and repeats the waves asked for (each in the wave after its first turn); greedy answers of up to
    `max_tokens` but the long one's."""
    rng = random.Random(seed)
    # the prefixes requests share: two paragraphs each (up to ~300 tokens), so four at once overflow a small KV pool
    shared = ["\n\n".join(PARAGRAPHS[i : i + 2]) for i in rng.sample(range(len(PARAGRAPHS) - 1), 3)]
    # system prompts of ~6, 100 and 280 tokens (cut by tokens: a paragraph of rare characters takes many per char)
    long_text = _token_ids(tokenizer, " ".join(PARAGRAPHS[rng.randrange(len(PARAGRAPHS))] for _ in range(4)))
    systems = ["You are a helpful assistant.", tokenizer.decode(long_text[:100]), tokenizer.decode(long_text[:280])]
    common = [_token_ids(tokenizer, w)[0] for w in (" the", ".", ",", " a", "\n")]  # stop ids that do occur

    def greedy(**body: Any) -> dict[str, Any]:
        return {"temperature": 0.0, "max_tokens": rng.randrange(1, max_tokens), **body}

    def thinking(body: dict[str, Any], p_off: float = 0.6) -> dict[str, Any]:
        """Qwen3.5's template opens <think>; most chats turn it off, so content, JSON and tool calls come at once."""
        if rng.random() < p_off:
            body["extra_body"] = {**body.get("extra_body", {}), "chat_template_kwargs": {"enable_thinking": False}}
        return body

    def chat_messages(system: str | None = None, max_user_chars: int = 120) -> list[dict[str, str]]:
        user = _prefix(rng, shared)[-rng.randrange(20, max_user_chars) :]
        return [{"role": "system", "content": system or rng.choice(systems)}, {"role": "user", "content": user}]

    def completion() -> Case:
        return Case("completion", "completion", greedy(prompt=_prefix(rng, shared), stream=rng.random() < 0.3))

    def paragraph() -> Case:
        """A paragraph's opening, the text the MTP heads draft best: runs of accepted drafts, chained verifies and
        several tokens a step, with stop strings, logprobs or a penalty on some."""
        body = greedy(prompt=PARAGRAPHS[rng.randrange(len(PARAGRAPHS))][:100], max_tokens=rng.randrange(10, 45),
                      stream=rng.random() < 0.4)  # fmt: skip
        roll = rng.randrange(4)
        if roll == 0:
            body["stop"] = rng.sample([".", ",", " the", "\n", "and"], 2)
            body["extra_body"] = {"include_stop_str_in_output": rng.random() < 0.5}
        elif roll == 1:
            body["logprobs"] = rng.randrange(0, 3)
        elif roll == 2:
            body["extra_body"] = {"repetition_penalty": 1.2, "min_tokens": rng.randrange(0, 8)}
        return Case("paragraph", "completion", body)

    def chat() -> Case:
        return Case("chat", "chat", thinking(greedy(messages=chat_messages(), stream=rng.random() < 0.3)))

    def stops() -> Case:
        body = greedy(prompt=_prefix(rng, shared), max_tokens=rng.randrange(8, max_tokens + 5))
        body["stop"] = rng.sample([".", ",", " the", "\n", "and"], rng.randrange(1, 3))
        extra: dict[str, Any] = {"include_stop_str_in_output": rng.random() < 0.5}
        if rng.random() < 0.5:
            extra["stop_token_ids"] = rng.sample(common, 2)
        if rng.random() < 0.4:
            extra["min_tokens"] = rng.randrange(1, 6)
        body = {**body, "stream": rng.random() < 0.4, "extra_body": extra}
        if rng.random() < 0.3:  # the same stops on a chat without thinking
            body = thinking({**body, "messages": chat_messages()}, p_off=1.0)
            del body["prompt"]
            return Case("chat-stop", "chat", body)
        return Case("stop", "completion", body)

    def lengths() -> Case:
        extra = {"ignore_eos": rng.random() < 0.5, "min_tokens": rng.randrange(0, 10)}
        body = greedy(prompt=_prefix(rng, shared), max_tokens=rng.randrange(10, max_tokens + 5), extra_body=extra)
        return Case("lengths", "completion", body)

    def logprobs() -> Case:
        if rng.random() < 0.5:
            return Case("logprobs", "completion", greedy(prompt=_prefix(rng, shared), logprobs=rng.randrange(0, 5),
                                                         stream=rng.random() < 0.3))  # fmt: skip
        body = greedy(messages=chat_messages(), logprobs=True, top_logprobs=rng.randrange(0, 5),
                      stream=rng.random() < 0.3)  # fmt: skip
        return Case("chat-logprobs", "chat", thinking(body))

    def echo() -> Case:  # lm-eval's loglikelihood requests
        body = {"prompt": _prefix(rng, shared), "echo": True, "logprobs": rng.randrange(0, 3), "temperature": 0.0,
                "max_tokens": rng.choice([0, 1])}  # fmt: skip
        return Case("echo", "completion", body)

    def prompt_logprobs() -> Case:
        body = greedy(prompt=_prefix(rng, shared), extra_body={"prompt_logprobs": rng.randrange(0, 3)})
        return Case("prompt-logprobs", "completion", body)

    def token_ids() -> Case:
        return Case("token-ids", "completion", greedy(prompt=_token_ids(tokenizer, _prefix(rng, shared))))

    def batch() -> Case:
        prompts = [_prefix(rng, shared) for _ in range(rng.randrange(2, 4))]
        return Case("batch", "completion", greedy(prompt=prompts, stream=rng.random() < 0.3))

    def structured() -> Case:
        roll = rng.randrange(3)
        if roll == 0:
            schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
                      "required": ["answer"], "additionalProperties": False}  # fmt: skip
            fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
            body = greedy(messages=chat_messages(), response_format=fmt, max_tokens=30)
            return Case("json-schema", "chat", thinking(body, p_off=1.0))
        if roll == 1:
            extra = {"structured_outputs": {"choice": ["north", "south", "grey sea", "none"]}}
            return Case("choice", "completion", greedy(prompt=_prefix(rng, shared), extra_body=extra))
        extra = {"structured_outputs": {"regex": "[A-Z][a-z]+( [a-z]+){1,3}\\."}}
        return Case("regex", "completion", greedy(prompt=_prefix(rng, shared), max_tokens=30, extra_body=extra))

    def biases() -> Case:
        extra: dict[str, Any] = {}
        body = greedy(prompt=_prefix(rng, shared), max_tokens=rng.randrange(8, max_tokens))
        if rng.random() < 0.5:
            body["logit_bias"] = {str(t): rng.choice([-100.0, -5.0, 3.0]) for t in rng.sample(common, 2)}
        else:
            extra["bad_words"] = rng.sample([" the", " and", " of the", " was"], 2)
        return Case("bias", "completion", {**body, "extra_body": extra})

    def penalties() -> Case:
        body = greedy(prompt=_prefix(rng, shared), max_tokens=rng.randrange(10, max_tokens + 5))
        roll = rng.randrange(3)
        if roll == 0:
            body["extra_body"] = {"repetition_penalty": rng.choice([1.1, 1.3])}
        elif roll == 1:
            body["frequency_penalty"] = rng.choice([0.5, 1.0])
        else:
            body["presence_penalty"] = rng.choice([0.5, 1.0])
        return Case("penalty", "completion", body)

    def tool_call() -> Case:
        tool = {"type": "function", "function": {"name": "log_weather", "description": "Record the weather.",
                "parameters": {"type": "object", "properties": {"wind": {"type": "string", "maxLength": 10}},
                               "required": ["wind"]}}}  # fmt: skip
        choice = {"type": "function", "function": {"name": "log_weather"}}
        body = greedy(messages=chat_messages(systems[0], 60), tools=[tool], tool_choice=choice, max_tokens=30)
        return Case("tool", "chat", thinking({**body, "stream": rng.random() < 0.3}, p_off=1.0))

    def seeded() -> Case:
        body = {"prompt": _prefix(rng, shared), "temperature": 0.8, "seed": rng.randrange(1000),
                "max_tokens": rng.randrange(4, 20), "n": rng.randrange(1, 4)}  # fmt: skip
        name = f"seeded-{rng.randrange(10**9)}"
        case = Case(name, "completion", body, seeded=True)
        case.follow_up = Case(name + "-again", "completion", dict(body), seeded=True, repeat_of=name)
        return case

    def abort() -> Case:
        body = greedy(prompt=_prefix(rng, shared), max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        return Case("abort", "completion", body, abort_after=rng.randrange(1, 4))

    def long_answer() -> Case:
        """A long shared prompt with a long answer: its decode outgrows a small KV pool beside the wave's other
        prompts, so the latest admitted sequence is preempted and recomputed (admission alone waits for room)."""
        body = {"prompt": rng.choice(shared), "temperature": 0.0, "max_tokens": rng.randrange(60, 100),
                "stream": rng.random() < 0.3, "extra_body": {"ignore_eos": True}}  # fmt: skip
        return Case("long-answer", "completion", body)

    def multi_turn() -> Case:
        case = chat()
        case.name = "turn-1"
        case.follow_up = Case("turn-2", "chat", greedy(messages=[{"role": "user", "content": "Go on."}]))
        return case

    def repeat() -> Case:
        case = rng.choice([completion, chat, logprobs])()
        case.is_quiet = True
        case.follow_up = Case(case.name + "-again", case.kind, dict(case.body), must_hit=True, is_quiet=True)
        return case

    kinds = [completion, paragraph, paragraph, chat, seeded, stops, lengths, logprobs, echo, prompt_logprobs,
             token_ids, batch, structured, biases, penalties, tool_call, seeded, abort, multi_turn, repeat]  # fmt: skip
    waves: list[list[Case]] = []
    for _ in range(num_waves):
        waves.append([rng.choice(kinds)() for _ in range(wave_size)] + [long_answer()])
    waves.append([])  # the follow-ups of the last wave
    return waves


def overflow_waves(tokenizer: Any, prompt_tokens: int = 280, max_tokens: int = 200) -> list[list[Case]]:
    """Two greedy answers that cannot both finish in a pool of fewer than 2 x (`prompt_tokens` + `max_tokens`) tokens:
    sent at once, both prompts are admitted (they fit side by side), both answers grow, and the pool runs out before
    the first ends, so the latest admitted is preempted whatever the timing (the waves' preemptions depend on which
    requests overlap). Distinct paragraphs as token ids, so neither is a prefix-cache hit of the other."""
    texts = ["\n\n".join(PARAGRAPHS[i : i + 4]) for i in (0, len(PARAGRAPHS) // 2)]
    prompts = [_token_ids(tokenizer, text)[:prompt_tokens] for text in texts]
    assert all(len(p) == prompt_tokens for p in prompts), [len(p) for p in prompts]
    body = {"temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
    return [[Case(f"overflow-{i}", "completion", {**body, "prompt": p}) for i, p in enumerate(prompts)], []]


def _fold_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one response: per choice, text / content, token ids, logprobs and tool-call arguments
    concatenated in order, the last finish_reason and stop_reason; the usage of the final chunk."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for part in chunk.get("choices") or []:
            into = choices.setdefault(part["index"], {"index": part["index"]})
            delta = part.get("delta") or {}
            for key in ("text", "content", "reasoning_content", "reasoning"):
                value = part.get(key) if key == "text" else delta.get(key)
                if value:
                    into[key] = into.get(key, "") + value
            for call in delta.get("tool_calls") or []:
                calls = into.setdefault("tool_calls", {})
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            if part.get("token_ids"):
                into.setdefault("token_ids", []).extend(part["token_ids"])
            logprobs = part.get("logprobs")
            if logprobs:
                merged = into.setdefault("logprobs", {})
                for key, value in logprobs.items():
                    if isinstance(value, list):
                        merged.setdefault(key, []).extend(value)
            for key in ("finish_reason", "stop_reason"):
                if part.get(key) is not None:
                    into[key] = part[key]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _plain(response: dict[str, Any]) -> dict[str, Any]:
    """Drops VOLATILE_KEYS at every depth, and keys whose value is None (a stream folds only what it sent)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE_KEYS and v is not None}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(response)


def _call(client: openai.OpenAI, case: Case) -> Record:
    create = client.completions.create if case.kind == "completion" else client.chat.completions.create
    # every answer carries its token ids (vLLM's return_token_ids), so tokens are compared, not only their text
    body = {**case.body, "extra_body": {**case.body.get("extra_body", {}), "return_token_ids": True}}
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    try:
        if not body.get("stream"):
            response = create(model=MODEL_NAME, **body).model_dump()
        else:
            stream = create(model=MODEL_NAME, **body)
            chunks = []
            for chunk in stream:
                chunks.append(chunk.model_dump())
                if case.abort_after is not None and len(chunks) >= case.abort_after:
                    stream.close()  # the client disconnects mid-stream
                    return Record(case.name, None)
            response = _fold_stream(chunks)
    except openai.APIError as error:
        return Record(case.name, None, error=f"{type(error).__name__}: {error}")
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return Record(case.name, _plain(response), cached_tokens=details.get("cached_tokens") or 0)


def _follow_up(case: Case, answer: Record) -> Case:
    """The second turn of a multi-turn chat: the first turn's messages, its answer, then the new user message."""
    message = answer.response["choices"][0].get("message") or {} if answer.response else {}
    content = message.get("content") or ""
    messages = [*case.body["messages"], {"role": "assistant", "content": content}, *case.follow_up.body["messages"]]
    return Case(case.follow_up.name, "chat", {**case.follow_up.body, "messages": messages})


def send_waves(client: openai.OpenAI, waves: list[list[Case]]) -> list[tuple[Case, Record]]:
    """Each wave's requests at once, the waves in order; a case's follow-up joins the next wave. Then the quiet
    cases one at a time, each followed by its repeat."""
    out: list[tuple[Case, Record]] = []
    carried: list[Case] = []
    quiet = [case for wave in waves for case in wave if case.is_quiet]
    with ThreadPoolExecutor(max_workers=16) as pool:
        for wave in waves:
            cases = carried + [case for case in wave if not case.is_quiet]
            records = list(pool.map(lambda case: _call(client, case), cases))
            out.extend(zip(cases, records, strict=True))
            carried = []
            for case, record in zip(cases, records, strict=True):
                if case.follow_up is None:
                    continue
                is_chat_turn = case.follow_up.name == "turn-2"
                carried.append(_follow_up(case, record) if is_chat_turn else case.follow_up)
    for case in quiet:
        out.append((case, _call(client, case)))
        out.append((case.follow_up, _call(client, case.follow_up)))
    return out


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where a and b differ: floats beyond LOGPROB_ATOL (None / -inf only equal to themselves), ranks
    beyond RANK_SLACK."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in {'A' if key in a else 'B'}")
            elif key == "rank" and isinstance(a[key], int) and isinstance(b[key], int):
                if abs(a[key] - b[key]) > RANK_SLACK:
                    out.append(f"{path}.rank: {a[key]} != {b[key]}")
            else:
                out.extend(diff(a[key], b[key], f"{path}.{key}"))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}"]
        return [line for i, (x, y) in enumerate(zip(a, b, strict=True)) for line in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
        if a == b or abs(a - b) <= LOGPROB_ATOL:
            return []
        return [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(a: list[tuple[Case, Record]], b: list[tuple[Case, Record]]) -> list[str]:
    """The differences between two servers' answers to the same waves (seeded and aborted requests skipped)."""
    out = []
    for i, ((case, ra), (_, rb)) in enumerate(zip(a, b, strict=True)):
        if case.seeded or case.abort_after is not None:
            continue
        if ra.error or rb.error:
            if ra.error != rb.error:
                out.append(f"#{i} {case.name}: error A {ra.error!r} B {rb.error!r}")
            continue
        out.extend(f"#{i} {case.name}: {line}" for line in diff(ra.response, rb.response))
    return out


def self_checks(records: list[tuple[Case, Record]]) -> list[str]:
    """What one server must hold on its own: no request failing, and a seeded request (n up to 3) repeated gives the
    same tokens. (Greedy n > 1 is refused, as vLLM 0.26 refuses it.)"""
    out = []
    by_name = {case.name: record for case, record in records}
    for i, (case, record) in enumerate(records):
        if case.repeat_of is not None and record.response:
            first = by_name[case.repeat_of].response
            out.extend(f"#{i} {case.name}: {line}" for line in diff(first, record.response))
        if record.error:
            out.append(f"#{i} {case.name}: {record.error}")
    return out
