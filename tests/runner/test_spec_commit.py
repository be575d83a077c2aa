"""runner/spec_commit.py on a speculating engine: the GDN state slots and the verify scratch (conv windows, token
rows) are laid out so that the commit finds every layer's tensors as one stack (one launch on the GPU), and the
stacked commit leaves the states exactly as the per-layer loop does, on the trained tiny checkpoints (dense, moe,
next) in fp32."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.runner import spec_commit
from deltaserve.runner.spec_commit import commit_gdn_states, gdn_stacks, stack_views
from deltaserve.tiny.trained import trained_model_dir

NAMES = ("conv_states", "ssm_states", "spec_conv_scratch", "spec_row_scratch")


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_states_and_scratch_stack_and_the_stacked_commit_equals_the_loop(variant: str) -> None:
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})  # fmt: skip
    model = llm.engine.core.runner.model
    mixers = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
    for name in NAMES:
        assert stack_views([getattr(m, name) for m in mixers]) is not None, f"{name}: the layers' views do not stack"
    generator = torch.Generator().manual_seed(0)
    for m in mixers:  # distinct values everywhere, so a wrong entry or slot shows
        for name in NAMES:
            t = getattr(m, name)
            t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype))
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    accepted = torch.tensor([1, 3, 3])
    saved = {name: [getattr(m, name).clone() for m in mixers] for name in NAMES}
    calls = []
    real = spec_commit.spec_state_commit_layers

    def counted(*args: object) -> None:
        calls.append(1)
        real(*args)

    stacks = gdn_stacks(model)
    assert stacks is not None
    assert llm.engine.core.runner.spec.gdn_stacks is not None, "the SpecDecoder found the stacks"
    with mock.patch.object(spec_commit, "spec_state_commit_layers", counted):
        commit_gdn_states(model, stacks, slots, accepted, 4)
    assert calls == [1], "the stacked commit did not run"
    stacked = {name: [getattr(m, name).clone() for m in mixers] for name in NAMES}
    for name in NAMES:  # back to the start, then the per-layer loop
        for m, t in zip(mixers, saved[name], strict=True):
            getattr(m, name).copy_(t)
    commit_gdn_states(model, None, slots, accepted, 4)  # the per-layer loop
    for name in NAMES:
        for i, m in enumerate(mixers):
            assert torch.equal(getattr(m, name), stacked[name][i]), f"{name} of GDN layer {i} differs"
    assert not torch.equal(stacked["conv_states"][0][2], saved["conv_states"][0][2]), "slot 2 was not committed"
