"""The GDN prefill scan's launch rule (kernels/gdn_triton.py scan_launch): its picks at the served shapes on a
132-SM card, the start-up warm-up's probes compiling every configuration a served call can pick, the rule's
configurations computing the prefill of the ref through the real launch path, and the fall-back to 2 stages where
3 do not fit the device's shared memory."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from triton.runtime.errors import OutOfResources

from deltaserve.kernels import gdn_triton
from deltaserve.kernels.gdn import gdn_prefill_ref
from deltaserve.kernels.gdn_triton import SCAN_FEW, SCAN_FEW_2_STAGES, SCAN_MANY, scan_launch, warmup_probes

from ._util import DEVICE, assert_close, poisoned_empty, randn, varlen_starts
from .test_gdn import _inputs

SMS = 132  # an H100 / H200
# (value heads, dv) of a rank's GDN layer: the 35B-A3B and the 27B, and the 27B at tensor parallel 4
SHAPES = {"35b-a3b": (32, 128), "27b": (48, 128), "27b-tp4": (12, 128)}


def test_the_rule_at_the_served_shapes() -> None:
    few, many = SCAN_FEW, SCAN_MANY
    # one sequence of either shape: 128 / 192 programs at BV 32, within two waves of 132 SMs
    assert scan_launch(1, 8192, 8192, 32, 128, SMS) == few
    assert scan_launch(1, 8192, 8192, 48, 128, SMS) == few
    # two 35B-A3B sequences: 256 programs, still within 264
    assert scan_launch(2, 4096, 2048, 32, 128, SMS) == few
    # past two waves: four sequences of equal length (the H100 sweep's 4 x 2048), BV 64
    assert scan_launch(4, 8192, 2048, 32, 128, SMS) == many
    assert scan_launch(2, 4096, 2048, 48, 128, SMS) == many
    # one long sequence beside short ones walks its chunks alone at the end: BV 32, 3 stages
    assert scan_launch(4, 8192 + 3, 8192, 32, 128, SMS) == few
    # the longest at exactly twice the mean still counts as even
    assert scan_launch(4, 4096, 2048, 32, 128, SMS) == many
    assert scan_launch(4, 4095, 2048, 32, 128, SMS) == few
    # no host hint: dissimilar, never a device sync to find out
    assert scan_launch(4, 8192, None, 32, 128, SMS) == few


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_tokens", "max_seq_len"),
    [(256, 8192, 4096), (8, 2048, 2048), (2, 8192, 8192), (3, 256, 256), (4, 6, 6), (8, 2048, 100)],
)
def test_warmup_probes_compile_whatever_a_served_call_can_pick(
    shape: str, max_num_seqs: int, max_num_tokens: int, max_seq_len: int
) -> None:
    """Every configuration a served prefill call can pick (random calls of up to max_num_seqs sequences of at most
    max_seq_len and max_num_tokens rows in all) is picked by a one-sequence prefill or one of the warm-up's probes;
    no probe is longer than a sequence may be."""
    hv, dv = SHAPES[shape]
    probes = warmup_probes(hv, dv, SMS, max_num_seqs, max_num_tokens, max_seq_len)
    for lengths in probes:
        assert len(lengths) <= max_num_seqs and sum(lengths) <= max_num_tokens and min(lengths) >= 1, lengths
        assert max(lengths) <= max_seq_len, lengths
    compiled = {scan_launch(1, n, n, hv, dv, SMS) for n in (1, min(max_num_tokens, max_seq_len))}
    compiled |= {scan_launch(len(ls), sum(ls), max(ls), hv, dv, SMS) for ls in probes}
    rng = random.Random(0)
    for _ in range(2000):
        num_seqs = rng.randint(1, min(max_num_seqs, max_num_tokens))
        total = rng.randint(num_seqs, max_num_tokens)
        kind = rng.choice(("random", "equal", "one long"))
        if kind == "random":  # a random composition of total into num_seqs parts
            cuts = sorted(rng.sample(range(1, total), num_seqs - 1))
            lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        elif kind == "equal":
            lengths = [min(total // num_seqs, max_seq_len)] * num_seqs
        else:
            lengths = [min(total - num_seqs + 1, max_seq_len)] + [1] * (num_seqs - 1)
        if max(lengths) > max_seq_len:
            continue  # no served call holds a sequence past max_model_len
        picked = scan_launch(num_seqs, sum(lengths), max(lengths), hv, dv, SMS)
        assert picked in compiled, f"{shape}: {num_seqs} sequences {lengths[:8]}... pick {picked}, compiled {compiled}"


def test_the_probes_carry_a_checkpoint_where_the_budget_allows() -> None:
    """The first sequence of each probe is two GDN chunks long where the step budget allows, so a probe run with an
    in-step checkpoint compiles the scan's HAS_CKPT variant of its configuration (runner/warmup.py)."""
    probes = warmup_probes(32, 128, SMS, 256, 8192, 4096)
    assert [len(p) for p in probes] == [3, 3], probes  # 3 x 128 programs pass 264; three for the uneven one too
    assert all(p[0] == 2 * gdn_triton.CHUNK for p in probes)
    assert probes[0] == (128, 128, 128) and probes[1] == (128, 1, 1)
    assert warmup_probes(32, 128, SMS, 2, 8192, 4096) == []  # two sequences never pass two waves: nothing to compile


def _prefill_case(lengths: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
    hk, hv, dk, dv = 1, 2, 64, 128
    inputs = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    states = randn(len(lengths), hv, dk, dv, scale=0.1)
    slots = torch.arange(len(lengths), device=DEVICE, dtype=torch.int32)
    init = torch.tensor([i % 2 == 0 for i in range(len(lengths))], device=DEVICE)
    return inputs, states, (varlen_starts(lengths), slots, init)


@pytest.mark.parametrize(("lengths", "hint", "config"), [([70, 66], 70, SCAN_MANY), ([130, 1, 1], 130, SCAN_FEW)])
def test_the_rule_picks_and_computes_the_prefill_through_the_launch_path(
    monkeypatch: pytest.MonkeyPatch, lengths: list[int], hint: int, config: tuple[int, int, int]
) -> None:
    """gdn_prefill_triton with the host hint takes the rule's pick (4 SMs, as off CUDA: 2 value heads x 4 column
    blocks a sequence pass two waves) and matches the ref at fp32."""
    monkeypatch.setattr(gdn_triton, "sm_count", lambda device: 4)  # on a GPU too, so both picks are met
    picks = []

    def recording(*args: Any) -> tuple[int, int, int]:
        picks.append(scan_launch(*args))
        return picks[-1]

    monkeypatch.setattr(gdn_triton, "scan_launch", recording)
    inputs, states, routing = _prefill_case(lengths)
    ref_states = states.clone()
    ref = gdn_prefill_ref(*inputs, ref_states, *routing)
    with poisoned_empty():
        out = gdn_triton.gdn_prefill_triton(*inputs, states, *routing, max_query_len=hint)
    assert picks == [config], picks
    assert_close("o", ref, out, 2e-5)
    assert_close("states", ref_states, states, 2e-5)


def test_three_stages_that_do_not_fit_fall_back_to_two_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch of SCAN_FEW that the device's shared memory refuses (Triton raises before running it) is launched
    again at SCAN_FEW_2_STAGES, and the device's later calls go there at once; the prefill still matches the ref."""
    monkeypatch.setattr(gdn_triton, "_SCAN_STAGES_DO_NOT_FIT", set())
    monkeypatch.setattr(gdn_triton, "sm_count", lambda device: 4)
    kernel = gdn_triton._gdn_chunk_scan_kernel
    stages: list[int] = []

    class RefusesThreeStages:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                stages.append(kwargs["num_stages"])
                if kwargs["num_stages"] == 3:
                    raise OutOfResources(117760, 101376, "shared memory")
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(gdn_triton, "_gdn_chunk_scan_kernel", RefusesThreeStages())
    for _ in range(2):
        inputs, states, routing = _prefill_case([70])
        ref_states = states.clone()
        ref = gdn_prefill_ref(*inputs, ref_states, *routing)
        out = gdn_triton.gdn_prefill_triton(*inputs, states, *routing, max_query_len=70)
        assert_close("o", ref, out, 2e-5)
        assert_close("states", ref_states, states, 2e-5)
    assert stages == [SCAN_FEW[2], SCAN_FEW_2_STAGES[2], SCAN_FEW_2_STAGES[2]], stages
    index = DEVICE.index if DEVICE.index is not None else 0
    assert {index} == gdn_triton._SCAN_STAGES_DO_NOT_FIT


def test_a_refusal_of_another_configuration_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_triton, "_SCAN_STAGES_DO_NOT_FIT", set())
    monkeypatch.setattr(gdn_triton, "sm_count", lambda device: 4)  # two sequences pick SCAN_MANY

    class Refuses:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                raise OutOfResources(1, 0, "shared memory")

            return launch

    monkeypatch.setattr(gdn_triton, "_gdn_chunk_scan_kernel", Refuses())
    inputs, states, routing = _prefill_case([70, 66])
    with pytest.raises(OutOfResources):
        gdn_triton.gdn_prefill_triton(*inputs, states, *routing, max_query_len=70)
    assert not gdn_triton._SCAN_STAGES_DO_NOT_FIT
