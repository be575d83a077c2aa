"""Drives deltaserve's model directly for one multimodal sequence, the way the runner will: the vision tower
encodes every item once, each prefill chunk takes the encoder rows its token window covers (embedding
replacement) and its slice of the 3-D MRoPE table, decode steps use index + mrope_delta; KV cache and GDN state
are bound as deltaserve/runner/cache.py binds them, and each step runs inside a ForwardContext.

Also builds the matching transformers reference inputs (pixel_values, grids, mm_token_type_ids) from the same
MultimodalInput, tiny vision checkpoints once per test session, and the vision set-up the model, engine and
tensor-parallel tests share: one Case per variant (checkpoint, tokenizer, driver, transformers reference, processor)
and the fixed image / multi-image / video PROMPTS it turns into token ids and a MultimodalInput.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.loader import load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import gather_mm_embeds
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.media import LoadedImage, LoadedVideo
from deltaserve.multimodal.processor import MultimodalProcessor
from deltaserve.multimodal.prompt import VisionTokenIds
from deltaserve.multimodal.video import VideoMetadata
from deltaserve.runner.cache import CacheLayout, allocate_and_bind
from deltaserve.tiny.media_prompts import reference_inputs as media_reference_inputs
from tests.multimodal.synthetic import synthetic_image, synthetic_video

BLOCK_SIZE = 16
MAX_TOKENS = 32  # tokens generated per prompt, by deltaserve and by the reference alike

PROMPTS: dict[str, dict[str, Any]] = {
    "image": {"text": ["What is in this picture?", "image"], "images": [(96, 128, 1)]},
    "multi-image": {"text": ["Compare", "image", "with", "image", "please."], "images": [(64, 64, 2), (300, 200, 3)]},
    "video": {"text": ["Watch:", "video", "What happens?"], "videos": [(6, 96, 128, 4, 3.0)]},
}


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


class Case:
    """One variant's checkpoint, deltaserve driver, transformers reference and processor, built once."""

    def __init__(self, variant: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        self.model_dir: Path = tiny_vision_checkpoint(variant)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.driver = MultimodalModelDriver(self.model_dir)
        self.reference = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        vision = self.driver.config.vision
        tokens = VisionTokenIds(vision.image_token_id, vision.video_token_id, vision.vision_start_token_id,
                                vision.vision_end_token_id)  # fmt: skip
        self.processor = MultimodalProcessor.from_model_dir(
            self.model_dir, tokens, lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        )

    def prompt(self, name: str) -> tuple[list[int], Any]:
        spec = PROMPTS[name]
        parts, loaded = [], []
        images, videos = iter(spec.get("images", [])), iter(spec.get("videos", []))
        for piece in spec["text"]:
            if piece == "image":
                height, width, seed = next(images)
                parts.append({"type": "image_url", "image_url": {"url": "unused"}})
                loaded.append(LoadedImage(synthetic_image(height, width, seed), f"image-{seed}"))
            elif piece == "video":
                num_frames, height, width, seed, fps = next(videos)
                parts.append({"type": "video_url", "video_url": {"url": "unused"}})
                metadata = VideoMetadata(num_frames, fps, tuple(range(num_frames)))
                loaded.append(LoadedVideo(synthetic_video(num_frames, height, width, seed), metadata, True, "v"))
            else:
                parts.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": parts}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.processor.process_loaded(ids, loaded)

    @torch.inference_mode()
    def reference_generate(self, ids: list[int], mm_input: Any) -> list[int]:
        kwargs = reference_inputs(ids, mm_input, self.driver.config)
        out = self.reference.generate(**kwargs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        return out[0, len(ids) :].tolist()

    @torch.inference_mode()
    def reference_logits(self, ids: list[int], generated: list[int], mm_input: Any) -> torch.Tensor:
        kwargs = reference_inputs(ids + generated, mm_input, self.driver.config)
        return self.reference(**kwargs).logits[0].float()


_CASES: dict[str, Case] = {}


def case_for(variant: str) -> Case:
    if variant not in _CASES:
        _CASES[variant] = Case(variant)
    return _CASES[variant]


def generate_together(
    llm: Any, requests: dict[str, tuple[list[int], MultimodalInput | None]], params: Any
) -> dict[str, list[int]]:
    """Adds every request (name -> prompt ids and its MultimodalInput, None for text) to llm's engine at once, in
    order, and steps the engine until all finish: name -> the generated token ids."""
    for name, (ids, mm_input) in requests.items():
        llm.engine.add_request(name, ids, params, mm_input=mm_input)
    outputs: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for output in llm.engine.step(by_output_kind=False):
            outputs.setdefault(output.request_id, []).extend(output.outputs[0].token_ids if output.outputs else [])
    return outputs
