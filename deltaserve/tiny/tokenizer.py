"""A small, real byte-level BPE tokenizer for the tiny checkpoints, trained from the shipped corpus.

The tokenizer has Qwen's pipeline (NFC, the Qwen split regex, byte-level BPE with no prefix space) and Qwen's
added tokens, placed after the BPE vocabulary in Qwen's order. tokenizer.json spells out the same pipeline that
transformers' tokenizer class rebuilds, so `tokenizers.Tokenizer.from_file` and `AutoTokenizer` agree token for
token. Training takes well under a second; its result is cached per process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# Byte alphabet (256) plus merges; the added tokens come after these ids.
NUM_BPE_TOKENS = 1280

# Qwen's special tokens, in Qwen's id order. They are never split and are dropped by skip_special_tokens.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added but not special: never split, yet kept by skip_special_tokens (tool-call and reasoning parsers need them).
PLAIN_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)
ALL_ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + PLAIN_ADDED_TOKENS

# Split regexes as transformers' Qwen3_5Tokenizer and Qwen2Tokenizer define them (Qwen3.5 adds \p{M} to words).
QWEN3_5_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX_BY_TOKENIZER_CLASS = {"Qwen3_5Tokenizer": QWEN3_5_SPLIT_REGEX, "Qwen2Tokenizer": QWEN2_SPLIT_REGEX}


def _pipeline_tokenizer(
    split_regex: str, vocab: dict[str, int] | None, merges: list[tuple[str, str]] | None
) -> Tokenizer:
    """An (optionally empty) BPE tokenizer with Qwen's normalizer, pre-tokenizer, post-processor and decoder."""
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _training_texts() -> list[str]:
    """The corpus in paragraphs, with the added-token strings removed so that BPE spends no merges on them."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    for token in ALL_ADDED_TOKENS:
        text = text.replace(token, "\n")
    return [paragraph for paragraph in text.split("\n\n") if paragraph]


@functools.cache
def _trained_bpe() -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """Train the BPE once per process; returns (vocab items sorted by id, merges). Deterministic across runs."""
    tokenizer = _pipeline_tokenizer(QWEN3_5_SPLIT_REGEX, None, None)
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_BPE_TOKENS,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        # Every byte must be a token, or some texts could not be encoded at all.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(), trainer=trainer)
    model_json = json.loads(tokenizer.to_str())["model"]
    vocab = tuple(sorted(model_json["vocab"].items(), key=lambda item: item[1]))
    merges = tuple(
        tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model_json["merges"]
    )
    return vocab, merges


def build_tokenizer(tokenizer_class: str) -> Tokenizer:
    """The trained tokenizer with the added tokens, using the split regex that `tokenizer_class` rebuilds."""
    vocab_items, merges = _trained_bpe()
    tokenizer = _pipeline_tokenizer(SPLIT_REGEX_BY_TOKENIZER_CLASS[tokenizer_class], dict(vocab_items), list(merges))
    # Added one at a time so that the ids follow ALL_ADDED_TOKENS exactly.
    for token in SPECIAL_TOKENS:
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    for token in PLAIN_ADDED_TOKENS:
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)])
    return tokenizer


def added_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Id of every added token, checked to be a single id."""
    token_ids = {token: tokenizer.token_to_id(token) for token in ALL_ADDED_TOKENS}
    missing = [token for token, token_id in token_ids.items() if token_id is None]
    if missing:
        raise RuntimeError(f"added tokens missing from the tiny tokenizer: {missing}")
    return token_ids


def chat_template() -> str:
    """The shipped Jinja chat template (Qwen3.5's prompt format)."""
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def build_tokenizer_config(tokenizer_class: str, token_ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json in the shape Qwen ships it: added-token table, eos/pad and the chat template."""
    added_tokens_decoder = {
        str(token_ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token in ALL_ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }
