"""The drafter drafts only what the next step may verify (StepPlan.num_drafts_next, docs/speculative-decoding.md#the-k-
policy), on the trained tiny dense / MoE / Next checkpoints with their MTP heads drafting (fp32, CPU), eager and
through the verify graphs' static-buffer code (uncaptured):

- greedy tokens with the k policy forcing k_step = 0 at every decode, and flipping between 0 and k (the acceptance
  rule at a high token cost, with a probe every second step), equal those without MTP and with vLLM's fixed k;
- every step runs the MTP layer once over its tokens (its KV follows the target's) and chains it only up to the
  drafts its plan asks for: at k_step = 0 no chained pass and no draft lm_head at all;
- no verify uses more drafts than the step before proposed for its sequence, and the spec-decode counters count
  exactly the drafts the plans verified (none at k_step = 0).
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run

K = 3
MAX_TOKENS = (12, 9, 5, 11, 7)  # per prompt: rows end at different steps (padding, plain decode rows)
VARIANTS = ("dense", "moe", "next")
POLICIES = {
    "zero": {"max_batch_tokens": 1},  # any decode count x (1 + 1) > 1: k_step 0 at every step with decodes
    # the trained heads' first position is accepted well under 0.5 of the time: k 0, but every second step a probe
    "flip": {"max_batch_tokens": 0, "token_cost": 0.5, "probe_interval": 2, "min_samples": 1, "measure_cost": False},
}


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def mtp_config(**extra: object) -> dict:
    return {"method": "mtp", "num_speculative_tokens": K, **extra}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per variant: prompts and their greedy tokens without MTP (checked equal with MTP at the fixed k)."""
    found = {}
    for variant in VARIANTS:
        plain = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(plain)
        expected = [list(o.token_ids) for o in run(plain, prompts, params())]
        fixed = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=mtp_config())
        assert [list(o.token_ids) for o in run(fixed, prompts, params())] == expected
        found[variant] = prompts, expected
    return found


def instrumented(llm: LLM) -> list[tuple[object, int]]:
    """Records (plan, MTP layer calls during its execute) for every step the runner executes (the drafter runs
    inside execute: no step of this engine defers its sampling)."""
    runner = llm.engine.core.runner
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    runner.model.mtp.register_forward_pre_hook(count)
    steps: list[tuple[object, int]] = []
    execute = runner.execute

    def recording_execute(plan, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 (execute's signature)
        before = calls[0]
        handle = execute(plan, *args, **kwargs)
        steps.append((plan, calls[0] - before))
        return handle

    runner.execute = recording_execute
    return steps


@pytest.mark.parametrize("path", ["eager", "graphs"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_drafter_drafts_what_the_next_step_may_verify(
    references: dict, variant: str, policy: str, path: str
) -> None:
    prompts, expected = references[variant]
    config = mtp_config(k_policy=POLICIES[policy])
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=config)
    graph_drafts: list[int] = []  # the drafts each post-sampling replay proposed
    if path == "graphs":
        runner = llm.engine.core.runner
        runner._use_spec_graphs(capture=False)
        graphs = runner.spec_graphs
        assert graphs.draft_counts == tuple(range(K + 1))  # a post-sampling graph for every count a plan may ask
        draft = graphs.draft

        def recording_draft(*args: object) -> None:
            graph_drafts.append(args[-1])
            draft(*args)

        graphs.draft = recording_draft
    steps = instrumented(llm)
    assert [list(o.token_ids) for o in run(llm, prompts, params())] == expected
    ready: dict[int, int] = {}  # row -> drafts the last step that planned it proposed for it (0: it did not sample)
    proposed = []
    for plan, calls in steps:
        num_drafts = K if plan.num_drafts_next is None else plan.num_drafts_next
        samples = any(s.needs_sample for s in plan.seqs)
        # one pass over the step's tokens, then a chained pass per draft past the first, for sampling rows only
        wanted = 0 if not plan.seqs else 1 + max(0, num_drafts - 1) if samples else 1
        assert calls == wanted, (plan.step_id, num_drafts, calls)
        for s in plan.seqs:
            assert s.num_draft_tokens <= ready.get(s.row, 0), (plan.step_id, s)
            ready[s.row] = num_drafts if s.needs_sample else 0
        for row in plan.removed:
            ready.pop(row, None)
        proposed.append(num_drafts)
    verified = [s.num_draft_tokens for plan, _ in steps for s in plan.seqs if s.num_draft_tokens]
    stats = llm.engine.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (len(verified), sum(verified))
    decodes = [s.num_draft_tokens for plan, _ in steps for s in plan.seqs if s.num_computed_tokens]
    if policy == "zero":  # nothing is proposed, from the prompts' step on (its sequences decode next)
        assert not verified and stats.spec_decode_num_accepted_tokens == 0 and set(proposed) == {0}
    else:  # k moves between 0 and k, and so do the drafts the steps propose
        assert {0, K} <= set(proposed) and {0, K} <= set(decodes)
        assert path == "eager" or {0, K} <= set(graph_drafts)  # the post-sampling replays stop where asked


@pytest.mark.parametrize("policy", [None, "flip"])
def test_a_verify_follows_a_step_that_sampled_its_sequence(policy: str | None) -> None:
    """A prompt whose chunked prefill leaves one token (a 16-token step budget), and sequences recomputed after
    forced preemptions: that 1-token chunk once verified the drafts its row held from another step (the drafter
    proposes only for the rows a step samples), counted as drafts vLLM never makes. Every verify chunk must follow,
    on its row, a chunk of its sequence that sampled; greedy tokens stay those without MTP."""
    extra = {} if policy is None else {"k_policy": POLICIES[policy]}
    kwargs = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16}
    plain = LLM(trained_model_dir("dense"), **kwargs)
    prompts = [p[:n] for p, n in zip(make_prompts(plain), (17, 23, 9), strict=False)]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [list(o.token_ids) for o in run(plain, prompts, sampling)]
    llm = LLM(trained_model_dir("dense"), speculative_config=mtp_config(**extra), **kwargs)
    steps = instrumented(llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling)
    collected: dict[str, list[int]] = {}
    num_steps = num_forced = 0
    while engine.has_unfinished():
        num_steps += 1
        if num_steps in (6, 11):  # mid-decode: the recompute of prompt + outputs is chunked again
            num_forced += engine.scheduler.preempt_all()
        for output in engine.step(by_output_kind=False):
            collected.setdefault(output.request_id, []).extend(output.outputs[0].token_ids if output.outputs else [])
    assert num_forced > 0
    assert [collected[str(i)] for i in range(len(prompts))] == expected
    sampled: dict[int, bool] = {}  # row -> whether the last chunk planned on it sampled
    verified = []
    for plan, _ in steps:
        for row in plan.removed:
            sampled.pop(row, None)
        for s in plan.seqs:
            if s.num_draft_tokens:
                assert sampled.get(s.row, False), (plan.step_id, s)
                verified.append(s.num_draft_tokens)
            sampled[s.row] = s.needs_sample
    stats = engine.stats()
    assert verified
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (len(verified), sum(verified))
