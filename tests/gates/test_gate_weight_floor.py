"""The token gate's verdict on a prompt whose logit or split error passes the fixed bounds: within 10x of the
reference's own change under one rounding of every weight it is listed as ill-conditioned and the check holds;
beyond that, or with no floor measured, the check fails. Built from hand-made PromptResults (no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.gates import tokens
from deltaserve.gates.references import ReferenceRun


def _verdict(results: list[tokens.PromptResult]) -> tuple[int, list[str]]:
    report = tokens.GateReport()
    run = ReferenceRun([[1]] * len(results), [[]] * len(results), {"class": "X"})
    code = tokens.report_verdict(report, results, "float32", Path("m"), "transformers", run, "random", None)
    return code, report.lines


def _result(index: int, logit: float = 1e-6, split: float = 1e-7, floor: float | None = None) -> tokens.PromptResult:
    result = tokens.PromptResult(index, 10, True, logit_rel_error=logit, split_rel_error=split, noise_floor=1e-6)
    result.weight_floor = floor
    return result


def test_well_conditioned_prompts_pass_without_any_listing() -> None:
    code, lines = _verdict([_result(0), _result(1)])
    assert code == 0 and not any("ill-conditioned" in line for line in lines)


@pytest.mark.parametrize(
    ("logit", "split", "floor", "expected"),
    [
        (5e-3, 1e-7, 1e-3, 0),  # logit error within 10x the reference's own change: ill-conditioned, listed
        (5e-2, 1e-7, 1e-3, 1),  # 50x: a defect
        (5e-3, 1e-7, None, 1),  # above the tolerance with nothing measured: fails
        (1e-6, 5e-3, 1e-3, 0),  # the split check the same way
        (1e-6, 5e-2, 1e-3, 1),
    ],
)
def test_errors_above_the_bounds_are_judged_against_the_weight_floor(
    logit: float, split: float, floor: float | None, expected: int
) -> None:
    code, lines = _verdict([_result(0), _result(1, logit, split, floor)])
    assert code == expected
    listed = [line for line in lines if line.startswith("  prompt 1:")]
    assert len(listed) == 1 and listed[0].endswith("ill-conditioned" if expected == 0 else "FAIL"), lines


def test_floors_are_measured_only_for_prompts_above_the_bounds() -> None:
    results = [_result(0), _result(1, logit=1e-3), _result(2, split=1e-3)]
    asked: list[int] = []
    tokens.measure_weight_floors(results, "float32", lambda i: asked.append(i) or 1.0)
    assert asked == [1, 2] and results[0].weight_floor is None and results[1].weight_floor == 1.0


@pytest.mark.parametrize(
    ("margin", "expected"),
    [
        (2e-4, 0),  # a top-k margin under 10x the fp32 logit tolerance: a router near-tie, listed as such
        (5e-3, 1),  # a clear routing choice: the logit error beyond the weight floor is a defect
    ],
)
def test_a_logit_error_beyond_the_weight_floor_at_a_router_near_tie_is_ill_conditioned(
    margin: float, expected: int
) -> None:
    result = _result(1, logit=1e-2, floor=1e-4)  # 100x its weight floor
    result.routing_margin = (29, 6, margin)
    code, lines = _verdict([_result(0), result])
    assert code == expected
    (listed,) = [line for line in lines if line.startswith("  prompt 1:")]
    assert "position 29" in listed and "layer 6" in listed
    assert listed.endswith("ill-conditioned (router near-tie)" if expected == 0 else "FAIL"), listed


def test_routing_margins_are_measured_at_the_first_position_over_the_bound_of_the_prompt_only() -> None:
    """Only for prompts above the bound and beyond their weight floor, at the first position over the bound, and
    not when that position is in the continuation (the margins cover the prompt's prefill)."""
    results = [_result(0), _result(1, logit=1e-2, floor=1e-4), _result(2, logit=1e-2, floor=5e-3),
               _result(3, logit=1e-2, floor=1e-4)]  # fmt: skip
    first_over = {1: 4, 2: 4, 3: 12}  # prompt 3's first position over the bound is past its 10 prompt tokens
    margins = (torch.arange(10, dtype=torch.float32) * 1e-4, torch.arange(10) % 3)
    asked: list[int] = []
    tokens.measure_router_ties(results, "float32", first_over, lambda i: asked.append(i) or margins)
    assert asked == [1]  # 2 is within its weight floor, 3 is over the bound in its continuation
    assert results[1].routing_margin == (4, 1, pytest.approx(4e-4)) and results[3].routing_margin is None


def test_first_position_over_the_bound() -> None:
    ref = torch.ones(6, 4)
    ours = ref.clone()
    ours[3, 0] += 1e-2  # alone 2e-3 of the whole reference's norm
    ours[5, 1] += 1e-1
    assert tokens.first_position_over(ours, ref, 1e-3) == 3
    assert tokens.first_position_over(ours, ref, 1e-1) == 5  # none alone over: the worst
