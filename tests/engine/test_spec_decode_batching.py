"""Speculative decoding (MTP drafts) under the engine's batching machinery, fp32 on the trained tiny dense checkpoint:
preemptions (the KV cache running out, and forced ones that drop verify results in flight) with outputs equal to a
run without speculation; n > 1 (each of the n sequences samples as its own seeded request); async scheduling on and
off, with greedy and seeded requests mixed in one batch; prompt logprobs and prefill-only logits unchanged;
grammar-constrained requests that speculate, grammars that start after a token included."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.engine.structured import StructuredOutputManager
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.engine.test_spec_decode_mtp import mtp_llm
from tests.support.drafts import enable_reference_drafts

# a cache of 20 blocks of 4 tokens (with the MTP layer's KV and the verify scratch) for 10 sequences of up to 55
# tokens: it runs out; the prefix cache stays on (its default) with one checkpoint slot (34 KB, the 40 KB added to the
# budget), so hits and speculation meet here too
SMALL_CACHE = {"max_num_seqs": 10, "max_num_batched_tokens": 48, "block_size": 4, "cpu_kv_cache_bytes": 640_000,
               "max_model_len": 64, "num_checkpoint_slots": 1}  # fmt: skip


def varied_prompts(llm: LLM) -> list[list[int]]:
    return [p[: 10 + 3 * i] for i, p in enumerate(make_prompts(llm) * 2)]


def test_preemptions_keep_greedy_outputs() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = LLM(trained_model_dir("dense"), dtype="float32", **SMALL_CACHE)
    prompts = varied_prompts(plain)
    expected = [list(o.token_ids) for o in run(plain, prompts, params)]
    spec, stats = mtp_llm("dense", 3, **SMALL_CACHE)
    assert [list(o.token_ids) for o in run(spec, prompts, params)] == expected
    assert spec.engine.scheduler.num_preemptions_total > 0  # the cache ran out
    assert stats["accepted_per_position"][0] > 0
    # forced preemptions at random steps: verify chunks in flight are dropped and their sequences recomputed
    engine, rng = spec.engine, random.Random(3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    collected: dict[str, list[int]] = {}
    num_forced = 0
    while engine.has_unfinished():
        if rng.random() < 0.15:
            num_forced += engine.scheduler.preempt_all()
        for output in engine.step(by_output_kind=False):
            collected.setdefault(output.request_id, []).extend(output.outputs[0].token_ids if output.outputs else [])
    assert num_forced > 0
    assert [collected[str(i)] for i in range(len(prompts))] == expected
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_free_state_slots == stats.num_total_state_slots


def test_n_sequences_sample_as_their_seeded_requests() -> None:
    spec, stats = mtp_llm("dense", 3)
    prompt = make_prompts(spec)[0][:6]  # a short prompt: the memorised paragraphs leave little to sample
    params = SamplingParams(n=3, temperature=1.2, seed=40, max_tokens=16, ignore_eos=True)
    (output,) = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completions = [list(c.token_ids) for c in output.outputs]
    assert len(completions) == 3 and len({tuple(c) for c in completions}) > 1
    for i, completion in enumerate(completions):  # the i-th of n samples with seed + i
        single = SamplingParams(temperature=1.2, seed=40 + i, max_tokens=16, ignore_eos=True)
        assert list(run(spec, [prompt], single)[0].token_ids) == completion
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):  # vLLM's rule
        SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    assert stats["accepted_per_position"][0] > 0


def test_async_scheduling_on_and_off_agree() -> None:
    outputs = {}
    for is_async in (True, False):
        llm, stats = mtp_llm("dense", 3, async_scheduling=is_async)
        prompts = make_prompts(llm)
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=20, ignore_eos=True)
                  for i in range(len(prompts))]  # fmt: skip
        outputs[is_async] = [list(o.token_ids) for o in run(llm, prompts, params)]
        assert stats["accepted_per_position"][0] > 0
    assert outputs[True] == outputs[False]


def test_prompt_logprobs_and_prefill_logits_are_unchanged() -> None:
    """Prompt logprobs (of chunks sharing steps with verify chunks) and a prefill-only request's logits are those
    of an engine without speculation."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    spec, stats = mtp_llm("dense", 3, max_num_batched_tokens=16)
    prompts = make_prompts(plain)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    outputs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert stats["accepted_per_position"][0] > 0
    assert len(expected) == len(prompts) > 0
    for prompt, want, got in zip(prompts, expected, outputs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        # vLLM's layout, in both: one entry per prompt token, None for the first (nothing predicts it), then the
        # prompt token's logprob with the top 2 (2 keys, or 3 where the prompt token is not among them)
        for logprobs in (want.prompt_logprobs, got.prompt_logprobs):
            assert len(logprobs) == len(prompt) > 1 and logprobs[0] is None
            entries = zip(prompt[1:], logprobs[1:], strict=True)
            assert all(token in entry and 2 <= len(entry) <= 3 for token, entry in entries)
        for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) for t in a)
    logits = plain.engine.prefill_logits(prompts[0], [10, 14])
    assert torch.allclose(spec.engine.prefill_logits(prompts[0], [10, 14]), logits, atol=1e-4)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "boolean"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def constrained() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["the", "a b"]),
    ]


PROMPT = "Hello there"


def test_constrained_requests_speculate() -> None:
    """Grammars and multi-token bad words speculate: each position of a verify chunk is masked as the grammar stands
    after the drafts before it (deferred sampling walks them and rolls back), and the accepted tokens advance it.
    Greedy and constrained rows give the tokens of an engine without speculation, the constraints hold, the seeded
    random row reproduces (it samples by the speculative rule: the same distribution, another draw)."""
    params = constrained()
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    spec, stats = mtp_llm("dense", 3, max_num_batched_tokens=16)
    expected = plain.generate([PROMPT] * len(params), params, use_tqdm=False)
    outputs = spec.generate([PROMPT] * len(params), params, use_tqdm=False)
    got, want = ([o.outputs[0].token_ids for o in outs] for outs in (outputs, expected))
    assert [got[i] for i in (0, 1, 2, 4)] == [want[i] for i in (0, 1, 2, 4)]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs[1].outputs[0].text)
    value = json.loads(outputs[2].outputs[0].text)
    assert set(value) == {"name", "n"} and len(value["name"]) <= 6
    assert [o.outputs[0].token_ids for o in spec.generate([PROMPT] * len(params), params, use_tqdm=False)] == got
    assert stats["accepted_per_position"][0] > 0


@pytest.mark.parametrize("mode", ["all", "none", "mixed"])
def test_constrained_requests_with_reference_drafts(mode: str) -> None:
    """Drafts that follow the constrained continuation (all accepted), break the grammar (every one shifted, so
    mostly tokens the grammar forbids: rejected by their position's mask) or mix both: the same tokens."""
    params = [p for p in constrained() if p.temperature == 0]
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    expected = plain.generate([PROMPT] * len(params), params, use_tqdm=False)
    spec = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    ids = spec.get_tokenizer()(PROMPT)["input_ids"]
    # one prompt, several requests: the drafts follow the constrained JSON (the longest continuation)
    stats = enable_reference_drafts(spec.engine.core, {tuple(ids): list(expected[2].outputs[0].token_ids)}, mode, 3)
    outputs = spec.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert stats["drafts"] > 0
    if mode != "none":
        assert stats["accepted"] > 0


# a prompt the dense checkpoint answers with varied tokens (to "Hello there" it repeats one)
START_PROMPT = "Once upon a time, the"


def start_after(plain: LLM) -> tuple[SamplingParams, int]:
    """A reasoning chat's constraint, on the dense checkpoint: a regex that starts after a token of the greedy
    answer to START_PROMPT (its first occurrence, at output position 2 or later, as </think> ends a reasoning phase);
    returns the params and that position."""
    free = plain.generate([START_PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = list(free[0].outputs[0].token_ids)
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}", start_after_token_id=tokens[index])
    return SamplingParams(temperature=0, max_tokens=index + 16, structured_outputs=so), index


def check_start_after(outputs: list, expected: list, index: int, llm: LLM) -> None:
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [list(o.outputs[0].token_ids) for o in expected]
    after = llm.get_tokenizer().decode(got[0][index + 1 :], skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", after), after


def test_a_grammar_that_starts_after_a_token_speculates() -> None:
    """A grammar waiting for its start token (a reasoning model's </think>) speculates: its verify positions are
    unmasked until a draft is that token and masked after it as the grammar stands after the drafts that follow;
    greedy tokens equal an engine's without speculation and the grammar holds after the start token."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    params, index = start_after(plain)
    expected = plain.generate([START_PROMPT, PROMPT], [params, constrained()[0]], use_tqdm=False)
    spec, stats = mtp_llm("dense", 3, max_num_batched_tokens=16)
    outputs = spec.generate([START_PROMPT, PROMPT], [params, constrained()[0]], use_tqdm=False)
    check_start_after(outputs, expected, index, spec)
    alone, alone_stats = mtp_llm("dense", 3, max_num_batched_tokens=16)
    check_start_after(alone.generate([START_PROMPT], [params], use_tqdm=False), expected[:1], index, alone)
    assert alone_stats["drafts"] > 0 and alone_stats["verifies"] > 0, alone_stats


@pytest.mark.parametrize("mode", ["all", "none", "mixed"])
def test_a_grammar_that_starts_after_a_token_with_reference_drafts(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Drafts that follow the constrained answer (the start token among them, then the grammar's tokens), break it,
    or mix both: the tokens of an engine without speculation; with drafts that follow it, some verify chunk holds the
    start token as a draft, so the positions after it are masked from the drafts alone."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    params, index = start_after(plain)
    expected = plain.generate([START_PROMPT], [params], use_tqdm=False)
    spec = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)
    ids = spec.get_tokenizer()(START_PROMPT)["input_ids"]
    stats = enable_reference_drafts(spec.engine.core, {tuple(ids): list(expected[0].outputs[0].token_ids)}, mode, 3)
    found = []
    starts_in = StructuredOutputManager._starts_in
    monkeypatch.setattr(
        StructuredOutputManager, "_starts_in", staticmethod(lambda s, d: found.append(starts_in(s, d)) or found[-1])
    )
    outputs = spec.generate([START_PROMPT], [params], use_tqdm=False)
    check_start_after(outputs, expected, index, spec)
    assert stats["drafts"] > 0
    if mode == "all":
        assert stats["accepted"] > 0 and any(found), found
