"""The decode graphs' buckets (runner/cuda_graph.py) are vLLM 0.26's capture sizes: the count itself as the last
bucket below 512, never a bucket above 512 (vLLM's default max_cudagraph_capture_size; a larger step runs eager), so
the static buffers the cache budget keeps for them are at most 512 rows."""

from __future__ import annotations

from deltaserve.runner.cuda_graph import buckets, capture_sizes, static_bytes


def test_the_count_is_the_last_bucket_below_512() -> None:
    assert capture_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(1) == [1]


def test_no_bucket_above_512() -> None:
    for count in (512, 513, 1024):
        sizes = capture_sizes(count)
        assert sizes[-1] == 512 and sizes == sorted(set(sizes)) and sizes[-2] == 496
    assert buckets(1024) == (capture_sizes(512), 512, 512)
    # the budget's reservation at vLLM's default count of 1,024 on a large GPU: 512 rows (0.71 GiB), not 1,024
    assert static_bytes(buckets(1024)[2], 248_320) == 512 * 248_320 * 6
