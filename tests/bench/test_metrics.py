"""Metric math on hand-made timings: vLLM's TTFT/TPOT/ITL/E2EL, throughputs, goodput, peaks, percentiles."""

from __future__ import annotations

import pytest

from deltaserve.bench.metrics import (
    RequestResult,
    compute_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    peak_concurrent_requests,
    peak_output_tokens_per_s,
    percentile_key,
)


def ok(start: float, ttft: float, itl: list[float], num_out: int, prompt_len: int = 10) -> RequestResult:
    latency = ttft + sum(itl)
    return RequestResult(prompt_len, True, start, ttft, latency, list(itl), num_out)


def failed() -> RequestResult:
    return RequestResult(prompt_len=99, is_success=False, error="HTTP 500")


def test_basic_definitions() -> None:
    results = [ok(0.0, 0.1, [0.02, 0.03], 3), ok(0.05, 0.2, [0.05], 2, prompt_len=20), failed()]
    m = compute_metrics(results, 2.0, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.0))
    assert m["completed"] == 2 and m["failed"] == 1
    # Only successful requests count, failed prompt tokens included nowhere.
    assert m["total_input_tokens"] == 30
    assert m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["p99_ttft_ms"] == pytest.approx(100.0 + 0.99 * 100.0)
    # TPOT = (E2EL - TTFT) / (out - 1): (0.15 - 0.1) / 2 and (0.25 - 0.2) / 1.
    assert m["mean_tpot_ms"] == pytest.approx((25.0 + 50.0) / 2)
    # ITL is pooled over requests: 20, 30, 50 ms.
    assert m["mean_itl_ms"] == pytest.approx(100.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["mean_e2el_ms"] == pytest.approx(200.0)
    assert m["request_goodput"] is None


def test_tpot_skips_single_token_requests_but_goodput_counts_them_as_zero() -> None:
    results = [ok(0.0, 0.5, [], 1), ok(0.0, 0.1, [0.1, 0.1], 3)]
    m = compute_metrics(results, 1.0, ("tpot",), (99.0,), {"tpot": 1.0})
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # only the 3-token request
    # The single-token request has TPOT 0 for goodput, so it meets a 1 ms SLO; the other does not.
    assert m["request_goodput"] == pytest.approx(1.0)


def test_goodput_requires_every_slo() -> None:
    results = [ok(0.0, 0.1, [0.01] * 4, 5), ok(0.0, 0.3, [0.01] * 4, 5), ok(0.0, 0.1, [0.2] * 4, 5)]
    m = compute_metrics(results, 2.0, goodput_slos_ms={"ttft": 200.0, "e2el": 500.0})
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets both
    m = compute_metrics(results, 2.0, goodput_slos_ms={"ttft": 100.0})
    assert m["request_goodput"] == pytest.approx(1.0)  # <= holds at the boundary


def test_selected_metrics_only_and_percentile_names() -> None:
    m = compute_metrics([ok(0.0, 0.1, [0.1], 2)], 1.0, ("ttft", "itl"), (50.0, 99.9))
    assert "p99.9_ttft_ms" in m and "p50_itl_ms" in m
    assert not any("tpot" in key or "e2el" in key for key in m)
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_empty_and_all_failed_runs_do_not_crash() -> None:
    m = compute_metrics([failed(), failed()], 1.0, ("ttft", "tpot", "itl", "e2el"), (99.0,))
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["mean_ttft_ms"] == 0.0 and m["max_output_tokens_per_s"] == 0.0 and m["max_concurrent_requests"] == 0


def test_peak_output_tokens_per_second_buckets_token_arrivals() -> None:
    # Request A: arrivals at 0.5, 0.6, 0.7, 1.2; request B (start 1.0): arrivals at 1.1, 1.3, 2.5.
    a = ok(0.0, 0.5, [0.1, 0.1, 0.5], 4)
    b = ok(1.0, 0.1, [0.2, 1.2], 3)
    assert peak_output_tokens_per_s([a, b, failed()]) == 3.0  # bins [0,1): 3, [1,2): 3, [2,3): 1


def test_peak_concurrency_is_a_half_open_sweep() -> None:
    back_to_back = [ok(0.0, 0.5, [0.5], 2), ok(1.0, 0.5, [0.5], 2)]
    assert peak_concurrent_requests(back_to_back) == 1
    overlapping = [ok(0.0, 1.0, [1.0], 2), ok(1.0, 1.0, [1.0], 2), ok(1.5, 0.1, [], 1)]
    assert peak_concurrent_requests(overlapping) == 3
    assert peak_concurrent_requests([failed()]) == 0


def test_parsers_validate() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99") == [50.0, 90.0, 99.0]
    with pytest.raises(ValueError):
        parse_percentiles("0,50")
    assert parse_metric_names("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)
