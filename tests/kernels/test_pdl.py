"""Programmatic dependent launch (docs/kernels.md#programmatic-dependent-launch), checked on the source: every kernel
that takes USE_PDL opens with `pdl_wait(USE_PDL)` at its top level, stores nothing and returns nowhere before it,
loads above it only the pointers listed here (each with the reason it cannot be the previous launch's output), and
every launch of it passes `**pdl_launch(...)`. The GPU half (the same tokens with DELTASERVE_PDL on and off, through
the decode graphs) is tests/runner/test_gpu_async.py::test_pdl_decode_matches_plain_launches.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deltaserve import env
from deltaserve.kernels._triton import pdl_launch

KERNELS_DIR = Path(__file__).resolve().parents[2] / "deltaserve" / "kernels"

# Kernel -> the pointers it may load above pdl_wait. Under PDL a kernel starts while only its immediate
# predecessor may still run, so these are weights, the step's metadata, the GDN state of an earlier step, or
# outputs of a launch at least two back.
PRE_WAIT_LOADS = {
    "_rms_norm_kernel": {"weight_ptr"},
    "_gated_rms_norm_kernel": {"weight_ptr"},
    "_causal_conv1d_update_kernel": {"state_indices_ptr"},
    # the state slot was last written by this layer in an earlier step; conv (the launch before) never touches it
    "_gdn_decode_kernel": {"state_indices_ptr", "A_log_ptr", "dt_bias_ptr", "ssm_states_ptr"},
    "_store_kv_kernel": {"slot_mapping_ptr"},
    # q is the preamble's output, two launches back (store_kv is the launch before); the K/V cache is not
    "_paged_attn_decode_kernel": {"query_start_loc_ptr", "seq_lens_ptr", "q_ptr", "block_tables_ptr"},
    "_paged_attn_combine_kernel": {"query_start_loc_ptr"},
    "_attn_preamble_kernel": {"q_weight_ptr", "k_weight_ptr", "cos_sin_ptr"},
    # the gate half of the qkv projection, written by the preamble several launches back
    "_sigmoid_gate_mul_kernel": {"gate_ptr"},
    # the whole weight tile; x comes from the launch before
    "_gemv_kernel": {"w_ptr"},
    "_silu_and_mul_kernel": set(),
    "_moe_router_kernel": set(),
    # up to 4 tokens (one K step): the weight rows and the gate row; x comes from the launch before
    "_moe_router_gemv_kernel": {"w_ptr", "gate_w_ptr"},
    "_moe_decode_gemm1_kernel": set(),
    "_moe_decode_gemm2_kernel": set(),
    "_moe_decode_gemm2_split_kernel": set(),
    "_moe_decode_combine_kernel": set(),
    "_moe_route_kernel": set(),
    "_moe_align_kernel": set(),
    "_moe_align_count_kernel": set(),
    "_moe_align_scan_kernel": set(),
    "_moe_align_scatter_kernel": set(),
}
# (the grouped MoE GEMMs and their sum, moe_triton, launch plainly: they take no USE_PDL)

# Kernel -> the pointers it may store to above pdl_wait: memory that neither the launch before nor any launch still
# running reads or writes. None since the gate/up's shared programs stopped storing act before the wait.
PRE_WAIT_STORES: dict[str, set[str]] = {}
STORES = ("store", "atomic_add", "atomic_cas", "atomic_xchg")


def _pdl_kernels() -> dict[str, tuple[ast.FunctionDef, ast.Module]]:
    found = {}
    for path in sorted(p for p in KERNELS_DIR.glob("*_triton.py") if p.name != "_triton.py"):
        module = ast.parse(path.read_text())
        for node in module.body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_PDL" for a in node.args.args):
                found[node.name] = (node, module)
    return found


def _is_call_to(node: ast.AST, attr: str) -> bool:
    """node is a call of `tl.<attr>` (or `<attr>` imported bare)."""
    if not isinstance(node, ast.Call):
        return False
    fn = node.func
    return (isinstance(fn, ast.Attribute) and fn.attr == attr) or (isinstance(fn, ast.Name) and fn.id == attr)


def _root_map(statements: list[ast.stmt], is_root: Callable[[str], bool]) -> Callable[[ast.AST], set[str]]:
    """roots(expr): the root names (is_root) an expression is built from, directly or through the assignments in
    `statements` (p_s = ssm_states_ptr + ...; p_x += BLOCK_K)."""
    derived: dict[str, set[str]] = {}

    def roots(expr: ast.AST) -> set[str]:
        found: set[str] = set()
        for n in ast.walk(expr):
            if isinstance(n, ast.Name):
                found |= ({n.id} if is_root(n.id) else set()) | derived.get(n.id, set())
        return found

    for stmt in statements:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                found = roots(node.value)
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name) and found:
                        derived[target.id] = derived.get(target.id, set()) | found
    return roots


def _accesses(statements: list[ast.stmt], roots: Callable[[ast.AST], set[str]]) -> tuple[set[str], set[str]]:
    """The roots that the tl.load / tl.store (and atomic) calls in `statements` reach."""
    loaded: set[str] = set()
    stored: set[str] = set()
    for stmt in statements:
        for node in ast.walk(stmt):
            if _is_call_to(node, "load"):
                loaded |= roots(node.args[0])
            if any(_is_call_to(node, op) for op in STORES):
                stored |= roots(node.args[0])
    return loaded, stored


def _helper_params(helper: ast.FunctionDef) -> tuple[list[str], set[str], set[str]]:
    """A @triton.jit helper's parameters, and those its loads / stores reach (through its own assignments)."""
    params = [a.arg for a in helper.args.args]
    loaded, stored = _accesses(helper.body, _root_map(helper.body, lambda name: name in params))
    return params, loaded, stored


def _pre_wait_access(above: list[ast.stmt], module: ast.Module) -> tuple[set[str], set[str]]:
    """The kernel pointers loaded and stored by the statements above the wait, directly or through a helper."""
    helpers = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    roots = _root_map(above, lambda name: name.endswith("_ptr"))
    loaded, stored = _accesses(above, roots)
    for stmt in above:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
                params, h_loaded, h_stored = _helper_params(helpers[node.func.id])
                for param, arg in zip(params, node.args, strict=False):
                    if param in h_loaded:
                        loaded |= roots(arg)
                    if param in h_stored:
                        stored |= roots(arg)
    return loaded, stored


def test_the_pdl_kernels_are_the_decode_path() -> None:
    assert set(_pdl_kernels()) == set(PRE_WAIT_LOADS)


@pytest.mark.parametrize("name", sorted(PRE_WAIT_LOADS))
def test_kernel_waits_before_dependent_access(name: str) -> None:
    kernel, module = _pdl_kernels()[name]
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    waits = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and _is_call_to(s.value, "pdl_wait")]
    assert len(waits) == 1, f"{name}: one pdl_wait(USE_PDL) at the top level of the body, found {len(waits)}"
    above = body[: waits[0]]
    for stmt in above:
        for node in ast.walk(stmt):
            assert not isinstance(node, ast.Return), f"{name}: a return above pdl_wait (line {node.lineno})"
    loaded, stored = _pre_wait_access(above, module)
    allowed_stores = PRE_WAIT_STORES.get(name, set())
    assert loaded <= PRE_WAIT_LOADS[name], f"{name}: loads {sorted(loaded - PRE_WAIT_LOADS[name])} above pdl_wait"
    assert stored <= allowed_stores, f"{name}: stores to {sorted(stored - allowed_stores)} above pdl_wait"


def test_the_checker_sees_through_helpers() -> None:
    """A load above the wait inside a @triton.jit helper counts as the kernel's own (mutation check of the checker:
    the GEMV router's one-step branch reaches its weight rows and the gate row only through _router_w_tile)."""
    kernel, module = _pdl_kernels()["_moe_router_gemv_kernel"]
    waits = [i for i, s in enumerate(kernel.body) if isinstance(s, ast.Expr) and _is_call_to(s.value, "pdl_wait")]
    loaded, stored = _pre_wait_access(kernel.body[: waits[0]], module)
    assert loaded == {"w_ptr", "gate_w_ptr"} and stored == set(), (loaded, stored)


@pytest.mark.parametrize("name", sorted(PRE_WAIT_LOADS))
def test_every_launch_passes_pdl_launch(name: str) -> None:
    _, module = _pdl_kernels()[name]
    launches = [
        node
        for node in ast.walk(module)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == name
    ]
    assert launches, f"{name} is never launched in its module"
    for call in launches:
        spread = [k.value for k in call.keywords if k.arg is None]
        assert any(_is_call_to(v, "pdl_launch") for v in spread), (
            f"{name} launched without **pdl_launch (line {call.lineno})"
        )


def test_pdl_setting_and_cpu_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASERVE_PDL", raising=False)
    assert env.pdl()  # on by default
    monkeypatch.setenv("DELTASERVE_PDL", "0")
    assert not env.pdl()
    monkeypatch.setenv("DELTASERVE_PDL", "1")
    assert pdl_launch(torch.zeros(1)) == {}  # a CPU tensor: a plain launch (the interpreter has no PDL)
