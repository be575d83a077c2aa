"""benchmarks/verify_rows.py: which rows it compares (a rejected draft's row and the rows after it in its call are
not comparable; nothing past the first differing token is), and, on the trained tiny dense checkpoint on the CPU,
that it finds a module that computes a verify row differently from the decode row and names it, and finds nothing
where both runs are the same engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import verify_rows  # noqa: E402

from deltaserve.tiny.trained import trained_model_dir  # noqa: E402


def _call(tokens: list[int], start: int, value: float) -> verify_rows.Call:
    rows = torch.full((len(tokens), 2), value)
    return verify_rows.Call(tokens, list(range(start, start + len(tokens))), {"layers.0.mlp": rows})


def test_rows_are_compared_only_where_their_history_is_the_plain_runs() -> None:
    plain = verify_rows.Run([5, 6, 7, 8, 9], [_call([5, 6], 0, 1.0), _call([7], 2, 1.0), _call([8], 3, 1.0)])
    # a verify at position 2 with drafts 8 (right) and 4 (wrong): rows 2 and 3 compare, row 4 saw token 4, not 9
    spec = verify_rows.Run([5, 6, 7, 8, 9], [_call([5, 6], 0, 1.0), _call([7, 8, 4], 2, 1.0)])
    rows = verify_rows.rows_by_position(spec, plain.tokens, limit=5)
    assert sorted(rows) == [0, 1, 2, 3]
    assert verify_rows.first_difference(plain, spec, ["layers.0.mlp"]) is None
    spec.calls[1].outputs["layers.0.mlp"][1] += 0.5  # position 3's row in the verify
    found = verify_rows.first_difference(plain, spec, ["layers.0.mlp"])
    assert found == {"position": 3, "module": "layers.0.mlp", "max_abs_diff": 0.5, "first_token_difference": 5}
    # past the first differing token nothing is compared
    spec.tokens = [5, 6, 7, 1, 9]
    assert verify_rows.first_difference(plain, spec, ["layers.0.mlp"]) is None


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    from transformers import AutoTokenizer

    from deltaserve.gates.tokens import make_text_prompts

    model = trained_model_dir("dense")
    return make_text_prompts(AutoTokenizer.from_pretrained(model), 1, 40, 0)[0]


def test_the_first_differing_module_and_position_are_named(prompt: list[int], monkeypatch) -> None:  # noqa: ANN001
    """The same engine twice finds every row equal; the second run with one MLP's output moved by a rounding step at
    one decode position (as a kernel that rounds a row differently would) is found there, in that module, though
    every later module of that row differs too."""
    model = str(trained_model_dir("dense"))
    plain = verify_rows.run_prompt(model, prompt, 12, "float32", "cpu", None)
    again = verify_rows.run_prompt(model, prompt, 12, "float32", "cpu", None)
    order = list(plain.calls[0].outputs)
    assert verify_rows.first_difference(plain, again, order) is None
    assert verify_rows.compared_positions(plain, again) == len(prompt) + 11
    target = len(prompt) + 3
    real_hook = verify_rows.hook_model

    def skewed(model: torch.nn.Module, calls: list) -> list:  # noqa: ANN001
        def nudge(_module: torch.nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            return output * (1 + 2**-20) if calls[-1].positions == [target] else output

        # registered first: hooks run in order, and the recording hook must see the moved output
        return [model.layers[2].mlp.register_forward_hook(nudge), *real_hook(model, calls)]

    monkeypatch.setattr(verify_rows, "hook_model", skewed)
    moved = verify_rows.run_prompt(model, prompt, 12, "float32", "cpu", None)
    found = verify_rows.first_difference(plain, moved, order)
    assert found is not None and (found["position"], found["module"]) == (target, "layers.2.mlp"), found
