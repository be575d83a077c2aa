"""A step's vision-encoder embeddings: which images and videos the step's chunks need encoded, the tower call, and
the per-row keeping of encoder outputs until their last placeholder is computed (docs/multimodal.md). ModelRunner
(runner/model_runner.py) owns the model and the request table that holds the outputs; it passes them in.
"""

from __future__ import annotations

import torch

from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import gather_mm_embeds
from deltaserve.runner.inputs import StepLayout
from deltaserve.runner.request_table import RequestTable
from deltaserve.step import StepPlan


def step_mm_embeds(
    model: Qwen35Model, table: RequestTable, plan: StepPlan, layout: StepLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's encoder embeddings: items a chunk's window needs are encoded whole (the ViT is bidirectional),
    all of a step's missing items in one tower call, and kept per row until their last placeholder is
    computed, so an image that straddles a chunk boundary is encoded once."""
    if model.visual is None:
        raise ValueError("a request carries images or videos, but the vision tower is not built "
                         "(--language-model-only, or a text-only checkpoint)")  # fmt: skip
    missing: list[tuple[int, int]] = []
    for seq in plan.seqs:
        outputs = table.encoder_outputs[seq.row]
        missing += [(seq.row, span.item) for span in seq.mm_spans if span.item not in outputs]
    if missing:
        items = [table.mm[row].items[index] for row, index in missing]
        encoded = model.visual.encode([(torch.from_numpy(it.pixel_values), it.grid_thw) for it in items])
        for (row, index), rows in zip(missing, encoded, strict=True):
            table.encoder_outputs[row][index] = rows
    pieces: list[tuple[int, torch.Tensor]] = []
    for i, seq in enumerate(plan.seqs):
        if not seq.mm_spans:
            continue
        mm, outputs = table.mm[seq.row], table.encoder_outputs[seq.row]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens
        base = int(layout.query_start_loc[i])
        for piece in mm.embed_slices(start, end):
            pieces.append((base + piece.dst_start, outputs[piece.item_index][piece.src_start : piece.src_end]))
        for index in list(outputs):
            last_run = mm.items[index].embed_runs[-1]
            if last_run[0] + last_run[1] <= end:
                del outputs[index]  # every placeholder of the item is computed
    return gather_mm_embeds(pieces, device)
