"""benchmarks/oracle/gdn_prefill_kernels.py `--cases`: the sizes the GDN prefill side by side times (the crossover
between deltaserve's kernel and the libraries lies between its default cases), parsed on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    path = REPO / "benchmarks/oracle/gdn_prefill_kernels.py"
    spec = importlib.util.spec_from_file_location("gdn_prefill_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cases_name_single_sequences_and_batches() -> None:
    cases = _tool().parse_cases("2048, 4096,4x2048,8192")
    assert cases == (
        ("isl2048", (2048,)),
        ("isl4096", (4096,)),
        ("4x2048", (2048, 2048, 2048, 2048)),
        ("isl8192", (8192,)),
    )


@pytest.mark.parametrize("spec", ["", "x2048", "4x", "2048tokens", "0", "0x64", "-4x2048", "4x2x64"])
def test_malformed_cases_are_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--cases"):
        _tool().parse_cases(spec)


def test_the_default_cases_are_the_recorded_ones() -> None:
    # the committed record's rows (benchmarks/results/kernels/gdn-prefill-ab-h200-20261206-s28.json) used these
    labels = [label for label, _ in _tool().CASES]
    assert labels == ["isl1024", "isl3072", "8x1024", "isl16384"]


HK, HV, DIM = 2, 4, 8  # the tiny head shape the input builders are checked at


def _our_inputs(
    seed: int, lengths: list[int], slots: list[int], has_initial: list[bool], num_slots: int | None = None
) -> dict:
    """make_our_inputs' dict on the CPU at a tiny head shape: raw q/k/v/a/b, A_log, dt_bias, the slot pool and the
    routing of sequences of `lengths` tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return {
        "q": torch.randn(tokens, HK, DIM, generator=gen),
        "k": torch.randn(tokens, HK, DIM, generator=gen),
        "v": torch.randn(tokens, HV, DIM, generator=gen),
        "a": torch.randn(tokens, HV, generator=gen),
        "b": torch.randn(tokens, HV, generator=gen),
        "A_log": torch.rand(HV, generator=gen),
        "dt_bias": torch.randn(HV, generator=gen),
        "ssm_states": torch.randn(num_slots or len(lengths), HV, DIM, DIM, generator=gen),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "state_indices": torch.tensor(slots, dtype=torch.int32),
        "has_initial_state": torch.tensor(has_initial),
    }


def test_same_values_gives_the_peers_our_inputs_through_the_prep_twin() -> None:
    """--same-values: the peers' q/k/v/g/beta are what our prep's twin makes of our raw inputs (one token batch, the
    vLLM layout with its leading 1), the start states are ours transposed to [N, HV, dv, dk], cu_seqlens ours."""
    import torch

    from deltaserve.kernels.gdn_flashinfer import gdn_prefill_prep_ref

    ours = _our_inputs(seed=0, lengths=[3, 3], slots=[0, 1], has_initial=[True, True])
    peers = _tool().peer_inputs_from_ours(ours)
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    want = dict(zip(("q", "k", "v", "g", "beta"), gdn_prefill_prep_ref(*(ours[n] for n in names)), strict=True))
    for name, value in want.items():
        assert peers[name].shape == (1, *value.shape) and torch.equal(peers[name][0], value), name
    assert torch.equal(peers["initial_state"], ours["ssm_states"].transpose(-1, -2))
    assert peers["initial_state"].is_contiguous() and peers["cu_seqlens"] is ours["query_start_loc"]


def test_served_inputs_hold_vllms_layer_layout_of_our_values() -> None:
    """triton-served / flashinfer-served: the conv output rows are q | k | v of each token (vLLM's split reads them
    so), the state cache is ours transposed to [slots, HV, dv, dk], the slots index it as int64."""
    import torch

    tokens, hk, hv, dim = 5, HK, HV, DIM
    ours = _our_inputs(seed=1, lengths=[2, 3], slots=[2, 0], has_initial=[True, False], num_slots=3)
    served = _tool().served_inputs_from_ours(ours)
    rows = served["conv_output"]
    assert rows.shape == (tokens, 2 * hk * dim + hv * dim) and rows.is_contiguous()
    assert torch.equal(rows[:, : hk * dim].view(tokens, hk, dim), ours["q"])
    assert torch.equal(rows[:, hk * dim : 2 * hk * dim].view(tokens, hk, dim), ours["k"])
    assert torch.equal(rows[:, 2 * hk * dim :].view(tokens, hv, dim), ours["v"])
    assert torch.equal(served["ssm_state"], ours["ssm_states"].transpose(-1, -2))
    assert served["state_indices"].dtype == torch.int64 and served["num_k_heads"] == hk


def test_baseline_runs_an_earlier_kernel_file_on_our_inputs(tmp_path: Path) -> None:
    """`--baseline FILE`: the file is imported as a module of its own, and its gdn_prefill_triton runs on our inputs;
    a baseline that is the served file gives the served op's outputs and states, and a changed file does not."""
    import torch

    from deltaserve.kernels.gdn_triton import gdn_prefill_triton

    source = (REPO / "deltaserve/kernels/gdn_triton.py").read_text()
    (tmp_path / "same.py").write_text(source)
    changed = source.replace(
        "b_beta = tl.where(m_t, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)", "b_beta = tl.where(m_t, 0.5, 0.0)"
    )
    assert changed != source
    (tmp_path / "changed.py").write_text(changed)
    generator = torch.Generator().manual_seed(0)

    def inputs() -> dict:
        generator.manual_seed(0)
        return {
            "q": torch.randn(80, 2, 16, generator=generator), "k": torch.randn(80, 2, 16, generator=generator),
            "v": torch.randn(80, 4, 16, generator=generator), "a": torch.randn(80, 4, generator=generator),
            "b": torch.randn(80, 4, generator=generator), "A_log": torch.zeros(4), "dt_bias": torch.zeros(4),
            "ssm_states": torch.randn(2, 4, 16, 16, generator=generator),
            "query_start_loc": torch.tensor([0, 70, 80], dtype=torch.int32),
            "state_indices": torch.tensor([0, 1], dtype=torch.int32),
            "has_initial_state": torch.tensor([True, False]),
        }  # fmt: skip

    served_in = inputs()
    served = gdn_prefill_triton(**served_in)
    same_in = inputs()
    same = _tool().load_baseline(str(tmp_path / "same.py"))(**same_in)
    assert torch.equal(same, served) and torch.equal(same_in["ssm_states"], served_in["ssm_states"])
    changed_in = inputs()
    assert not torch.allclose(_tool().load_baseline(str(tmp_path / "changed.py"))(**changed_in), served)


def test_scan_configs_parse_and_refuse_by_name() -> None:
    assert _tool().parse_scan_configs("32x4x2, 64x2x3") == [(32, 4, 2), (64, 2, 3)]
    for spec in ("", "32x4", "32x4x0", "ax4x2", "32x4x2x1"):
        with pytest.raises(ValueError, match="--scan-configs"):
            _tool().parse_scan_configs(spec)


def test_variants_load_as_modules_of_their_own(tmp_path: Path) -> None:
    """`--variant FILE` (repeatable): each file is its own module, named by its stem, so two variants never share
    one kernel's compiled code or globals."""
    source = (REPO / "deltaserve/kernels/gdn_triton.py").read_text()
    first, second = tmp_path / "abl-one.py", tmp_path / "abl_two.py"
    first.write_text(source)
    second.write_text(source.replace("SCAN_FEW = (32, 4, 3)", "SCAN_FEW = (16, 4, 3)"))
    tool = _tool()
    one, two = tool.load_baseline(str(first)), tool.load_baseline(str(second))
    assert one.__module__ == "deltaserve.kernels._gdn_triton_abl_one"
    assert two.__module__ == "deltaserve.kernels._gdn_triton_abl_two"
    # the tool wraps each file's gdn_prefill_triton (it passes only the arguments that file takes)
    assert one.__wrapped__.__globals__["SCAN_FEW"] == (32, 4, 3)
    assert two.__wrapped__.__globals__["SCAN_FEW"] == (16, 4, 3)
