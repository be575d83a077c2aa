"""The non-streamed completions body after it moved off the event loop (api/completion_body.py, api/json_body.py):
byte for byte what it was, prompt logprobs carried once per prompt, and the bound on prompt-logprob work.

tests/api/data/response_bodies.json holds request bodies and the responses main adec2ea gave for them against the
FakeEngine served with default settings (id fixed by X-Request-Id, created set to 0): completions with n > 1 and
prompt_logprobs and logprobs, echo with logprobs, echo-only scoring, batched text and token-id prompts, token ids as
names; streamed echo with logprobs (each prompt's echoed logprobs built once); chat with n > 1, prompt_logprobs and
top_logprobs (its body is rendered off the event loop too). Two edits since: echo's first top_logprobs entry is null,
as vLLM gives it (it was {} at adec2ea); a choice's token_ids, prompt_logprobs and prompt_token_ids, and a chat body's
prompt_logprobs and prompt_token_ids, are null when not asked for, as vLLM sends its models whole (they were absent),
and so are a chat message's refusal, annotations, audio, function_call and reasoning; then vLLM's remaining null fields
(a choice's routed_experts, a body's service_tier, system_fingerprint, kv_transfer_params, ec_transfer_params and
metrics, a chat body's prompt_text), the rest of its models serialised whole.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.api import cli
from deltaserve.api.completion_body import check_prompt_logprob_work, prompt_logprob_entries
from deltaserve.api.errors import APIError
from deltaserve.api.json_body import PIECE_CHARS, RawJSON, render_json
from deltaserve.api.protocol import CompletionRequest
from deltaserve.api.settings import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve

RECORDED = json.loads((Path(__file__).parent / "data" / "response_bodies.json").read_text())


@pytest.fixture(scope="module")
def plain_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    """Default settings (no reasoning or tool parser), as the bodies were recorded."""
    server = serve(fake_engine)
    yield server
    server.stop()


@pytest.mark.parametrize("case", RECORDED, ids=[str(i) for i in range(len(RECORDED))])
def test_body_is_byte_for_byte_the_recorded_one(plain_server: ServerThread, case: dict[str, Any]) -> None:
    url = plain_server.base_url + case.get("path", "/v1/completions")
    response = httpx.post(url, json={"model": MODEL_NAME, **case["request"]}, headers={"x-request-id": "golden"})
    assert response.status_code == 200, response.text
    if not case["request"].get("stream"):
        assert response.headers["content-type"] == "application/json"
        assert int(response.headers["content-length"]) == len(response.content)
    assert re.sub(r'"created":\d+,', '"created":0,', response.text) == case["response"]


def _random_value(rng: random.Random, depth: int) -> Any:
    """Scalars of every JSON kind, and containers that are long near the top and short further down."""
    kind = rng.randrange(8 if depth < 3 else 5)
    sizes = [[0, 3, 70, 300], [0, 2, 10, 70], [0, 1, 3]][min(depth, 2)]
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randrange(-(10**12), 10**12)
    if kind == 2:
        return rng.choice([-9999.0, 0.1, -1e-300, 1e300, 2.5, -0.0])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\\n\u00e9\u2603\U0001f600\x00') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.choice(sizes))]
    if kind == 6:
        return {f"k{i}\u00e9": _random_value(rng, depth + 1) for i in range(rng.choice(sizes))}
    return [{str(t): {"logprob": -0.5, "rank": t, "decoded_token": " x"} for t in range(21)}] * rng.choice([1, 8])


@pytest.mark.parametrize("seed", range(6))
def test_render_json_is_json_dumps(seed: int) -> None:
    """Any value: the pieces joined are JSONResponse's bytes; long lists and big containers come in pieces."""
    value = {"top": [_random_value(random.Random(seed * 100 + i), 0) for i in range(4)], "scores": [0.5] * 10000,
             "int keys": {1: "a", 2: "b"}}  # fmt: skip
    expected = json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    chunks = render_json(value)
    assert b"".join(chunks) == expected
    assert max(len(chunk) for chunk in chunks) <= 4 * PIECE_CHARS + 2**16


def test_render_json_emits_raw_pieces_and_refuses_nan() -> None:
    shared = RawJSON(render_json([{"1": 2}] * 3))
    assert b"".join(render_json({"a": [shared, shared], "b": shared})) == b'{"a":[[{"1":2},{"1":2},{"1":2}],' \
        b'[{"1":2},{"1":2},{"1":2}]],"b":[{"1":2},{"1":2},{"1":2}]}'  # fmt: skip
    with pytest.raises(ValueError):
        render_json({"x": [math.nan] * 5000})


def _request(**fields: Any) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def test_prompt_logprob_entries_counts_every_choice_and_field() -> None:
    assert prompt_logprob_entries(_request(n=4), 100, None) == 0
    assert prompt_logprob_entries(_request(n=4, prompt_logprobs=20), 100, 20) == 4 * 100 * 21
    # echo with logprobs: the prompt_logprobs field (implied logprobs) and the echoed logprobs
    assert prompt_logprob_entries(_request(n=2, echo=True, logprobs=5), 100, 5) == 2 * 100 * 12
    assert prompt_logprob_entries(_request(echo=True, logprobs=1, prompt_logprobs=0), 10, 0) == 10 * (1 + 2)
    check_prompt_logprob_work(_request(n=2, prompt_logprobs=0), 50, 0, bound=100)  # exactly at the bound
    with pytest.raises(APIError) as caught:
        check_prompt_logprob_work(_request(n=2, prompt_logprobs=0), 51, 0, bound=100)
    assert caught.value.param == "prompt_logprobs" and "102 prompt logprob entries" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param", "names"),
    [
        ({"prompt_logprobs": 20}, "prompt_logprobs", ["n=128", "2000 prompt tokens", "prompt_logprobs=20"]),
        ({"echo": True, "logprobs": 20, "max_tokens": 0}, "logprobs", ["n=128", "echo with logprobs=20"]),
    ],
)
def test_requests_beyond_the_bound_are_refused_naming_the_fields(
    http: httpx.Client, fields: dict[str, Any], param: str, names: list[str]
) -> None:
    """n x prompt tokens x (logprobs + 1) over the default bound: vLLM's 400 envelope, before any engine work."""
    assert DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES < 128 * 2000 * 21
    body = {"model": MODEL_NAME, "prompt": [[7] * 1000, [8] * 1000], "n": 128, "max_tokens": 1, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert all(name in error["message"] for name in names) and "--max-prompt-logprob-entries" in error["message"]


def test_the_bound_is_a_flag() -> None:
    parser = argparse.ArgumentParser(prog="deltaserve serve")
    cli.add_arguments(parser)
    assert cli.build_settings(parser.parse_args(["m"]), "m").max_prompt_logprob_entries == 2**21
    args = parser.parse_args(["m", "--max-prompt-logprob-entries", "5000000"])
    assert cli.build_settings(args, "m").max_prompt_logprob_entries == 5_000_000
    with pytest.raises(ValueError, match="--max-prompt-logprob-entries must be positive"):
        cli.build_settings(parser.parse_args(["m", "--max-prompt-logprob-entries", "0"]), "m")
