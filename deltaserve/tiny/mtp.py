"""The MTP (multi-token prediction) head of a tiny checkpoint, built from transformers' own layer classes.

transformers ignores `mtp.*` (docs/ARCHITECTURE.md#the-mtp-head: it has no MTP reference), so this module assembles the
head from the trunk's classes, in the official layout and order of operations:
u = mtp.fc(concat[mtp.pre_fc_norm_embedding(embed(x_{t+1})), mtp.pre_fc_norm_hidden(h_t)]), one full-attention
decoder layer `mtp.layers.0`, `mtp.norm`, then the trunk's shared lm_head; h_t is the trunk's hidden state at
position t after its final norm, and the head predicts token t+2. Training (deltaserve/tiny/train.py) and the
acceptance check below both use it. `python -m deltaserve.tiny.mtp DIR` prints the head's top-1 agreement with
the trunk's own next-next token on the corpus' held-out paragraphs (the greedy acceptance rate a one-token
speculative draft would see).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from deltaserve.tiny.tokenizer import CORPUS_PATH

MTP_PREFIX = "mtp."
# Every HELD_OUT_EVERY-th paragraph of the corpus (counting from HELD_OUT_OFFSET) is never trained on.
HELD_OUT_EVERY = 10
HELD_OUT_OFFSET = 5


def corpus_split(text: str | None = None) -> tuple[str, str]:
    """(training text, held-out text): paragraphs of the shipped corpus, every 10th one held out."""
    text = CORPUS_PATH.read_text(encoding="utf-8") if text is None else text
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    held = [p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY == HELD_OUT_OFFSET]
    train = [p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY != HELD_OUT_OFFSET]
    return "\n\n".join(train) + "\n\n", "\n\n".join(held) + "\n\n"


def text_model_of(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a composite or flat transformers model."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def text_config_of(model: nn.Module) -> object:
    config = model.config
    return getattr(config, "text_config", None) or config


class MtpHead(nn.Module):
    """One MTP layer over a transformers trunk; parameter names are the checkpoint's `mtp.*` names minus `mtp.`."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        text_model = text_model_of(trunk)
        config = text_config_of(trunk)
        layer_types = list(config.layer_types)
        if "full_attention" not in layer_types:
            raise ValueError("the trunk has no full-attention layer to take the MTP layer's class from")
        # The MTP layer is a full-attention decoder layer; transformers picks the layer type by index.
        attention_index = layer_types.index("full_attention")
        layer_class = type(text_model.layers[attention_index])
        norm_class = type(text_model.norm)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer_class(config, attention_index)])
        self.norm = norm_class(hidden, eps=config.rms_norm_eps)
        self.attention_index = attention_index

    def forward(
        self, trunk: nn.Module, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, T, V] for token t+2 from next_ids [B, T] (token t+1) and hidden [B, T, H] (normed h_t)."""
        text_model = text_model_of(trunk)
        embedded = text_model.embed_tokens(next_ids)
        fused = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope_positions = positions
        if hasattr(text_model.rotary_emb, "mrope_section"):
            # Qwen3.5's MRoPE rotary takes [3, B, T] (text: three equal rows); transformers 5.17 does not expand
            # a [B, T] tensor itself (later versions do).
            rope_positions = positions.unsqueeze(0).expand(3, -1, -1)
        position_embeddings = text_model.rotary_emb(fused, rope_positions)
        for layer in self.layers:
            # No mask: transformers' SDPA path is causal when the mask is None and the query is longer than 1.
            fused = layer(fused, position_embeddings=position_embeddings, attention_mask=None, position_ids=positions)
        return trunk.lm_head(self.norm(fused))


def _checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def unfuse_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors as the per-expert checkpoint tensors (Qwen3-Next's release layout)."""
    prefix = name.rsplit("experts.", 1)[0] + "experts."
    out = {}
    if name.endswith("experts.gate_up_proj"):
        # [E, 2I, H]: per expert the gate rows, then the up rows.
        half = tensor.shape[1] // 2
        for expert in range(tensor.shape[0]):
            out[f"{prefix}{expert}.gate_proj.weight"] = tensor[expert, :half]
            out[f"{prefix}{expert}.up_proj.weight"] = tensor[expert, half:]
    elif name.endswith("experts.down_proj"):
        for expert in range(tensor.shape[0]):
            out[f"{prefix}{expert}.down_proj.weight"] = tensor[expert]
    else:
        raise ValueError(f"{name} is not a fused expert tensor")
    return out


def fuse_experts(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors under `prefix` (…mlp.experts.) as transformers' fused parameters."""
    gate_up = [
        torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]], dim=0)
        for e in range(num_experts)
    ]
    down = [tensors[f"{prefix}{e}.down_proj.weight"] for e in range(num_experts)]
    return {f"{prefix}gate_up_proj": torch.stack(gate_up), f"{prefix}down_proj": torch.stack(down)}


def load_mtp_head(trunk: nn.Module, model_dir: Path) -> MtpHead:
    """The checkpoint's `mtp.*` tensors in an MtpHead over `trunk` (every tensor must be used, none missing)."""
    head = MtpHead(trunk).to(next(trunk.parameters()).dtype)
    tensors = {k[len(MTP_PREFIX) :]: v for k, v in _checkpoint_tensors(model_dir).items() if k.startswith(MTP_PREFIX)}
    if not tensors:
        raise ValueError(f"{model_dir} has no mtp.* tensors")
    expected = head.state_dict()
    num_experts = int(getattr(text_config_of(trunk), "num_experts", 0) or 0)
    for prefix in {k.rsplit("experts.", 1)[0] + "experts." for k in tensors if ".experts.0." in k}:
        per_expert = {k: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
        tensors.update(fuse_experts(per_expert, prefix, num_experts))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"mtp tensors do not fit the head: missing {missing}, unexpected {unexpected}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})
    return head.eval()


@dataclass
class MtpAgreement:
    """Top-1 agreement of the MTP head's draft with the trunk's own next-next greedy token."""

    num_positions: int
    num_agree: int
    num_trunk_correct: int  # the trunk's argmax equals the held-out text's next token

    @property
    def rate(self) -> float:
        return self.num_agree / max(self.num_positions, 1)


def _agreement_counts(trunk: nn.Module, head: MtpHead, ids: torch.Tensor, first: int = 0) -> tuple[int, int, int]:
    """(positions, agreements, trunk-correct) over positions t >= first of one sequence ids [1, T]."""
    text_model = text_model_of(trunk)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    hidden = text_model(input_ids=ids, position_ids=positions).last_hidden_state
    trunk_next = trunk.lm_head(hidden).argmax(-1)  # [1, T]: the trunk's guess for token t+1
    drafts = head(trunk, ids[:, 1:], hidden[:, :-1], positions[:, :-1]).argmax(-1)  # [1, T-1]: token t+2
    # draft at t guesses t+2; the trunk's own token for t+2 is its argmax at t+1.
    agree = (drafts[:, :-1] == trunk_next[:, 1:-1])[:, first:]
    correct = (trunk_next[:, :-1] == ids[:, 1:])[:, first:]
    return agree.numel(), int(agree.sum()), int(correct.sum())


@torch.inference_mode()
def mtp_agreement(trunk: nn.Module, head: MtpHead, token_ids: list[int], window: int = 256) -> MtpAgreement:
    """On `token_ids` in windows: at each position t the head drafts t+2 from (h_t, x_{t+1}); it agrees when
    that equals the trunk's argmax at t+1 (what greedy verification of the draft would accept)."""
    totals = [0, 0, 0]
    for start in range(0, len(token_ids) - 2, window):
        ids = torch.tensor([token_ids[start : start + window + 1]])
        if ids.shape[1] < 3:
            break
        totals = [a + b for a, b in zip(totals, _agreement_counts(trunk, head, ids), strict=True)]
    return MtpAgreement(*totals)


@torch.inference_mode()
def mtp_self_agreement(
    trunk: nn.Module,
    head: MtpHead,
    token_ids: list[int],
    num_prompts: int = 8,
    prompt_len: int = 32,
    num_tokens: int = 64,
) -> MtpAgreement:
    """The same agreement on the trunk's own greedy continuations of held-out prompts: the acceptance rate a
    one-token MTP draft would see in greedy speculative decoding (the draft reads the tokens the trunk chose)."""
    totals = [0, 0, 0]
    stride = max((len(token_ids) - prompt_len) // num_prompts, 1)
    for index in range(num_prompts):
        ids = list(token_ids[index * stride : index * stride + prompt_len])
        for _ in range(num_tokens):
            hidden = text_model_of(trunk)(input_ids=torch.tensor([ids])).last_hidden_state[:, -1]
            ids.append(int(trunk.lm_head(hidden).argmax(-1)))
        counts = _agreement_counts(trunk, head, torch.tensor([ids]), first=prompt_len - 1)
        totals = [a + b for a, b in zip(totals, counts, strict=True)]
    return MtpAgreement(*totals)


def held_out_token_ids(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tokenizer.encode(corpus_split()[1]).ids


def check_mtp(model_dir: Path, is_self_generated: bool = False) -> MtpAgreement:
    """Load trunk (transformers, fp32) and head from a checkpoint and measure agreement on held-out text (or on
    the trunk's own greedy continuations of held-out prompts)."""
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    model_class = getattr(transformers, config["architectures"][0])
    trunk = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = load_mtp_head(trunk, model_dir)
    measure = mtp_self_agreement if is_self_generated else mtp_agreement
    return measure(trunk, head, held_out_token_ids(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltaserve.tiny.mtp", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--min-rate", type=float, default=0.0, help="exit 1 when the agreement is below this")
    args = parser.parse_args(argv)
    result = check_mtp(args.model_dir)
    generated = check_mtp(args.model_dir, is_self_generated=True)
    if result.num_positions == 0 or generated.num_positions == 0:
        print("mtp check: no held-out positions to measure")
        return 2
    print(
        f"mtp check: {args.model_dir}: MTP top-1 agreement with the trunk's next-next token "
        f"{result.num_agree}/{result.num_positions} = {result.rate:.3f} on held-out text "
        f"(trunk next-token accuracy there {result.num_trunk_correct / result.num_positions:.3f}); "
        f"{generated.num_agree}/{generated.num_positions} = {generated.rate:.3f} on the trunk's own greedy "
        "continuations of held-out prompts (greedy one-token acceptance)"
    )
    return 0 if result.rate >= args.min_rate else 1


if __name__ == "__main__":
    sys.exit(main())
