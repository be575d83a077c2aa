"""A stand-in for flashinfer.gdn_prefill (FlashInfer 0.6.14's GDN chunked prefill) in plain torch, for the tests of
deltaserve's FlashInfer path (kernels/gdn_flashinfer.py) on machines without FlashInfer or an SM90 GPU.

FakeFlashInfer computes what chunk_gated_delta_rule documents (the recurrent form, in fp32) and checks its arguments as
FlashInfer's SM90 path does, so a wrong layout fails a test instead of passing it. install_fake_flashinfer puts it
into sys.modules as flashinfer.gdn_prefill (fp32 accepted too, so the path compares tightly with its twin).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

# FlashInfer's SM90 kernel takes bf16 / fp16 only; the stand-in also takes fp32 so the path is compared tightly.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class FakeFlashInfer:
    """flashinfer.gdn_prefill.chunk_gated_delta_rule (0.6.14) in plain torch, the recurrent form in fp32: per value
    head h (q/k head h·HQ // HV), state S [V, K] from initial_state [N, HV, V, K]; per token S ← αS, u = β(v − Sk),
    S ← S + ukᵀ, o = scale·Sq (scale 1/√head_size when not given). Checks its arguments as FlashInfer does (one
    head size, GVA head counts, contiguous q/k/v, fp32 contiguous g/beta/state of the right shapes)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> None:
        self.dtypes = dtypes
        self.calls = 0
        self.batches: list[tuple[int, int]] = []  # (sequences, tokens) of each call

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None = None,
        beta: torch.Tensor | None = None,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        use_qk_l2norm_in_kernel: bool = False,
        output: torch.Tensor | None = None,
        output_state: torch.Tensor | None = None,
        state_checkpoints: torch.Tensor | None = None,
        checkpoint_cu_starts: torch.Tensor | None = None,
        checkpoint_every_n_tokens: int = 0,
        use_cp: str | bool = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        assert cu_seqlens is not None and cu_seqlens.dim() == 1 and not cu_seqlens.is_floating_point()
        assert not use_qk_l2norm_in_kernel, "FlashInfer 0.6.14 ignores it: q and k must come normed"
        assert checkpoint_every_n_tokens == 0 and state_checkpoints is None and checkpoint_cu_starts is None
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert t.dim() == 3 and t.is_contiguous(), f"{name}: [T, H, D] contiguous, got {tuple(t.stride())}"
            assert t.dtype == q.dtype and t.dtype in self.dtypes, f"{name}: {t.dtype}"
        num_tokens, num_q_heads, head_size = q.shape
        num_v_heads = v.shape[1]
        assert k.shape == q.shape and v.shape == (num_tokens, num_v_heads, head_size), "one head size, one T"
        assert num_v_heads % num_q_heads == 0, "GVA: num_v_heads a multiple of num_q_heads"
        num_seqs = cu_seqlens.shape[0] - 1
        self.batches.append((num_seqs, num_tokens))
        for name, t in (("g", g), ("beta", beta)):
            assert t is not None and t.dtype == torch.float32 and t.is_contiguous(), name
            assert t.shape == (num_tokens, num_v_heads), f"{name}: {tuple(t.shape)}"
        state_shape = (num_seqs, num_v_heads, head_size, head_size)
        assert initial_state is not None and initial_state.dtype == torch.float32 and initial_state.is_contiguous()
        assert initial_state.shape == state_shape, f"initial_state: {tuple(initial_state.shape)}"
        if output is None:
            output = torch.empty(num_tokens, num_v_heads, head_size, dtype=q.dtype, device=q.device)
        assert output.is_contiguous() and output.dtype == q.dtype and output.shape == v.shape
        scale = scale if scale else 1.0 / math.sqrt(head_size)
        heads = torch.arange(num_v_heads, device=q.device) * num_q_heads // num_v_heads  # [HV] q/k head of each
        final = initial_state.clone()  # [N, HV, V, K]
        starts = cu_seqlens.tolist()
        for n in range(num_seqs):
            state = final[n]
            for t in range(starts[n], starts[n + 1]):
                q_t, k_t = q[t, heads].float(), k[t, heads].float()  # [HV, K]
                state = state * g[t][:, None, None]
                u = beta[t][:, None] * (v[t].float() - torch.einsum("hvk,hk->hv", state, k_t))  # [HV, V]
                state = state + u[:, :, None] * k_t[:, None, :]
                output[t] = (scale * torch.einsum("hvk,hk->hv", state, q_t)).to(q.dtype)
            final[n] = state
        return (output, final) if output_final_state else output


def install_fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    """FakeFlashInfer as flashinfer.gdn_prefill.chunk_gated_delta_rule (fp32 allowed), in sys.modules until the test
    ends."""
    fake = FakeFlashInfer(dtypes=(*KERNEL_DTYPES, torch.float32))
    package = types.ModuleType("flashinfer")
    package.__path__ = []  # a package, so flashinfer.gdn_prefill resolves
    package.__version__ = "0.6.14+fake"
    module = types.ModuleType("flashinfer.gdn_prefill")
    module.chunk_gated_delta_rule = fake
    module.chunk_gated_delta_rule_sm90 = object()  # its SM90 kernel imported (unusable_reason looks)
    package.gdn_prefill = module
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", module)
    return fake
