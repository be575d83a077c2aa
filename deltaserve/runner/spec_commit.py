"""The commit after a verify step's accept: every GDN layer's live slot rolled to the state after its last accepted
token, in one call over the layers' stacked tensors (docs/speculative-decoding.md#the-commit-one-launch).

Each GDN layer holds views into one tensor per kind: its conv and recurrent state slots (runner/cache.py binds
`conv[i]` and `ssm[i]`) and its verify scratch, conv windows and token rows (runner/spec_decode.py allocates them
the same way). `stack_views` finds that common tensor from the views alone, so the commit runs as one kernel over
[L, ...] instead of a loop of small ones a layer; the layers' gate parameters (A_log, dt_bias), which the replay
of the accepted tokens reads, are copied into one [L, HV] tensor each once. Where the views are not so laid out (a
test's own tensors) the loop runs, with the same result.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.gdn_spec import spec_state_commit, spec_state_commit_layers
from deltaserve.model.qwen3_5 import Qwen35Model


def stack_views(views: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The views as one [L, ...] view of the tensor they index, when they are equally spaced slices of one storage
    with equal shapes, strides and dtypes (view i at offset first + i·step); else None."""
    if not views or any(v is None for v in views):
        return None
    first = views[0]
    assert first is not None
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else first.numel()
    if step <= 0:
        return None
    base = first.untyped_storage().data_ptr()
    for i, view in enumerate(views):
        if (
            view.untyped_storage().data_ptr() != base
            or view.shape != first.shape
            or view.stride() != first.stride()
            or view.dtype != first.dtype
            or view.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


GdnStacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def gdn_stacks(model: Qwen35Model) -> GdnStacks | None:
    """Every GDN layer's conv states, recurrent states, conv scratch and row scratch as one [L, ...] view each, and
    its A_log and dt_bias as one [L, HV] copy each (None when any kind does not stack, or the model has no GDN
    layer). Derived once per verify scratch, by the SpecDecoder that allocates it (its verify graphs take the
    SpecDecoder's), not per commit: a few hundred Python calls."""
    mixers = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
    if not mixers:
        return None
    stacks = [stack_views([getattr(m, name) for m in mixers])
              for name in ("conv_states", "ssm_states", "spec_conv_scratch", "spec_row_scratch")]  # fmt: skip
    if any(s is None for s in stacks):
        return None
    gates = [torch.stack([getattr(m, name).detach() for m in mixers]) for name in ("A_log", "dt_bias")]
    return (*stacks, *gates)  # type: ignore[return-value]


def commit_gdn_states(
    model: Qwen35Model, stacks: GdnStacks | None, state_indices: torch.Tensor, num_accepted: torch.Tensor, width: int
) -> None:
    """Every GDN layer: live slot state_indices[s] <- its conv window after token num_accepted[s], and its recurrent
    state with tokens 0 .. num_accepted[s] replayed on it. stacks: gdn_stacks(model) (None: the per-layer loop);
    state_indices [S] int32 (< 0: nothing), num_accepted [S] on the device; no host sync, so a verify graph captures
    it."""
    if stacks is not None:
        spec_state_commit_layers(*stacks, state_indices, num_accepted, width)
        return
    for layer in model.layers:
        if not layer.is_full_attention:
            m = layer.linear_attn
            spec_state_commit(m.conv_states, m.ssm_states, m.spec_conv_scratch, m.spec_row_scratch, m.A_log,
                              m.dt_bias, state_indices, num_accepted, width)  # fmt: skip
