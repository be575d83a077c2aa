"""The decode-path MoE kernels compiled for sm_90 (on the CPU, with Triton's own ptxas) use no local memory.

The 35B-A3B decode cliff of issue 11 (B = 48-64 slower than B = 128) was the one-program MoE alignment
spilling 3 KiB a thread at 257-512 entries; this guards that kernel and the decode MoE block against spills
at the batch sizes that hurt, without a GPU. It runs benchmarks/kernel_resources.py in a subprocess because
the test session runs Triton's interpreter, which replaces the compiler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.kernels.attention_triton import DECODE_PROGRAMS_PER_SM, WIDE_PROGRAMS_PER_SM

ROOT = Path(__file__).resolve().parents[2]


def _kernel_resources(flags: list[str]) -> tuple[str, int, int]:
    """benchmarks/kernel_resources.py on the 35B-A3B shape with `flags`, outside the interpreter: its stdout, the
    launches it compiled and those with spills (skips where Triton's wheel has no ptxas)."""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "ptxas").is_file():
        pytest.skip("Triton's wheel carries no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--shape", "35b-a3b", *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = re.search(r"(\d+) launches compiled for sm_90; (\d+) with local-memory spills", done.stdout)
    assert summary, done.stdout[-2000:]
    return done.stdout, int(summary.group(1)), int(summary.group(2))


@pytest.mark.slow
def test_decode_moe_kernels_do_not_spill_on_sm90() -> None:
    command = ["--batches", "8,64", "--only", "moe_align,moe_block"]
    # the choice-split down kernel and its combine, the routing on next_pow2(T) rows
    command += ["--moe-gemm2", "16,128,4,1,1;32,256,8,1,2", "--moe-gemm1", "32,256,4,3,0,1"]
    # the O(log N) align kernel at the smallest, a decode and the largest entry counts it serves, and the
    # router's GEMV and tl.dot launches on both sides of each switch
    command += ["--align-entries", "8,512,8192", "--align-experts", "256,512", "--router-tokens", "4,5,33,64,65"]
    stdout, num_launches, num_spilling = _kernel_resources(command)
    assert num_launches >= 4 + 6 + 5, stdout
    assert "_moe_align_kernel" in stdout and "_moe_decode_gemm1_kernel" in stdout, stdout
    assert "_moe_decode_gemm2_split_kernel" in stdout and "_moe_decode_combine_kernel" in stdout
    for label in ("align N=8192 E=512 M=16", "router T=64", "router T=65"):
        assert label in stdout, stdout
    assert "_moe_router_gemv_kernel" in stdout and "_moe_router_kernel" in stdout, stdout
    assert num_spilling == 0, stdout
    stacks = [int(m.group(1)) for m in re.finditer(r"_moe_align_kernel\s+\d+\s+(\d+)", stdout)]
    assert len(stacks) >= 8 and max(stacks) == 0, stdout  # no local-memory frame either


@pytest.mark.slow
def test_verify_kernels_compile_for_sm90_without_spills() -> None:
    """The speculative verify step's conv, delta rule and commit, which no CPU test compiles otherwise (the interpreter
    runs them): they compile for sm_90, use no local memory, and steps of other widths and batch sizes (1 + k = 1
    included, where Triton would specialise an integer 1) reuse the same variant, so nothing compiles while
    serving. The attention's verify rows (the split-K kernel over W-token queries and its combine) compile without
    spills too and fit the programs per SM their split count assumes; they specialise on the row block and the
    causal mask, never on the split count: 4 variants over these cases."""
    stdout, num_launches, num_spilling = _kernel_resources(["--batches", "", "--verify", "8x4,1x1,3x2"])
    assert num_launches == 15, stdout
    assert "_causal_conv1d_verify_kernel" in stdout and "_gdn_verify_kernel" in stdout, stdout
    assert "_spec_state_commit_kernel" in stdout, stdout  # bf16 conv beside fp32 states: sm_90 refused a mix once
    assert num_spilling == 0, stdout
    assert "; 7 distinct variants" in stdout, stdout
    fits = {m.group(1): int(m.group(2)) for m in re.finditer(r"attn_verify (\S+): \S+ fits (\d+) programs", stdout)}
    # 8x4 at the 35B-A3B's group of 8: 32 rows a program, WIDE_PROGRAMS_PER_SM; the others 16 rows, as decodes
    assert fits == {"8x4": WIDE_PROGRAMS_PER_SM, "1x1": DECODE_PROGRAMS_PER_SM, "3x2": DECODE_PROGRAMS_PER_SM}, stdout


@pytest.mark.slow
def test_decode_attention_compiles_once_for_every_split_count() -> None:
    """The split-K decode attention at batch sizes whose split counts all differ (64, 39, 28 and 12 splits at B = 1,
    5, 7 and 16 over a 16,384-token context on the H200's SM count) compiles to two variants: the split kernel and
    its combine. With the count a constexpr each count compiled its own pair (8 variants here) on first use, and
    eager steps (batch sizes no CUDA-graph bucket had) compiled them while serving (the JIT monitor named them in
    grids/h100_mtp-27b-c64-20261206-s31)."""
    command = ["--batches", "1,5,7,16", "--context", "16384", "--only", "paged_attention"]
    stdout, num_launches, num_spilling = _kernel_resources(command)
    assert num_spilling == 0, stdout
    assert num_launches == 8 and "; 2 distinct variants" in stdout, stdout


@pytest.mark.slow
def test_flashinfer_prep_kernel_compiles_for_sm90_without_spills() -> None:
    """The prep kernel of --gdn-prefill-backend flashinfer (q/k L2 norms, the gates, bf16 in) has run on no GPU yet:
    it compiles for sm_90 at the 27B's heads and uses no local memory."""
    stdout, num_launches, num_spilling = _kernel_resources(["--shape", "27b", "--batches", "", "--prefill", "1x64"])
    assert "_gdn_prep_kernel" in stdout, stdout
    assert num_spilling == 0, stdout
