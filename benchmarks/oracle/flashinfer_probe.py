"""On the H200, after both bundles are unpacked: can vLLM 0.26.0's default (FlashInfer) GDN prefill run here?

Checks, in order, and prints one line each (exit 0 only when all hold):
1. the modules vLLM's FlashInfer GDN path imports are importable (flashinfer, cutlass, cuda.bindings, tvm_ffi),
   with versions; a missing module is named;
2. vLLM resolves the GDN prefill backend to FlashInfer for this GPU with `auto` (qwen_gdn_linear_attn.
   _resolve_gdn_prefill_backend, the function whose log line reads "Using FlashInfer GDN prefill kernel");
3. FlashInfer's chunk_gated_delta_rule runs (its CuTe-DSL kernel is compiled on the first call: the time is
   printed) on a Qwen3.5-shaped problem, and its output and final state equal vLLM's Triton/FLA kernel within
   bf16 rounding (max abs error printed).

Run with PYTHONPATH=/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site
(the registry's h200-offline-flashinfer site; the second entry stands for the .pth file a PYTHONPATH folder
does not read).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback


def check_imports() -> bool:
    ok = True
    for name in ("tvm_ffi", "cuda.bindings.driver", "cutlass", "cutlass.cute", "flashinfer", "flashinfer.gdn_prefill"):
        try:
            module = importlib.import_module(name)
            version = getattr(module, "__version__", "")
            print(f"import {name}: ok {version} ({getattr(module, '__file__', '')})")
        except Exception as exc:
            ok = False
            missing = getattr(exc, "name", None)
            named = f" (missing module {missing})" if missing else ""
            print(f"import {name}: FAILED {type(exc).__name__}: {exc}{named}")
    return ok


def check_backend_choice() -> bool:
    import torch
    from vllm.platforms import current_platform

    capability = torch.cuda.get_device_capability()
    print(f"GPU {torch.cuda.get_device_name()} capability {capability}; is_cuda={current_platform.is_cuda()}")
    is_sm90 = current_platform.is_device_capability(90)
    print(f"vLLM `auto` GDN prefill backend on this GPU: {'flashinfer' if is_sm90 else 'not flashinfer (not SM90)'}")
    return is_sm90


def run_kernels(num_tokens: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> bool:
    import torch
    from gdn_prefill_kernels import make_inputs  # same folder
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        fi_chunk_gated_delta_rule,
        fla_chunk_gated_delta_rule,
    )

    inputs = make_inputs(num_tokens, 1, num_k_heads, num_v_heads, head_dim, seed=0)
    start = time.perf_counter()
    fi_out, fi_state = fi_chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"flashinfer chunk_gated_delta_rule first call (includes the CuTe-DSL compile): {seconds:.1f} s")
    fla_out, fla_state = fla_chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=False)
    torch.cuda.synchronize()
    out_err = (fi_out.float() - fla_out.float()).abs().max().item()
    state_err = (fi_state.float() - fla_state.float()).abs().max().item()
    scale = fla_out.float().abs().max().item()
    is_close = out_err <= 0.05 * max(scale, 1e-6)
    print(
        f"flashinfer vs triton/fla at T={num_tokens}, HK={num_k_heads}, HV={num_v_heads}, d={head_dim}: output max abs "
        f"error {out_err:.3g} (output max {scale:.3g}), final state max abs error {state_err:.3g}: "
        f"{'ok' if is_close else 'MISMATCH'}"
    )
    return is_close


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    ok = check_imports()
    if not ok:
        print("flashinfer probe: FAIL (imports)")
        return 1
    try:
        ok = check_backend_choice() and run_kernels(args.tokens, 16, 32, 128)
    except Exception:
        traceback.print_exc()
        ok = False
    print(f"flashinfer probe: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    sys.exit(main())
