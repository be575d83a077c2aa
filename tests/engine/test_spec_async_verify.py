"""Async verify (docs/speculative-decoding.md#async-verify): with `async_verify`, a speculating sequence's next chunk is
planned while its verify chunk runs, at the start that assumes every draft accepted, and the runner moves it back on
the device by the drafts that verify rejected (runner/spec_chain.py). On the CPU, fp32, the trained tiny dense / MoE /
Next checkpoints drafting with their MTP heads (whose drafts are partly rejected, so chunks do move):

- greedy tokens equal those without speculation, eager and through the verify graphs' code (uncaptured), and
  chained chunks were planned and moved back (removing either move changes the tokens: checked when written);
- one request at a time, the drafts every verify step checked and the spec-decode counters equal those with
  async_verify off: the drafter continues where the accepted run really ended;
- stop tokens, stop strings, max_tokens, min_tokens and seeded sampling, n = 2 and preemption in a small KV pool
  give the tokens of async_verify off (rows that must not chain: scheduler/spec.py `can_chain`);
- with the CUDA calls stood in (tests/support/fake_cuda.py), the captured verify graphs replay chained steps and
  give a plain CPU engine's tokens;
- the spec-decode counters skip the chained verify in flight of a sequence that stopped (its result is dropped);
- under a k policy, chained plain decodes replayed through the width-1 graphs' code keep the tokens and logprobs.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.runner import inputs as runner_inputs
from deltaserve.runner import model_runner, spec_chain
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.engine.test_spec_decode_batching import SMALL_CACHE, varied_prompts
from tests.runner.test_cuda_paths_on_cpu import BASE, PEAK, TOGETHER, TOTAL, fake_gpu_llm
from tests.support.fake_cuda import fake_cuda

MAX_TOKENS = (16, 6, 5, 14, 7)  # rows end at different steps


def mtp(k: int, is_async: bool = True) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "async_verify": is_async}


def greedy(max_tokens: int = 12, **kwargs: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


def params() -> list[SamplingParams]:
    return [greedy(n) for n in MAX_TOKENS]


def tokens_of(outputs: list) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


class Shifts:
    """Counts, over the steps executed while it is installed, the chained chunks and how far they were moved back
    (every step with one computes its shift through spec_chain.start_shift)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.chained = self.moved = 0
        start_shift = spec_chain.start_shift

        def counting(layout, table, device):  # noqa: ANN001, ANN202 (start_shift's signature)
            shift = start_shift(layout, table, device)
            self.chained += int(layout.chained.sum())
            self.moved += 0 if shift is None else int(shift.sum())
            return shift

        monkeypatch.setattr(spec_chain, "start_shift", counting)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    found = {}
    for variant in ("dense", "moe", "next"):
        plain = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(plain)
        found[variant] = prompts, tokens_of(run(plain, prompts, params()))
    return found


@pytest.mark.parametrize(
    ("variant", "k", "graphs"),
    [("dense", 1, False), ("dense", 3, True), ("moe", 3, False), ("moe", 2, True), ("next", 3, True)],
)
def test_greedy_equals_no_speculation(
    references: dict, variant: str, k: int, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, expected = references[variant]
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=mtp(k))
    if graphs:
        llm.engine.core.runner._use_spec_graphs(capture=False)
        replays = []
        graphs_run = llm.engine.core.runner.spec_graphs.run
        llm.engine.core.runner.spec_graphs.run = lambda *args: replays.append(1) or graphs_run(*args)
    shifts = Shifts(monkeypatch)
    assert tokens_of(run(llm, prompts, params())) == expected
    assert shifts.chained > 0 and shifts.moved > 0, (shifts.chained, shifts.moved)
    if graphs:
        assert replays


def verify_drafts(llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict]:
    """Each prompt alone: its tokens, and for every verify step (prompt, the true start of its chunk) -> the drafts
    it checked. A chained chunk's true start is its planned one less the shift it was moved back by."""
    engine = llm.engine
    runner = engine.core.runner
    spec = runner.spec
    found: dict[tuple[int, int], list[int]] = {}
    current: dict[str, object] = {}
    start_shift = spec_chain.start_shift

    def recording_shift(layout, table, device):  # noqa: ANN001, ANN202 (start_shift's signature)
        current["shift"] = shift = start_shift(layout, table, device)
        return shift

    fill = spec.fill_draft_inputs

    def recording_fill(input_ids, layout):  # noqa: ANN001, ANN202 (SpecDecoder's own signature)
        step = current["layout"]
        (index,) = layout.seq_index.tolist()  # one request at a time: one verify chunk
        shift = current.get("shift")
        start = int(step.starts[index]) - (0 if shift is None else int(shift[index]))
        found[(current["prompt"], start)] = spec.draft_tokens[layout.draft_rows, layout.draft_cols].tolist()
        return fill(input_ids, layout)

    layout_step = runner_inputs.layout_step

    def recording_layout(*args):  # noqa: ANN002, ANN202 (layout_step's signature)
        current["layout"] = layout = layout_step(*args)
        current["shift"] = None
        return layout

    monkeypatch.setattr(spec_chain, "start_shift", recording_shift)
    monkeypatch.setattr(model_runner, "layout_step", recording_layout)
    spec.fill_draft_inputs = recording_fill
    outputs = []
    for index, prompt in enumerate(prompts):
        current["prompt"] = index
        outputs.append(tokens_of(run(llm, [prompt], greedy(16)))[0])
    return outputs, found


@pytest.mark.parametrize(("variant", "graphs"), [("dense", False), ("moe", True)])
def test_the_drafter_continues_where_the_accepted_run_ended(
    references: dict, variant: str, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wherever a verify with async_verify starts at a position a verify without it also starts at, the drafts it
    checks are the same (one request at a time: the same computations): the MTP drafter after a chained chunk drafts
    from the true end of the accepted run, not the planned one, eager and in the verify graphs' post-sampling code."""
    prompts, _ = references[variant]
    runs = []
    for is_async in (False, True):
        llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=mtp(3, is_async))
        if graphs:  # the post-sampling graph's drafter (uncaptured) reads the static buffers' starts
            llm.engine.core.runner._use_spec_graphs(capture=False)
        with monkeypatch.context() as patch:
            shifts = Shifts(patch)
            runs.append(verify_drafts(llm, prompts[:3], patch))
    (off_tokens, off_drafts), (on_tokens, on_drafts) = runs
    assert on_tokens == off_tokens
    assert shifts.moved > 0  # some verify started before its planned start
    common = sorted(set(off_drafts) & set(on_drafts))
    assert len(common) >= len(on_drafts) // 2, (len(common), len(on_drafts))
    for key in common:
        width = min(len(off_drafts[key]), len(on_drafts[key]))
        assert on_drafts[key][:width] == off_drafts[key][:width], key


@pytest.fixture(scope="module")
def dense_pair() -> tuple[LLM, LLM]:
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    spec = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=mtp(3))
    return plain, spec


def assert_same(pair: tuple[LLM, LLM], prompts: list[list[int]], sampling: object) -> list:
    plain, spec = pair
    expected, got = run(plain, prompts, sampling), run(spec, prompts, sampling)
    assert tokens_of(got) == tokens_of(expected)
    assert [o.text for o in got] == [o.text for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    return got


def test_stops_and_lengths_inside_chained_runs(references: dict, dense_pair: tuple[LLM, LLM]) -> None:
    prompts, _ = references["dense"]
    continuation = tokens_of(run(dense_pair[0], prompts, greedy(16)))
    stops = [greedy(16, stop_token_ids=[c[5]], ignore_eos=False) for c in continuation]
    assert all(o.finish_reason == "stop" for o in assert_same(dense_pair, prompts, stops))
    texts = [o.text for o in run(dense_pair[0], prompts, greedy(16))]
    stop = next(t[len(t) // 2 : len(t) // 2 + 3] for t in texts if len(t.strip()) > 8)
    assert_same(dense_pair, prompts, greedy(16, stop=[stop]))
    for max_tokens in (1, 2, 4, 9):
        assert all(len(o.token_ids) == max_tokens for o in assert_same(dense_pair, prompts, greedy(max_tokens)))


def test_rows_that_must_not_chain_keep_their_tokens(references: dict, dense_pair: tuple[LLM, LLM]) -> None:
    """min_tokens (the runner's mask reads its host output count) chains only once reached; a seeded random row
    (its generator follows the output index) never chains; n = 2 samples two sequences of one request."""
    prompts, _ = references["dense"]
    continuation = tokens_of(run(dense_pair[0], prompts, greedy(16)))
    masked = [greedy(16, min_tokens=7, stop_token_ids=[c[1]], ignore_eos=False) for c in continuation]
    assert all(len(o.token_ids) >= 7 for o in assert_same(dense_pair, prompts, masked))
    # seeded random rows sample through the rejection rule with MTP (not the tokens of no MTP): against MTP without
    # async_verify, whose steps they take exactly (they never chain)
    off = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=mtp(3, False))
    seeded = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(5)]
    assert_same((off, dense_pair[1]), prompts, seeded)
    spec = dense_pair[1]
    # n = 2 seeded (greedy n > 1 is refused, as vLLM 0.26 refuses it): against MTP without async_verify, as above
    both = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], both, use_tqdm=False)
    want = off.generate([{"prompt_token_ids": p} for p in prompts], both, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in got] == [
        [list(c.token_ids) for c in o.outputs] for o in want
    ]


def test_preemption_in_a_small_kv_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = LLM(trained_model_dir("moe"), dtype="float32", **SMALL_CACHE)
    prompts = varied_prompts(plain)
    sampling = greedy(30)
    expected = tokens_of(run(plain, prompts, sampling))
    llm = LLM(trained_model_dir("moe"), dtype="float32", speculative_config=mtp(3), **SMALL_CACHE)
    shifts = Shifts(monkeypatch)
    assert tokens_of(run(llm, prompts, sampling)) == expected
    assert llm.engine.core.scheduler.num_preemptions_total > 0 and shifts.moved > 0


def test_captured_verify_graphs_replay_chained_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = {**BASE, "enable_prefix_caching": False, "speculative_config": mtp(3)}
    sampling = [greedy(n) for n in (12, 5, 8)]
    prompts = [{"prompt_token_ids": ids} for ids in TOGETHER]
    want = tokens_of(o.outputs[0] for o in LLM(trained_model_dir("dense"), **{**kwargs, "speculative_config": None})
                     .generate(prompts, sampling, use_tqdm=False))  # fmt: skip
    budgets: list[int] = []
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:
        llm = fake_gpu_llm(trained_model_dir("dense"), budgets, **kwargs)
        assert llm.engine.runner.spec_graphs.is_captured
        shifts = Shifts(monkeypatch)
        got = tokens_of(o.outputs[0] for o in llm.generate(prompts, sampling, use_tqdm=False))
    assert got == want
    assert cuda.replays > 0 and shifts.chained > 0 and shifts.moved > 0
    assert torch.equal(torch.tensor([len(t) for t in got]), torch.tensor([12, 5, 8]))


COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def test_spec_decode_counters_skip_verifies_whose_sequence_already_stopped(
    references: dict, dense_pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence that stops inside a verify's accepted run usually has a chained verify in flight, whose result is
    dropped; as vLLM skips a finished request's output, the spec-decode counters (vllm:spec_decode_*) do not count
    it (before: 11 drafts counted where 6 were applied)."""
    prompts, _ = references["dense"]
    spec = dense_pair[1]
    continuation = tokens_of(run(dense_pair[0], prompts, greedy(16)))
    stops = [greedy(16, stop_token_ids=[c[4]], ignore_eos=False) for c in continuation]
    scheduler = spec.engine.core.scheduler
    update = scheduler.update
    counts = {"live": [0, 0, 0], "stale": 0}

    def counting_update(plan, result):  # noqa: ANN001, ANN202 (Scheduler.update's signature)
        entries = scheduler._inflight[plan.step_id]
        for (seq, _, _, _), item, tokens in zip(entries, plan.seqs, result.token_ids, strict=True):
            if not item.num_draft_tokens or not tokens:
                continue
            if seq.is_finished:
                counts["stale"] += 1
            else:
                for i, value in enumerate((1, item.num_draft_tokens, len(tokens) - 1)):
                    counts["live"][i] += value
        return update(plan, result)

    monkeypatch.setattr(scheduler, "update", counting_update)
    before = spec.engine.stats()
    assert all(o.finish_reason == "stop" for o in run(spec, prompts, stops))
    after = spec.engine.stats()
    assert counts["stale"] > 0  # some sequence stopped with a chained verify in flight
    assert [getattr(after, f) - getattr(before, f) for f in COUNTERS] == counts["live"]


def test_chained_plain_decodes_of_the_k_policy_run_through_the_width_one_graphs(
    references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a k policy flipping k between 0 and 3 (a probe every second step), a plain decode planned behind a verify
    in flight is chained too, and an all-decode step runs through the width-1 graphs' code (uncaptured), whose static
    buffers take the shift as the verify graphs' do: greedy tokens and their logprobs equal those without
    speculation. (The tokens alone do not notice a width-1 replay left unshifted; its logprobs move by ~0.06.)"""
    prompts, _ = references["dense"]
    sampling = [greedy(n, logprobs=0) for n in MAX_TOKENS]
    expected = run(LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8), prompts, sampling)
    flip = {"max_batch_tokens": 0, "token_cost": 0.5, "probe_interval": 2, "min_samples": 1, "measure_cost": False}
    llm = LLM(
        trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=mtp(3) | {"k_policy": flip}
    )
    runner = llm.engine.core.runner
    runner._use_spec_graphs(capture=False)
    shifted = []
    graphs_run = runner.spec_decode_graphs.run

    def recording_run(layout, inputs, table, block_size):  # noqa: ANN001, ANN202 (VerifyGraphs.run's signature)
        shifted.append(inputs.start_shift is not None and bool(inputs.start_shift.any()))
        return graphs_run(layout, inputs, table, block_size)

    runner.spec_decode_graphs.run = recording_run
    shifts = Shifts(monkeypatch)
    got = run(llm, prompts, sampling)
    assert tokens_of(got) == tokens_of(expected)
    assert shifts.moved > 0 and any(shifted), (shifts.moved, shifted)
    for ours, theirs in zip(got, expected, strict=True):
        for index, token in enumerate(theirs.token_ids):
            assert ours.logprobs[index][token].logprob == pytest.approx(theirs.logprobs[index][token].logprob, abs=1e-4)


def test_a_runner_that_does_not_track_verify_ends_refuses_chained_chunks(references: dict) -> None:
    """The runner records where verifies end only with async verify on (per-step work nothing else reads); a chained
    chunk reaching a runner without that record is refused, never run from a stale start."""
    prompts, _ = references["dense"]
    off = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=mtp(3, False))
    assert not off.engine.core.runner.spec.tracks_next_start
    llm = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=mtp(3))
    runner = llm.engine.core.runner
    assert runner.spec.tracks_next_start
    runner.spec.tracks_next_start = False
    with pytest.raises(ValueError, match="does not track where verifies end"):
        run(llm, prompts, params())
