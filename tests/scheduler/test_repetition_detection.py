"""vLLM's repetition_detection (scheduler/stop.py): the pattern rule against its definition on random outputs, its
place among the stop rules (after eos / stop ids / length, gated by min_tokens), its parameters' checks in vLLM's
words; then through the engine on the trained tiny dense checkpoint (which repeats itself greedily), with MTP
giving the same tokens, and through the API (finish_reason "repetition", a 400 for bad parameters)."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import RepetitionDetectionParams, SamplingParams
from deltaserve.scheduler.repetition import RepetitionWatch
from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.stop import check_stop
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode_mtp import mtp_llm
from tests.support.engines import share


def repeats(tokens: list[int], low: int, high: int, count: int) -> bool:
    """The definition: some length L in [low (0: 1), high] whose count copies fit end the output."""
    return any(
        tokens[len(tokens) - length * count :] == tokens[len(tokens) - length :] * count
        for length in range(max(low, 1), high + 1)
        if 0 < length * count <= len(tokens)
    )


def ends_repeating(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    return RepetitionWatch(params).ends_repeating(tokens)


def test_the_rule_is_its_definition() -> None:
    """Random outputs over small alphabets (so patterns happen), few lengths (the walk) and many (the vector filter
    first), each output checked as it grows, as the scheduler checks it after every token."""
    rng = random.Random(5)
    num_filtered = 0
    for trial in range(3000):
        size = rng.randint(1, 14) if trial % 2 else rng.randint(60, 240)
        high = rng.randint(1, 6) if trial % 2 else rng.randint(40, 120)
        low, count = rng.randint(0, high), rng.randint(2, 4)
        alphabet = rng.choice([2, 3, 5])
        # a repeated block now and then, so that long patterns occur too
        tokens = [rng.randrange(alphabet) for _ in range(size)]
        if trial % 3 == 0 and size > 8:
            block = tokens[: rng.randint(1, size // 3)]
            tokens = tokens[: size // 2] + block * count
        params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=count)
        watch = RepetitionWatch(params)
        for end in range(1, len(tokens) + 1):
            assert watch.ends_repeating(tokens[:end]) == repeats(tokens[:end], low, high, count), (tokens, end)
        num_filtered += not watch.is_walked
    assert num_filtered > 300
    assert not ends_repeating([1, 1, 1], RepetitionDetectionParams())  # max_pattern_size 0: off
    # a pattern shorter than min_pattern_size does not count
    assert not ends_repeating([1, 1, 1, 1], RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2,
                                                                      min_count=3))  # fmt: skip
    assert ends_repeating([1, 2, 1, 2, 1, 2], RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2,
                                                                        min_count=3))  # fmt: skip


def stop_of(outputs: list[int], max_tokens: int = 100, **params: object) -> tuple[str, int | str | None] | None:
    seq = Sequence("r", [1, 2, 3], max_tokens, sampling=SamplingParams(**params), eos_token_ids=frozenset({9}),
                   eos_token_id=9)  # fmt: skip
    seq.output_token_ids = list(outputs)
    return check_stop(seq, outputs[-1], 4096)


def test_its_place_among_the_stop_rules() -> None:
    detection = {"max_pattern_size": 2, "min_count": 3}
    assert stop_of([5, 6, 5, 6, 5, 6], repetition_detection=detection) == ("repetition", "repetition_detected")
    assert stop_of([5, 6, 5, 6, 5], repetition_detection=detection) is None
    # eos, a stop token id and the length come first, as in vLLM's check_stop
    assert stop_of([9, 9, 9], repetition_detection={"max_pattern_size": 1, "min_count": 3}) == ("stop", None)
    assert stop_of([7, 7, 7], repetition_detection={"max_pattern_size": 1, "min_count": 3},
                   stop_token_ids=[7]) == ("stop", 7)  # fmt: skip
    assert stop_of([5, 6] * 3, repetition_detection=detection, max_tokens=6) == ("length", None)
    # below min_tokens nothing stops on a pattern
    assert stop_of([5, 6] * 3, repetition_detection=detection, min_tokens=8) is None
    assert stop_of([5, 6] * 4, repetition_detection=detection, min_tokens=8) == ("repetition", "repetition_detected")


def test_the_parameters_are_checked_in_vllms_words() -> None:
    with pytest.raises(ValueError, match="min_pattern_size <= max_pattern_size"):
        RepetitionDetectionParams(max_pattern_size=2, min_pattern_size=3, min_count=2)
    with pytest.raises(ValueError, match="max_pattern_size, min_pattern_size must be >=0"):
        RepetitionDetectionParams(max_pattern_size=-1)
    with pytest.raises(ValueError, match="min_count must be >= 2"):
        SamplingParams(repetition_detection={"max_pattern_size": 2, "min_count": 1})
    assert SamplingParams(repetition_detection={"max_pattern_size": 0}).repetition_detection.min_count == 0


PROMPTS = ["Once upon a time, the", "Hello there"]  # the dense checkpoint repeats a pair, and one token


def test_the_engine_stops_on_a_repeated_pattern_with_and_without_mtp() -> None:
    """Greedy outputs end at the first position where a pattern repeats min_count times (the run without detection
    has it there), with vLLM's finish and stop reasons; MTP stops inside an accepted run at the same token."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", **share())
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            repetition_detection={"max_pattern_size": 4, "min_count": 3})  # fmt: skip
    full = [o.outputs[0] for o in plain.generate(PROMPTS, free, use_tqdm=False)]
    cut = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    for whole, out in zip(full, cut, strict=True):
        tokens = list(whole.token_ids)
        end = next(i + 1 for i in range(len(tokens)) if repeats(tokens[: i + 1], 0, 4, 3))
        assert list(out.token_ids) == tokens[:end] and end < 40
        assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    spec, stats = mtp_llm("dense", 3)
    assert [list(o.outputs[0].token_ids) for o in spec.generate(PROMPTS, params, use_tqdm=False)] == [
        list(o.token_ids) for o in cut
    ]
    assert stats["verifies"] > 0
