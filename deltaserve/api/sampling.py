"""Request fields -> the engine's SamplingParams, with vLLM's defaulting rules and 400s that name the field.

check_sampling_request runs with the other field checks, before any work; build_sampling_params runs once the prompt
is tokenised, since max_tokens needs its length: it derives max_tokens and applies the length rules (the engine's
resolve_max_tokens, once per prompt), then builds and checks the rest.

A sampling field the request leaves unset takes the model's generation_config default (engine.default_sampling,
empty under --generation-config vllm), then SamplingParams' own default. Fields the engine cannot honour are refused
by name; fields that cannot change a token here are accepted and logged in vLLM's words ("The following fields
were present in the request but ignored: ..."), once per distinct set so a client cannot flood the log.

Stop strings are bounded (MAX_STOP_STRINGS, MAX_STOP_CHARS): every generated token is matched against every stop
string of every sequence, so 100,000 of them with n=8 would slow every other request. vLLM has no bound; OpenAI
allows four.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import IGNORED_FIELDS, UNSUPPORTED_FIELDS, APIModel, CompletionRequest, SamplingRequest
from deltaserve.api.settings import MAX_N, ServerState
from deltaserve.engine.frontend import (
    RequestError,
    bad_words_token_ids,
    check_cache_salt,
    check_priority,
    resolve_max_tokens,
)
from deltaserve.sampling_params import (
    ParamError,
    SamplingParams,
    StructuredOutputsParams,
    logprobs_cap_error,
)

logger = logging.getLogger(__name__)
# Prompts whose SamplingParams build_each builds between two awaits
PARAMS_SLICE = 64

MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 64 * 1024
NUM_LOGGED_FIELD_SETS = 256
# Extra fields an endpoint reads itself (completions refuses a non-text response_format).
HANDLED_EXTRA_FIELDS = frozenset({"response_format", "cache_salt"})  # cache_salt: cache_salt_of
_logged_field_sets: OrderedDict[frozenset[str], None] = OrderedDict()

# Fields that fall back to generation_config.json defaults when the request leaves them unset.
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty")  # fmt: skip


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def warn_once_per_set(
    log: logging.Logger, logged: OrderedDict[frozenset[str], None], limit: int, names: frozenset[str], message: str
) -> None:
    """`message: {'name', ...}` at WARNING, once for each distinct set of names (the last `limit` sets remembered in
    `logged`), so one client cannot flood the log with a line a request."""
    if not names or names in logged:
        return
    logged[names] = None
    if len(logged) > limit:
        logged.popitem(last=False)
    log.warning("%s: %s", message, "{" + ", ".join(repr(name) for name in sorted(names)) + "}")


def log_ignored_fields(request: APIModel) -> None:
    """vLLM's log line for fields it accepts and ignores: unknown ones, and known ones with no effect here."""
    extra = request.model_extra or {}
    ignored = frozenset(name for name, value in extra.items() if name not in HANDLED_EXTRA_FIELDS and (
                        name in IGNORED_FIELDS or name not in UNSUPPORTED_FIELDS or not _is_set(value)))  # fmt: skip
    warn_once_per_set(logger, _logged_field_sets, NUM_LOGGED_FIELD_SETS, ignored,
                      "The following fields were present in the request but ignored")  # fmt: skip


def check_stop(stop: str | list[str] | None) -> None:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(strings)}.", "stop")
    num_chars = sum(len(text) for text in strings)
    if num_chars > MAX_STOP_CHARS:
        raise bad_request(f"stop strings may total at most {MAX_STOP_CHARS} characters, got {num_chars}.", "stop")


def cache_salt_of(request: Any) -> Any:
    """vLLM's `cache_salt` extra field of a request (None when absent): requests share cached prefixes only with
    requests of the same salt."""
    return (getattr(request, "model_extra", None) or {}).get("cache_salt")


def check_unsupported(request: SamplingRequest) -> None:
    """Features that would change the output if silently ignored are refused instead."""
    extra = request.model_extra or {}
    for name, needs in UNSUPPORTED_FIELDS.items():
        if _is_set(extra.get(name)):
            raise bad_request(f"{name} is not supported: it needs {needs}, which deltaserve does not have.", name)
    try:  # honoured by the prefix cache (scheduler/prefix_cache.py root_hash); the engine frontend's rule
        check_cache_salt(cache_salt_of(request))
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    if request.use_beam_search and not isinstance(request, CompletionRequest):  # completions: api/beam_search.py
        raise bad_request("Beam search is not supported in chat completions.", "use_beam_search")
    if not 1 <= request.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {request.n}.", "n")
    check_stop(request.stop)
    log_ignored_fields(request)


def sample_logprobs(request: SamplingRequest) -> int | None:
    """SamplingParams.logprobs of a request (None: none): completions' `logprobs`, chat's `top_logprobs` (0 when
    unset) once `logprobs` is true; None with logprob_token_ids, which vLLM's request models pass instead."""
    if request.logprob_token_ids:
        return None
    if isinstance(request, CompletionRequest):
        return request.logprobs
    return (request.top_logprobs or 0) if request.logprobs else None


def check_logprobs_cap(num_logprobs: int | None, num_prompt_logprobs: int | None, state: ServerState) -> None:
    """vLLM's engine-side bound in its words: a count of -1 is the vocabulary, and a count above --max-logprobs (its
    -1 also the vocabulary) is refused naming the resolved count; None and 0 ask for nothing to bound."""
    error = logprobs_cap_error(num_logprobs, num_prompt_logprobs, state.max_logprobs, state.vocab_size)
    if error is not None:
        raise bad_request(*error)


def check_sampling_request(state: ServerState, request: SamplingRequest) -> None:
    """The sampling fields both endpoints check before any work: refused features, n and stop, priority against
    --scheduling-policy, and the logprobs counts' cap (the logprobs fields' own checks are the request models'
    validators, as vLLM's: api/protocol.py)."""
    check_unsupported(request)
    try:
        check_priority(request.priority, state.settings.scheduling_policy)
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    check_logprobs_cap(sample_logprobs(request), request.prompt_logprobs, state)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def build_sampling_params(
    state: ServerState,
    request: SamplingRequest,
    *,
    num_prompt_tokens: int,
    max_tokens: int | None,
    prompt_param: str,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    bad_words_ids: list[list[int]] | None,
    is_beam_search: bool = False,
) -> SamplingParams:
    """SamplingParams for one prompt of num_prompt_tokens tokens. max_tokens is the request's (None: unset); the
    one derivation of the value the engine gets, and the one check of the context lengths, is resolve_max_tokens
    (a generation_config max_new_tokens caps it, as vLLM's server does). A ValueError from the validation becomes
    a 400, naming the field where vLLM's does (ParamError). bad_words_ids: tokenize_bad_words's (the request's
    bad_words as token sequences, tokenized once a request off the event loop and checked against the vocabulary
    there). is_beam_search: the request's n is the beam width, not n sampled sequences."""
    defaults: dict[str, Any] = state.engine.default_sampling or {}
    try:
        max_tokens = resolve_max_tokens(
            max_tokens, num_prompt_tokens, state.engine.max_model_len, defaults.get("max_tokens"), prompt_param
        )
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    values: dict[str, Any] = {}
    for name in DEFAULTABLE_FIELDS:
        value = getattr(request, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            values[name] = value
    vocab_size = state.vocab_size
    if values.get("top_k", 0) > vocab_size:
        values["top_k"] = vocab_size  # same distribution; keeps the sampler's top-k within the vocabulary
    stop_token_ids = list(dict.fromkeys(request.stop_token_ids or []))
    if stop_token_ids and not (min(stop_token_ids) >= 0 and max(stop_token_ids) < vocab_size):
        # vLLM's words; the list is cut at 16 ids so that a long request cannot make a long error
        outside = [t for t in stop_token_ids if not 0 <= t < vocab_size][:16]
        raise bad_request(
            f"stop_token_ids contains out-of-vocab token id(s) {outside}. Vocabulary size: {vocab_size}",
            "stop_token_ids",
        )
    try:
        params = SamplingParams(
            # beam search: n is the beam width (api/beam_search.py), never n sampled sequences (vLLM builds its
            # BeamSearchParams, which the greedy rule does not check)
            n=1 if is_beam_search else request.n,
            seed=request.seed,
            stop=_stop_strings(request.stop),
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            logit_bias=request.logit_bias,
            allowed_token_ids=request.allowed_token_ids,
            # one list for every prompt of the request, not a copy each: 2,048 copies of 5,000 words made each of
            # the collector's full passes walk 10M references, a stall of the event loop wherever it ran
            bad_words=request.bad_words or [],
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
            thinking_token_budget=request.thinking_token_budget,
            logprob_token_ids=request.logprob_token_ids or None,
            repetition_detection=request.repetition_detection,
            **values,
        )
    except ParamError as exc:  # vLLM's VLLMValidationError: the 400 names the field
        raise bad_request(str(exc), exc.param) from None
    except ValueError as exc:  # a plain ValueError in vLLM too: its 400 names no field
        raise bad_request(str(exc)) from None
    try:
        params.validate_vocab(vocab_size)
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from None
    params.bad_words_token_ids = bad_words_ids  # set after the check: tokenize_bad_words checked them, once
    return params


async def build_each(items: Iterable[Any], build: Callable[[Any], SamplingParams]) -> list[SamplingParams]:
    """build(item) for each prompt (or conversation) of a request, awaiting between slices of PARAMS_SLICE: at
    2,048 prompts with 5,000 bad words each slice holds the event loop a few ms, where the whole list held it hundreds
    (tests/api/test_api_hostile.py)."""
    params: list[SamplingParams] = []
    for index, item in enumerate(items):
        if index and index % PARAMS_SLICE == 0:
            await anyio.sleep(0)  # other requests and /health run between slices
        params.append(build(item))
    return params


async def tokenize_bad_words(state: ServerState, request: SamplingRequest) -> list[list[int]] | None:
    """The request's bad_words as token sequences (vLLM's rule, frontend.bad_words_token_ids), tokenized once for all
    its prompts on the tokenizer's threads: thousands of words take seconds, which must not hold the event loop (and
    with it every other request and /health). None when it has none."""
    if not request.bad_words:
        return None
    words = list(request.bad_words)
    if not all(words):
        return None  # SamplingParams refuses an empty word, by its own message
    vocab_size = state.vocab_size

    def tokenize() -> list[list[int]]:
        ids = bad_words_token_ids(state.engine.tokenizer, words)
        checked = SamplingParams(bad_words_token_ids=ids)
        checked.validate_vocab(vocab_size)  # vLLM's out-of-vocab refusal, once, not once a prompt
        return ids

    run = state.tokens.run_large if sum(map(len, words)) > state.tokens.large_chars else state.tokens.run
    try:
        return await run(tokenize)
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from None
