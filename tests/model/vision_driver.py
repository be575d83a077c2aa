"""Drives deltaserve's model directly for one multimodal sequence, the way the runner will: the vision tower
encodes every item once, each prefill chunk takes the encoder rows its token window covers (embedding
replacement) and its slice of the 3-D MRoPE table, decode steps use index + mrope_delta; KV cache and GDN state
are bound as deltaserve/runner/cache.py binds them, and each step runs inside a ForwardContext.

Also builds the matching transformers reference inputs (pixel_values, grids, mm_token_type_ids) from the same
MultimodalInput, and tiny vision checkpoints once per test session.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.loader import load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import gather_mm_embeds
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.runner.cache import CacheLayout, allocate_and_bind
from deltaserve.tiny.media_prompts import reference_inputs as media_reference_inputs

BLOCK_SIZE = 16


@functools.cache
def tiny_vision_checkpoint(variant: str) -> Path:
    """A tiny vision checkpoint (dense-vl or moe-vl), generated once per process."""
    from deltaserve.tiny import make_tiny

    root = Path(tempfile.mkdtemp(prefix="deltaserve-vision-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny(root / variant, variant)


class MultimodalModelDriver:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, max_len: int = 1024) -> None:
        self.config = ModelConfig.from_pretrained(model_dir)
        self.dtype = dtype
        self.model = Qwen35Model(self.config, dtype, "cpu", build_vision=True)
        load_checkpoint(self.model, self.config, model_dir)
        num_blocks = -(-max_len // BLOCK_SIZE)
        allocate_and_bind(self.model, self.config, CacheLayout(num_blocks, BLOCK_SIZE, 1, 0, 0), dtype, "cpu")
        self.block_ids = list(range(num_blocks))

    def _context(self, start: int, num_tokens: int, is_decode: bool, has_mrope: bool) -> ForwardContext:
        seq_len = start + num_tokens
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
        slots = [self.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, seq_len)]
        return ForwardContext(
            num_decode_tokens=num_tokens if is_decode else 0,
            num_prefill_tokens=0 if is_decode else num_tokens,
            query_start_loc=qsl,
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_tables=torch.tensor([self.block_ids], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=num_tokens,
            max_seq_len=seq_len,
            state_indices=torch.tensor([0], dtype=torch.int32),
            has_initial_state=torch.tensor([start > 0]),
            has_mrope_positions=has_mrope,
            prefill_query_start_loc=qsl if not is_decode else qsl[1:] - 1,
        )

    def encode(self, mm_input: MultimodalInput | None) -> list[torch.Tensor]:
        if mm_input is None:
            return []
        return self.model.visual.encode([(torch.from_numpy(it.pixel_values), it.grid_thw) for it in mm_input.items])

    @torch.inference_mode()
    def step(self, token_ids: list[int], start: int, mm_input: MultimodalInput | None,
             encoder_outputs: list[torch.Tensor], is_decode: bool = False) -> torch.Tensor:  # fmt: skip
        """Runs tokens [start, start + n) of the sequence; returns logits [n, V] fp32."""
        end = start + len(token_ids)
        if mm_input is not None:
            positions = torch.from_numpy(mm_input.positions(start, end))
            slices = mm_input.embed_slices(start, end)
        else:
            positions = torch.arange(start, end).expand(3, -1)
            slices = []
        # one sequence in the step, so its tokens start at row 0 of the batch
        mm_embeds = gather_mm_embeds(
            [(s.dst_start, encoder_outputs[s.item_index][s.src_start : s.src_end]) for s in slices], "cpu"
        )
        has_mrope = bool((positions != positions[0:1]).any())
        ctx = self._context(start, len(token_ids), is_decode, has_mrope)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(token_ids), positions, mm_embeds)
        return self.model.compute_logits(hidden)

    def generate(self, prompt: list[int], mm_input: MultimodalInput | None, max_tokens: int,
                 chunks: list[int] | None = None) -> tuple[list[int], torch.Tensor]:  # fmt: skip
        """Greedy tokens and the logits of the prompt (as chunks of the given sizes) + every decode step."""
        outputs = self.encode(mm_input)
        chunks = chunks or [len(prompt)]
        assert sum(chunks) == len(prompt)
        pieces, start = [], 0
        for size in chunks:
            pieces.append(self.step(prompt[start : start + size], start, mm_input, outputs))
            start += size
        tokens: list[int] = []
        for _ in range(max_tokens):
            token = int(torch.argmax(pieces[-1][-1]))
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
            pieces.append(self.step([token], start, mm_input, outputs, is_decode=True))
            start += 1
        return tokens, torch.cat(pieces)


def reference_inputs(ids: list[int], mm_input: MultimodalInput, config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' forward/generate kwargs for the same prompt and items (the media gate's, from the package)."""
    return media_reference_inputs(ids, mm_input, config.vision.image_token_id, config.vision.video_token_id)
