"""The engine's profiling hooks: the model's profiler labels (model/labels.py) and the runner's step observer
(runner/observer.py). Off, the labels record nothing and return one shared no-op; on, every layer (index and kind)
and every op has its range. The observer sees every collected step with its plan, result and host timings. Neither
changes a token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.model import labels
from deltaserve.runner.observer import StepTimings
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import StepPlan, StepResult

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8]]
MAX_TOKENS = 6


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS, one request each, stepped to the end."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step(by_output_kind=False):  # deltas
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    return tokens


def _profiled(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tokens = _generate(engine)
    return tokens, [e.name for e in prof.events() if e.name.startswith(labels.PREFIX)]


@pytest.fixture(scope="module")
def engine(tiny_moe: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_moe), device="cpu", max_model_len=128))


def test_labels_are_off_by_default_and_record_nothing(engine: LLMEngine) -> None:
    assert not labels.is_enabled()
    assert labels.label("attn.qkv_proj") is labels.label("lm.lm_head")  # the shared no-op: nothing built per op
    tokens, names = _profiled(engine)
    assert names == []
    assert all(len(t) == MAX_TOKENS for t in tokens.values())


def test_labels_name_every_layer_and_op_and_change_no_token(engine: LLMEngine) -> None:
    plain = _generate(engine)
    with labels.enabled():
        tokens, names = _profiled(engine)
    assert not labels.is_enabled()  # put back after the block
    assert tokens == plain
    found = {name.removeprefix(labels.PREFIX) for name in names}
    config = engine.model_config
    for index, layer_type in enumerate(config.layer_types):
        assert f"layer.{index}.{layer_type}" in found, (index, sorted(found))
    ops = {"lm.embed", "lm.lm_head", "lm", "layer.rms_norm", "layer.rope_cos_sin_for_positions", "attn.qkv_proj",
           "attn.attn_preamble", "attn.store_kv", "attn.paged_attention", "attn.sigmoid_gate_mul", "attn.o_proj",
           "gdn.in_proj_qkvzba", "gdn.causal_conv1d_update", "gdn.causal_conv1d_prefill", "gdn.gdn_decode",
           "gdn.gdn_prefill", "gdn.gated_rms_norm", "gdn.out_proj", "mlp.fused_moe_block"}  # fmt: skip
    assert ops <= found, sorted(ops - found)


def test_the_step_observer_sees_every_collected_step(engine: LLMEngine) -> None:
    plain = _generate(engine)
    seen: list[tuple[StepPlan, StepResult, StepTimings]] = []
    engine.runner.set_step_observer(lambda plan, result, timings: seen.append((plan, result, timings)))
    try:
        tokens = _generate(engine)
    finally:
        engine.runner.set_step_observer(None)
    assert tokens == plain
    # one prefill step, then a step per further token (every row samples in each)
    assert len(seen) >= MAX_TOKENS
    for plan, result, timings in seen:
        assert plan.step_id == result.step_id and not plan.is_empty
        assert len(result.token_ids) == len(plan.seqs)
        assert 0 <= timings.wait_s <= timings.collect_s and timings.launch_s > 0
        assert timings.launched_at <= timings.collected_at
    step_ids = [plan.step_id for plan, _, _ in seen]
    assert step_ids == sorted(step_ids)
    sampled = [t for _, result, _ in seen for row in result.token_ids for t in row]
    assert len(sampled) == sum(len(t) for t in tokens.values())
    _generate(engine)  # removed: the list does not grow
    assert len(seen) == len(step_ids)
