"""vLLM's flat_logprobs (offline API): the container reads as the per-position dict list it replaces (index, negative
index, slices, iteration; a None position reads {}; edits refused in vLLM's words), and through the engine a request
with flat_logprobs gets FlatLogprobs whose positions equal the plain request's, cumulative and delta alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine.flat_logprobs import FlatLogprobs, new_logprobs
from deltaserve.engine.llm import LLM
from deltaserve.engine.request import Logprob
from deltaserve.sampling_params import RequestOutputKind, SamplingParams
from tests.support.engines import share

POSITIONS = [
    {5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")},
    None,
    {7: Logprob(-0.25, 3, None)},
    {},
    {1: Logprob(-2.0, 1, "c"), 2: Logprob(-3.0, 2, "d"), 3: Logprob(-4.0, 3, "e")},
]
PLAIN = [p or {} for p in POSITIONS]  # a None position reads back as {}, as vLLM's


def test_the_container_reads_as_the_list() -> None:
    flat = FlatLogprobs()
    flat.extend(POSITIONS)
    assert len(flat) == 5 and list(flat) == PLAIN
    assert [flat[i] for i in range(-5, 5)] == PLAIN + PLAIN
    for window in (slice(1, 4), slice(2, None), slice(None, 2), slice(-2, None), slice(4, 2), slice(0, 5, 2),
                   slice(None, None, -1), slice(5, None)):  # fmt: skip
        part = flat[window]
        assert isinstance(part, FlatLogprobs) and list(part) == PLAIN[window], window
    assert flat[1:3].start_indices == [0, 0] and flat[1:3].token_ids == [7]  # rebased onto its own lists
    with pytest.raises(IndexError):
        flat[5]
    for edit, words in ((lambda: flat.__setitem__(0, {}), "Cannot set logprobs in FlatLogprobs"),
                        (lambda: flat.__delitem__(0), "Cannot delete logprobs from FlatLogprobs"),
                        (lambda: flat.insert(0, {}), "Cannot insert logprobs to FlatLogprobs")):  # fmt: skip
        with pytest.raises(TypeError, match=words):
            edit()
    assert list(flat) == PLAIN
    assert isinstance(new_logprobs(True), FlatLogprobs) and new_logprobs(False) == []


def scored(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2, **kwargs)


def test_the_engine_fills_flat_containers_with_the_plain_positions(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", **share())
    plain, flat = llm.generate(["the sea and", "the sea and"], [scored(), scored(flat_logprobs=True)],
                               use_tqdm=False)  # fmt: skip
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs) and isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert isinstance(plain.outputs[0].logprobs, list) and len(plain.outputs[0].logprobs) == 5
    assert list(flat.outputs[0].logprobs) == plain.outputs[0].logprobs
    assert plain.prompt_logprobs[0] is None and flat.prompt_logprobs[0] == {}
    assert list(flat.prompt_logprobs)[1:] == plain.prompt_logprobs[1:] and len(plain.prompt_logprobs) > 2
    # deltas: each step's slice of the flat container, joined, is the whole list (of a request run alone, as this one)
    (alone,) = llm.generate(["the sea and"], scored(), use_tqdm=False)
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().encode("the sea and")
    engine.add_request("delta", prompt, scored(flat_logprobs=True, output_kind=RequestOutputKind.DELTA))
    pieces: list = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            logprobs = output.outputs[0].logprobs
            assert isinstance(logprobs, FlatLogprobs)
            pieces.extend(logprobs)
    assert pieces == alone.outputs[0].logprobs
