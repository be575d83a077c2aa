"""The block-FP8 MoE block's decode path (kernels/moe_decode_triton.moe_block_fp8_triton: the router, gate/up with
in-kernel routing over FP8 weights, the choice-split down quantizing each act row, the combine) against its twin
kernels/moe.fused_moe_block_fp8_ref (the composition the FP8 model runs above the decode sizes), into poisoned
outputs. Under TRITON_INTERPRET=1 on the CPU in fp32 (products exact, sums in another order: fp32 rounding); the
35B-A3B shape in bf16 on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import moe_decode_triton
from deltaserve.kernels.fp8 import Fp8Rows, quantize_activation_ref
from deltaserve.kernels.moe import FP8_BLOCK_MAX_TOKENS, fused_moe_block_fp8_ref
from deltaserve.kernels.moe_decode_triton import FP8_DECODE_CONFIGS, FP8_DECODE_MAX_TOKENS, moe_block_fp8_triton

from ._util import DEVICE, assert_close, poisoned_empty
from .test_fp8 import FP32_RATIO, _weight, _x


def _block(
    experts: int, hidden: int, inter: int, inter_sh: int | None
) -> tuple[torch.Tensor, tuple[object, ...], tuple[object, ...]]:
    """(router [E, H], (w13, w2), the shared expert's (gate|up, down, gate row) or ()) with random FP8 weights."""
    router = _x(experts, hidden, seed=7) * 0.1
    experts_w = (_weight(experts, 2 * inter, hidden, parts=(inter, inter)), _weight(experts, hidden, inter, seed=4))
    shared: tuple[object, ...] = ()
    if inter_sh is not None:
        gate_up = _weight(2 * inter_sh, hidden, parts=(inter_sh, inter_sh), seed=8)
        shared = (gate_up, _weight(hidden, inter_sh, seed=9), _x(1, hidden, seed=10) * 0.1)
    return router, experts_w, shared


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Token counts of the calls that took the decode path (decode_gemms), as the block op ran them."""
    calls: list[int] = []
    real = moe_decode_triton.decode_gemms

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe_decode_triton, "decode_gemms", spy)
    return calls


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "inter_sh"),
    [
        (1, 256, 128, 128),  # whole groups; the shared expert as the gate/up's extra entry
        (3, 192, 64, 96),  # a partial last group of H; gate|up rows not whole 128-row blocks (per-row scales)
        (8, 256, 128, None),  # the largest decode bucket, no shared expert
    ],
)
def test_decode_path_matches_the_composition(
    tokens: int, hidden: int, inter: int, inter_sh: int | None, decode_calls: list[int]
) -> None:
    router, (w13, w2), shared = _block(8, hidden, inter, inter_sh)
    x = _x(tokens, hidden)
    with poisoned_empty(int_poison=-7):
        out = moe_block_fp8_triton(x, router, w13, w2, 2, True, *shared)
    assert decode_calls == [tokens]
    assert_close("y", fused_moe_block_fp8_ref(x, router, w13, w2, 2, True, *shared), out, FP32_RATIO)


def test_above_the_decode_sizes_the_block_composes_the_fp8_ops(decode_calls: list[int]) -> None:
    router, (w13, w2), shared = _block(8, 256, 128, 128)
    x = _x(FP8_DECODE_MAX_TOKENS + 3, 256)
    with poisoned_empty():
        out = moe_block_fp8_triton(x, router, w13, w2, 2, True, *shared)
    assert decode_calls == []
    assert_close("y", fused_moe_block_fp8_ref(x, router, w13, w2, 2, True, *shared), out, FP32_RATIO)


def test_decode_path_reads_the_rows_quantization() -> None:
    """Fp8Rows (a norm's own quantization) are the gate/up GEMMs' input as they came: the same output as the rows
    quantized in the op, and a changed scale changes it; the ref reads them alike."""
    router, (w13, w2), shared = _block(8, 256, 128, 128)
    x = _x(2, 256)
    rows = Fp8Rows(x, *quantize_activation_ref(x))
    wrong = Fp8Rows(x, rows.q, rows.scale * 2)
    for block in (moe_block_fp8_triton, fused_moe_block_fp8_ref):
        plain_out = block(x, router, w13, w2, 2, True, *shared)
        assert torch.equal(block(rows, router, w13, w2, 2, True, *shared), plain_out)
        assert not torch.equal(block(wrong, router, w13, w2, 2, True, *shared), plain_out)


def test_every_decode_bucket_has_a_config_fp8_can_run() -> None:
    """Buckets 1 .. FP8_DECODE_MAX_TOKENS each have a decode config with the group as gate/up's K step and the
    choice-split down (decode_gemms refuses anything else for FP8); the model's limit is the kernel's."""
    assert FP8_DECODE_MAX_TOKENS == FP8_BLOCK_MAX_TOKENS
    buckets = sorted(FP8_DECODE_CONFIGS)
    assert buckets == [1 << i for i in range(FP8_DECODE_MAX_TOKENS.bit_length())]
    for config in FP8_DECODE_CONFIGS.values():
        assert config.path == "decode" and config.gemm1.BLOCK_K == 128 and config.gemm2.CHOICES_PER_PROGRAM > 0


def test_decode_path_refuses_mixed_weights() -> None:
    router, (w13, w2), _ = _block(4, 128, 64, None)
    config = FP8_DECODE_CONFIGS[1]
    with pytest.raises(ValueError, match="every expert GEMM or for none"):
        moe_decode_triton.decode_gemms(
            _x(1, 128), w13, w2.weight.float(), config.gemm1, config.gemm2, logits=_x(1, 4), top_k=2
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_decode_path_bf16_model_shape(tokens: int, decode_calls: list[int]) -> None:
    """The 35B-A3B block (E = 256, I = 512, H = 2048, top-8, shared expert 512) in bf16 on the GPU, within bf16
    rounding of the ref; every bucket's launch configuration compiles and runs."""
    router, (w13, w2), shared = _block(256, 2048, 512, 512)
    x = _x(tokens, 2048).bfloat16()
    router, gate = router.bfloat16(), shared[2].bfloat16()  # type: ignore[union-attr]
    shared = (*shared[:2], gate)
    with poisoned_empty():
        out = moe_block_fp8_triton(x, router, w13, w2, 8, True, *shared)
    assert decode_calls == [tokens] and DEVICE.type == "cuda"
    assert_close("y", fused_moe_block_fp8_ref(x, router, w13, w2, 8, True, *shared), out, 1e-2)


@pytest.mark.gpu
def test_decode_path_replays_in_a_cuda_graph() -> None:
    """The decode path captured in a CUDA graph (as the engine's decode buckets are) and replayed on new rows and their
    quantization gives the eager call's bits each time: every launch's grid comes from shapes, and the in-kernel
    routing reads the router's logits of this replay."""
    router, (w13, w2), shared = _block(256, 2048, 512, 512)
    router, shared = router.bfloat16(), (*shared[:2], shared[2].bfloat16())  # type: ignore[union-attr]

    def rows(seed: int) -> Fp8Rows:
        x = _x(2, 2048, seed=seed).bfloat16()
        return Fp8Rows(x, *quantize_activation_ref(x))

    static = rows(20)
    moe_block_fp8_triton(static, router, w13, w2, 8, True, *shared)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_block_fp8_triton(static, router, w13, w2, 8, True, *shared)
    for seed in range(21, 25):
        fresh = rows(seed)
        for tensor, value in ((static.x, fresh.x), (static.q, fresh.q), (static.scale, fresh.scale)):
            tensor.copy_(value)
        graph.replay()
        assert torch.equal(static_out, moe_block_fp8_triton(static, router, w13, w2, 8, True, *shared))
