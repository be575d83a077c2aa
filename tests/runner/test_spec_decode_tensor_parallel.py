"""Speculative decoding with the MTP layer under tensor parallelism on the CPU: two ranks over gloo (rank 0 here, one
spawned worker), fp32, the trained tiny dense and MoE checkpoints (runner/spec_ranks.py).

- greedy tokens with MTP at TP=2 (k = 1 and 3; MoE also with expert parallelism) are the tokens of one rank without
  speculation, and the engine's spec-decode counters (the vllm:spec_decode_* series) equal one rank's with MTP: the
  same drafts were proposed and the same ones accepted;
- grammar-constrained, bad-words and seeded random rows speculate at TP=2 (deferred sampling: rank 0 walks the
  drafts through the grammars, then tells the worker what it accepted) with one rank's tokens and counters;
- the worker exits cleanly (code 0) at shutdown.
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.engine.test_spec_decode_batching import PROMPT, constrained

MAX_TOKENS = 16
ENGINE = {"dtype": "float32", "device": "cpu", "max_num_seqs": 8}
COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def counters(llm: LLM) -> dict[str, object]:
    stats = llm.engine.stats()
    return {name: getattr(stats, name) for name in COUNTERS}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per variant: the prompts and their greedy tokens at one rank without speculation."""
    found = {}
    for variant in ("dense", "moe"):
        llm = LLM(trained_model_dir(variant), **ENGINE)
        prompts = make_prompts(llm)
        found[variant] = prompts, [list(o.token_ids) for o in run(llm, prompts, greedy())]
    return found


def shut_down_cleanly(llm: LLM) -> None:
    (process,) = llm.engine.runner.workers.processes
    llm.shutdown()
    assert process.exitcode == 0  # the worker left its loop on rank 0's shutdown message, not killed


def assert_greedy_like_one_rank(references: dict, variant: str, k: int, two: LLM) -> None:
    """two (MTP at TP=2) gives the greedy tokens of one rank without speculation and the counters of one rank with
    MTP on the variant's prompts."""
    prompts, expected = references[variant]
    one = LLM(trained_model_dir(variant), speculative_config=mtp(k), **ENGINE)
    assert [list(o.token_ids) for o in run(one, prompts, greedy())] == expected
    assert [list(o.token_ids) for o in run(two, prompts, greedy())] == expected
    drafted, reference = counters(two), counters(one)
    assert drafted == reference
    assert drafted["spec_decode_num_accepted_tokens"] > 0  # drafts were accepted, and rejected ones rolled back
    assert drafted["spec_decode_num_accepted_tokens"] < drafted["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize(
    ("variant", "k", "engine"),
    [("dense", 1, {}), ("moe", 1, {}), ("moe", 3, {"enable_expert_parallel": True})],
    ids=["dense-k1", "moe-k1", "moe-k3-expert-parallel"],
)
def test_two_ranks_with_mtp_give_one_rank_tokens_and_counters(
    references: dict, variant: str, k: int, engine: dict
) -> None:
    two = LLM(trained_model_dir(variant), speculative_config=mtp(k), tensor_parallel_size=2, **ENGINE, **engine)
    try:
        assert_greedy_like_one_rank(references, variant, k, two)
    finally:
        shut_down_cleanly(two)


def test_dense_k3_greedy_constrained_and_seeded_rows_at_two_ranks(references: dict) -> None:
    """One engine (one worker start): the greedy prompts, then grammar, bad-words and seeded random rows, which
    sample deferred (rank 0 walks the drafts through the grammars) and by the random rule (rank 0's generators)."""
    two = LLM(trained_model_dir("dense"), speculative_config=mtp(3), tensor_parallel_size=2, **ENGINE)
    try:
        with pytest.raises(ValueError, match="every rank builds its MTP drafter"):
            two.engine.core.enable_speculation(3, object())  # a drafter object cannot reach the worker
        assert_greedy_like_one_rank(references, "dense", 3, two)
        params = constrained()
        one = LLM(trained_model_dir("dense"), speculative_config=mtp(3), **ENGINE)
        expected = one.generate([PROMPT] * len(params), params, use_tqdm=False)
        before = counters(two)
        outputs = two.generate([PROMPT] * len(params), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
        after = counters(two)
        assert {n: after[n] - before[n] for n in COUNTERS[:3]} == {n: counters(one)[n] for n in COUNTERS[:3]}
        assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    finally:
        shut_down_cleanly(two)
