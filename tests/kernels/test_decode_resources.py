"""The paged attention and GDN decode kernels compiled for sm_90 on the CPU (benchmarks/kernel_resources.py):
no local-memory spills, and the attention decode kernel still fits the resident programs per SM that its split
count assumes (attention_triton.DECODE_PROGRAMS_PER_SM), at the served shapes and the engine's 16-token pages.
A subprocess, because the test session runs Triton's interpreter, which replaces the compiler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.kernels.attention_triton import DECODE_PROGRAMS_PER_SM

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
def test_decode_attention_and_gdn_fit_on_sm90(shape: str) -> None:
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "ptxas").is_file():
        pytest.skip("Triton's wheel carries no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--shape", shape]
    command += ["--batches", "1,64", "--context", "4096", "--only", "paged_attention,gdn_decode"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = re.search(r"(\d+) launches compiled for sm_90; (\d+) with local-memory spills", done.stdout)
    assert summary, done.stdout[-2000:]
    assert int(summary.group(2)) == 0, done.stdout
    for kernel in ("_paged_attn_decode_kernel", "_paged_attn_combine_kernel", "_gdn_decode_kernel"):
        assert kernel in done.stdout, done.stdout
    fits = [int(n) for n in re.findall(r"_paged_attn_decode_kernel fits (\d+) programs per SM", done.stdout)]
    assert len(fits) == 2, done.stdout
    assert min(fits) >= DECODE_PROGRAMS_PER_SM, done.stdout
