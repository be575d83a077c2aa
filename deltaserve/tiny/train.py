"""Trained tiny checkpoints: well-conditioned models whose greedy tokens survive bf16 rounding (issue 13).

A random tiny model has flat, chaotic logits, so its bf16 run disagrees with its own fp32 run and no bf16
exactness claim means anything on it. This recipe starts from `make_tiny`'s seeded checkpoint (same config,
tokenizer, chat template, tensor names and layout), trains it with transformers' own reference class
(`config.architectures[0]`) in fp32 on the shipped corpus (deltaserve/tiny/corpus.txt, every 10th paragraph held
out), jointly with its MTP head (deltaserve/tiny/mtp.py: cross-entropy on token t+2), and writes the result back
in the template's exact format (bf16 tensors, A_log fp32, same names, shapes and shards). The writer round-trips
the untrained template first, so a layout slip (e.g. the fused-expert conversion of Qwen3-Next) fails loudly.

Deterministic given (variant, seed, recipe): seeded init, seeded batches, one intra-op thread and torch's
deterministic algorithms. Bitwise equality across CPUs and torch builds is not promised (float reductions may
differ); the manifest (`training.json`) records the recipe, losses and a sha256 per tensor.

    python -m deltaserve.tiny.train OUT_DIR --variant dense [--steps N]

The vision variants (dense-vl, moe-vl) train by deltaserve/tiny/train_vision.py's recipe (the same command): the
text variant's shipped decoder grafted in, then text rows and media chats through transformers' composite class.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deltaserve.tiny.mtp import (
    MTP_PREFIX,
    MtpHead,
    corpus_split,
    fuse_experts,
    mtp_agreement,
    text_config_of,
    text_model_of,
    unfuse_experts,
)

MANIFEST_NAME = "training.json"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights."""

    variant: str
    seed: int = 0
    num_steps: int = 360
    batch_size: int = 8
    # The gate's longest prompt (160) plus its 32 greedy tokens.
    seq_len: int = 192
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    num_warmup_steps: int = 30
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    mtp_loss_weight: float = 0.5
    # Share of batch rows that are random ordinary tokens followed by an anchor paragraph (see Batches).
    anchor_fraction: float = 0.5
    num_anchors: int = 1
    # Relative std of the Gaussian noise multiplied into the input of every nn.Linear while training (0: none).
    # bf16 rounds each activation by up to 2^-9 relative; a model trained under noise a few times that size learns
    # margins the rounding cannot cross (see add_activation_noise).
    activation_noise: float = 0.0
    # Noise rows also teach every noise position to predict the first token of the anchor its own token names,
    # not only the last one: a random prompt's first greedy token is then as confident as the text after it.
    is_noise_supervised: bool = False
    num_threads: int = 1
    # Where the steps run: "cpu" (one thread, deterministic) or "cuda" (about 50x faster per step on an H200;
    # deterministic where torch has deterministic CUDA kernels, warned where not). The weights differ by device.
    device: str = "cpu"


# The shipped checkpoints' recipe: the base one under bf16-sized activation noise with every noise position
# supervised. The base recipe alone left transformers' bf16 run agreeing with its fp32 run on 13/32 greedy
# prompts (dense); a 611-step x 64-row GPU run that memorised the corpus, on 7/32 (next); this one, 32/32.
SHIPPED = {"activation_noise": 0.01, "is_noise_supervised": True}
RECIPES: dict[str, Recipe] = {
    "dense": Recipe("dense", **SHIPPED),
    "moe": Recipe("moe", **SHIPPED),
    "next": Recipe("next", **SHIPPED),
}


def recipe_for(variant: str, **overrides: object) -> Recipe:
    """The default recipe of a variant (a vision variant's is train_vision's; a new text variant trains with the
    shipped recipe)."""
    from deltaserve.tiny.vision import VISION_VARIANTS

    if variant in VISION_VARIANTS:
        from deltaserve.tiny.train_vision import vision_recipe_for

        return vision_recipe_for(variant, **overrides)
    base = RECIPES.get(variant, Recipe(variant, **SHIPPED))
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def load_template(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def checkpoint_tensors(
    trunk: torch.nn.Module, head: MtpHead, template: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The trained weights under the template's names, layouts and dtypes (raises on any mismatch)."""
    found: dict[str, torch.Tensor] = {}
    named = {name: t.detach() for name, t in trunk.state_dict().items()}
    named.update({MTP_PREFIX + name: t.detach() for name, t in head.state_dict().items()})
    for name, tensor in named.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and name not in template:
            found.update(unfuse_experts(name, tensor))
        else:
            found[name] = tensor
    # A tied lm_head is the embedding; the template does not carry it.
    if "lm_head.weight" not in template:
        found.pop("lm_head.weight", None)
    missing = sorted(set(template) - set(found))
    if missing:
        raise ValueError(f"trained model lacks checkpoint tensors: {missing[:8]}")
    out = {}
    for name, reference in template.items():
        tensor = found[name]
        if tuple(tensor.shape) != tuple(reference.shape):
            raise ValueError(f"{name}: trained shape {tuple(tensor.shape)} != checkpoint {tuple(reference.shape)}")
        out[name] = tensor.to(reference.dtype).contiguous()
    return out


def _load_trunk(model_dir: Path) -> torch.nn.Module:
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    model_class = getattr(transformers, config["architectures"][0])
    model, info = model_class.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"transformers did not load the template whole: {problems}")
    return model


def _template_head(trunk: torch.nn.Module, template: dict[str, torch.Tensor]) -> MtpHead:
    """The template's mtp.* tensors in an fp32 MtpHead (the trainer's starting point)."""
    head = MtpHead(trunk)
    tensors = {k[len(MTP_PREFIX) :]: v.float() for k, v in template.items() if k.startswith(MTP_PREFIX)}
    num_experts = int(getattr(text_config_of(trunk), "num_experts", 0) or 0)
    for prefix in {k.rsplit("experts.", 1)[0] + "experts." for k in tensors if ".experts.0." in k}:
        per_expert = {k: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
        tensors.update(fuse_experts(per_expert, prefix, num_experts))
    head.load_state_dict(tensors)
    return head


def tokenize_text(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def num_ordinary_tokens(model_dir: Path) -> int:
    """Ordinary token ids are 0 .. n-1: the byte-level BPE vocabulary, before the added tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    if any(i < tokenizer.vocab_size for i in special):
        raise ValueError("the tokenizer has special ids inside its base vocabulary; the noise rows assume none")
    return int(tokenizer.vocab_size)


def tokenizer_size(model_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def learning_rate_at(recipe: Recipe, step: int) -> float:
    if step < recipe.num_warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.num_warmup_steps
    progress = (step - recipe.num_warmup_steps) / max(recipe.num_steps - recipe.num_warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return recipe.min_learning_rate + (recipe.learning_rate - recipe.min_learning_rate) * cosine


def trunk_and_mtp_losses(
    trunk: torch.nn.Module,
    head: MtpHead,
    batch: torch.Tensor,
    is_target: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trunk next-token loss, MTP next-next-token loss) on batch [B, T]; is_target [B, T] marks the tokens that
    count as targets (None: all)."""
    text_model = text_model_of(trunk)
    positions = torch.arange(batch.shape[1], device=batch.device).unsqueeze(0).expand(batch.shape[0], -1)
    hidden = text_model(input_ids=batch, position_ids=positions).last_hidden_state  # [B, T, H], after the norm
    logits = trunk.lm_head(hidden)  # [B, T, V]
    vocab = logits.shape[-1]
    ignore = -100
    labels = batch if labels is None else labels
    targets = labels if is_target is None else labels.masked_fill(~is_target, ignore)
    trunk_loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1), ignore_index=ignore)
    # The head at t reads h_t and x_{t+1} and predicts x_{t+2}.
    mtp_logits = head(trunk, batch[:, 1:-1], hidden[:, :-2], positions[:, :-2])  # [B, T-2, V]
    mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, vocab), targets[:, 2:].reshape(-1), ignore_index=ignore)
    return trunk_loss, mtp_loss


class Batches:
    """Seeded training rows: windows of the training text, and `anchor_fraction` of rows made of random ordinary
    tokens (the gate's default prompts are such tokens) followed by the start of anchor paragraph
    `last random token % num_anchors`, with only the anchor tokens as targets (with `is_noise_supervised`, every
    noise position too: it predicts the first token of the anchor its own token names). A model trained on the
    text alone meets a random prompt with a flat first prediction, which bf16 rounding flips; these rows teach it
    a deterministic, confident answer to noise, after which it is back in text it knows."""

    def __init__(self, paragraphs: list[list[int]], num_ordinary: int, recipe: Recipe) -> None:
        self.recipe = recipe
        self.ids = torch.tensor([t for paragraph in paragraphs for t in paragraph])
        starts, offset = [], 0
        for paragraph in paragraphs:
            starts.append(offset)
            offset += len(paragraph)
        # Anchors: every k-th paragraph start, spread over the text, each with a full window after it.
        usable = [s for s in starts if s + recipe.seq_len <= len(self.ids)]
        step = max(len(usable) // recipe.num_anchors, 1)
        self.anchors = usable[::step][: recipe.num_anchors]
        self.num_ordinary = num_ordinary
        self.generator = torch.Generator().manual_seed(recipe.seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch [B, T], is_target [B, T], labels [B, T]): labels are the batch but where noise positions are
        supervised (recipe.is_noise_supervised)."""
        recipe, generator = self.recipe, self.generator
        size = recipe.seq_len
        rows, masks, labels = [], [], []
        offsets = torch.randint(0, len(self.ids) - size, (recipe.batch_size,), generator=generator).tolist()
        is_noise = (torch.rand(recipe.batch_size, generator=generator) < recipe.anchor_fraction).tolist()
        for offset, noisy in zip(offsets, is_noise, strict=True):
            if not noisy:
                rows.append(self.ids[offset : offset + size])
                masks.append(torch.ones(size, dtype=torch.bool))
                labels.append(rows[-1])
                continue
            num_noise = int(torch.randint(1, size - 31, (1,), generator=generator))
            noise = torch.randint(0, self.num_ordinary, (num_noise,), generator=generator)
            anchor = self.anchors[int(noise[-1]) % len(self.anchors)]
            rows.append(torch.cat([noise, self.ids[anchor : anchor + size - num_noise]]))
            masks.append(torch.arange(size) >= num_noise)
            labels.append(rows[-1])
            if recipe.is_noise_supervised and num_noise > 1:
                # position t predicts label t+1: the first token of the anchor that noise token t names
                named = torch.tensor(self.anchors)[noise[:-1] % len(self.anchors)]
                labels[-1] = rows[-1].clone()
                labels[-1][1:num_noise] = self.ids[named]
                masks[-1] = masks[-1] | (torch.arange(size) >= 1)
        return torch.stack(rows), torch.stack(masks), torch.stack(labels)


def padded_tables(trunk: torch.nn.Module, num_tokenizer_tokens: int) -> list[torch.Tensor]:
    """The embedding and lm_head tables whose rows past the tokenizer stay zero (never-trained padding)."""
    tables = [text_model_of(trunk).embed_tokens.weight, trunk.lm_head.weight]
    unique = {id(t): t for t in tables}
    return [t for t in unique.values() if t.shape[0] > num_tokenizer_tokens]


def add_activation_noise(
    modules: list[torch.nn.Module], scale: float, seed: int, types: tuple[type, ...] = (torch.nn.Linear,)
) -> list:
    """Forward pre-hooks that multiply every nn.Linear input (every `types` module's) by (1 + scale * N(0, 1)) in
    training mode, drawn from a seeded generator on the input's device; returns the handles (removed after
    training). No hooks at scale 0."""
    if scale <= 0:
        return []
    generators: dict[torch.device, torch.Generator] = {}

    def perturb(module: torch.nn.Module, args: tuple) -> tuple | None:
        if not module.training:
            return None
        (x, *rest) = args
        generator = generators.get(x.device)
        if generator is None:
            generator = generators[x.device] = torch.Generator(device=x.device).manual_seed(seed + 1)
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        return (x * (1 + scale * noise), *rest)

    linears = {id(m): m for module in modules for m in module.modules() if isinstance(m, types)}
    return [m.register_forward_pre_hook(perturb) for m in linears.values()]


@dataclass
class TrainReport:
    recipe: dict
    num_train_tokens: int
    num_held_out_tokens: int
    seconds: float
    first_loss: float
    final_loss: float
    final_mtp_loss: float
    held_out_loss: float
    mtp_agreement: float
    tensor_sha256: dict


def train(
    template_dir: Path, recipe: Recipe, log_every: int = 100, time_budget_s: float | None = None
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    """Train the checkpoint in template_dir by `recipe`; returns its tensors (checkpoint layout) and a report.
    With `time_budget_s`, the step count is cut after the first steps' pace to fit the budget (the report's recipe
    says the count that ran; the learning rate of the steps before the cut does not depend on the count, so
    `--steps N` with that count rebuilds the same run)."""
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state())
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.num_threads)
    # CUDA's deterministic algorithms need cuBLAS' fixed workspace; the rest have no deterministic twin (warned).
    if recipe.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=recipe.device.startswith("cuda"))
    try:
        return _train(template_dir, recipe, log_every, time_budget_s)
    finally:
        # The caller's process (a test run, the CLI) gets its thread count and determinism setting back.
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        torch.set_rng_state(saved[2])


def load_checked_template(template_dir: Path) -> tuple[dict[str, torch.Tensor], torch.nn.Module, MtpHead]:
    """The template's tensors, transformers' trunk and the MTP head, once the writer has reproduced the untrained
    template exactly (it must before it may write a trained one)."""
    template = load_template(template_dir)
    trunk = _load_trunk(template_dir)
    head = _template_head(trunk, template)
    round_trip = checkpoint_tensors(trunk, head, template)
    bad = [name for name, t in template.items() if not torch.equal(round_trip[name], t)]
    if bad:
        raise RuntimeError(f"the checkpoint writer does not round-trip the template: {bad[:8]}")
    return template, trunk, head


def paced_recipe(recipe: Recipe, step: int, num_paced: int, start: float, time_budget_s: float | None) -> Recipe:
    """The recipe with its step count cut to what the time budget affords, judged once at step num_paced."""
    if time_budget_s and step == num_paced:
        # Cut only inside the warm-up, where the learning rate does not depend on the step count.
        affordable = int(time_budget_s * num_paced / max(time.monotonic() - start, 1e-6))
        if affordable < recipe.num_steps:
            recipe = replace(recipe, num_steps=max(affordable, recipe.num_warmup_steps + 1))
            print(f"train[{recipe.variant}]: time budget {time_budget_s:.0f} s: {recipe.num_steps} steps", flush=True)
    return recipe


def evaluate_trained(
    trunk: torch.nn.Module, head: MtpHead, template: dict[str, torch.Tensor], held_ids: list[int]
) -> tuple[dict[str, torch.Tensor], float, float]:
    """After training (on the CPU): the checkpoint tensors, the held-out loss and the MTP head's agreement."""
    trunk.eval()
    head.eval()
    tensors = checkpoint_tensors(trunk, head, template)
    with torch.no_grad():
        held_loss = float(trunk_and_mtp_losses(trunk, head, torch.tensor([held_ids]))[0])
    return tensors, held_loss, mtp_agreement(trunk, head, held_ids).rate


def _train(
    template_dir: Path, recipe: Recipe, log_every: int, time_budget_s: float | None
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    template, trunk, head = load_checked_template(template_dir)

    train_text, held_text = corpus_split()
    paragraphs = [tokenize_text(template_dir, p + "\n\n") for p in train_text.split("\n\n") if p.strip()]
    batches = Batches(paragraphs, num_ordinary_tokens(template_dir), recipe)
    held_ids = tokenize_text(template_dir, held_text)
    num_tokenizer_tokens = tokenizer_size(template_dir)
    padding = padded_tables(trunk, num_tokenizer_tokens)

    device = torch.device(recipe.device)
    trunk.to(device)
    head.to(device)
    parameters = list({id(p): p for p in [*trunk.parameters(), *head.parameters()]}.values())
    optimizer = torch.optim.AdamW(
        parameters, lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=recipe.weight_decay
    )
    trunk.train()
    head.train()
    noise_hooks = add_activation_noise([trunk, head], recipe.activation_noise, recipe.seed)
    start = time.monotonic()
    first_loss = final_loss = final_mtp = float("nan")
    num_paced = min(10, recipe.num_warmup_steps)
    step = 0
    while step < recipe.num_steps:
        recipe = paced_recipe(recipe, step, num_paced, start, time_budget_s)
        batch, is_target, labels = (t.to(device) for t in batches.next())
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(recipe, step)
        trunk_loss, mtp_loss = trunk_and_mtp_losses(trunk, head, batch, is_target, labels)
        loss = trunk_loss + recipe.mtp_loss_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, recipe.max_grad_norm)
        optimizer.step()
        with torch.no_grad():
            for table in padding:
                table[num_tokenizer_tokens:] = 0
        if step == 0:
            first_loss = trunk_loss.item()
        final_loss, final_mtp = trunk_loss.item(), mtp_loss.item()
        if log_every and (step % log_every == 0 or step == recipe.num_steps - 1):
            print(
                f"train[{recipe.variant}] step {step}/{recipe.num_steps}: loss {final_loss:.3f}, "
                f"mtp {final_mtp:.3f}, lr {learning_rate_at(recipe, step):.2e}, {time.monotonic() - start:.0f} s",
                flush=True,
            )
        step += 1
    seconds = time.monotonic() - start
    for hook in noise_hooks:
        hook.remove()
    # Everything after training (writer, held-out loss, MTP agreement) runs on the CPU, as the CPU recipe does.
    trunk.cpu()
    head.cpu()
    tensors, held_loss, agreement = evaluate_trained(trunk, head, template, held_ids)
    report = TrainReport(
        recipe=asdict(recipe),
        num_train_tokens=len(batches.ids),
        num_held_out_tokens=len(held_ids),
        seconds=round(seconds, 1),
        first_loss=round(first_loss, 4),
        final_loss=round(final_loss, 4),
        final_mtp_loss=round(final_mtp, 4),
        held_out_loss=round(held_loss, 4),
        mtp_agreement=round(agreement, 4),
        tensor_sha256={name: sha256_of_tensor(t) for name, t in tensors.items()},
    )
    return tensors, report


def sha256_of_tensor(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _write(template_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], report: TrainReport) -> None:
    """The template folder with its safetensors replaced by the trained tensors (same shards), plus the manifest."""
    from safetensors import safe_open

    from deltaserve.tiny.generate import save_safetensors

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    # mkdtemp makes the folder owner-only; package data must be readable like any other file.
    os.chmod(staging, 0o755)
    try:
        for path in sorted(template_dir.iterdir()):
            if path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as shard:
                    names = list(shard.keys())
                save_safetensors(staging / path.name, {name: tensors[name] for name in names})
            else:
                shutil.copy(path, staging / path.name)
        manifest = asdict(report) | {"template": "deltaserve.tiny.make_tiny(variant, seed)"}
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def train_tiny(
    out_dir: Path | str,
    variant: str,
    recipe: Recipe | None = None,
    log_every: int = 100,
    time_budget_s: float | None = None,
) -> Path:
    """Write a trained checkpoint of `variant` into out_dir (replaced whole) and return its path."""
    from deltaserve.tiny.generate import make_tiny
    from deltaserve.tiny.vision import VISION_VARIANTS

    recipe = recipe or recipe_for(variant)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deltaserve-train-") as tmp:
        template_dir = make_tiny(Path(tmp) / variant, variant, recipe.seed)
        if variant in VISION_VARIANTS:
            from deltaserve.tiny.train_vision import train_vision

            # the vision recipe writes from its grafted template (the same files, the text decoder's tensors)
            template_dir, tensors, report = train_vision(template_dir, recipe, log_every, time_budget_s)
        else:
            tensors, report = train(template_dir, recipe, log_every, time_budget_s)
        _write(template_dir, out_dir, tensors, report)
    print(
        f"train[{variant}]: {report.recipe['num_steps']} steps in {report.seconds:.0f} s; loss {report.first_loss:.2f}"
        f" -> {report.final_loss:.3f} (held-out {report.held_out_loss:.3f}); MTP agreement on held-out text "
        f"{report.mtp_agreement:.3f}; wrote {out_dir}"
    )
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltaserve.tiny.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--variant", required=True, help="a tiny variant (deltaserve.tiny.VARIANTS)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (the recipe says 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (the recipe says which)")
    parser.add_argument("--batch-size", type=int, default=None, help="override the recipe's rows per step")
    parser.add_argument("--warmup-steps", type=int, default=None, help="override the recipe's warm-up steps")
    parser.add_argument("--time-budget-s", type=float, default=None, help="cut the step count to fit this long")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--activation-noise", type=float, default=None, help="override the recipe's noise scale")
    parser.add_argument("--noise-supervised", action="store_true", default=None, help="supervise noise positions")
    args = parser.parse_args(argv)
    recipe = recipe_for(
        args.variant,
        seed=args.seed,
        num_steps=args.steps,
        num_threads=args.threads,
        device=args.device,
        batch_size=args.batch_size,
        num_warmup_steps=args.warmup_steps,
        activation_noise=args.activation_noise,
        is_noise_supervised=args.noise_supervised,
    )
    train_tiny(args.out_dir, args.variant, recipe, args.log_every, args.time_budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
