"""The trained-checkpoint recipe (deltaserve/tiny/train.py) and the MTP head (deltaserve/tiny/mtp.py): the writer
keeps make_tiny's exact format, the noise rows teach an anchor, a few steps really train, the head's layout is
the official one, and the shipped checkpoints (text and vision) are what their manifests say."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltaserve.tiny import train as train_module
from deltaserve.tiny.mtp import corpus_split, fuse_experts, load_mtp_head, unfuse_experts
from deltaserve.tiny.spec import WIDE_VARIANTS
from deltaserve.tiny.trained import TRAINED_ROOT, TRAINED_VARIANTS, trained_model_dir
from deltaserve.tiny.vision import VISION_VARIANTS

TEXT_TRAINED = tuple(v for v in TRAINED_VARIANTS if v not in VISION_VARIANTS)


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_corpus_split_holds_out_every_tenth_paragraph() -> None:
    train, held = corpus_split("\n\n".join(f"p{i}" for i in range(25)))
    assert held.split() == ["p5", "p15"] and "p5" not in train.split() and len(train.split()) == 23


def test_fused_and_per_expert_layouts_round_trip() -> None:
    gate_up = torch.randn(4, 6, 5)
    down = torch.randn(4, 5, 3)
    per_expert = unfuse_experts("m.layers.0.mlp.experts.gate_up_proj", gate_up)
    per_expert |= unfuse_experts("m.layers.0.mlp.experts.down_proj", down)
    assert torch.equal(per_expert["m.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :3])
    assert torch.equal(per_expert["m.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, 3:])
    fused = fuse_experts(per_expert, "m.layers.0.mlp.experts.", 4)
    assert torch.equal(fused["m.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(fused["m.layers.0.mlp.experts.down_proj"], down)


def test_noise_rows_end_in_the_anchor_their_last_token_names(tiny_dense: Path) -> None:
    recipe = train_module.recipe_for("dense", anchor_fraction=1.0, batch_size=6, is_noise_supervised=False)
    train_text, _ = corpus_split()
    paragraphs = [train_module.tokenize_text(tiny_dense, p + "\n\n") for p in train_text.split("\n\n") if p.strip()]
    batches = train_module.Batches(paragraphs, train_module.num_ordinary_tokens(tiny_dense), recipe)
    assert len(batches.anchors) == recipe.num_anchors
    rows, is_target, labels = batches.next()
    assert torch.equal(labels, rows)  # noise positions unsupervised: the labels are the rows
    assert rows.shape == is_target.shape == (6, recipe.seq_len)
    for row, mask in zip(rows, is_target, strict=True):
        num_noise = int((~mask).sum())
        assert num_noise >= 1 and bool(mask[num_noise:].all()) and int(row[:num_noise].max()) < 1280
        anchor = batches.anchors[int(row[num_noise - 1]) % recipe.num_anchors]
        assert torch.equal(row[num_noise:], batches.ids[anchor : anchor + recipe.seq_len - num_noise])


def test_supervised_noise_positions_predict_the_anchor_they_name(tiny_dense: Path) -> None:
    train_text, _ = corpus_split()
    paragraphs = [train_module.tokenize_text(tiny_dense, p + "\n\n") for p in train_text.split("\n\n") if p.strip()]

    def batch(is_supervised: bool) -> tuple[torch.Tensor, ...]:
        recipe = train_module.recipe_for("dense", anchor_fraction=1.0, batch_size=4, num_anchors=3,
                                         is_noise_supervised=is_supervised)  # fmt: skip
        batches = train_module.Batches(paragraphs, train_module.num_ordinary_tokens(tiny_dense), recipe)
        return (*batches.next(), batches)

    rows, plain_mask, _, _ = batch(False)
    same_rows, is_target, labels, batches = batch(True)
    assert torch.equal(rows, same_rows)
    for row, plain, mask, label in zip(rows, plain_mask, is_target, labels, strict=True):
        num_noise = int((~plain).sum())
        assert num_noise >= 1 and bool(mask[1:].all())
        for t in range(num_noise - 1):
            assert int(label[t + 1]) == int(batches.ids[batches.anchors[int(row[t]) % 3]])
        assert torch.equal(label[num_noise:], row[num_noise:])


@pytest.mark.parametrize("variant", ["dense", "next"])
def test_a_few_steps_train_and_keep_the_make_tiny_format(
    variant: str, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Fused dense weights and Qwen3-Next's per-expert experts come back in make_tiny's names, shapes, dtypes and
    shards; the held-out loss falls; transformers loads the result whole; the MTP head loads from its mtp.* tensors."""
    # Text rows only: with noise rows the first and last batches' losses are over different targets.
    recipe = train_module.recipe_for(
        variant, num_steps=6, batch_size=2, seq_len=48, num_warmup_steps=2, anchor_fraction=0.0
    )
    tensors, report = train_module.train(tiny_dirs[variant], recipe, log_every=0)
    template = tensors_of(tiny_dirs[variant])
    assert {k: (v.shape, v.dtype) for k, v in tensors.items()} == {k: (v.shape, v.dtype) for k, v in template.items()}
    # The loss falls on the same tokens: the held-out text before and after. (The first and the last training batch
    # are different text; six steps do not order their losses: transformers 5.25's Qwen3-Next gave 13.67 -> 13.80.)
    _, untrained_trunk, untrained_head = train_module.load_checked_template(tiny_dirs[variant])
    held_ids = train_module.tokenize_text(tiny_dirs[variant], corpus_split()[1])
    with torch.no_grad():
        held_losses = train_module.trunk_and_mtp_losses(
            untrained_trunk.eval(), untrained_head.eval(), torch.tensor([held_ids])
        )
    untrained_loss = float(held_losses[0])
    assert report.held_out_loss < untrained_loss - 0.05, (untrained_loss, report.held_out_loss)
    changed = [name for name in template if not torch.equal(tensors[name], template[name])]
    assert any(name.startswith("mtp.") for name in changed) and any("layers.0." in name for name in changed)
    out = tmp_path / variant
    train_module._write(tiny_dirs[variant], out, tensors, report)
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in tiny_dirs[variant].glob("*.safetensors")
    )
    assert json.loads((out / "training.json").read_text())["recipe"]["num_steps"] == 6
    from deltaserve.gates.references import load_transformers

    trunk, _ = load_transformers(out, torch.float32, "cpu")
    head = load_mtp_head(trunk, out)
    assert torch.equal(head.fc.weight.to(torch.bfloat16), tensors["mtp.fc.weight"])
    # padding rows past the tokenizer stay zero (never-trained padding, logits exactly 0)
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    assert not embed[1300:].any() and (out.stat().st_mode & 0o777) == 0o755


def test_a_time_budget_cuts_the_step_count_inside_the_warm_up(tiny_dirs: dict[str, Path]) -> None:
    """--time-budget-s: after the paced steps the count is cut to what fits (never below the warm-up plus one), and
    the report's recipe states the count that ran, so `--steps N` rebuilds the run."""
    recipe = train_module.recipe_for("dense", num_steps=500, batch_size=1, seq_len=40, num_warmup_steps=3)
    _, report = train_module.train(tiny_dirs["dense"], recipe, log_every=0, time_budget_s=1e-6)
    assert report.recipe["num_steps"] == 4 and report.recipe["device"] == "cpu"
    _, uncut = train_module.train(
        tiny_dirs["dense"],
        train_module.recipe_for("dense", num_steps=4, batch_size=1, seq_len=40, num_warmup_steps=3),
        0,
    )
    assert uncut.tensor_sha256 == report.tensor_sha256


def test_a_broken_expert_writer_is_caught_by_the_round_trip(tiny_next: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def swapped(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        out = unfuse_experts(name, tensor)
        return {k.replace("gate_proj", "TMP").replace("up_proj", "gate_proj").replace("TMP", "up_proj"): v
                for k, v in out.items()}  # fmt: skip

    monkeypatch.setattr(train_module, "unfuse_experts", swapped)
    with pytest.raises(RuntimeError, match="does not round-trip"):
        train_module.train(tiny_next, train_module.recipe_for("next", num_steps=1, batch_size=1, seq_len=40), 0)


@pytest.mark.parametrize("variant", TEXT_TRAINED)
def test_shipped_trained_checkpoint_matches_its_manifest(variant: str, tiny_dirs: dict[str, Path]) -> None:
    folder = trained_model_dir(variant)
    manifest = json.loads((folder / "training.json").read_text())
    tensors = tensors_of(folder)
    assert {name: train_module.sha256_of_tensor(t) for name, t in tensors.items()} == manifest["tensor_sha256"]
    template = tensors_of(tiny_dirs[variant])
    assert {k: (v.shape, v.dtype) for k, v in tensors.items()} == {k: (v.shape, v.dtype) for k, v in template.items()}
    assert manifest["recipe"] == asdict(train_module.recipe_for(variant))
    assert sum(p.stat().st_size for p in folder.iterdir()) < 4 * 2**20
    assert manifest["final_loss"] < manifest["first_loss"] / 4  # trained


def test_the_fp8_gate_checkpoints_are_not_shipped_and_say_how_to_make_them() -> None:
    """dense-w128 / moe-w128 / next-w128 stay variants (make_tiny, train.py) but ship no weights: the H200 trains
    them at gate time (scripts/h200.sh gates fp8), so asking for the shipped one names the command that trains it."""
    assert not set(WIDE_VARIANTS) & set(TRAINED_VARIANTS)
    assert not [p for p in TRAINED_ROOT.iterdir() if p.name in WIDE_VARIANTS]
    for variant in WIDE_VARIANTS:
        with pytest.raises(FileNotFoundError, match="not shipped") as info:
            trained_model_dir(variant)
        assert f"python -m deltaserve.tiny.train DIR --variant {variant} --device cuda" in str(info.value)


def test_the_cli_device_flag_reaches_the_recipe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--device cuda`, as scripts/h200.sh gates fp8 trains the -w128 checkpoints, is the recipe's device (which
    training.json records and the FP8 gate's record names); without it the recipe's own (cpu)."""
    seen: list[tuple[str, train_module.Recipe]] = []
    monkeypatch.setattr(train_module, "train_tiny", lambda out, variant, recipe, *rest: seen.append((variant, recipe)))
    assert train_module.main([str(tmp_path / "d"), "--variant", "dense-w128", "--device", "cuda"]) == 0
    assert train_module.main([str(tmp_path / "d"), "--variant", "next-w128"]) == 0
    assert [(v, r.device) for v, r in seen] == [("dense-w128", "cuda"), ("next-w128", "cpu")]
    assert seen[0][1] == train_module.recipe_for("dense-w128", device="cuda")


def test_shipped_vision_checkpoints_match_their_manifests_and_a_random_one_is_not_conditioned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dense-vl and moe-vl (deltaserve/tiny/train_vision.py): the tensors their manifests hash, make_tiny's names,
    shapes, dtypes, shards and side files byte for byte, the recipe the code states; and the media conditioning
    check (a few image prompts and tokens) passes on the trained dense-vl and fails on the random template."""
    from deltaserve.gates.conditioning import check_media_conditioning
    from deltaserve.tiny import make_tiny

    assert set(VISION_VARIANTS) <= set(TRAINED_VARIANTS)
    for variant in VISION_VARIANTS:
        folder = trained_model_dir(variant)
        template_dir = make_tiny(tmp_path / variant, variant)
        manifest = json.loads((folder / "training.json").read_text())
        tensors = tensors_of(folder)
        assert {name: train_module.sha256_of_tensor(t) for name, t in tensors.items()} == manifest["tensor_sha256"]
        layout = {k: (v.shape, v.dtype) for k, v in tensors_of(template_dir).items()}
        assert {k: (v.shape, v.dtype) for k, v in tensors.items()} == layout
        files = sorted(p.name for p in template_dir.iterdir())
        assert sorted(p.name for p in folder.iterdir()) == sorted([*files, "training.json"])
        for name in files:
            if not name.endswith(".safetensors"):
                assert (folder / name).read_bytes() == (template_dir / name).read_bytes(), name
        assert manifest["recipe"] == asdict(train_module.recipe_for(variant))
        assert manifest["recipe"]["text_variant"] == VISION_VARIANTS[variant]
        assert sum(p.stat().st_size for p in folder.iterdir()) < 3 * 2**20
    capsys.readouterr()
    assert check_media_conditioning(trained_model_dir("dense-vl"), "image", num_prompts=3, max_tokens=8) == 0
    assert check_media_conditioning(tmp_path / "dense-vl", "image", num_prompts=3, max_tokens=8) == 1
    out = capsys.readouterr().out
    assert "image prompts: transformers-bfloat16 vs transformers-float32 STRICT 3/3" in out
    assert "NOT well conditioned" in out.splitlines()[-1]
