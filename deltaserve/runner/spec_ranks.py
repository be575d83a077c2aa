"""Speculative decoding under tensor parallelism: what rank 0's accept decision tells the other ranks
(docs/speculative-decoding.md#tensor-parallelism).

Every rank runs a verify chunk's forward on its shard and keeps its own shard's per-token GDN scratch; only
rank 0 samples and applies the accept rule (it alone holds the gathered logits, the sampler's generators and the
grammars' masks). One broadcast over the device group then carries, in one int64 buffer, what every rank needs to
stay in step: each sampling sequence's next input token [n], and for the step's verify chunks their emitted tokens
[S, W] (-1 padding) and emitted counts [S]. With them a rank commits the same accepted tokens into its live slots,
records the same last sampled tokens and feeds its MTP drafter the same inputs, so its drafts (argmax over the
gathered draft logits) are rank 0's. A step without verify chunks broadcasts the [n] tokens alone, as before
speculation. Both sides size the buffer from the plan alone.
"""

from __future__ import annotations

import torch

from deltaserve.model.parallel import TensorParallel
from deltaserve.runner.spec_handle import SpecHandle


def _verify_shape(spec: SpecHandle | None) -> tuple[int, int]:
    """(S verify chunks, W the widest chunk's 1 + k) of the step, (0, 0) without verify chunks."""
    if spec is None or spec.layout is None:
        return 0, 0
    return len(spec.layout.seq_index), int(spec.layout.token_index.shape[1])


def send_accepted(tp: TensorParallel, tokens: torch.Tensor, spec: SpecHandle | None) -> None:
    """Rank 0, after its accept: broadcasts tokens [n] (each sampling sequence's next input) and, with verify
    chunks, spec.tokens [S, W] and spec.num_emitted [S]."""
    if not tp.is_parallel:
        return
    num_verify, _ = _verify_shape(spec)
    if not num_verify:
        tp.broadcast_from_first(tokens)
        return
    parts = [tokens.to(torch.int64), spec.tokens.to(torch.int64).reshape(-1), spec.num_emitted.to(torch.int64)]
    tp.broadcast_from_first(torch.cat(parts))  # [n + S·W + S]


def receive_accepted(tp: TensorParallel, num_seqs: int, spec: SpecHandle | None, device: torch.device) -> torch.Tensor:
    """A rank other than 0: receives rank 0's broadcast; returns the [n] next input tokens and, with verify chunks,
    sets spec.tokens [S, W] and spec.num_emitted [S] as rank 0's accept set them."""
    num_verify, width = _verify_shape(spec)
    buffer = torch.empty(num_seqs + num_verify * (width + 1), dtype=torch.int64, device=device)
    tp.broadcast_from_first(buffer)
    if num_verify:
        body = buffer[num_seqs : num_seqs + num_verify * width]
        spec.tokens = body.view(num_verify, width)
        spec.num_emitted = buffer[num_seqs + num_verify * width :]
    return buffer[:num_seqs]
