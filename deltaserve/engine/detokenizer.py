"""Incremental detokenization of one output sequence, with stop strings, following vLLM v1's detokenizer.

Input: the sequence's newly generated token ids, step by step. Output: the text so far (stop-truncated), text deltas
for streaming, the matched stop string, and per-token text for logprobs. Fast tokenizers are decoded with the
`tokenizers` DecodeStream (a sliding window: O(new tokens) per step, never emits half a UTF-8 character); other
tokenizers get the same window algorithm over `tokenizer.decode`. Not here: stop token ids, eos and max_tokens
(the engine checks those and passes `is_stop_terminated`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# tokenizers' error when a window decodes to text that does not extend the previous one (vLLM resets the stream)
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"
# vLLM primes the stream with the shortest clean prompt suffix of 4..23 tokens, as left context for the first token
_MIN_PRIMING_TOKENS = 4
_MAX_PRIMING_TOKENS = 24
# UTF-8 characters span at most 4 bytes, so 4 earlier tokens are enough context to rebuild one
_MAX_LOGPROB_CONTEXT = 4
# Text pieces kept before they are joined into one string (bounds per-sequence objects, amortises the copy)
_MAX_CHUNKS = 64


def rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a fast tokenizer, None for a Python one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class _WindowDecodeStream:
    """DecodeStream's algorithm over `tokenizer.decode`, for tokenizers without a Rust backend."""

    def __init__(self, decode: Callable[[list[int]], str], prefix_ids: list[int]) -> None:
        self._decode = decode
        self._ids = list(prefix_ids)
        self._prefix = decode(self._ids) if self._ids else ""
        self._prefix_index = 0

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # a trailing U+FFFD is a character still missing bytes: wait for the next token
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT_CHAR):
            return None
        new_text = text[len(self._prefix) :]
        num_window_ids = len(self._ids) - self._prefix_index
        self._ids = self._ids[self._prefix_index :]
        self._prefix = self._decode(self._ids)
        self._prefix_index = num_window_ids
        return new_text


class IncrementalDetokenizer:
    """Text of one output sequence. Feed ids with add_tokens(); read text, take_delta() or decode_token()."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        # an excluded stop string may be arriving: hold back as many chars as it could already have produced
        self.num_holdback_chars = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.output_token_ids: list[int] = []
        self._chunks: list[str] = []
        self._num_chars = 0
        self._num_emitted_chars = 0

        self._backend = rust_tokenizer(tokenizer)
        self._added_token_text: dict[int, str] | None = None
        self._is_last_special = False
        if self._backend is not None:
            priming_ids = self._priming_suffix(prompt_token_ids, self._backend.decode)
            self._stream: DecodeStream | _WindowDecodeStream = DecodeStream(
                ids=priming_ids, skip_special_tokens=self.skip_special_tokens
            )
            if not (params.skip_special_tokens or params.spaces_between_special_tokens):
                # vLLM: consecutive added tokens are emitted as their raw content, without a separating space
                added = self._backend.get_added_tokens_decoder()
                self._added_token_text = {token_id: token.content for token_id, token in added.items()} or None
        else:

            def decode(ids: list[int]) -> str:
                return tokenizer.decode(
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )

            self._stream = _WindowDecodeStream(decode, self._priming_suffix(prompt_token_ids, tokenizer.decode))

    @staticmethod
    def _priming_suffix(prompt_token_ids: list[int], decode: Callable[[list[int]], str]) -> list[int]:
        """The shortest prompt suffix (4..23 tokens) that starts on a character boundary."""
        if len(prompt_token_ids) <= _MIN_PRIMING_TOKENS:
            return list(prompt_token_ids)
        for num_tokens in range(_MIN_PRIMING_TOKENS, min(len(prompt_token_ids) + 1, _MAX_PRIMING_TOKENS)):
            suffix = prompt_token_ids[-num_tokens:]
            if REPLACEMENT_CHAR not in decode(suffix):
                return suffix
        # vLLM falls back to the whole prompt; a bounded window gives the same text without an O(prompt) decode
        return prompt_token_ids[-_MAX_PRIMING_TOKENS:]

    def _decode_next(self, token_id: int) -> str:
        if self._backend is None:
            return self._stream.step(token_id) or ""
        try:
            piece = self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):
            logger.exception("invalid token id %r", token_id)
            piece = None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_ERROR):
                raise
            # rare non-monotonic decodes break DecodeStream's state; restart it without context, as vLLM does
            logger.warning("invalid prefix while detokenizing, resetting the decode stream")
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            piece = self._stream.step(self._backend, token_id)
        if self._added_token_text is not None:
            special_text = self._added_token_text.get(token_id)
            is_special = special_text is not None
            if is_special and self._is_last_special:
                piece = special_text
            self._is_last_special = is_special
        return piece or ""

    def add_tokens(self, token_ids: list[int], is_stop_terminated: bool = False) -> str | None:
        """Consume new output ids; returns the stop string matched in the new text (text is truncated), else None.

        is_stop_terminated: the last id is the eos / stop token that finished the sequence; as in vLLM its text is
        left out unless include_stop_str_in_output. Stop strings are not searched within the first min_tokens.
        """
        if not token_ids:
            return None
        skipped_stop_id = None
        if is_stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_id = token_ids[-1]
            token_ids = token_ids[:-1]
        check_from = self._num_chars
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            piece = self._decode_next(token_id)
            if piece:
                self._append(piece)
            if self.min_tokens and len(self.output_token_ids) <= self.min_tokens:
                check_from = self._num_chars
        if skipped_stop_id is not None:
            self.output_token_ids.append(skipped_stop_id)
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(self._num_chars - check_from)

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """vLLM's check_stop_strings: first stop string (in list order) that overlaps the new text wins."""
        if num_new_chars <= 0:
            return None
        tail = self._text_from(self._num_chars - (num_new_chars + max(len(s) for s in self.stop) - 1))
        tail_start = self._num_chars - len(tail)
        for stop_str in self.stop:
            # only matches that end inside the new text; earlier text was searched before
            index = tail.find(stop_str, max(0, len(tail) - (num_new_chars + len(stop_str) - 1)))
            if index == -1:
                continue
            truncate_to = tail_start + index
            if self.include_stop_str_in_output:
                truncate_to += len(stop_str)
            if truncate_to < self._num_chars:
                self._truncate(truncate_to)
            return stop_str
        return None

    @property
    def text(self) -> str:
        """The full output text so far, stop-truncated (no hold-back)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def take_delta(self, is_finished: bool) -> str:
        """Text not handed out yet. Until finished, the last num_holdback_chars stay back (a stop string may be
        forming there, and an excluded stop string must never reach the client)."""
        end = self._num_chars - (0 if is_finished else self.num_holdback_chars)
        start = self._num_emitted_chars
        if end <= start:
            return ""
        self._num_emitted_chars = end
        return self._text_from(start)[: end - start]

    def decode_token(self, token_id: int, position: int | None = None, context: list[int] | None = None) -> str:
        """Text of one logprob candidate, as vLLM: tokenizer.decode([id]); a trailing U+FFFD (part of a multi-byte
        character) is rebuilt from up to 4 earlier output tokens, or "" while the character is still incomplete.

        position: index in the output of the step the candidate belongs to; default the last token added, so call
        this after add_tokens() for that step. context: the earlier tokens to rebuild from instead (a prompt
        logprob's: the prompt tokens before its position, as vLLM).
        """
        text = self.tokenizer.decode([token_id])
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        if context is not None:
            context = context[-_MAX_LOGPROB_CONTEXT:]
        else:
            if position is None:
                position = len(self.output_token_ids) - 1
            context = self.output_token_ids[max(0, position - _MAX_LOGPROB_CONTEXT) : max(0, position)]
        return decode_in_context(self.tokenizer, token_id, context)

    def _append(self, piece: str) -> None:
        self._chunks.append(piece)
        self._num_chars += len(piece)
        if len(self._chunks) > _MAX_CHUNKS:
            self._chunks = ["".join(self._chunks)]

    def _text_from(self, start: int) -> str:
        """text[start:], reading only the chunks it spans (O(len(result)) plus one chunk)."""
        start = max(start, 0)
        pieces: list[str] = []
        position = self._num_chars
        for chunk in reversed(self._chunks):
            if position <= start:
                break
            pieces.append(chunk)
            position -= len(chunk)
        return "".join(reversed(pieces))[start - position :]

    def _truncate(self, num_chars: int) -> None:
        while self._chunks and self._num_chars - len(self._chunks[-1]) >= num_chars:
            self._num_chars -= len(self._chunks.pop())
        if self._num_chars > num_chars:
            keep = len(self._chunks[-1]) - (self._num_chars - num_chars)
            self._chunks[-1] = self._chunks[-1][:keep]
            self._num_chars = num_chars
        self._num_emitted_chars = min(self._num_emitted_chars, num_chars)


class TokenIdsOnly:
    """A sequence's detokenizer under SamplingParams(detokenize=False), as vLLM's base IncrementalDetokenizer: the
    ids are kept and no text is made (text "", logprob candidates without decoded_token); no stop string is searched
    (SamplingParams refuses stop strings without detokenize)."""

    def __init__(self) -> None:
        self.output_token_ids: list[int] = []

    def add_tokens(self, token_ids: list[int], is_stop_terminated: bool = False) -> str | None:
        self.output_token_ids.extend(token_ids)
        return None

    @property
    def text(self) -> str:
        return ""

    def take_delta(self, is_finished: bool) -> str:
        return ""

    def decode_token(self, token_id: int, position: int | None = None, context: list[int] | None = None) -> str | None:
        return None


def decode_in_context(tokenizer: PreTrainedTokenizerBase, token_id: int, context: list[int]) -> str:
    """The text a token that decodes to part of a multi-byte character adds after the shortest tail of `context`
    that completes it (vLLM's correction), "" while the character stays incomplete; the derender route names logprob
    tokens with it too (api/serving_derender.py)."""
    for num_context in range(1, len(context) + 1):
        context_ids = context[-num_context:]
        full_text = tokenizer.decode(context_ids + [token_id])
        if full_text.endswith(REPLACEMENT_CHAR):
            continue
        # context tokens that are themselves partial characters belong to this token's character
        clean_end = len(context_ids)
        while clean_end > 0 and tokenizer.decode([context_ids[clean_end - 1]]).endswith(REPLACEMENT_CHAR):
            clean_end -= 1
        clean_prefix = tokenizer.decode(context_ids[:clean_end]) if clean_end else ""
        if full_text.startswith(clean_prefix):
            return full_text[len(clean_prefix) :]
        num_common = 0
        for a, b in zip(clean_prefix, full_text, strict=False):
            if a != b:
                break
            num_common += 1
        return full_text[num_common:]
    return ""
