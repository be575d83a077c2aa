"""The GPU start-up warm-up's plans: a step larger than one sequence runs as several (as the scheduler would
batch them), so the warm-up reaches max_num_batched_tokens even when it exceeds max_model_len. While speculating,
the warm-up's verify step (runner/verify_warmup.py): its bucket, its plans (through spec_layout and the runner's
checks), and the whole warm-up run on a CPU runner with the MTP drafter of a trained tiny checkpoint (the CPU runs
the steps unmeasured; tests/runner/test_gpu_warmup.py measures them on the GPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.runner import memory
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_layout import spec_layout
from deltaserve.runner.verify_warmup import PeakMeter, verify_warmup_plans, verify_warmup_rows, warm_up_verify
from deltaserve.runner.warmup import lengths_plan, profile_peak_bytes, warmup_plan
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import StepPlan
from deltaserve.tiny.trained import trained_model_dir


def test_warmup_plan_splits_a_step_into_sequences_of_at_most_max_len() -> None:
    plan = warmup_plan(0, 100, 40, 16, 1000)
    assert [s.num_new_tokens for s in plan.seqs] == [40, 40, 20]
    assert [s.write_slot for s in plan.seqs] == [0, 1, 2] and [r.row for r in plan.added] == [0, 1, 2]
    assert [s.new_block_ids for s in plan.seqs] == [(0, 1, 2), (3, 4, 5), (6, 7)]  # disjoint, enough for each
    assert all(s.num_computed_tokens == 0 and s.read_slot is None and not s.needs_sample for s in plan.seqs)
    assert [len(r.prompt_token_ids) for r in plan.added] == [40, 40, 20]
    (single,) = warmup_plan(0, 32, 40, 16, 1000).seqs
    assert single.num_new_tokens == 32 and single.new_block_ids == (0, 1)


def test_with_the_prefix_cache_the_warmup_saves_an_in_step_checkpoint(tiny_moe: Path) -> None:
    """The chunked prefill's in-step checkpoint variant compiles at start-up, not at the first served request: the
    warm-up's first sequence of each step longer than a GDN chunk saves one at 64 into a slot of its own."""
    plan = warmup_plan(0, 100, 40, 16, 1000, checkpoint_slot=3)
    assert [s.checkpoints for s in plan.seqs] == [(), (), ()]  # 40 tokens: no grid position inside
    plan = warmup_plan(0, 150, 100, 16, 1000, checkpoint_slot=2)
    assert [s.checkpoints for s in plan.seqs] == [((64, 2),), ()]
    # the GDN scan's probes (several sequences, the first two chunks long) save theirs alike
    plan = lengths_plan(0, (128, 1, 1), 16, 1000, checkpoint_slot=3)
    assert [s.checkpoints for s in plan.seqs] == [((64, 3),), (), ()]
    assert [s.num_new_tokens for s in plan.seqs] == [128, 1, 1] and [s.write_slot for s in plan.seqs] == [0, 1, 2]
    engine = LLMEngine(EngineConfig(model=str(tiny_moe), max_model_len=128, max_num_batched_tokens=160))
    runner = engine.runner
    result = runner.run(warmup_plan(0, 160, 128, runner.block_size, runner.vocab_size, checkpoint_slot=2))
    assert result.token_ids == ((), ())
    runner.execute(StepPlan(1, (), removed=(0, 1)))
    states = runner.model.layers[0].mixer.ssm_states
    assert states[2].abs().sum() > 0 and not torch.equal(states[2], states[0])


def test_a_split_warmup_step_runs_through_the_runner(tiny_moe: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_moe), max_model_len=64, max_num_batched_tokens=160))
    runner = engine.runner
    result = runner.run(warmup_plan(0, 160, 64, runner.block_size, runner.vocab_size))
    assert result.token_ids == ((), (), ())  # warm-up rows sample nothing
    runner.execute(StepPlan(1, (), removed=(0, 1, 2)))
    assert runner.table.num_active == 0
    states = runner.model.layers[0].mixer.ssm_states
    assert states is not None and torch.isfinite(states[:3]).all() and states[:3].abs().sum() > 0


def test_verify_warmup_rows_are_the_largest_verify_step_the_scheduler_may_plan() -> None:
    # 1,024 tokens of 1 + k = 4: above the largest verify-graph bucket (512 tokens), so such a step runs eager;
    # slots of 10 bytes, a verify chunk's scratch of 30 (k = 3 states: the last one is the live slot's)
    assert verify_warmup_rows(3, 256, 8192, 10**15, 10, 30) == 256  # max_num_seqs
    assert verify_warmup_rows(3, 1024, 2048, 10**15, 10, 30) == 512  # the token budget: 512 chunks of 4 tokens
    assert verify_warmup_rows(1, 1024, 2048, 10**15, 10, 10) == 1024
    assert verify_warmup_rows(3, 256, 8192, 1000, 10, 30) == 25  # beside a count set: 1000 bytes hold 25 of 40
    assert verify_warmup_rows(3, 256, 2, -5, 10, 30) == 1  # the floors: one chunk, as the served engine's
    # vLLM's default count sized to memory: half of 1000 bytes holds 12 sequences of a slot and 3 scratch states
    assert verify_warmup_rows(3, 256, 8192, 1000, 10, 30, is_sized=True) == 12
    # under the k policy the scratch is a quarter of the budget: 250 bytes hold 8 chunks of 30
    assert verify_warmup_rows(3, 256, 8192, 1000, 10, 30, is_sized=True, has_policy=True) == 8


def test_verify_warmup_plans_pass_spec_layout() -> None:
    prefill, decode, verify, removal = verify_warmup_plans(5, 3, 2, 4, 1000)
    assert [p.step_id for p in (prefill, decode, verify, removal)] == [5, 6, 7, 8]
    assert [r.row for r in prefill.added] == [0, 1, 2] and removal.removed == (0, 1, 2) and not removal.seqs
    assert all(s.needs_sample and s.read_slot is None and s.num_computed_tokens == 0 for s in prefill.seqs)
    # 1 prompt token + 1 decoded + 1 + k + (k - 1) drafter lookahead = 7 tokens: 2 blocks of 4 a row, disjoint
    assert [s.new_block_ids for s in prefill.seqs] == [(0, 1), (2, 3), (4, 5)]
    # the plain decode: one token a row, no drafts, so the step runs the decode path (no spec layout)
    assert decode.num_decodes == 3 and [(s.num_computed_tokens, s.num_new_tokens) for s in decode.seqs] == [(1, 1)] * 3
    assert all(s.num_draft_tokens == 0 and s.read_slot == s.write_slot == s.row for s in decode.seqs)
    assert [s.num_computed_tokens for s in verify.seqs] == [2, 2, 2]
    qsl = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in verify.seqs])])
    layout = spec_layout(verify.seqs, qsl, np.arange(3), verify.num_decodes)
    assert verify.num_decodes == 0 and layout.seq_index.tolist() == [0, 1, 2]
    assert layout.num_drafts.tolist() == [2, 2, 2] and layout.num_tokens == 9
    assert layout.sample_counts.tolist() == [3, 3, 3] and layout.state_slots.tolist() == [0, 1, 2]


@pytest.fixture(scope="module")
def mtp_runner():  # noqa: ANN201 (yields a ModelRunner)
    """A CPU runner speculating with the trained tiny dense checkpoint's MTP head, k = 2; the tests below leave its
    caches unbound (the warm-up's throw-away caches replace them), so nothing else uses it."""
    llm = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, max_model_len=64,
              max_num_batched_tokens=64, speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    yield llm.engine.runner
    del llm


def count_drafter_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every MtpDrafter.propose call from now on, in order (the drafter still runs)."""
    drafted: list[int] = []
    propose = MtpDrafter.propose

    def counting_propose(self: MtpDrafter, inputs):  # noqa: ANN001, ANN202 (the drafter's own signature)
        drafted.append(len(inputs.rows))
        return propose(self, inputs)

    monkeypatch.setattr(MtpDrafter, "propose", counting_propose)
    return drafted


def test_verify_warmup_step_runs_through_the_runner_with_its_drafter(
    mtp_runner, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    runner = mtp_runner
    table, spec = runner.table, runner.spec
    drafted = count_drafter_rows(monkeypatch)
    accepted: list[int] = []
    accept = SpecDecoder.accept

    def counting_accept(self: SpecDecoder, handle, *args):  # noqa: ANN001, ANN002, ANN202 (accept's own signature)
        accepted.append(len(handle.layout.seq_index))
        return accept(self, handle, *args)

    monkeypatch.setattr(SpecDecoder, "accept", counting_accept)
    result = warm_up_verify(runner, 4, PeakMeter(runner.device))
    assert accepted == [4]  # one step of 4 verify chunks went through the accept rule
    # each verify chunk emitted its accepted drafts and one token of the target's: 1 .. 1 + k
    assert len(result.token_ids) == 4 and all(1 <= len(t) <= 3 for t in result.token_ids)
    assert drafted == [4, 4, 4]  # after the prefill, the plain decode and the verify step (the removal: empty)
    assert runner.table is table and runner.spec is spec  # the runner's own, back in place


def test_warmup_with_speculation_runs_a_verify_step_on_the_cpu(
    mtp_runner, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    runner = mtp_runner
    table, spec = runner.table, runner.spec
    drafted = count_drafter_rows(monkeypatch)
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.warmup"):
        assert profile_peak_bytes(runner, 64, 64, 8) == 0  # unmeasured off CUDA
    # the drafter after each of the 7 prefills (64, 32, ..., 1 tokens: no row samples), the GDN scan's two probes
    # (4 SMs off CUDA: 3 sequences each) with and without a checkpoint, then after the verify warm-up's prefill, its
    # plain decode and its verify step (8 rows each)
    assert drafted == [0] * 7 + [0] * 4 + [8, 8, 8]
    # the CPU budget (cpu_kv_cache_bytes) and the 64-token step hold max_num_seqs = 8 chunks of 1 + k = 3
    assert "a verify step of 8 rows of 3 tokens with drafts and the MTP drafter" in caplog.text
    assert runner.table is table and runner.spec is spec
    mixers = [layer.mixer for layer in runner.model.layers]
    assert all(getattr(m, "spec_conv_scratch", None) is None for m in mixers)  # every throw-away view dropped
    assert all(m.k_cache is None and m.conv_states is None for m in mixers)
    assert runner.model.mtp.attention.k_cache is None and runner.model.mtp.slot_hidden is None


@pytest.mark.parametrize("speculative_config", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_start_up_runs_the_warmup_before_the_runner_has_a_spec(
    speculative_config: dict | None, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The GPU's start-up order on the CPU: the warm-up (while speculating with its verify step) runs inside the
    runner's constructor, before the runner's own SpecDecoder exists (execute() reads it on every step), and what it
    leaves behind changes no served token."""
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 64, "max_num_batched_tokens": 64,
              "speculative_config": speculative_config}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 17, 29, 5]}, {"prompt_token_ids": [11, 2]}]
    plain = LLM(trained_model_dir("dense"), **kwargs)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    peaks: list[int] = []

    def warm_then_budget(runner, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:  # noqa: ANN001
        peaks.append(profile_peak_bytes(runner, max_num_batched_tokens, max_model_len, max_num_seqs))
        return runner.engine_config.cpu_kv_cache_bytes

    # runner/warmup.py defines it; size_caches looks it up in runner/memory.py
    monkeypatch.setattr(memory, "cache_budget", warm_then_budget)
    warmed = LLM(trained_model_dir("dense"), **kwargs)
    assert peaks == [0]
    assert [list(o.outputs[0].token_ids) for o in warmed.generate(prompts, params, use_tqdm=False)] == expected
