"""A process that serves on a GPU runs torch's CPU ops on one thread once started (as vLLM's workers); an explicit
OMP_NUM_THREADS or DELTASERVE_CPU_THREADS is left alone, and so is CPU execution, where the threads run the model."""

from __future__ import annotations

import pytest
import torch

from deltaserve.runner import threads


def test_the_serving_thread_rule() -> None:
    assert threads.serving_threads("cuda", {}) == 1
    assert threads.serving_threads("cuda", {"OMP_NUM_THREADS": "4"}) is None
    assert threads.serving_threads("cuda", {"DELTASERVE_CPU_THREADS": "2"}) is None
    assert threads.serving_threads("cuda", {"OMP_NUM_THREADS": ""}) == 1  # an empty value names no count
    assert threads.serving_threads("cpu", {}) is None


def test_applied_on_a_gpu_process_and_not_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in threads.EXPLICIT:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads.apply_serving_threads("cpu") is None and torch.get_num_threads() == 2
        assert threads.apply_serving_threads("cuda") == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.apply_serving_threads("cuda") is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
