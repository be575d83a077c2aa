"""The GDN layer's mixed step writes its decode and prefill halves into one buffer through `out` views (no copies):
the conv and GDN kernels and their twins must fill exactly their rows of the view they are given, return it, and
refuse an `out` of the wrong shape, dtype or layout."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels._dispatch import output
from deltaserve.kernels.conv import causal_conv1d_prefill_ref, causal_conv1d_update_ref
from deltaserve.kernels.conv_triton import causal_conv1d_prefill_triton, causal_conv1d_update_triton
from deltaserve.kernels.gdn import gdn_decode_ref, gdn_prefill_ref
from deltaserve.kernels.gdn_triton import gdn_decode_triton, gdn_prefill_triton

from ._util import DEVICE, assert_close, randn, varlen_starts

NUM_DECODES = 3
LENGTHS = [70, 5]  # the prefill rows after the decodes: two chunks and a short one


def _nan_buffer(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "ref"])
def test_conv_halves_land_in_one_buffer(use_triton: bool) -> None:
    channels, kernel_size = 48, 4
    num_prefill = sum(LENGTHS)
    x = randn(NUM_DECODES + num_prefill, channels + 8)[:, :channels]  # the layer's column slice
    weight = randn(channels, kernel_size, scale=0.5)
    states = randn(8, kernel_size - 1, channels)
    decode_slots, prefill_slots = (
        torch.tensor([5, -1, 2], device=DEVICE).int(),
        torch.tensor([0, 7], device=DEVICE).int(),
    )
    qsl, init = varlen_starts(LENGTHS), torch.tensor([True, False], device=DEVICE)
    ref_states = states.clone()
    ref_d = causal_conv1d_update_ref(x[:NUM_DECODES], weight, ref_states, decode_slots)
    ref_p = causal_conv1d_prefill_ref(x[NUM_DECODES:], weight, ref_states, qsl, prefill_slots, init)
    update = causal_conv1d_update_triton if use_triton else causal_conv1d_update_ref
    prefill = causal_conv1d_prefill_triton if use_triton else causal_conv1d_prefill_ref
    buf = _nan_buffer(NUM_DECODES + num_prefill, channels)
    got_d = update(x[:NUM_DECODES], weight, states, decode_slots, out=buf[:NUM_DECODES])
    got_p = prefill(x[NUM_DECODES:], weight, states, qsl, prefill_slots, init, out=buf[NUM_DECODES:])
    assert got_d.data_ptr() == buf.data_ptr() and got_p.data_ptr() == buf[NUM_DECODES:].data_ptr()
    assert_close("decode rows", ref_d, buf[:NUM_DECODES], 2e-6)
    assert_close("prefill rows", ref_p, buf[NUM_DECODES:], 2e-6)
    assert torch.equal(states, ref_states)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "ref"])
def test_gdn_halves_land_in_one_buffer(use_triton: bool) -> None:
    """q / k / v as strided head views of one conv-output buffer (the layer no longer makes them contiguous)."""
    hk, hv, dk, dv = 1, 2, 32, 32
    num_tokens = NUM_DECODES + sum(LENGTHS)
    mixed = randn(num_tokens, 2 * hk * dk + hv * dv)
    q = mixed[:, : hk * dk].view(num_tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(num_tokens, hv, dv)
    ba = randn(num_tokens, 2 * hv)
    b, a = ba[:, :hv], ba[:, hv:]
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = randn(hv, scale=0.5)
    states = randn(6, hv, dk, dv, scale=0.1)
    decode_slots, prefill_slots = (
        torch.tensor([4, -1, 1], device=DEVICE).int(),
        torch.tensor([0, 3], device=DEVICE).int(),
    )
    qsl, init = varlen_starts(LENGTHS), torch.tensor([True, False], device=DEVICE)
    d, p = slice(0, NUM_DECODES), slice(NUM_DECODES, num_tokens)
    ref_states = states.clone()
    ref_d = gdn_decode_ref(q[d], k[d], v[d], a[d], b[d], A_log, dt_bias, ref_states, decode_slots)
    ref_p = gdn_prefill_ref(q[p], k[p], v[p], a[p], b[p], A_log, dt_bias, ref_states, qsl, prefill_slots, init)
    decode = gdn_decode_triton if use_triton else gdn_decode_ref
    prefill = gdn_prefill_triton if use_triton else gdn_prefill_ref
    buf = _nan_buffer(num_tokens, hv, dv)
    got_d = decode(q[d], k[d], v[d], a[d], b[d], A_log, dt_bias, states, decode_slots, out=buf[d])
    got_p = prefill(q[p], k[p], v[p], a[p], b[p], A_log, dt_bias, states, qsl, prefill_slots, init, out=buf[p])
    assert got_d.data_ptr() == buf.data_ptr() and got_p.data_ptr() == buf[p].data_ptr()
    assert_close("decode rows", ref_d, buf[d], 2e-5)
    assert torch.equal(buf[1], torch.zeros_like(buf[1])), "a padding slot's row must be zeros"
    assert_close("prefill rows", ref_p, buf[p], 2e-5)
    assert_close("states", ref_states, states, 2e-5)


def test_output_refuses_a_wrong_out() -> None:
    like = torch.zeros(4, 3, device=DEVICE)
    assert output(None, (4, 3), like).shape == (4, 3)
    with pytest.raises(ValueError, match="want"):
        output(torch.zeros(4, 2, device=DEVICE), (4, 3), like)
    with pytest.raises(ValueError, match="want"):
        output(torch.zeros(4, 3, dtype=torch.float64, device=DEVICE), (4, 3), like)
    with pytest.raises(ValueError, match="contiguous"):
        output(torch.zeros(4, 6, device=DEVICE)[:, ::2], (4, 3), like)
