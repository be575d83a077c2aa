"""SamplingParams: a request's sampling settings, field names and defaults as vLLM's. Shared by every stage.

The api builds it, the engine validates it, the scheduler carries it into the step plan and the runner turns it
into the sampler's tensors; it is a plain dataclass (no tensors, no callables), so it pickles across processes.
StructuredOutputsParams is vLLM's constraint spec (json, regex, choice, grammar, json_object, structural_tag): the
source text travels to the engine core, which compiles it (engine/structured.py).
"""

from __future__ import annotations

import copy
import enum
import itertools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltaserve import env

logger = logging.getLogger(__name__)

# vLLM accepts seeds in the signed 64-bit range.
MAX_SEED = 2**63 - 1
# vLLM's count for logprobs and prompt_logprobs (and for --max-logprobs, the cap) that means the whole vocabulary
ALL_LOGPROBS = -1
# vLLM's _MAX_TEMP: a temperature above 0 and below it is raised to it (the logits would overflow)
MIN_TEMPERATURE = 1e-2
# vLLM's MAX_LOGPROB_TOKEN_IDS: the most token ids one request's logprob_token_ids may list
MAX_LOGPROB_TOKEN_IDS = 128
# vLLM's bound on temperature (OpenAI's too), and the temperature below which a request is greedy (_SAMPLING_EPS)
MAX_TEMPERATURE = 2.0
GREEDY_TEMPERATURE = 1e-5
# vLLM's default max_logprobs (--max-logprobs, LLM(max_logprobs=...)): the most logprobs one position may ask for
MAX_LOGPROBS = 20


def resolve_num_logprobs(count: int | None, vocab_size: int) -> int | None:
    """A logprobs / prompt_logprobs count (or the --max-logprobs cap) with vLLM's -1 made the vocabulary size (config
    vocab_size, as vLLM's get_vocab_size); None and every other count as given. The engine's runner and sampler
    take -1 to mean "not asked", so every count is resolved before it gets there (EngineFrontend.new_request)."""
    return vocab_size if count == ALL_LOGPROBS else count


def logprobs_cap_error(
    num_logprobs: int | None, num_prompt_logprobs: int | None, max_logprobs: int, vocab_size: int
) -> tuple[str, str] | None:
    """(vLLM's message, the field) for the first of the sample / prompt logprobs counts above max_logprobs, both and
    the cap with -1 resolved to the vocabulary first; None when both fit (None and 0 ask for nothing to bound). The
    server's 400 (api/sampling.py) and the offline LLM's ValueError (engine/llm.py) say the same."""
    cap = resolve_num_logprobs(max_logprobs, vocab_size)
    for count, kind, param in ((num_logprobs, "sample", "logprobs"),
                               (num_prompt_logprobs, "prompt", "prompt_logprobs")):  # fmt: skip
        count = resolve_num_logprobs(count, vocab_size)
        if count and count > cap:
            message = f"Requested {kind} logprobs of {count}, which is greater than max allowed: {cap}"
            return str(field_error(message, param, count)), param
    return None


def child_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded n > 1 request: seed + index, as vLLM's ParentRequest derives it.

    vLLM hands seed + index to torch.Generator.manual_seed, which takes values up to 2**64 - 1, so a seed at the
    int64 maximum is valid for every choice. Here it wraps into the signed 64-bit range that SamplingParams accepts;
    the sampler reduces seeds modulo 2**64 (sampler.make_generator), so the wrapped seed draws the same tokens.
    """
    return (seed + index + 2**63) % 2**64 - 2**63


class ParamError(ValueError):
    """A sampling parameter vLLM refuses; `param` names the request field (the api's 400 carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


BUDGET_MESSAGE = "`thinking_token_budget` must be a non-negative integer or -1 for unlimited."


def validation_message(message: str, param: str, value: Any = None) -> str:
    """vLLM's VLLMValidationError as str() words it: the message, then "(parameter=P, value=V)" (no value part for
    None)."""
    extras = f"parameter={param}" + ("" if value is None else f", value={value}")
    return f"{message} ({extras})"


def field_error(message: str, param: str, value: Any = None) -> ParamError:
    """vLLM's VLLMValidationError raised outside a request model: its words (validation_message), the 400 naming
    the field."""
    return ParamError(validation_message(message, param, value), param)


def check_thinking_token_budget(value: Any) -> int | None:
    """vLLM's validate_thinking_token_budget: None or -1 is no budget, else a non-negative int (not a bool, not a
    float); ParamError names the field."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == -1):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise field_error(BUDGET_MESSAGE, "thinking_token_budget", value)
    return value


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's StructuredOutputsParams (exactly one of the constraint fields)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # xgrammar's structural-tag JSON (forced tool calls are built as one)
    # deltaserve: the constraint starts after this token is generated (a reasoning model's </think> when the
    # prompt opens a thinking block), as vLLM leaves the reasoning section unconstrained
    start_after_token_id: int | None = None
    # set once the constraint parsed (the api checks it off its event loop; the engine then does not again)
    is_checked: bool = field(default=False, compare=False, repr=False)

    CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in self.CONSTRAINTS)
        if count > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are specified: "
                f"{self.constraint_dict()}"
            )
        if count < 1:
            raise ValueError(
                f"You must use one kind of structured outputs constraint but none are specified: {self.__dict__}"
            )

    def constraint_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.CONSTRAINTS if getattr(self, name) is not None}

    @property
    def kind(self) -> str:
        return next(name for name in self.CONSTRAINTS if getattr(self, name) is not None)


@dataclass
class RepetitionDetectionParams:
    """vLLM's repetition detection: a sequence whose output ends with a pattern of min_pattern_size ..
    max_pattern_size tokens repeated min_count times stops, finish_reason "repetition" (scheduler/stop.py).
    max_pattern_size 0 is off; the checks and their words are vLLM's."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    def __post_init__(self) -> None:
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. Set "
                "both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you do not wish to "
                "detect repetitive patterns, set max_pattern_size to 0."
            )


class RequestOutputKind(enum.Enum):
    """vLLM's RequestOutputKind. The offline LLM returns each request's final output whatever a request's
    output_kind says, as vLLM's LLM does (its _add_request sets FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling settings; field names and defaults follow vLLM's SamplingParams.

    detokenize=False: vLLM's; the outputs carry token ids and logprobs with no text ("", and decoded_token None),
    and stop strings are refused. output_kind: vLLM's, see RequestOutputKind. extra_args: vLLM's free-form args for
    custom sampling plugins, which no in-tree sampler reads (here neither). skip_clone: clone() copies shallowly."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per generated token; -1 (ALL_LOGPROBS): the whole vocabulary
    # top-N per prompt token (the prompt token itself always comes first); -1: the whole vocabulary
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    # the token sequences of bad_words, filled by the engine front end from its tokenizer (vLLM's rule: each word
    # as written and with a leading space); the last token of a sequence is banned when the others precede it
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the most tokens a thinking section may hold before the reasoning end is forced (None or -1: no bound;
    # needs --reasoning-parser or --reasoning-config: engine/thinking_budget.py)
    thinking_token_budget: int | None = None
    # vLLM's: logprobs of exactly these token ids at each generated position, beside the sampled token's (None: the
    # top-N of `logprobs`); at most MAX_LOGPROB_TOKEN_IDS, and `logprobs`, when set too, equals their count
    logprob_token_ids: list[int] | None = None
    # vLLM's: stop a sequence whose output ends in a repeated token pattern (None: off)
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's (offline API only, as there): the outputs' logprobs and prompt_logprobs as FlatLogprobs, which read as
    # the per-position dict lists (engine/flat_logprobs.py)
    flat_logprobs: bool = False
    # vLLM's: the request looks nothing up in the prefix cache (its computed blocks are still cached for others);
    # None: True exactly when it asks prompt_logprobs, which deltaserve computes for every prompt position
    skip_reading_prefix_cache: bool | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    skip_clone: bool = False

    @staticmethod
    def from_optional(
        n: int | None = 1,
        presence_penalty: float | None = 0.0,
        frequency_penalty: float | None = 0.0,
        repetition_penalty: float | None = 1.0,
        temperature: float | None = 1.0,
        top_p: float | None = 1.0,
        **kwargs: Any,
    ) -> SamplingParams:
        """vLLM's SamplingParams.from_optional: None for n, a penalty, temperature or top_p is its default; the
        other keywords go to the constructor as given (which makes logit_bias keys ints and clamps the biases)."""
        return SamplingParams(
            n=1 if n is None else n,
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            **kwargs,
        )

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, a shallow one when skip_clone."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    def __post_init__(self) -> None:
        # vLLM's __post_init__ normalisations: a temperature in (0, 0.01) is raised to 0.01 (with its warning), seed
        # -1 means no seed, None stands for an empty stop / stop_token_ids / bad_words list, True logprobs for 1
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. We have "
                "maxed it out to %s.", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE,
            )  # fmt: skip
            self.temperature = MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logprobs is True:
            self.logprobs = 1
        if self.logprob_token_ids is not None and not self.logprob_token_ids:
            self.logprob_token_ids = None  # vLLM's server passes `ids or None`: an empty list asks for nothing
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.thinking_token_budget = check_thinking_token_budget(self.thinking_token_budget)
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.logit_bias:
            # vLLM's from_optional: keys become ints, biases are clamped to [-100, 100]
            try:
                self.logit_bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                invalid = [t for t in self.logit_bias if not _is_int_like(t)]
                raise field_error(
                    f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
                    "logit_bias",
                    invalid,
                ) from None
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        self.validate()

    def validate(self) -> None:
        """vLLM's _verify_args, in its order and words: a ValueError (the API's 400 names no field, as vLLM's), or a
        ParamError where vLLM raises its VLLMValidationError (the message ends with the parameter and the value,
        and the 400 names the field)."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > (max_n := env.max_n_sequences()):
            raise ValueError(
                f"n must be at most {max_n}, got {self.n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
                "environment variable."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise field_error(f"temperature must be a finite number, got {self.temperature}.", "temperature",
                              self.temperature)  # fmt: skip
        if self.temperature < 0.0:
            raise field_error(f"temperature must be non-negative, got {self.temperature}.", "temperature",
                              self.temperature)  # fmt: skip
        if self.temperature > MAX_TEMPERATURE:
            raise field_error(f"temperature must be in [0, 2], got {self.temperature}.", "temperature",
                              self.temperature)  # fmt: skip
        if not 0.0 < self.top_p <= 1.0:
            raise field_error(f"top_p must be in (0, 1], got {self.top_p}.", "top_p", self.top_p)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise field_error(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens", self.max_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0 and self.logprobs != ALL_LOGPROBS:
            raise field_error(f"logprobs must be non-negative or -1, got {self.logprobs}.", "logprobs", self.logprobs)
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0 and self.prompt_logprobs != ALL_LOGPROBS:
            raise field_error(f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.",
                              "prompt_logprobs", self.prompt_logprobs)  # fmt: skip
        if self.seed is not None and not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        if not all(self.bad_words):  # all() in C: a request's thousands of words are checked once a prompt
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        if self.is_greedy and self.n > 1:
            # vLLM's _verify_greedy_sampling: n greedy sequences would all be the same
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise field_error("allowed_token_ids is not None and empty!", "allowed_token_ids", self.allowed_token_ids)
        if self.prompt_logprobs is not None and not self.skip_reading_prefix_cache:
            # vLLM would report fewer prompt positions (none for the cached ones); deltaserve reports them all
            raise ValueError("skip_reading_prefix_cache=False is not supported with prompt_logprobs: the prompt "
                             "logprobs of every prompt position are computed, so such a request reads no prefix "
                             "cache (leave skip_reading_prefix_cache unset or True).")  # fmt: skip

    def validate_vocab(self, vocab_size: int) -> None:
        """vLLM's token-id bounds of logit_bias, allowed_token_ids and the bad words' tokens (the model's
        vocabulary, config vocab_size), as VLLMValidationErrors (field_error)."""
        if self.logit_bias and not _within(self.logit_bias, vocab_size):
            invalid = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            raise field_error(
                f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                "logit_bias", invalid,
            )  # fmt: skip
        if self.allowed_token_ids is not None and not _within(self.allowed_token_ids, vocab_size):
            invalid = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
            raise field_error("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", invalid)
        if self.logprob_token_ids is not None:
            # vLLM's _validate_logprobs
            num = len(self.logprob_token_ids)
            if num > MAX_LOGPROB_TOKEN_IDS:
                raise field_error(f"Requested logprob_token_ids of length {num}, which is greater than max allowed: "
                                  f"{MAX_LOGPROB_TOKEN_IDS}", "logprob_token_ids", num)  # fmt: skip
            if not _within(self.logprob_token_ids, vocab_size):
                invalid = [t for t in self.logprob_token_ids if not 0 <= t < vocab_size]
                raise field_error(f"token_id(s) {invalid} in logprob_token_ids contain out-of-vocab token ids. "
                                  f"Vocabulary size: {vocab_size}", "logprob_token_ids", invalid)  # fmt: skip
            if self.logprobs is not None and self.logprobs != num:
                raise field_error(
                    f"When both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids). "
                    f"Got logprobs={self.logprobs}, len(logprob_token_ids)={num}.", "logprob_token_ids", num,
                )  # fmt: skip
        bad_ids = self.bad_words_token_ids or []
        if not _within(itertools.chain.from_iterable(bad_ids), vocab_size):
            invalid = [t for ids in bad_ids for t in ids if not 0 <= t < vocab_size]
            raise field_error(
                f"The model vocabulary size is {vocab_size}, but the following tokens were specified as bad: "
                f"{invalid}. All token id values should be integers satisfying: 0 <= token_id <= {vocab_size - 1}.",
                "bad_words", self.bad_words,
            )  # fmt: skip

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's: the logprobs a generated position reports beside the sampled token's (`logprobs`, else the count
        of logprob_token_ids), None when none are asked for."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_history_mask(self) -> bool:
        """A constraint whose mask depends on the tokens already sampled: a grammar, a bad word of more than one
        token, or a thinking-token budget (the engine core fills these masks, and forces tokens, between steps)."""
        return (
            self.structured_outputs is not None
            or self.thinking_token_budget is not None
            or any(len(ids) > 1 for ids in self.bad_words_token_ids or [])
        )


def _within(token_ids: Iterable[int], vocab_size: int) -> bool:
    """Whether every id is in [0, vocab_size). min and max run in C: a Python loop over a request's thousands of ids,
    repeated for each of its prompts, held the server's event loop for seconds."""
    ids = token_ids if isinstance(token_ids, (list, tuple, dict)) else list(token_ids)
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def _is_int_like(value: object) -> bool:
    try:
        int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, the settings of the offline LLM.beam_search: beam_width beams, max_tokens steps
    (every step runs unless no beam is left), eos completes a beam unless ignore_eos, the steps sample at
    `temperature` (0: the candidates are the top logprobs), length_penalty divides the score by the length (prompt
    and beam) to that power. include_stop_str_in_output is accepted and, as in vLLM's offline search, changes
    nothing: a completed sequence keeps its eos. structured_outputs is refused by LLM.beam_search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
