"""Trained vision checkpoints (dense-vl, moe-vl): image and video prompts whose greedy tokens survive bf16 (issue 14).

The text recipe (deltaserve/tiny/train.py) leaves a decoder that never saw an image embedding: grafted into a
vision variant it met the media gate's prompts with flat logits (transformers' bf16 against its fp32: 19/32 on
image prompts). This recipe starts from `make_tiny(variant, seed)` (the vision template: same config, processor
configs, chat template, tensor names, dtypes and shards), puts the shipped trained decoder and MTP head of the
matching text variant into it (deltaserve/tiny/trained/<text variant>: text stays conditioned), then trains the
whole model, vision tower included, with transformers' composite class (`config.architectures[0]`) in fp32 on
steps whose rows are either
- text rows: the text recipe's rows (corpus windows and supervised noise rows ending in its anchor), with the
  MTP head's loss as there;
- media rows: chats built exactly as the media gate builds its prompts (tiny/media_prompts.py: synthetic images,
  multi-image and video chats, the chat template), at seeds the gate does not use, through deltaserve's processor
  (media_prompts.process_prompts, proven equal to transformers' Qwen3-VL processors), followed by an assistant answer
  that is a corpus paragraph named by the prompt's media (images: the text recipe's anchor; any video: a second
  paragraph). Every token after the chat's first media span is a target (the user text read past images, the
  template, the answer) but the vision tokens themselves, which no model can predict.
The text recipe's activation noise (relative N(0, 1) on the input of every nn.Linear, here also the patch
embedding's nn.Conv3d) stands in for bf16 rounding in the tower and the decoder alike.

Deterministic given (variant, seed, recipe) and the shipped text checkpoint (its manifest's sha256 is recorded):
seeded rows, one intra-op thread, torch's deterministic algorithms. The manifest (training.json) is the text
recipe's plus the media losses. `python -m deltaserve.tiny.train OUT_DIR --variant dense-vl` runs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from deltaserve.tiny import train as text_train
from deltaserve.tiny.mtp import corpus_split
from deltaserve.tiny.vision import VISION_VARIANTS

IGNORE = -100
MEDIA_ROW_KINDS = ("image", "multi-image", "video")


@dataclass(frozen=True)
class VisionRecipe(text_train.Recipe):
    """The text recipe's fields (they drive the text rows, the optimiser and the noise) plus the media rows'."""

    # The shipped trained text checkpoint whose decoder and MTP head start the training.
    text_variant: str = ""
    # Share of rows that are media chats; the rest are the text recipe's rows.
    media_fraction: float = 0.5
    # Relative odds of each media row kind (media_prompts.py's kinds).
    image_weight: float = 2.0
    multi_image_weight: float = 1.0
    video_weight: float = 2.0
    # Prompt indexes are drawn from 0 .. num_prompt_indexes-1 (they pick the gate's prompt structures: edge sizes
    # first, media placement, repeated images, a second video); the seeds start at media_seed_base, above the
    # gate's default seed 0, so no gate prompt is trained on.
    num_prompt_indexes: int = 64
    media_seed_base: int = 1000
    # Tokens of the answer paragraph after each media chat (the gate reads 32 greedy tokens).
    answer_len: int = 40
    # Weight of the media rows' summed loss in the step's loss (the mean over all of the step's target tokens).
    media_loss_weight: float = 1.0


VISION_RECIPES: dict[str, VisionRecipe] = {
    variant: VisionRecipe(variant, text_variant=text_variant, **text_train.SHIPPED)
    for variant, text_variant in VISION_VARIANTS.items()
}


def vision_recipe_for(variant: str, **overrides: object) -> VisionRecipe:
    """The default recipe of a vision variant, with the given (non-None) fields replaced."""
    if variant not in VISION_RECIPES:
        raise ValueError(f"{variant!r} is not a vision variant (known: {', '.join(VISION_RECIPES)})")
    return replace(VISION_RECIPES[variant], **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class VisionTrainReport(text_train.TrainReport):
    text_source: dict
    num_media_rows: int
    first_media_loss: float
    final_media_loss: float


def graft_text_weights(template_dir: Path, text_dir: Path, out_dir: Path) -> dict:
    """A copy of the vision template with every decoder and MTP tensor taken from the trained text checkpoint
    (names, shapes and dtypes must match: anything else is refused by name); returns the text source's identity."""
    import shutil

    from safetensors import safe_open

    from deltaserve.tiny.generate import save_safetensors

    text = text_train.load_template(text_dir)
    template = text_train.load_template(template_dir)
    decoder = [name for name in template if not name.startswith("model.visual.")]
    missing = [name for name in decoder if name not in text]
    if missing:
        raise ValueError(f"the text checkpoint {text_dir} lacks decoder tensors of the template: {missing[:8]}")
    bad = [n for n in decoder if (text[n].shape, text[n].dtype) != (template[n].shape, template[n].dtype)]
    if bad:
        raise ValueError(f"the text checkpoint {text_dir} differs from the template in shape or dtype: {bad[:8]}")
    shutil.copytree(template_dir, out_dir)
    for path in sorted(template_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as shard:
            names = list(shard.keys())
        save_safetensors(out_dir / path.name, {n: text[n] if n in text and n in decoder else template[n]
                                               for n in names})  # fmt: skip
    manifest = text_dir / text_train.MANIFEST_NAME
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()[:16] if manifest.is_file() else None
    return {"dir": text_dir.name, "num_tensors": len(decoder), "manifest_sha256": digest}


@dataclass
class MediaRow:
    """One media chat and its answer: ids [T], targets [T] (IGNORE where none) and the transformers kwargs."""

    kind: str
    ids: list[int]
    targets: torch.Tensor  # [T]
    kwargs: dict[str, torch.Tensor]


class MediaRows:
    """Seeded media chats through the checkpoint's processor, each followed by its answer paragraph."""

    def __init__(self, model_dir: Path, recipe: VisionRecipe, corpus_ids: torch.Tensor, anchors: list[int]) -> None:
        from transformers import AutoTokenizer

        from deltaserve.config import ModelConfig
        from deltaserve.tiny.media_prompts import corpus_words

        self.model_dir = model_dir
        self.recipe = recipe
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = ModelConfig.from_pretrained(model_dir).vision
        self.image_token_id, self.video_token_id = vision.image_token_id, vision.video_token_id
        self.vision_ids = torch.tensor([vision.image_token_id, vision.video_token_id, vision.vision_start_token_id,
                                        vision.vision_end_token_id])  # fmt: skip
        self.words = corpus_words()
        # images answer with the text recipe's anchor (what its noise rows lead to); a video with another paragraph
        self.answers = {
            "image": corpus_ids[anchors[0] : anchors[0] + recipe.answer_len].tolist(),
            "video": corpus_ids[anchors[1] : anchors[1] + recipe.answer_len].tolist(),
        }
        weights = np.array([recipe.image_weight, recipe.multi_image_weight, recipe.video_weight])
        self.kind_odds = weights / weights.sum()
        self.rng = np.random.default_rng([recipe.seed, 14])
        self.num_drawn = 0

    def answer_for(self, parts: list[str]) -> list[int]:
        return self.answers["video" if "video" in parts else "image"]

    def next(self) -> MediaRow:
        from deltaserve.tiny.media_prompts import make_media_prompt, process_prompts, reference_inputs

        kind = MEDIA_ROW_KINDS[int(self.rng.choice(len(MEDIA_ROW_KINDS), p=self.kind_odds))]
        index = int(self.rng.integers(0, self.recipe.num_prompt_indexes))
        seed = self.recipe.media_seed_base + self.recipe.seed * 1_000_003 + self.num_drawn
        self.num_drawn += 1
        prompt = make_media_prompt(self.tokenizer, kind, index, seed, self.words)
        (processed,) = process_prompts(self.model_dir, self.tokenizer, [prompt])
        ids = processed.ids + self.answer_for(prompt.parts)
        kwargs = reference_inputs(ids, processed.mm_input, self.image_token_id, self.video_token_id)
        targets = torch.tensor(ids)
        first_media = int(torch.isin(targets, self.vision_ids).nonzero()[0, 0])
        is_target = ~torch.isin(targets, self.vision_ids) & (torch.arange(len(ids)) > first_media)
        return MediaRow(kind, ids, targets.masked_fill(~is_target, IGNORE), kwargs)


def _media_loss_sum(model: torch.nn.Module, row: MediaRow) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over the row's targets, their count) from transformers' own forward."""
    logits = model(**row.kwargs, use_cache=False).logits[0]  # [T, V]
    targets = row.targets[1:]
    loss = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="sum")
    return loss, int((targets != IGNORE).sum())


def train_vision(
    template_dir: Path, recipe: VisionRecipe, log_every: int = 50, time_budget_s: float | None = None
) -> tuple[Path, dict[str, torch.Tensor], VisionTrainReport]:
    """Graft and train; returns the grafted template folder (kept for the writer), the tensors and the report."""
    from deltaserve.tiny.trained import trained_model_dir

    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state())
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        # beside the template (the caller's temporary folder holds both)
        grafted = template_dir.with_name(template_dir.name + "-grafted")
        text_source = graft_text_weights(template_dir, trained_model_dir(recipe.text_variant), grafted)
        tensors, report = _train(grafted, recipe, text_source, log_every, time_budget_s)
        return grafted, tensors, report
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        torch.set_rng_state(saved[2])


def _train(
    template_dir: Path, recipe: VisionRecipe, text_source: dict, log_every: int, time_budget_s: float | None
) -> tuple[dict[str, torch.Tensor], VisionTrainReport]:
    if recipe.device != "cpu":
        raise ValueError("the vision recipe runs on the CPU only (its determinism is the CPU's)")
    template, model, head = text_train.load_checked_template(template_dir)

    train_text, held_text = corpus_split()
    paragraphs = [text_train.tokenize_text(template_dir, p + "\n\n") for p in train_text.split("\n\n") if p.strip()]
    # one text row per draw: the text recipe's rows, seeded as there
    text_rows = text_train.Batches(
        paragraphs, text_train.num_ordinary_tokens(template_dir), replace(recipe, batch_size=1)
    )
    usable = [s for s in _paragraph_starts(paragraphs) if s + recipe.answer_len <= len(text_rows.ids)]
    media_anchors = [text_rows.anchors[0], usable[len(usable) // 2]]
    media_rows = MediaRows(template_dir, recipe, text_rows.ids, media_anchors)
    is_media_draws = torch.Generator().manual_seed(recipe.seed + 14)
    held_ids = text_train.tokenize_text(template_dir, held_text)
    num_tokenizer_tokens = text_train.tokenizer_size(template_dir)
    padding = text_train.padded_tables(model, num_tokenizer_tokens)

    parameters = list({id(p): p for p in [*model.parameters(), *head.parameters()]}.values())
    optimizer = torch.optim.AdamW(
        parameters, lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=recipe.weight_decay
    )
    model.train()
    head.train()
    noise_hooks = text_train.add_activation_noise(
        [model, head], recipe.activation_noise, recipe.seed, (torch.nn.Linear, torch.nn.Conv3d)
    )
    start = time.monotonic()
    first = {"text": math.nan, "media": math.nan}
    last = {"text": math.nan, "media": math.nan, "mtp": math.nan}
    num_media_rows = 0
    num_paced = min(10, recipe.num_warmup_steps)
    step = 0
    while step < recipe.num_steps:
        recipe = text_train.paced_recipe(recipe, step, num_paced, start, time_budget_s)
        is_media = (torch.rand(recipe.batch_size, generator=is_media_draws) < recipe.media_fraction).tolist()
        num_media = sum(is_media)
        rows = [media_rows.next() for _ in range(num_media)]
        texts = [text_rows.next() for _ in range(recipe.batch_size - num_media)]
        for group in optimizer.param_groups:
            group["lr"] = text_train.learning_rate_at(recipe, step)
        optimizer.zero_grad(set_to_none=True)
        sums = [_media_loss_sum(model, row) for row in rows]
        media_sum = sum((s for s, _ in sums), torch.zeros(()))
        num_media_targets = sum(n for _, n in sums)
        text_sum, num_text_targets, mtp_loss = torch.zeros(()), 0, torch.zeros(())
        if texts:
            batch, is_target, labels = (torch.cat(parts) for parts in zip(*texts, strict=True))
            trunk_loss, mtp_loss = text_train.trunk_and_mtp_losses(model, head, batch, is_target, labels)
            num_text_targets = int(is_target[:, 1:].sum())
            text_sum = trunk_loss * num_text_targets
        num_targets = max(num_media_targets + num_text_targets, 1)
        loss = (recipe.media_loss_weight * media_sum + text_sum) / num_targets + recipe.mtp_loss_weight * mtp_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, recipe.max_grad_norm)
        optimizer.step()
        with torch.no_grad():
            for table in padding:
                table[num_tokenizer_tokens:] = 0
        num_media_rows += num_media
        text_mean = float(text_sum.detach()) / max(num_text_targets, 1) if texts else math.nan
        media_mean = float(media_sum.detach()) / max(num_media_targets, 1) if rows else math.nan
        step_losses = {"text": text_mean, "media": media_mean}
        for key, value in step_losses.items():
            if not math.isnan(value):
                first[key] = value if math.isnan(first[key]) else first[key]
                last[key] = value
        last["mtp"] = float(mtp_loss.detach()) if texts else last["mtp"]
        if log_every and (step % log_every == 0 or step == recipe.num_steps - 1):
            print(
                f"train[{recipe.variant}] step {step}/{recipe.num_steps}: text {last['text']:.3f}, media "
                f"{last['media']:.3f}, mtp {last['mtp']:.3f}, lr {text_train.learning_rate_at(recipe, step):.2e}, "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
        step += 1
    seconds = time.monotonic() - start
    for hook in noise_hooks:
        hook.remove()
    tensors, held_loss, agreement = text_train.evaluate_trained(model, head, template, held_ids)
    report = VisionTrainReport(
        recipe=asdict(recipe),
        num_train_tokens=len(text_rows.ids),
        num_held_out_tokens=len(held_ids),
        seconds=round(seconds, 1),
        first_loss=round(first["text"], 4),
        final_loss=round(last["text"], 4),
        final_mtp_loss=round(last["mtp"], 4),
        held_out_loss=round(held_loss, 4),
        mtp_agreement=round(agreement, 4),
        tensor_sha256={name: text_train.sha256_of_tensor(t) for name, t in tensors.items()},
        text_source=text_source,
        num_media_rows=num_media_rows,
        first_media_loss=round(first["media"], 4),
        final_media_loss=round(last["media"], 4),
    )
    return tensors, report


def _paragraph_starts(paragraphs: list[list[int]]) -> list[int]:
    starts, offset = [], 0
    for paragraph in paragraphs:
        starts.append(offset)
        offset += len(paragraph)
    return starts


def manifest_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / text_train.MANIFEST_NAME).read_text())
