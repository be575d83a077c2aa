"""Device diagnosis of the chunked GDN prefill, stage by stage: the buffers each kernel writes (captured from the
launcher's torch.empty calls) checked against torch recomputations from the previous stage's own outputs, so the
first stage off names the kernel; then the failing case again with each kernel's warps or block width changed."""

from __future__ import annotations

import torch

import deltaserve.kernels.gdn_triton as gt
from deltaserve.kernels.gdn import _l2norm, gdn_prefill_ref

# bf16 on the H200; fp32 under TRITON_INTERPRET=1 on a CPU (a smoke run of this script only)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
NAMES = ["out", "qn", "kn", "gcum", "xw", "xu", "aqk", "a_scratch", "w", "u", "hs", "vnew"]


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def inputs(t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    dev = DEV
    mixed = torch.randn(t, 2 * hk * dk + hv * dv, device=dev).to(dtype)
    q = mixed[:, : hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(t, hv, dv)
    ba = torch.randn(t, 2 * hv, device=dev).to(dtype)
    A_log = torch.log(torch.empty(hv, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(hv, device=dev) * 0.5
    states = torch.randn(3, hv, dk, dv, device=dev) * 0.1
    return q, k, v, ba[:, hv:], ba[:, :hv], A_log, dt_bias, states


def run_captured(args: tuple[torch.Tensor, ...], t: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, k, v, a, b, A_log, dt_bias, states = args
    qsl = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    init = torch.tensor([True], device=DEV)
    captured: list[torch.Tensor] = []
    real = torch.empty

    def empty(*a_: object, **kw: object) -> torch.Tensor:
        x = real(*a_, **kw)
        if x.is_floating_point():
            x.fill_(float("nan"))
        captured.append(x)
        return x

    st = states.clone()
    torch.empty = empty
    try:
        gt.gdn_prefill_triton(q, k, v, a, b, A_log, dt_bias, st, qsl, slots, init)
    finally:
        torch.empty = real
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return dict(zip(NAMES, captured, strict=True)), st


def stages(t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    dtype = DTYPE
    args = inputs(t, hk, hv, dk, dv, dtype)
    q, k, v, a, b, A_log, dt_bias, states = args
    buf, st = run_captured(args, t)
    group = hv // hk
    bt = gt.CHUNK
    r = slice(0, min(t, bt))
    n = r.stop
    f = lambda x: x.float()  # noqa: E731
    line = [f"T={t} hk{hk} hv{hv} dk{dk} dv{dv}:"]
    kn_ref = _l2norm(k).to(dtype)
    line.append(f"kn {rel(kn_ref, buf['kn']):.1e}")
    errs = {key: [] for key in ("xu", "w", "u", "hs", "vnew", "o")}
    for h in range(hv):
        kh = h // group
        kc = torch.zeros(bt, dk, device=DEV)
        kc[:n] = f(buf["kn"][r, kh])
        qc = torch.zeros(bt, dk, device=DEV)
        qc[:n] = f(buf["qn"][r, kh])
        vc = torch.zeros(bt, dv, device=DEV)
        vc[:n] = f(v[r, h])
        beta = torch.zeros(bt, device=DEV)
        beta[:n] = torch.sigmoid(f(b[r, h]))
        gam = torch.zeros(bt, device=DEV)
        gam[:n] = f(buf["gcum"][r, h])
        gam[n:] = gam[n - 1]
        lower = torch.ones(bt, bt, device=DEV).tril(-1).bool()
        A = torch.where(lower, (kc @ kc.T) * beta[:, None] * (gam[:, None] - gam[None, :]).clamp_max(0).exp(), 0.0)
        X = torch.linalg.inv(torch.eye(bt, device=DEV) + A)
        errs["xu"].append(rel(X * beta[None, :], buf["xu"][0, h]))
        w_ref = (f(buf["xw"][0, h]) @ kc).to(dtype)
        errs["w"].append(rel(w_ref[:n], buf["w"][r, h]))
        u_ref = f(buf["xu"][0, h]) @ vc
        errs["u"].append(rel(u_ref[:n], buf["u"][r, h]))
        s0 = states[1, h].to(dtype)
        errs["hs"].append(rel(s0, buf["hs"][0, h]))
        vn_ref = (f(buf["u"][r, h]) - f(buf["w"][r, h]) @ f(buf["hs"][0, h])).to(dtype)
        errs["vnew"].append(rel(vn_ref, buf["vnew"][r, h]))
        o_ref = (
            ((qc * gam.exp()[:, None]).to(dtype).float() @ f(buf["hs"][0, h]))[:n]
            + f(buf["aqk"][0, h])[:n, :n] @ f(buf["vnew"][r, h])
        ) * dk**-0.5
        errs["o"].append(rel(o_ref, buf["out"][r, h]))
    for key, vals in errs.items():
        line.append(f"{key} {max(vals):.1e}")
    ref_states = states.clone()
    qsl = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    ref = gdn_prefill_ref(
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ref_states,
        qsl,
        torch.tensor([1], dtype=torch.int32, device=DEV),
        torch.tensor([True], device=DEV),
    )
    line.append(f"| end-to-end o {rel(ref, buf['out']):.1e} state {rel(ref_states[1], st[1]):.1e}")
    print(" ".join(line), flush=True)


def sweep(t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    args = inputs(t, hk, hv, dk, dv, DTYPE)
    q, k, v, a, b, A_log, dt_bias, states = args
    qsl = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    init = torch.tensor([True], device=DEV)
    ref_states = states.clone()
    ref = gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, ref_states, qsl, slots, init)
    for name, value in [
        (None, None),
        ("CHUNK_PREPARE_WARPS", 8),
        ("CHUNK_WU_WARPS", 4),
        ("CHUNK_WU_WARPS", 2),
        ("CHUNK_SCAN_WARPS", 8),
        ("CHUNK_SCAN_WARPS", 2),
        ("CHUNK_OUT_WARPS", 8),
        ("CHUNK_OUT_BV", 128),
        ("CHUNK_BV", 16),
    ]:
        old = getattr(gt, name) if name else None
        if name:
            setattr(gt, name, value)
        try:
            st = states.clone()
            out = gt.gdn_prefill_triton(q, k, v, a, b, A_log, dt_bias, st, qsl, slots, init)
            print(
                f"  T={t} dk{dk} dv{dv} {name}={value}: o {rel(ref, out):.1e} state {rel(ref_states[1], st[1]):.1e}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            print(f"  {name}={value}: {type(e).__name__}: {e}", flush=True)
        finally:
            if name:
                setattr(gt, name, old)


def timing() -> None:
    """The chunked prefill at the served head shapes with the w / u kernel at 4 and 8 warps, and the prepare's
    blocked inverse alone (ms, do_bench)."""
    import triton

    for label, lengths, hk, hv in (("27b-2048", [2048], 16, 48), ("35b-a3b-8x1024", [1024] * 8, 16, 32)):
        t = sum(lengths)
        q, k, v, a, b, A_log, dt_bias, _ = inputs(t, hk, hv, 128, 128, DTYPE)
        states = torch.randn(len(lengths) + 1, hv, 128, 128, device=DEV) * 0.05
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
        slots = torch.arange(len(lengths), dtype=torch.int32, device=DEV)
        init = torch.ones(len(lengths), dtype=torch.bool, device=DEV)
        old = gt.CHUNK_WU_WARPS
        for warps in (4, 8):
            gt.CHUNK_WU_WARPS = warps
            call = (q, k, v, a, b, A_log, dt_bias, states, qsl, slots, init)
            ms = triton.testing.do_bench(lambda call=call: gt.gdn_prefill_triton(*call), rep=200)
            print(f"  {label} wu warps {warps}: {ms:.3f} ms a layer's chunked prefill", flush=True)
        gt.CHUNK_WU_WARPS = old
    # The prepare kernel's blocked (I + A)^-1 alone over as many [64, 64] tiles as the prepare launch has
    # programs (27B 2048: 32 chunks x 48 heads; 8x1024 on 32 heads: 4096): its share of the prepare's time.
    for label, num_tiles in (("27b-2048", 32 * 48), ("35b-a3b-8x1024", 128 * 32)):
        strict = (torch.randn(num_tiles, gt.CHUNK, gt.CHUNK, device=DEV) * 0.05).tril(-1)
        ms = triton.testing.do_bench(lambda s=strict: gt.chunk_inverse_triton(s), rep=200)
        print(f"  {label} blocked inverse alone ({num_tiles} tiles, incl. one clone): {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    import sys

    if "--time" in sys.argv:
        timing()
        sys.exit(0)
    for shape in [(40, 2, 4, 64, 32), (40, 2, 4, 64, 64), (40, 2, 4, 32, 32), (40, 2, 4, 128, 128)]:
        try:
            stages(*shape)
        except Exception as e:  # noqa: BLE001
            print(shape, type(e).__name__, e, flush=True)
    sweep(40, 2, 4, 64, 32)
    sweep(100, 2, 4, 64, 32)
