"""benchmarks/tune_moe.py without a GPU: the coordinate search keeps the fastest candidate, every candidate is a
valid config, and the script exits 2 when there is nothing to tune on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.kernels.moe_configs import GemmConfig, MoEConfig

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("tune_moe", ROOT / "benchmarks" / "tune_moe.py")
tune_moe = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(tune_moe)


def test_search_keeps_the_fastest_gate_up_then_the_fastest_down() -> None:
    g1s = [GemmConfig(16, 128), GemmConfig(32, 128), GemmConfig(64, 64)]
    g2s = [GemmConfig(8, 128), GemmConfig(16, 128), GemmConfig(32, 256)]
    cost = {16: 3.0, 32: 1.0, 64: 2.0}  # gate/up by BLOCK_N
    extra = {8: 0.5, 16: 0.2, 32: 0.9}  # down by BLOCK_N

    def measure(config: MoEConfig) -> float:
        return cost[config.gemm1.BLOCK_N] + extra[config.gemm2.BLOCK_N]

    make = lambda a, b: MoEConfig("decode", a, b)  # noqa: E731
    best, best_us, log = tune_moe._search(measure, make, g1s, g2s, time.monotonic() + 60)
    assert best == MoEConfig("decode", GemmConfig(32, 128), GemmConfig(16, 128))
    assert best_us == pytest.approx(1.2)
    assert len(log) == len(g1s) + len(g2s) - 1


def test_candidates_are_valid_configs() -> None:
    for spec_ in tune_moe.DECODE_G1 + tune_moe.DECODE_G2 + tune_moe.GROUPED:
        config = tune_moe._gemm(spec_)
        assert config.BLOCK_N >= 8 and config.BLOCK_K >= 16 and config.num_warps in (1, 2, 4, 8)
    # one-warp programs only for the decode gate/up (its routing without cross-warp barriers)
    assert 1 not in {tune_moe._gemm(s).num_warps for s in tune_moe.DECODE_G2 + tune_moe.GROUPED}
    assert {tune_moe._gemm(s).num_warps for s in tune_moe.DECODE_G1} == {1, 2, 4}
    # the first down candidate is the one the gate/up search runs with: the one-program kernel; the choice split
    # variants are among the rest
    assert tune_moe._gemm(tune_moe.DECODE_G2[0]).CHOICES_PER_PROGRAM == 0
    assert {tune_moe._gemm(s).CHOICES_PER_PROGRAM for s in tune_moe.DECODE_G2} == {0, 1, 2, 4}
    # ... and the gate/up list holds today's choice and the next_pow2(T)-row routing variant of it
    assert tune_moe._gemm(tune_moe.DECODE_G1[0]).ROUTE_ROWS == 16
    assert {tune_moe._gemm(s).ROUTE_ROWS for s in tune_moe.DECODE_G1} == {1, 16}
    for block_m in (16, 32, 64):
        MoEConfig("grouped", tune_moe._gemm(tune_moe.GROUPED[0]), tune_moe._gemm(tune_moe.GROUPED[1]), block_m)


def test_exits_2_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the no-GPU exit path")
    command = [sys.executable, str(ROOT / "benchmarks" / "tune_moe.py"), "--out", str(tmp_path / "t.json")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    assert "nothing to tune" in done.stderr


def test_fp8_candidates_run_the_fp8_decode_path() -> None:
    """Each --fp8 candidate (as the search pairs them: every gate/up with the first down, the first gate/up with
    every down) is a config the FP8 decode path takes, and computes the block op's result (fp32, the interpreter;
    the first served config is the first candidate, so the search starts from what serves)."""
    import torch

    from deltaserve.kernels.moe import fused_moe_block_fp8_ref
    from deltaserve.kernels.moe_decode_triton import FP8_DECODE_CONFIGS, moe_block_fp8_triton

    from ._util import assert_close
    from .test_fp8 import FP32_RATIO, _x
    from .test_moe_decode_fp8 import _block

    g1s, g2s = [tune_moe._gemm(s) for s in tune_moe.FP8_G1], [tune_moe._gemm(s) for s in tune_moe.FP8_G2]
    assert MoEConfig("decode", g1s[0], g2s[0]) == FP8_DECODE_CONFIGS[1]
    router, (w13, w2), shared = _block(4, 128, 64, 64)
    x = _x(2, 128)
    ref = fused_moe_block_fp8_ref(x, router, w13, w2, 2, True, *shared)
    for g1, g2 in [(g1, g2s[0]) for g1 in g1s] + [(g1s[0], g2) for g2 in g2s[1:]]:
        out = moe_block_fp8_triton(x, router, w13, w2, 2, True, *shared, config=MoEConfig("decode", g1, g2))
        assert_close(f"{g1} {g2}", ref, out, FP32_RATIO)
    assert torch.isfinite(ref).all()
