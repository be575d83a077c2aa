"""Do the two arms of a MoE benchmark on dummy weights do the same expert work? Greedy decodes of one dummy
MoE model under two weight schemes, on two prompt sets, counting the distinct tokens per output position across the
batch and the distinct experts each decode step's router picks.

Schemes: `vllm`, vLLM's `--load-format dummy` (every float tensor U(-1e-3, 1e-3), generator re-seeded to 1234 per
tensor), which deltaserve's loader.init_dummy_weights now follows and which this script calls; `former`,
deltaserve's scheme before (normal(0, 0.02) matrices from one stream, zero vectors, A_log in [0, log 16]).
Prompt sets: `random` (random token ids, as the random dataset) and `same-ending` (random ids whose last 8 are
shared, as every chat template's assistant prefix makes them).

The model is transformers' Qwen3_5MoeForCausalLM at the 35B-A3B dummy's widths (hidden 2048, 16/2 heads of 256,
GDN 16/32 heads of 128, top-8 experts of 512, shared expert 512) with fewer layers and experts and a smaller
vocabulary, so it runs on a CPU in minutes; the collapse it shows does not depend on those three.

    python benchmarks/dummy_routing.py [--layers 8] [--experts 64] [--batch 16] [--prompt-len 64] [--new 24]
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.model.loader import init_dummy_weights


def former_init(model: torch.nn.Module, seed: int = 0) -> None:
    """deltaserve's dummy weights up to commit 871d47e (model/loader.py), over transformers' parameter names."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                param.uniform_(0.0, 2.772588722, generator=generator)  # log 1 .. log 16
            elif leaf == "dt_bias":
                param.zero_()
            elif ".linear_attn.norm" in name:
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)


def build(num_layers: int, num_experts: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        hidden_size=2048, num_hidden_layers=num_layers, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=num_experts, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=vocab, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5MoeForCausalLM(config).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--schemes", default="vllm,former")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for scheme in args.schemes.split(","):
        model = build(args.layers, args.experts, args.vocab)
        init_dummy_weights(model) if scheme == "vllm" else former_init(model)
        picks: list[torch.Tensor] = []
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                # transformers' router returns (logits, scores, indices): the indices are the experts picked
                module.register_forward_hook(lambda mod, inp, out, sink=picks: sink.append(out[-1].detach()))
        generator = torch.Generator().manual_seed(7)
        for prompts in ("random", "same-ending"):
            ids = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=generator)
            if prompts == "same-ending":
                ids[:, -8:] = torch.arange(100, 108)
            picks.clear()
            start = time.time()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False)
            new = out[:, args.prompt_len :]
            distinct = [len(set(new[:, j].tolist())) for j in range(new.shape[1])]
            steps = [p for p in picks if p.shape[0] == args.batch]  # decode steps: one row per sequence
            experts = [len(set(p.flatten().tolist())) for p in steps]
            print(f"{scheme:7s} {prompts:11s} distinct tokens per output position over {args.batch} sequences: "
                  f"min {min(distinct)} mean {sum(distinct) / len(distinct):.1f}; distinct experts per decode-step "
                  f"router call: mean {sum(experts) / len(experts):.1f} min {min(experts)} of {args.experts} "
                  f"(at most {min(args.experts, 8 * args.batch)}) [{time.time() - start:.0f} s]",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
