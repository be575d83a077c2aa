"""vLLM's --stream-interval: a streamed sequence's deltas gather that many tokens (its first token and its finish go
at once), cumulative outputs are sent every step as vLLM sends them, and the tokens are the same whatever the
interval."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.api import cli
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import RequestOutputKind, SamplingParams

from ..api.test_api_flags import parse


def run(engine: LLMEngine, kind: RequestOutputKind, n: int = 1) -> list[list[list[int]]]:
    """Per step that reported the request: each sequence's token ids in that output."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=kind, n=n, seed=1)
    engine.add_request("r", "The cat sat on the mat", params)
    steps = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            steps.append([list(seq.token_ids) for seq in sorted(output.outputs, key=lambda seq: seq.index)])
    return steps


def test_deltas_gather_the_interval(tiny_dense: Path) -> None:
    plain = LLMEngine(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256))
    every = run(plain, RequestOutputKind.DELTA)
    assert [len(step[0]) for step in every] == [1] * 8
    gathered = LLMEngine(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256, stream_interval=3))
    chunks = run(gathered, RequestOutputKind.DELTA)
    # the first token at once, then three at a time, the finish with what is left
    assert [len(step[0]) for step in chunks] == [1, 3, 3, 1]
    assert [t for step in chunks for t in step[0]] == [t for step in every for t in step[0]]
    # cumulative outputs are not held back (vLLM's offset moves only in delta mode)
    assert [len(step[0]) for step in run(gathered, RequestOutputKind.CUMULATIVE)] == list(range(1, 9))


def test_the_flag_and_its_bounds() -> None:
    assert cli.build_engine_config(parse("m", "--stream-interval", "4"), "m", "cpu").stream_interval == 4
    assert cli.build_engine_config(parse("m"), "m", "cpu").stream_interval == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig(model="m", stream_interval=bad)
