"""Stand-ins for the two attention libraries of --attention-backend, in plain torch, for the tests of deltaserve's
library paths (kernels/attention_fa3.py, kernels/attention_flashinfer.py) on machines without them or a GPU.

Each computes causal paged GQA attention in fp32 from ONLY what its call hands it (the paged cache and the
metadata, never deltaserve's own tensors), with the causal mask aligned to the bottom right as both libraries do,
and checks its arguments as strictly as the library would (dtypes, shapes, layouts, and for FlashInfer that the
plan's indptrs and last-page fills come on the host, so a plan never syncs the device), so metadata built wrong
fails a test instead of passing it. fp32 is accepted too, so the paths compare tightly with paged_attention_ref.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, nq, d], keys/values [L, nkv, d] (its whole context) -> [Lq, nq, d] fp32, causal bottom-right."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # [nq, Lq, L]
    length, q_len = keys.shape[0], q.shape[0]
    query_pos = torch.arange(length - q_len, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


def _check_cache(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    assert k.dim() == 4 and k.shape == v.shape, f"paged cache [num_blocks, block_size, nkv, d], got {tuple(k.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "the cache's head dim must be contiguous"
    assert k.dtype == v.dtype == q.dtype and q.dtype in dtypes, f"dtypes q {q.dtype} cache {k.dtype}"
    assert q.dim() == 3 and q.shape[2] == k.shape[3] and q.shape[1] % k.shape[2] == 0, "GQA: nq a multiple of nkv"
    assert q.stride(-1) == 1, "q's head dim must be contiguous"


class FakeFlashAttn:
    """vllm.vllm_flash_attn.flash_attn_varlen_func (vLLM 0.26), the paged path with fa_version=3."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> None:
        self.dtypes = dtypes
        self.batches: list[tuple[int, int]] = []  # (sequences, query rows) of each call

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, cu_seqlens_q: torch.Tensor,
        max_seqlen_k: int, cu_seqlens_k: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
        softmax_scale: float | None = None, causal: bool = False, block_table: torch.Tensor | None = None,
        out: torch.Tensor | None = None, fa_version: int = 2, **unused: Any,
    ) -> torch.Tensor:  # fmt: skip
        assert fa_version == 3 and causal and softmax_scale is not None
        assert cu_seqlens_k is None, "paged: the key lengths come as seqused_k"
        assert not any(v is not None and v is not False for v in unused.values()), f"unexpected: {unused}"
        _check_cache(k, v, q, self.dtypes)
        assert k.shape[1] % 16 == 0, "FA3 pages hold a multiple of 16 tokens"
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k), ("block_table", block_table)):
            assert t is not None and t.dtype == torch.int32 and t.device == q.device, f"{name}: int32 on q's device"
        num_seqs = seqused_k.shape[0]
        assert cu_seqlens_q.shape == (num_seqs + 1,) and block_table.shape[0] == num_seqs
        assert block_table.dim() == 2 and block_table.stride(-1) == 1
        starts, lengths = cu_seqlens_q.tolist(), seqused_k.tolist()
        assert starts[0] == 0 and starts[-1] == q.shape[0], f"cu_seqlens_q {starts} over {q.shape[0]} rows"
        assert max(b - a for a, b in zip(starts, starts[1:], strict=False)) <= max_seqlen_q
        assert max(lengths) <= max_seqlen_k and max(lengths) <= block_table.shape[1] * k.shape[1]
        if out is None:
            out = torch.empty_like(q)
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
        self.batches.append((num_seqs, q.shape[0]))
        block_size = k.shape[1]
        for b in range(num_seqs):
            positions = torch.arange(lengths[b])
            slots = block_table[b].long()[positions // block_size] * block_size + positions % block_size
            keys, values = (c.reshape(-1, *c.shape[2:])[slots] for c in (k, v))
            out[starts[b] : starts[b + 1]] = _attend(q[starts[b] : starts[b + 1]], keys, values, softmax_scale).to(
                out.dtype
            )
        return out


class FakePrefillWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper (0.6.14): plan on the host, run on the planned pages."""

    instances: list[FakePrefillWrapper] = []
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any) -> None:
        assert kv_layout == "NHD" and not kwargs, "deltaserve's cache is NHD, no CUDA-graph buffers"
        assert float_workspace_buffer.dtype == torch.uint8 and float_workspace_buffer.numel() >= 128 << 20
        self.device = float_workspace_buffer.device
        self.planned: dict[str, Any] | None = None
        self.plans = 0
        self.runs: list[int] = []  # query rows of each run
        FakePrefillWrapper.instances.append(self)

    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, causal: bool = False, sm_scale: float | None = None, q_data_type: Any = None,
        kv_data_type: Any = None, **unused: Any,
    ) -> None:  # fmt: skip
        assert causal and sm_scale is not None and not unused, f"unexpected: {unused}"
        for name, t in (("qo_indptr", qo_indptr), ("paged_kv_indptr", paged_kv_indptr),
                        ("paged_kv_last_page_len", paged_kv_last_page_len)):  # fmt: skip
            # plan reads these on the host: a device tensor here is a device -> host sync in every step
            assert t.device.type == "cpu" and t.dtype == torch.int32 and t.dim() == 1, f"{name}: int32 on the host"
        assert paged_kv_indices.dtype == torch.int32 and paged_kv_indices.device == self.device
        num_seqs = qo_indptr.shape[0] - 1
        assert paged_kv_indptr.shape == (num_seqs + 1,) and paged_kv_last_page_len.shape == (num_seqs,)
        assert int(qo_indptr[0]) == 0 and int(paged_kv_indptr[0]) == 0
        assert int(paged_kv_indptr[-1]) == paged_kv_indices.shape[0], "one index per page"
        assert bool((paged_kv_last_page_len >= 1).all() and (paged_kv_last_page_len <= page_size).all())
        assert bool((paged_kv_indptr[1:] > paged_kv_indptr[:-1]).all()), "every sequence holds a page"
        assert q_data_type in self.dtypes and kv_data_type == q_data_type
        self.planned = {"qo": qo_indptr.tolist(), "kv": paged_kv_indptr.tolist(), "pages": paged_kv_indices.clone(),
                        "last": paged_kv_last_page_len.tolist(), "heads": (num_qo_heads, num_kv_heads, head_dim_qk),
                        "page_size": page_size, "scale": sm_scale, "dtype": q_data_type}  # fmt: skip
        self.plans += 1

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        plan = self.planned
        assert plan is not None, "run before plan"
        k, v = paged_kv_cache
        _check_cache(k, v, q, self.dtypes)
        assert (q.shape[1], k.shape[2], q.shape[2]) == plan["heads"] and k.shape[1] == plan["page_size"]
        assert q.dtype == plan["dtype"] and q.shape[0] == plan["qo"][-1], "q rows as planned"
        if out is None:
            out = torch.empty_like(q)
        assert out.shape == q.shape and out.dtype == q.dtype
        self.runs.append(q.shape[0])
        qo, kv, last, page_size = plan["qo"], plan["kv"], plan["last"], plan["page_size"]
        for b in range(len(qo) - 1):
            pages = plan["pages"][kv[b] : kv[b + 1]].long()
            length = (len(pages) - 1) * page_size + last[b]
            slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:length]
            keys, values = (c.reshape(-1, *c.shape[2:])[slots] for c in (k, v))
            out[qo[b] : qo[b + 1]] = _attend(q[qo[b] : qo[b + 1]], keys, values, plan["scale"]).to(out.dtype)
        return out


def install_fake_fa3(monkeypatch: pytest.MonkeyPatch) -> FakeFlashAttn:
    """FakeFlashAttn as vllm.vllm_flash_attn.flash_attn_varlen_func (fp32 allowed), until the test ends."""
    fake = FakeFlashAttn(dtypes=(*KERNEL_DTYPES, torch.float32))
    package = types.ModuleType("vllm")
    package.__path__ = []
    package.__version__ = "0.26.0+fake"
    module = types.ModuleType("vllm.vllm_flash_attn")
    module.flash_attn_varlen_func = fake
    module.fa_version_unsupported_reason = lambda version: None
    package.vllm_flash_attn = module
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", module)
    return fake


def install_fake_flashinfer_prefill(monkeypatch: pytest.MonkeyPatch) -> type[FakePrefillWrapper]:
    """FakePrefillWrapper as flashinfer.BatchPrefillWithPagedKVCacheWrapper (fp32 allowed), until the test ends;
    added to a flashinfer stand-in already installed (tests/support/fake_flashinfer.py), else a new one."""
    monkeypatch.setattr(FakePrefillWrapper, "instances", [])
    monkeypatch.setattr(FakePrefillWrapper, "dtypes", (*KERNEL_DTYPES, torch.float32))
    package = sys.modules.get("flashinfer")
    if package is None or not getattr(package, "__version__", "").endswith("+fake"):
        package = types.ModuleType("flashinfer")
        package.__path__ = []
        package.__version__ = "0.6.14+fake"
        monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setattr(package, "BatchPrefillWithPagedKVCacheWrapper", FakePrefillWrapper, raising=False)
    return FakePrefillWrapper
