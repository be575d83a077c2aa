"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained here: deltas vs one-shot decode, split
multi-byte characters, stop strings across tokens, streaming hold-back, special tokens and logprob token text."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from deltaserve.engine import detokenizer as detokenizer_module
from deltaserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from deltaserve.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 你好 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello again. STOP here or never",
    "naïve café — déjà vu ✓ 日本語 テキスト",
]
SAMPLE = "héllo wörld 你好 🙂 the lazy dog says STOP! then 日本語 ✓ déjà vu"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 3, trainer)
    backend.add_tokens([AddedToken("<think>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def _stream(
    tokenizer: PreTrainedTokenizerFast,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    chunk: int = 1,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed output ids `chunk` at a time, taking a delta after each step and a final one when done."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or [], params)
    deltas: list[str] = []
    stop = None
    for start in range(0, len(output_ids), chunk):
        stop = detok.add_tokens(output_ids[start : start + chunk])
        deltas.append(detok.take_delta(is_finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.take_delta(is_finished=True))
    return detok, deltas, stop


def test_tokenizer_splits_multibyte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    """Guards the tests below: some tokens of SAMPLE are partial UTF-8 characters."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(SAMPLE)]
    assert any(p.endswith(REPLACEMENT_CHAR) for p in pieces)
    assert any(p.startswith(REPLACEMENT_CHAR) for p in pieces)


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_one_shot_decode(
    tokenizer: PreTrainedTokenizerFast, chunk: int, skip_special_tokens: bool
) -> None:
    output_ids = tokenizer.encode("<think>" + SAMPLE + "<|im_end|><|im_end|> bye<|endoftext|>")
    prompt_ids = tokenizer.encode("prompt: 你好 wörld")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas, stop = _stream(tokenizer, output_ids, params, prompt_ids, chunk)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert stop is None
    assert "".join(deltas) == expected == detok.text
    assert ("<|im_end|>" in expected) is not skip_special_tokens
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert detok.output_token_ids == output_ids


def test_split_character_waits_for_its_last_byte(tokenizer: PreTrainedTokenizerFast) -> None:
    emoji_ids = tokenizer.encode("🙂")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi"), SamplingParams())
    for token_id in emoji_ids[:-1]:
        detok.add_tokens([token_id])
        assert detok.take_delta(is_finished=False) == ""
        assert detok.text == ""
    detok.add_tokens(emoji_ids[-1:])
    assert detok.take_delta(is_finished=False) == "🙂"


def test_window_fallback_matches_decode_stream(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    output_ids = tokenizer.encode(SAMPLE + "<|im_end|>")
    params = SamplingParams(skip_special_tokens=False)
    _, fast_deltas, _ = _stream(tokenizer, output_ids, params, tokenizer.encode("abc 你好"))
    monkeypatch.setattr(detokenizer_module, "rust_tokenizer", lambda tok: None)
    slow, slow_deltas, _ = _stream(tokenizer, output_ids, params, tokenizer.encode("abc 你好"))
    assert slow._backend is None
    assert slow_deltas == fast_deltas
    assert "".join(slow_deltas) == tokenizer.decode(output_ids, skip_special_tokens=False)


@pytest.mark.parametrize("stop_str", ["wörld 你", "好 🙂", "lazy", "STOP!"])
def test_stop_string_across_tokens_is_found_and_cut(tokenizer: PreTrainedTokenizerFast, stop_str: str) -> None:
    output_ids = tokenizer.encode(SAMPLE)
    before = SAMPLE[: SAMPLE.index(stop_str)]
    detok, deltas, stop = _stream(tokenizer, output_ids, SamplingParams(stop=["never matches", stop_str]))
    assert stop == stop_str
    assert detok.text == before == "".join(deltas)
    assert len(detok.output_token_ids) < len(output_ids)  # found as soon as it completed

    detok, deltas, stop = _stream(
        tokenizer, output_ids, SamplingParams(stop=[stop_str], include_stop_str_in_output=True)
    )
    assert stop == stop_str
    assert detok.text == before + stop_str == "".join(deltas)


def test_first_listed_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = tokenizer.encode("the lazy dog")
    detok, _, stop = _stream(
        tokenizer, output_ids, SamplingParams(stop=["dog", "lazy dog", "z"]), chunk=len(output_ids)
    )
    assert stop == "dog"  # vLLM checks stop strings in list order, not by position
    assert detok.text == "the lazy "


def test_streaming_holds_back_possible_stop_prefix(tokenizer: PreTrainedTokenizerFast) -> None:
    stop_str = "STOP!"
    output_ids = tokenizer.encode("hello STOP here, STOP never")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop_str]))
    emitted = ""
    for token_id in output_ids:
        assert detok.add_tokens([token_id]) is None
        emitted += detok.take_delta(is_finished=False)
        # never more than text minus len(stop) - 1 chars, so a forming stop string cannot leak
        assert len(emitted) == max(0, len(detok.text) - (len(stop_str) - 1))
        assert detok.text.startswith(emitted)
    emitted += detok.take_delta(is_finished=True)
    assert emitted == detok.text == "hello STOP here, STOP never"
    assert detok.take_delta(is_finished=True) == ""


def test_include_stop_str_streams_without_hold_back(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"], include_stop_str_in_output=True))
    detok.add_tokens(tokenizer.encode("hello"))
    assert detok.take_delta(is_finished=False) == "hello"


def test_stop_token_text_is_dropped_unless_included(tokenizer: PreTrainedTokenizerFast) -> None:
    dog_ids = tokenizer.encode("the lazy dog")
    newline = tokenizer.encode(",")[0]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[newline]))
    detok.add_tokens(dog_ids)
    assert detok.add_tokens([newline], is_stop_terminated=True) is None
    assert detok.take_delta(is_finished=True) == "the lazy dog"
    assert detok.output_token_ids == dog_ids + [newline]

    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop_token_ids=[newline], include_stop_str_in_output=True)
    )
    detok.add_tokens(dog_ids + [newline], is_stop_terminated=True)
    assert detok.text == "the lazy dog,"


def test_stop_strings_ignored_within_min_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    first, second = tokenizer.encode("dog"), tokenizer.encode(" then dog again")
    params = SamplingParams(stop=["dog"], min_tokens=len(first))
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.add_tokens(first) is None
    assert detok.add_tokens(second) == "dog"
    assert detok.text == "dog then "


def test_min_tokens_boundary_inside_one_step(tokenizer: PreTrainedTokenizerFast) -> None:
    first = tokenizer.encode("dog")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["dog"], min_tokens=len(first)))
    # one step covering min_tokens and more: only text after the min_tokens-th token is searched
    assert detok.add_tokens(first + tokenizer.encode(" then dog again")) == "dog"
    assert detok.text == "dog then "


def test_spaces_between_special_tokens_off_keeps_raw_content(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = tokenizer.encode("a<|im_end|><|endoftext|><think><think>b")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detok, deltas, _ = _stream(tokenizer, output_ids, params)
    assert "".join(deltas) == "a<|im_end|><|endoftext|><think><think>b"
    detok, deltas, _ = _stream(tokenizer, output_ids, SamplingParams())
    assert "".join(deltas) == "a<think><think>b"


def test_spaces_between_special_tokens_with_a_spacing_decoder() -> None:
    """A WordPiece decoder joins tokens with spaces; vLLM drops the space between two added tokens when asked."""
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(["a b c"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_end|>", "<s>"]))
    spaced = PreTrainedTokenizerFast(tokenizer_object=backend)
    output_ids = spaced.encode("a <|im_end|><s> b")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(_stream(spaced, output_ids, params)[1]) == "a <|im_end|><s> b"
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    assert "".join(_stream(spaced, output_ids, params)[1]) == "a <|im_end|> <s> b"


def test_decode_token_rebuilds_split_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = tokenizer.encode("ok 🙂")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(logprobs=2))
    texts = []
    for token_id in output_ids:
        detok.add_tokens([token_id])
        texts.append(detok.decode_token(token_id))
    # a character's bytes: "" until the last one, which carries the whole character (vLLM's correction)
    assert "".join(texts) == "ok 🙂"
    assert texts[-1].endswith("🙂")
    assert texts[-2] == ""
    assert detok.decode_token(tokenizer.encode("the")[0], position=0) == tokenizer.decode(tokenizer.encode("the")[:1])
    # without context a partial character decodes as vLLM reports it: empty
    assert detok.decode_token(output_ids[-1], position=0) == ""


def test_many_tokens_keep_chunks_bounded(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = tokenizer.encode(SAMPLE) * 40
    detok, deltas, _ = _stream(tokenizer, output_ids, SamplingParams(stop=["never in the text"]))
    assert len(detok._chunks) <= 65
    assert "".join(deltas) == SAMPLE * 40
