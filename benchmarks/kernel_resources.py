"""Registers, spills and load widths of the decode-path Triton kernels on sm_90, compiled on a CPU-only machine.

No GPU and no device time: every Triton launch that the kernel launchers make on CPU tensors is intercepted,
specialised exactly as Triton's JIT would on the H200 (the same binder: pointer alignment, integers divisible
by 16 or equal to 1, `do_not_specialize`), compiled for sm_90 with the ptxas that ships in Triton's wheel,
and summarised from `cuobjdump`: registers, stack frame and local-memory traffic (spills), shared memory,
and the instruction mix that matters for memory-bound kernels (LDG widths, cp.async, HMMA/HGMMA).

    python benchmarks/kernel_resources.py --shape 35b-a3b --batches 1,32,64
    python benchmarks/kernel_resources.py --batches "" --align-entries 8,256,512,4096 --align-experts 64,256,512 \
        --router-tokens 1,5,9,17,33,64

A kernel with LOCAL traffic (LDL/STL) in its decode configuration is the first suspect of a cliff: the
one-program MoE alignment spilled 3 KiB a thread at 257-512 entries, the 35B-A3B decode cliff at B = 48-64.
`--align-entries` / `--align-experts` / `--align-block-m` sweep the alignment kernel alone over entry counts,
expert counts and BLOCK_M; `--router-tokens` the router logits launch (GEMV up to 64 tokens, tl.dot above) on
the shape's router; `--prefill 1x2048,8x1024` the GDN chunked prefill launches (N prompts of L tokens);
`--verify 1x4,64x4` the speculative verify step's conv and delta-rule launches (S sequences of W = 1 + k tokens);
`--fp8-rows 1,64,2048` the block-FP8 GEMM (and its activation quantization) at the shape's FP8 projections.
The last line counts the distinct variants compiled (a kernel and its specialisation): launches that differ only
in batch-dependent integers should share one.
Besides registers and spills each row gives the SASS instruction count (`sass`) and the
barriers (BAR) and shuffles (SHFL) in it: for kernels without loops (the align kernel's sort is unrolled) the
count is what every thread executes, so `sass` × warps per scheduler (warps / 4) bounds the issue cycles of a
one-program launch from below. Must run WITHOUT TRITON_INTERPRET (the interpreter replaces the JIT); exits 2
when it is set, and 2 when the options select nothing to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SM90 = ("cuda", 90, 32)


@dataclass
class Compiled:
    """One compiled specialisation and its resource summary."""

    kernel: str
    label: str
    regs: int
    stack: int
    shared: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def spills(self) -> int:
        return self.counts.get("LDL", 0) + self.counts.get("STL", 0)


def _tools_dir() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin"


def _summarise(kernel: Any, name: str, label: str, work: Path) -> Compiled:
    path = work / f"{name}.cubin"
    path.write_bytes(kernel.asm["cubin"])
    tools = _tools_dir()
    res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True).stdout
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:\d+", res)
    counts: dict[str, int] = {}
    counted = r"\b(LDGSTS|LDG\.E(?:\.(?:64|128|U16|S16|U8))?|HGMMA|QGMMA|HMMA|LDL|STL|STG\.E(?:\.\d+)?)"
    for op in re.findall(counted, sass):  # QGMMA: the 8-bit wgmma (FP8 operands)
        counts[op] = counts.get(op, 0) + 1
    # every instruction (address comment, optional predicate, opcode), and the synchronising ones among them
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    counts["sass"] = len(opcodes)
    for op in ("BAR", "SHFL"):
        counts[op] = sum(1 for o in opcodes if o == op)
    # cache control (an L2 prefetch is CCTL.E.PML2); global atomics and fences (the FP8 split GEMM's tile counts)
    for op in ("CCTL", "ATOMG", "RED", "MEMBAR"):
        num = sum(1 for o in opcodes if o == op)
        if num:
            counts[op] = num
    regs, stack = (int(usage.group(1)), int(usage.group(2))) if usage else (-1, -1)
    return Compiled(name, label, regs, stack, int(kernel.metadata.shared), counts)


# sm_90 per-SM limits: 64 K 32-bit registers, 228 KB of shared memory (1 KB of it reserved per block), 32 blocks,
# 64 warps. Registers are allocated per warp in units of 256.
SM90_REGISTERS = 65536
SM90_SHARED = 233472
SM90_SHARED_RESERVED = 1024
SM90_MAX_BLOCKS = 32
SM90_MAX_WARPS = 64


def programs_per_sm(compiled: Compiled, num_warps: int) -> int:
    """How many programs of this compiled kernel one sm_90 SM holds at once (registers, shared memory, warps)."""
    regs_per_warp = -(-max(compiled.regs, 1) * 32 // 256) * 256
    by_regs = SM90_REGISTERS // (regs_per_warp * num_warps)
    by_shared = SM90_SHARED // (compiled.shared + SM90_SHARED_RESERVED)
    return min(by_regs, by_shared, SM90_MAX_BLOCKS, SM90_MAX_WARPS // num_warps)


class Interceptor:
    """Replaces JITFunction.run: each launch is specialised and compiled for sm_90 instead of run."""

    def __init__(self, work: Path) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.target = GPUTarget(*SM90)
        self.backend = make_backend(self.target)
        self.work = work
        self.label = ""
        self.results: list[Compiled] = []
        self.variants: dict[tuple[str, str], Compiled] = {}  # one a (kernel, specialisation): what Triton compiles

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization, options)
        key = (fn.__name__, repr((signature, sorted(constexprs.items()), sorted(attrs.items()), options)))
        if key in self.variants:
            self.results.append(Compiled(**{**self.variants[key].__dict__, "label": self.label}))
            return
        source = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(source, target=self.target, options=options.__dict__)
        summary = _summarise(kernel, fn.__name__, self.label, self.work)
        self.variants[key] = summary
        self.results.append(summary)

    def install(self) -> Callable[[], None]:
        from triton.runtime.jit import JITFunction

        original = JITFunction.run
        interceptor = self

        def run(self: Any, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
            interceptor.run(self, args, kwargs)

        JITFunction.run = run  # type: ignore[method-assign]

        def restore() -> None:
            JITFunction.run = original  # type: ignore[method-assign]

        return restore


def decode_launches(
    shape: str,
    batch: int,
    context: int,
    moe_path: str = "",
    page: int = 16,
    moe_gemm1s: tuple[Any, ...] = (),
    moe_gemm2s: tuple[Any, ...] = (),
) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per decode-path op at one batch size, on CPU tensors of the real shapes (bf16); `page` is
    the KV-cache block size (the engine's default 16), `context` the block table's capacity in tokens;
    each GemmConfig of `moe_gemm1s` / `moe_gemm2s` adds a decode-path moe_block launch with that gate/up or
    down config (the other at the default), labelled moe_block[g1 or g2 BLOCK_N/BLOCK_K/warps/stages/
    cCHOICES_PER_PROGRAM/rROUTE_ROWS]."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.kernels import moe_configs, moe_decode_triton, moe_triton
    from deltaserve.kernels.attention_triton import paged_attention_triton, store_kv_triton
    from deltaserve.kernels.conv_triton import causal_conv1d_update_triton
    from deltaserve.kernels.gdn_triton import gdn_decode_triton
    from deltaserve.kernels.moe_routing_triton import moe_align_triton, moe_route_triton
    from deltaserve.kernels.norm_triton import gated_rms_norm_triton, rms_norm_triton
    from deltaserve.kernels.preamble_triton import attn_preamble_triton

    m = MODELS[shape]
    bf16 = torch.bfloat16
    b, h = batch, m.hidden
    nq, nkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    pages = -(-context // page)
    e = lambda *s, dtype=bf16: torch.empty(*s, dtype=dtype)  # noqa: E731
    qkv = e(b, nq * 2 * d + 2 * nkv * d)
    cache = e(b * pages, page, nkv, d)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq_lens = torch.full((b,), context, dtype=torch.int32)
    tables = torch.zeros(b, pages, dtype=torch.int32)
    slots = torch.arange(b, dtype=torch.int32)
    mixed = e(b, m.conv_dim)
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    qk = mixed[:, : 2 * hk * dk]
    launches: list[tuple[str, Callable[[], object]]] = [
        ("rms_norm", lambda: rms_norm_triton(e(b, h), e(h), 1e-6, e(b, h))),
        ("attn_preamble", lambda: attn_preamble_triton(qkv, e(d), e(d), e(b, m.rotary_dim), nq, nkv, d, 64, 1e-6)),
        ("store_kv", lambda: store_kv_triton(e(b, nkv, d), e(b, nkv, d), cache, cache, slots.long())),
        ("paged_attention", lambda: paged_attention_triton(e(b, nq, d), cache, cache, qsl, seq_lens, tables, 0.06, 1)),
        ("conv_update", lambda: causal_conv1d_update_triton(mixed, e(m.conv_dim, 4), e(b, 3, m.conv_dim), slots)),
        (
            "gdn_decode",
            lambda: gdn_decode_triton(
                qk[:, : hk * dk].view(b, hk, dk),
                qk[:, hk * dk :].view(b, hk, dk),
                mixed[:, 2 * hk * dk :].view(b, hv, dv),
                e(b, hv),
                e(b, hv),
                e(hv, dtype=torch.float32),
                e(hv),
                e(b, hv, dk, dv, dtype=torch.float32),
                slots,
            ),
        ),
        ("gated_rms_norm", lambda: gated_rms_norm_triton(e(b, hv, dv), e(b, hv, dv), e(dv), 1e-6)),
    ]
    from deltaserve.kernels import linear_triton
    from deltaserve.kernels.linear_triton import gemv_config, gemv_triton

    # kernels.linear's register GEMV takes up to GEMV_MAX_ROWS rows (the fused GDN input projection, as served;
    # --gemv-max-rows compiles another limit's variant); more rows, and depths past the GEMV's tile, run on cuBLAS
    projections = {"in_proj": (m.conv_dim + hv * dv + 2 * hv, h), "out_proj": (h, hv * dv), "o_proj": (h, nq * d),
                   "qkv": (nq * 2 * d + 2 * nkv * d, h)}  # fmt: skip
    if not m.num_experts:
        projections.update({"gate_up": (2 * m.mlp_inter, h), "down": (h, m.mlp_inter)})
    if batch <= linear_triton.GEMV_MAX_ROWS:
        for name, (n, kk) in projections.items():
            config = gemv_config(kk, batch)
            if config is not None:
                launch = lambda n=n, kk=kk, config=config: gemv_triton(e(b, kk), e(n, kk), config)  # noqa: E731
                launches.append((f"linear.{name}", launch))
    if m.num_experts:
        ex, k, inter = m.num_experts, m.top_k, m.moe_inter
        ids = torch.stack([torch.randperm(ex)[:k] for _ in range(b)])
        weights = torch.full((b, k), 1.0 / k)
        w13, w2 = e(ex, 2 * inter, h), e(ex, h, inter)
        config = moe_configs.default_config(batch, ex, k)
        if moe_path:
            config = moe_configs.MoEConfig(moe_path, config.gemm1, config.gemm2, config.block_m)
        launches += [
            ("moe_route", lambda: moe_route_triton(e(b, ex), k, True)),
            ("moe_align", lambda: moe_align_triton(ids, ex, moe_triton.grouped_block_m(b * k, ex))),
            (
                "fused_moe",
                lambda: moe_triton.fused_moe_triton(e(b, h), w13, w2, weights, ids, e(b, h), e(b, 1), config=config),
            ),
            (
                "moe_block",
                lambda: moe_decode_triton.moe_block_triton(
                    e(b, h), e(ex, h), w13, w2, k, True, e(2 * m.mlp_inter, h), e(h, m.mlp_inter), e(1, h), config
                ),
            ),
        ]
        variants = [("g1", moe_configs.MoEConfig("decode", g1, config.gemm2)) for g1 in moe_gemm1s]
        variants += [("g2", moe_configs.MoEConfig("decode", config.gemm1, g2)) for g2 in moe_gemm2s]
        for which, variant in variants:
            g = variant.gemm1 if which == "g1" else variant.gemm2
            spec = f"{g.BLOCK_N}/{g.BLOCK_K}/{g.num_warps}/{g.num_stages}/c{g.CHOICES_PER_PROGRAM}/r{g.ROUTE_ROWS}"
            name = f"moe_block[{which} {spec}]"
            shared = e(2 * m.mlp_inter, h), e(h, m.mlp_inter), e(1, h)
            block = lambda v=variant, s=shared: moe_decode_triton.moe_block_triton(  # noqa: E731
                e(b, h), e(ex, h), w13, w2, k, True, *s, v
            )
            launches.append((name, block))
    return launches


def align_launches(
    entries: list[int], experts: list[int], block_ms: list[int]
) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per alignment-kernel configuration: N entries over E experts."""
    from deltaserve.kernels.moe_routing_triton import moe_align_triton

    launches: list[tuple[str, Callable[[], object]]] = []
    for n in entries:
        for ex in experts:
            for bm in block_ms:
                ids = torch.zeros(n, 1, dtype=torch.int64)
                launches.append(
                    (f"align N={n} E={ex} M={bm}", lambda ids=ids, ex=ex, bm=bm: moe_align_triton(ids, ex, bm))
                )
    return launches


def router_launches(shape: str, tokens: list[int]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per router logits launch on the shape's router and shared gate."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.kernels.moe_decode_triton import router_logits_triton

    m = MODELS[shape]
    if not m.num_experts:
        return []
    bf16 = torch.bfloat16
    router, gate = torch.empty(m.num_experts, m.hidden, dtype=bf16), torch.empty(1, m.hidden, dtype=bf16)
    return [
        (f"router T={t}", lambda t=t: router_logits_triton(torch.empty(t, m.hidden, dtype=bf16), router, gate))
        for t in tokens
    ]


def prefill_launches(shape: str, cases: list[str]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per prefill case "NxL" (N prompts of L tokens): deltaserve's GDN chunked prefill, the prep
    kernel that feeds FlashInfer's (kernels/gdn_flashinfer_triton.py, served with --gdn-prefill-backend
    flashinfer), and the attention prefill over the prompts (the autotuner's first config: the only one kept off a
    GPU)."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.kernels.attention_triton import paged_attention_triton
    from deltaserve.kernels.gdn_flashinfer_triton import gdn_prefill_prep_triton
    from deltaserve.kernels.gdn_triton import gdn_prefill_triton

    m = MODELS[shape]
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    bf16 = torch.bfloat16
    launches: list[tuple[str, Callable[[], object]]] = []
    for case in cases:
        num_seqs, length = (int(x) for x in case.split("x"))
        t = num_seqs * length
        mixed = torch.empty(t, m.conv_dim, dtype=bf16)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * length
        slots = torch.arange(num_seqs, dtype=torch.int32)

        # q, k, v (views of the conv output, as served), a, b, A_log, dt_bias: what both kernels take first
        inputs = (
            mixed[:, : hk * dk].view(t, hk, dk),
            mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk),
            mixed[:, 2 * hk * dk :].view(t, hv, dv),
            torch.zeros(t, hv, dtype=bf16),
            torch.zeros(t, hv, dtype=bf16),
            torch.zeros(hv),
            torch.zeros(hv, dtype=bf16),
        )

        def thunk(
            inputs: tuple = inputs, qsl: torch.Tensor = qsl, slots: torch.Tensor = slots, length: int = length
        ) -> object:
            states = torch.zeros(len(slots), hv, dk, dv)
            # the runner's host hint: the scan's launch rule picks as for a served step of these sequences
            init = torch.ones(len(slots), dtype=torch.bool)
            return gdn_prefill_triton(*inputs, states, qsl, slots, init, max_query_len=length)

        def prep(inputs: tuple = inputs) -> object:
            return gdn_prefill_prep_triton(*inputs)

        launches.append((f"gdn_prefill {case}", thunk))
        launches.append((f"gdn_flashinfer_prep {case}", prep))
        nq, nkv, d, page = m.num_q_heads, m.num_kv_heads, m.head_dim, 16
        pages = -(-length // page)
        cache = torch.empty(num_seqs * pages, page, nkv, d, dtype=bf16)
        tables = torch.arange(num_seqs * pages, dtype=torch.int32).view(num_seqs, pages)
        seq_lens = torch.full((num_seqs,), length, dtype=torch.int32)
        attn_args = (torch.empty(t, nq, d, dtype=bf16), cache, cache, qsl, seq_lens, tables, d**-0.5, length, length)
        launches.append((f"attn_prefill {case}", lambda args=attn_args: paged_attention_triton(*args)))
    return launches


def verify_launches(shape: str, cases: list[str]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per speculative verify step for cases "SxW" (S sequences, chunks of W = 1 + k tokens): the
    verify conv, the verify delta rule, the commit over the layers and the attention's split-K launch over W-token
    queries (kernels/gdn_spec_conv_triton.py,
    kernels/gdn_spec_triton.py, kernels/gdn_spec_commit_triton.py: bf16 conv windows beside fp32 recurrent states,
    as served; the interpreter's fp32 tests cannot see a kernel that mixes them wrongly)."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.kernels.attention_triton import paged_attention_triton
    from deltaserve.kernels.gdn_spec import verify_row_width
    from deltaserve.kernels.gdn_spec_commit_triton import spec_state_commit_layers_triton
    from deltaserve.kernels.gdn_spec_conv_triton import causal_conv1d_verify_triton
    from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton

    m = MODELS[shape]
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    bf16 = torch.bfloat16
    e = lambda *s, dtype=bf16: torch.empty(*s, dtype=dtype)  # noqa: E731
    launches: list[tuple[str, Callable[[], object]]] = []
    for case in cases:
        num_seqs, width = (int(x) for x in case.split("x"))
        t = num_seqs * width
        mixed = e(t, m.conv_dim)
        index = torch.arange(t).view(num_seqs, width)
        slots = torch.arange(num_seqs, dtype=torch.int32)
        conv_states = e(num_seqs, m.conv_kernel - 1, m.conv_dim)
        conv_args = (
            mixed,
            e(m.conv_dim, m.conv_kernel),
            conv_states,
            slots,
            index,
            e(num_seqs, width, *conv_states.shape[1:]),
        )
        q = mixed[:, : hk * dk].view(t, hk, dk)
        k = mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
        v = mixed[:, 2 * hk * dk :].view(t, hv, dv)
        states = e(num_seqs, hv, dk, dv, dtype=torch.float32)
        row = verify_row_width(hk, dk, hv, dv)
        # the row scratch holds 1 + k = 4 columns whatever the step's width, as served (allocated once for k)
        gdn_args = (q, k, v, e(t, hv), e(t, hv), e(hv, dtype=torch.float32), e(hv), states, slots, index,
                    e(num_seqs, 4, row))  # fmt: skip
        # the commit's grid spans the layers (two are enough for its compile)
        layers = 2
        commit_args = (
            e(layers, num_seqs, *conv_states.shape[1:]),
            e(layers, num_seqs, hv, dk, dv, dtype=torch.float32),
            e(layers, num_seqs, 4, *conv_states.shape[1:]),
            e(layers, num_seqs, 4, row),
            e(layers, hv, dtype=torch.float32),
            e(layers, hv),
            slots,
            torch.zeros(num_seqs, dtype=torch.int64),
            width,
        )
        launches.append((f"conv_verify {case}", lambda a=conv_args: causal_conv1d_verify_triton(*a)))
        launches.append((f"gdn_verify {case}", lambda a=gdn_args: gdn_verify_triton(*a)))
        launches.append((f"spec_commit {case}", lambda a=commit_args: spec_state_commit_layers_triton(*a)))
        # the full-attention layers' verify rows: the split-K path with W query tokens a sequence
        pages = 4096 // 16
        cache = e(num_seqs * pages, 16, m.num_kv_heads, m.head_dim)
        attn_args = (
            e(t, m.num_q_heads, m.head_dim),
            cache,
            cache,
            torch.arange(num_seqs + 1, dtype=torch.int32) * width,
            torch.full((num_seqs,), 1024, dtype=torch.int32),
            torch.zeros(num_seqs, pages, dtype=torch.int32),
            0.06,
            width,
        )
        launches.append((f"attn_verify {case}", lambda a=attn_args: paged_attention_triton(*a)))
    return launches


def fp8_launches(shape: str, rows: list[int]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per block-FP8 GEMM launch (the activation quantization, then the GEMM) at every distinct FP8
    projection shape of the shape's FP8 release (benchmarks/fp8_ab.py dense_shapes), M rows each."""
    import importlib.util

    from deltaserve.kernels.fp8 import FP8_DTYPE, GROUP, Fp8Weight
    from deltaserve.kernels.fp8_triton import fp8_linear_triton

    if not rows:
        return []
    spec = importlib.util.spec_from_file_location("fp8_ab", Path(__file__).with_name("fp8_ab.py"))
    fp8_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp8_ab)
    launches: list[tuple[str, Callable[[], object]]] = []
    for names, num_out, num_in in fp8_ab.dense_shapes(fp8_ab.text_config(shape)):
        scales = torch.empty(-(-num_out // GROUP), -(-num_in // GROUP))
        weight = Fp8Weight.of(torch.empty(num_out, num_in, dtype=FP8_DTYPE), scales, GROUP)
        for m in rows:
            x = torch.empty(m, num_in, dtype=torch.bfloat16)
            launches.append((f"fp8 {names} M={m}", lambda x=x, weight=weight: fp8_linear_triton(x, weight)))
    return launches + fp8_producer_launches(fp8_ab.text_config(shape), rows) + fp8_moe_launches(shape, rows)


def fp8_moe_launches(shape: str, rows: list[int]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) for the block-FP8 MoE block's decode path (kernels/moe_decode_triton.moe_block_fp8_triton:
    router, gate/up with in-kernel routing, the split down and its combine) at each of rows up to its token limit,
    on the shape's expert and shared-expert widths; none for a dense shape."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.kernels.fp8 import FP8_DTYPE, GROUP, Fp8Weight
    from deltaserve.kernels.moe_decode_triton import FP8_DECODE_MAX_TOKENS, moe_block_fp8_triton

    m = MODELS[shape]
    if not m.num_experts:
        return []

    def weight(*shape: int) -> Fp8Weight:
        scales = torch.empty(*shape[:-2], -(-shape[-2] // GROUP), -(-shape[-1] // GROUP))
        return Fp8Weight.of(torch.empty(*shape, dtype=FP8_DTYPE), scales, GROUP)

    ex, h, inter, inter_sh = m.num_experts, m.hidden, m.moe_inter, m.mlp_inter
    w13, w2 = weight(ex, 2 * inter, h), weight(ex, h, inter)
    shared = weight(2 * inter_sh, h), weight(h, inter_sh), torch.empty(1, h, dtype=torch.bfloat16)
    router = torch.empty(ex, h, dtype=torch.bfloat16)
    return [
        (
            f"fp8 moe_block M={t}",
            lambda t=t: moe_block_fp8_triton(
                torch.empty(t, h, dtype=torch.bfloat16), router, w13, w2, m.top_k, True, *shared
            ),
        )
        for t in rows
        if t <= FP8_DECODE_MAX_TOKENS
    ]


def fp8_producer_launches(text: dict[str, Any], rows: list[int]) -> list[tuple[str, Callable[[], object]]]:
    """(label, thunk) per launch that quantizes its own output for an FP8 projection (kernels/fp8.py's Fp8Rows):
    the decoder's RMSNorm with its residual, SiLU-and-mul, the attention output gate and the GDN gated norm, at the
    shape's widths, M rows each."""
    from deltaserve.kernels.activation_triton import sigmoid_gate_mul_fp8_triton, silu_and_mul_fp8_triton
    from deltaserve.kernels.norm_triton import gated_rms_norm_fp8_triton, rms_norm_fp8_triton

    hidden, gate_width = text["hidden_size"], text["num_attention_heads"] * text["head_dim"]
    heads, head_dim = text["linear_num_value_heads"], text["linear_value_head_dim"]
    inter = text.get("shared_expert_intermediate_size") if text.get("num_experts") else text["intermediate_size"]
    bf16 = torch.bfloat16
    launches: list[tuple[str, Callable[[], object]]] = []
    for m in rows:
        x, w = torch.empty(m, hidden, dtype=bf16), torch.empty(hidden, dtype=bf16)
        g, o = torch.empty(m, heads, head_dim, dtype=bf16), torch.empty(head_dim, dtype=bf16)
        launches += [
            (f"fp8 rms_norm M={m}", lambda x=x, w=w: rms_norm_fp8_triton(x, w, 1e-6, x)),
            (f"fp8 silu_and_mul M={m}", lambda m=m: silu_and_mul_fp8_triton(torch.empty(m, 2 * inter, dtype=bf16))),
            (
                f"fp8 gate_mul M={m}",
                lambda m=m: sigmoid_gate_mul_fp8_triton(*torch.empty(2, m, gate_width, dtype=bf16)),
            ),
            (f"fp8 gated_rms_norm M={m}", lambda g=g, o=o: gated_rms_norm_fp8_triton(g, g, o, 1e-6)),
        ]
    return launches


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="35b-a3b", choices=("35b-a3b", "27b"))
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page", type=int, default=16, help="KV-cache block size (the engine's --block-size)")
    parser.add_argument("--only", default="", help="comma list of op labels to compile (default: all)")
    parser.add_argument("--gemv-max-rows", type=int, default=None, help="compile the GEMV at this row limit")
    parser.add_argument("--moe-path", default="", choices=("", "decode", "grouped"), help="force the MoE path")
    parser.add_argument("--align-entries", default="", help="comma list of entry counts for the align sweep")
    parser.add_argument("--align-experts", default="256", help="comma list of expert counts for the align sweep")
    parser.add_argument("--align-block-m", default="16", help="comma list of BLOCK_M for the align sweep")
    parser.add_argument("--router-tokens", default="", help="comma list of token counts for the router sweep")
    parser.add_argument(
        "--moe-gemm1",
        default="",
        help="semicolon list of decode gate/up configs BLOCK_N,BLOCK_K,warps,stages[,0,ROUTE_ROWS], each an "
        "extra moe_block[...] launch per batch",
    )
    parser.add_argument(
        "--moe-gemm2",
        default="",
        help="semicolon list of decode down configs BLOCK_N,BLOCK_K,warps,stages[,CHOICES_PER_PROGRAM], each an "
        "extra moe_block[...] launch per batch; --only moe_block selects them too",
    )
    parser.add_argument("--prefill", default="", help='comma list of GDN prefill cases "NxL" (N prompts of L tokens)')
    parser.add_argument(
        "--verify", default="", help='comma list of speculative verify cases "SxW" (S sequences of 1 + k = W tokens)'
    )
    parser.add_argument(
        "--fp8-rows", default="", help="comma list of row counts M for the block-FP8 GEMM at the FP8 projections"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/deltaserve-kernel-resources"))
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_resources: TRITON_INTERPRET is set; the interpreter bypasses the compiler. Unset it.")
        return 2
    from deltaserve.kernels import attention_triton, fp8_triton, gdn_triton

    # The launchers size split counts and pick configurations from the SM count; an H100 / H200 has 132 (the tensors
    # here are on the CPU).
    attention_triton.sm_count = lambda device: 132
    gdn_triton.sm_count = lambda device: 132
    fp8_triton.sm_count = lambda device: 132
    args.work.mkdir(parents=True, exist_ok=True)
    interceptor = Interceptor(args.work)
    restore = interceptor.install()
    only = {o for o in args.only.split(",") if o}
    if args.gemv_max_rows is not None:  # another row limit's variant (docs/kernels-log.md, C36)
        from deltaserve.kernels import linear_triton

        linear_triton.GEMV_MAX_ROWS = args.gemv_max_rows
    sweeps = align_launches(_ints(args.align_entries), _ints(args.align_experts), _ints(args.align_block_m))
    sweeps += router_launches(args.shape, _ints(args.router_tokens))
    from deltaserve.kernels.moe_configs import GemmConfig

    gemm1s = tuple(GemmConfig(*_ints(spec)) for spec in args.moe_gemm1.split(";") if spec.strip())
    gemm2s = tuple(GemmConfig(*_ints(spec)) for spec in args.moe_gemm2.split(";") if spec.strip())
    sweeps += prefill_launches(args.shape, [c for c in args.prefill.split(",") if c])
    sweeps += verify_launches(args.shape, [c for c in args.verify.split(",") if c])
    sweeps += fp8_launches(args.shape, _ints(args.fp8_rows))
    try:
        for batch in _ints(args.batches):
            for label, thunk in decode_launches(
                args.shape, batch, args.context, args.moe_path, args.page, gemm1s, gemm2s
            ):
                if only and label.split("[")[0] not in only:
                    continue
                interceptor.label = f"B={batch} {label}"
                thunk()
        for label, thunk in sweeps:
            interceptor.label = label
            thunk()
    finally:
        restore()
    if not interceptor.results:
        print("kernel_resources: nothing selected to compile (check --batches / --only / the sweeps)")
        return 2
    head = f"{'launch':<26} {'kernel':<34} {'regs':>4} {'stack':>5} {'smem':>6} {'spill ops':>9} {'sass':>6}"
    print(f"{head}  instruction mix")
    for r in interceptor.results:
        mix = " ".join(f"{k}:{v}" for k, v in sorted(r.counts.items()) if k not in ("LDL", "STL", "sass"))
        row = f"{r.label:<26} {r.kernel:<34} {r.regs:>4} {r.stack:>5} {r.shared:>6} {r.spills:>9} {r.counts['sass']:>6}"
        print(f"{row}  {mix}")
    # Kernels whose launcher sizes its grid from a residency assumption: name -> the num_warps it launches with.
    residency_checked = {"_paged_attn_decode_kernel": attention_triton.DECODE_NUM_WARPS}
    for r in interceptor.results:
        if r.kernel in residency_checked:
            print(f"{r.label}: {r.kernel} fits {programs_per_sm(r, residency_checked[r.kernel])} programs per SM")
    spilling = [r for r in interceptor.results if r.spills]
    print(
        f"{len(interceptor.results)} launches compiled for sm_90; {len(spilling)} with local-memory spills; "
        f"{len(interceptor.variants)} distinct variants"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
