"""Speculative decoding is exact under greedy sampling: with any drafts (all accepted, none, a mix), the outputs
equal the outputs without speculation, fp32 on the CPU, on the trained tiny dense / MoE / Next checkpoints, k = 1..4;
and so do stop tokens, min_tokens, max_tokens, stop strings and logprobs that fall inside an accepted run.

Drafts come from tests/support/drafts.py (the reference continuation, shifted where a rejection is wanted), so each
case also asserts that verify chunks ran and how many drafts were accepted: a run that never speculated fails.
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.mtp import corpus_split
from deltaserve.tiny.trained import trained_model_dir
from tests.support.drafts import MODES, enable_reference_drafts

MAX_TOKENS = 16


# Paragraphs of the shipped corpus the tiny checkpoints were trained on whose greedy continuations vary on all three
# (random token ids, or held-out text, mostly give one token repeated: a continuation that no longer depends on the
# GDN state, so a wrong rollback would go unseen; on these, zeroing the GDN state changes the tokens)
PARAGRAPHS = (0, 7, 14, 17, 32)


def make_prompts(llm: LLM) -> list[list[int]]:
    paragraphs = [p for p in corpus_split()[0].split("\n\n") if p.strip()]
    return [llm.engine.tokenizer.encode(paragraphs[i])[:24] for i in PARAGRAPHS]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], dict[tuple[int, ...], list[int]]]]:
    """Per variant: prompts and their greedy continuations without speculation."""
    found = {}
    for variant in ("dense", "moe", "next"):
        llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(llm)
        outputs = run(llm, prompts, greedy())
        found[variant] = prompts, {tuple(p): list(o.token_ids) for p, o in zip(prompts, outputs, strict=True)}
    return found


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_greedy_equals_no_speculation(references: dict, variant: str, k: int) -> None:
    prompts, continuation = references[variant]
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
    stats = enable_reference_drafts(llm.engine.core, continuation, "all", k)
    drafter = llm.engine.core.runner.spec.drafter
    for mode in MODES:
        drafter.mode = mode
        before = dict(stats)
        outputs = run(llm, prompts, greedy())
        assert [list(o.token_ids) for o in outputs] == [continuation[tuple(p)] for p in prompts], mode
        drafts, accepted = stats["drafts"] - before["drafts"], stats["accepted"] - before["accepted"]
        assert drafts > 0, mode
        if mode == "all":
            assert accepted == drafts, (mode, accepted, drafts)
        elif mode == "none":
            assert accepted == 0, (mode, accepted, drafts)
        else:
            assert 0 < accepted < drafts, (mode, accepted, drafts)


@pytest.fixture(scope="module")
def dense_pair(references: dict) -> tuple[LLM, LLM, dict[str, int]]:
    """The dense checkpoint without speculation and with k = 4 all-accepted drafts."""
    _, continuation = references["dense"]
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    spec = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    stats = enable_reference_drafts(spec.engine.core, continuation, "all", 4)
    return plain, spec, stats


def per_prompt_stop(references: dict, index: int, **kwargs: object) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each prompt stops on the token its reference continuation produces at output `index`."""
    prompts, continuation = references["dense"]
    params = [greedy(stop_token_ids=[continuation[tuple(p)][index]], **kwargs) for p in prompts]
    return prompts, params


def assert_same(plain: LLM, spec: LLM, stats: dict, prompts: list, params: object) -> list:
    before = stats["accepted"]
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert stats["accepted"] > before  # the stops fell inside accepted runs
    return got


def test_stop_token_inside_accepted_run(references: dict, dense_pair: tuple) -> None:
    """The drafts run past the stop token; the tokens accepted after it are dropped."""
    prompts, params = per_prompt_stop(references, 5, ignore_eos=False)
    outputs = assert_same(*dense_pair, prompts, params)
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 6 for o in outputs)


def test_min_tokens_masks_verify_positions(references: dict, dense_pair: tuple) -> None:
    """A stop token drafted below min_tokens is masked at its verify position (rejected), as without speculation."""
    prompts, params = per_prompt_stop(references, 1, min_tokens=7)
    outputs = assert_same(*dense_pair, prompts, params)
    assert all(len(o.token_ids) >= 7 for o in outputs)


@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_max_tokens_inside_accepted_run(references: dict, dense_pair: tuple, max_tokens: int) -> None:
    prompts, _ = references["dense"]
    outputs = assert_same(*dense_pair, prompts, greedy(max_tokens=max_tokens)) if max_tokens > 2 else None
    if outputs is None:  # one or two outputs leave no room for drafts: nothing to accept, same tokens
        plain, spec, _ = dense_pair
        params = greedy(max_tokens=max_tokens)
        assert [o.token_ids for o in run(spec, prompts, params)] == [o.token_ids for o in run(plain, prompts, params)]
    else:
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outputs)


def test_stop_string_inside_accepted_run(references: dict, dense_pair: tuple) -> None:
    plain, spec, stats = dense_pair
    prompts, _ = references["dense"]
    texts = [o.text for o in run(plain, prompts, greedy())]
    stop = next(t[len(t) // 2 : len(t) // 2 + 3] for t in texts if len(t.strip()) > 8)
    outputs = assert_same(plain, spec, stats, prompts, greedy(stop=[stop]))
    assert any(o.finish_reason == "stop" for o in outputs)


def test_logprobs_of_accepted_tokens(references: dict, dense_pair: tuple) -> None:
    plain, spec, stats = dense_pair
    prompts, _ = references["dense"]
    params = greedy(logprobs=2, max_tokens=8)
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    for want, have in zip(expected, got, strict=True):
        assert list(have.token_ids) == list(want.token_ids)
        assert len(have.logprobs) == len(want.logprobs) == 8
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            assert a.keys() == b.keys()
            for token, entry in a.items():
                assert b[token].rank == entry.rank
                assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_without_async_scheduling(references: dict) -> None:
    prompts, continuation = references["dense"]
    llm = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, async_scheduling=False)
    stats = enable_reference_drafts(llm.engine.core, continuation, "mixed", 3)
    assert [list(o.token_ids) for o in run(llm, prompts, greedy())] == [continuation[tuple(p)] for p in prompts]
    assert 0 < stats["accepted"] < stats["drafts"]


@pytest.mark.parametrize("mode", ["all", "mixed"])
def test_penalties_count_the_drafts_before_each_position(mode: str) -> None:
    """With repetition / frequency / presence penalties, position j of a verify chunk is penalised as if drafts
    0 .. j-1 had been generated, and the accepted tokens join the counts: the outputs are those without
    speculation (whose continuation the drafts follow here)."""
    params = greedy(repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.6)
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    prompts = make_prompts(plain)
    expected = [list(o.token_ids) for o in run(plain, prompts, params)]
    assert expected != [list(o.token_ids) for o in run(plain, prompts, greedy())]  # the penalties change tokens
    spec = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    continuation = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    stats = enable_reference_drafts(spec.engine.core, continuation, mode, 3)
    assert [list(o.token_ids) for o in run(spec, prompts, params)] == expected
    assert stats["accepted"] > 0
