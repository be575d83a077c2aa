"""vLLM's speculative-decoding metrics (vllm/v1/spec_decode/metrics.py): the counts the engine core keeps from each
step's plan and result (engine/stats.py SpecDecodeCounts), vLLM's periodic "SpecDecoding metrics" log line, and the
four vllm:spec_decode_* counters on /metrics with vLLM's names, types, help text and position labels: present only
when speculative decoding is configured, as in vLLM (a real engine with the MTP layer loaded exports them at zero)."""

from __future__ import annotations

import dataclasses
import logging
import re

import httpx
import pytest

from deltaserve.engine.stats import EngineStats, SpecDecodeCounts
from deltaserve.engine_config import EngineConfig
from deltaserve.step import ScheduledSeq, StepPlan, StepResult

from .fake_engine import FakeEngine
from .server_thread import serve
from .test_api_metrics import scrape, value

# vLLM 0.26's line (its format string, with its %.2f / %d / %.3f / %.1f fields)
VLLM_LINE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: (\d+\.\d\d), Accepted throughput: (\d+\.\d\d) tokens/s, "
    r"Drafted throughput: (\d+\.\d\d) tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
    r"Per-position acceptance rate: ((?:\d\.\d{3}(?:, )?)+), Avg Draft acceptance rate: (\d+\.\d)%$"
)
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


def _seq(row: int, num_draft_tokens: int, num_computed: int = 10) -> ScheduledSeq:
    return ScheduledSeq(row, num_computed, 1 + num_draft_tokens, row, row, (), True, num_draft_tokens)


def _step(seqs: list[ScheduledSeq], tokens: list[tuple[int, ...]]) -> tuple[StepPlan, StepResult]:
    return StepPlan(0, tuple(seqs)), StepResult(0, tuple(tokens))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_follow_the_plans_drafts_and_the_accepted_tokens() -> None:
    counts = SpecDecodeCounts(3)
    prefill = ScheduledSeq(4, 0, 7, 4, None, (0,), True)  # samples one token and drafted nothing: not a draft
    no_sample = ScheduledSeq(5, 0, 7, 5, None, (1,), False)
    # accepted runs of 4 (all 3 drafts and the bonus), 1 (none), 2 (the first draft) tokens, and a seq with k = 2
    counts.observe_step(*_step([_seq(0, 3), _seq(1, 3), _seq(2, 3), _seq(3, 2), prefill, no_sample],
                               [(1, 2, 3, 4), (5,), (6, 7), (8, 9, 10), (11,), ()]))  # fmt: skip
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (4, 11, 3 + 0 + 1 + 2)
    assert counts.accepted_per_pos == [3, 2, 1]
    fields = counts.fields()
    assert fields["spec_decode_num_accepted_tokens_per_pos"] == (3, 2, 1) and fields["num_speculative_tokens"] == 3
    EngineStats(0, 0, 0.0, 1, 1, 1, 1, 0, **fields)  # the fields are EngineStats'


def test_vllms_log_line_once_per_interval_over_that_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    counts = SpecDecodeCounts(2, log_interval_s=10.0, clock=clock)
    counts.observe_step(*_step([_seq(0, 2), _seq(1, 2)], [(1, 2, 3), (4, 5)]))
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.stats"):
        clock.now += 5.0
        counts.maybe_log()
        assert "SpecDecoding" not in caplog.text  # not before the interval
        clock.now += 5.0
        counts.maybe_log()
    match = VLLM_LINE.search(caplog.records[-1].getMessage())
    assert match is not None, caplog.text
    # 2 drafts of 2 tokens, 3 accepted: mean length 1 + 3/2, per position 2/2 and 1/2, rate 75 %, over 10 s
    assert match.groups() == ("2.50", "0.30", "0.40", "3", "4", "1.000, 0.500", "75.0")
    # the next interval counts only its own drafts, and an interval without drafts writes nothing
    counts.observe_step(*_step([_seq(0, 2)], [(6,)]))
    clock.now += 10.0
    line = counts.log_line()
    assert line is not None and VLLM_LINE.search(line).group(1, 4, 5, 6) == ("1.00", "0", "2", "0.000, 0.000")
    clock.now += 10.0
    assert counts.log_line() is None


def test_metrics_names_types_labels_and_values(
    http: httpx.Client, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = fake_engine.stats
    spec = {"num_speculative_tokens": 3, "spec_decode_num_drafts": 7, "spec_decode_num_draft_tokens": 21,
            "spec_decode_num_accepted_tokens": 12, "spec_decode_num_accepted_tokens_per_pos": (6, 4, 2)}  # fmt: skip
    assert not any(name.startswith("vllm:spec_decode") for name in scrape(http))  # off: no series, as vLLM
    monkeypatch.setattr(fake_engine, "stats", lambda: dataclasses.replace(base(), **spec))
    families = scrape(http)
    text = http.get("/metrics").text
    for name, doc in SPEC_METRICS.items():
        assert families[name]["type"] == "counter"
        assert f"# HELP {name}_total {doc}" in text
    assert value(families, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 7
    assert value(families, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total") == 21
    assert value(families, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total") == 12
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_pos = [value(families, name, name + "_total", position=str(p)) for p in range(3)]
    assert per_pos == [6, 4, 2]


def test_a_real_engine_with_mtp_exports_them_at_zero() -> None:
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.tiny.trained import trained_model_dir

    config = EngineConfig(model=str(trained_model_dir("dense")), device="cpu", max_model_len=64, max_num_seqs=1,
                          speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    server = serve(AsyncEngine.from_config(config, multiprocess=False))
    try:
        with httpx.Client(base_url=server.base_url) as http:
            families = scrape(http)
    finally:
        server.stop()
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert {s[0] for s in families[name]["samples"]} == {name + "_total"}
    positions = sorted(dict(labels)["position"] for _, labels in families[name]["samples"])
    assert positions == ["0", "1"]
    for family in SPEC_METRICS:
        assert families[family]["type"] == "counter"
        # one zero sample per series (a position each for the per-position family): a family without its
        # samples is not one exported at zero
        samples = families[family]["samples"]
        assert {sample for sample, _ in samples} == {family + "_total"}, (family, samples)
        assert list(samples.values()) == [0] * (len(positions) if family == name else 1), (family, samples)
