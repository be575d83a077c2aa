"""The served MTP layer (deltaserve/model/mtp.py) against the trainer's MtpHead (deltaserve/tiny/mtp.py, built from
transformers' own layer classes: what the shipped trained checkpoints' heads were trained with), in fp32 on the
shipped trained dense / moe / next checkpoints: same inputs (the target's final-normed hidden states of a prompt and
its next tokens), same outputs to fp32 rounding, through the shared lm_head too; and its own KV cache written at the
target's slots (a prefix, then one more token, equals one call over everything)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ModelConfig
from deltaserve.model.checkpoint_files import CheckpointFiles
from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.loader import CheckpointError, load_checkpoint
from deltaserve.model.mtp import MtpError
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import CacheLayout, allocate_and_bind, bytes_per_block, plan_cache
from deltaserve.tiny.mtp import load_mtp_head
from deltaserve.tiny.trained import trained_model_dir

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# a prompt from the tiny vocabulary (any ids: the comparison is of the same function on the same inputs)
PROMPT = [5, 17, 99, 300, 41, 1000, 3, 3, 7, 8, 250, 12, 60, 61, 62, 900, 14, 42, 200]
# fp32, the same math in another order (GEMM blocking, fused norms)
TOLERANCE = 1e-5


@dataclass
class Served:
    config: ModelConfig
    model: Qwen35Model
    block_ids: list[int]
    device: str = "cpu"


def _context(served: Served, start: int, num_tokens: int) -> ForwardContext:
    """One sequence's prefill chunk of tokens [start, start + num_tokens), its KV in blocks laid out in reverse
    order (so a wrong slot index reads another block)."""
    seq_len = start + num_tokens
    device = served.device
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    blocks = served.block_ids
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, seq_len)]
    return ForwardContext(
        num_decode_tokens=0,
        num_prefill_tokens=num_tokens,
        query_start_loc=qsl,
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=num_tokens,
        max_seq_len=seq_len,
        state_indices=torch.tensor([0], dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([start > 0], device=device),
        prefill_query_start_loc=qsl,
    )


def _build(variant: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Served:
    model_dir = trained_model_dir(variant)
    config = ModelConfig.from_pretrained(model_dir)
    model = Qwen35Model(config, dtype, device, build_mtp=True)
    load_checkpoint(model, config, model_dir)
    model.fuse_projections()
    allocate_and_bind(model, config, CacheLayout(NUM_BLOCKS, BLOCK_SIZE, 1, 0, 0), dtype, torch.device(device))
    return Served(config, model.eval(), list(reversed(range(NUM_BLOCKS))), device)


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def served(request: pytest.FixtureRequest) -> Served:
    return _build(request.param)


@torch.inference_mode()
def _target_hidden(served: Served) -> torch.Tensor:
    """The target's final-normed hidden states of PROMPT [T, H] (its KV and state written as a prefill)."""
    positions = torch.arange(len(PROMPT), device=served.device).expand(3, -1)
    with forward_context(_context(served, 0, len(PROMPT))):
        return served.model(torch.tensor(PROMPT, device=served.device), positions)


@torch.inference_mode()
def _mtp(served: Served, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The MTP layer over positions [start, stop): token t's input is (hidden[t], PROMPT[t + 1])."""
    next_ids = torch.tensor(PROMPT[start + 1 : stop + 1], device=served.device)
    positions = torch.arange(start, stop, device=served.device)
    with forward_context(_context(served, start, stop - start)):
        return served.model.mtp(next_ids, positions, hidden[start:stop])


def test_mtp_layer_equals_trainer_head(served: Served) -> None:
    import transformers

    model_dir = served.config.path
    trunk_class = getattr(transformers, served.config.architecture)
    trunk = trunk_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = load_mtp_head(trunk, model_dir)
    hidden = _target_hidden(served)  # [T, H]
    num = len(PROMPT) - 1
    ours = _mtp(served, hidden, 0, num)  # [T-1, H]
    with torch.inference_mode():
        ours_logits = served.model.compute_logits(ours)  # [T-1, V]
        captured: dict[str, torch.Tensor] = {}
        # the head's output before the shared lm_head: what mtp.norm returns
        hook = head.norm.register_forward_hook(lambda module, args, out: captured.update(out=out))
        ref_logits = head(trunk, torch.tensor([PROMPT[1:]]), hidden[None, :num], torch.arange(num)[None])[0].float()
        hook.remove()
        ref_out = captured["out"][0]  # [T-1, H]
    assert float((ours - ref_out).abs().max()) < TOLERANCE * float(ref_out.abs().max())
    assert float((ours_logits - ref_logits).abs().max()) < TOLERANCE * float(ref_logits.abs().max())
    assert torch.equal(ours_logits.argmax(-1), ref_logits.argmax(-1))


def test_mtp_kv_written_at_the_targets_slots(served: Served) -> None:
    """A prefix through the MTP layer, then the next position alone (reading the prefix's K/V from the cache through
    the block table) gives what one call over both gives."""
    hidden = _target_hidden(served)
    num = len(PROMPT) - 1
    whole = _mtp(served, hidden, 0, num)
    served.model.mtp.attention.k_cache.zero_()  # the second pass must write its own K/V
    served.model.mtp.attention.v_cache.zero_()
    prefix = _mtp(served, hidden, 0, num - 1)
    last = _mtp(served, hidden, num - 1, num)
    assert float((torch.cat([prefix, last]) - whole).abs().max()) < TOLERANCE * float(whole.abs().max())


# -- loading ---------------------------------------------------------------------------------------------------


MTP_FIELD = "text_config.mtp_num_hidden_layers"


def _copy_without_mtp(src: Path, dst: Path) -> Path:
    """src's checkpoint with every mtp.* tensor removed (shards and index)."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    index_path.write_text(json.dumps(index))
    return dst


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads((folder / "config.json").read_text())
    edit(data)
    (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("variant", ["dense", "next"])
def test_mtp_tensors_consumed_when_on_and_skipped_when_off(variant: str) -> None:
    model_dir = trained_model_dir(variant)
    config = ModelConfig.from_pretrained(model_dir)
    num_mtp = sum(name.startswith("mtp.") for name in CheckpointFiles(model_dir).tensors)
    off = load_checkpoint(Qwen35Model(config, torch.float32, "cpu"), config, model_dir)
    assert off.skipped_by_rule["mtp"] == num_mtp > 0
    on_model = Qwen35Model(config, torch.float32, "cpu", build_mtp=True)
    on = load_checkpoint(on_model, config, model_dir)
    assert "mtp" not in on.skipped_by_rule and on.unexpected == []
    assert on.num_tensors_loaded == off.num_tensors_loaded + num_mtp
    fc = load_file(model_dir / CheckpointFiles(model_dir).tensors["mtp.fc.weight"].shard)["mtp.fc.weight"]
    assert torch.equal(on_model.mtp.fc, fc.float())
    assert Qwen35Model(config, torch.float32, "cpu").mtp is None


def test_a_checkpoint_without_mtp_tensors_is_refused_by_name(tmp_path: Path) -> None:
    folder = _copy_without_mtp(trained_model_dir("dense"), tmp_path / "no-mtp")
    config = ModelConfig.from_pretrained(folder)
    model = Qwen35Model(config, torch.float32, "cpu", build_mtp=True)
    with pytest.raises(CheckpointError, match=r"method mtp needs the checkpoint's MTP layer, but it has no mtp\.\*"):
        load_checkpoint(model, config, folder)
    # without speculative decoding the same checkpoint loads
    load_checkpoint(Qwen35Model(config, torch.float32, "cpu"), config, folder)


@pytest.mark.parametrize(
    ("variant", "edit", "field"),
    [
        ("dense", lambda c: c["text_config"].update(mtp_num_hidden_layers=0), f"`{MTP_FIELD}` is 0"),
        ("dense", lambda c: c["text_config"].pop("mtp_num_hidden_layers"), f"`{MTP_FIELD}` is 0"),
        ("next", lambda c: c.update(num_nextn_predict_layers=0), "`num_nextn_predict_layers` is 0"),
    ],
)  # fmt: skip
def test_a_config_without_an_mtp_layer_is_refused_by_field(
    variant: str, edit: Callable[[dict], None], field: str, tmp_path: Path
) -> None:
    folder = shutil.copytree(trained_model_dir(variant), tmp_path / variant)
    _edit_config(folder, edit)
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(MtpError, match=re.escape(field)):
        Qwen35Model(config, torch.float32, "cpu", build_mtp=True)
    assert Qwen35Model(config, torch.float32, "cpu").mtp is None


def test_qwen3_next_defaults_to_one_mtp_layer() -> None:
    """Qwen3-Next's config.json has no MTP field; vLLM reads num_nextn_predict_layers, default 1."""
    config = ModelConfig.from_pretrained(trained_model_dir("next"))
    assert (config.mtp_num_hidden_layers, config.mtp_field) == (1, "num_nextn_predict_layers")


def test_the_cache_plan_counts_the_mtp_layer_only_when_loaded(served: Served) -> None:
    """One more attention layer per KV block when the MTP layer is loaded (and only then), bound to a view of its
    own: no target layer's K/V is overwritten by the draft."""
    config = served.config
    base = bytes_per_block(config, BLOCK_SIZE, torch.float32)
    num_attn = len(config.full_attention_layers)
    assert bytes_per_block(config, BLOCK_SIZE, torch.float32, has_mtp=True) * num_attn == base * (num_attn + 1)
    budget = 64 * base
    off = plan_cache(config, torch.float32, BLOCK_SIZE, budget, 1, 16)
    on = plan_cache(config, torch.float32, BLOCK_SIZE, budget, 1, 16, has_mtp=True)
    assert on.num_blocks < off.num_blocks
    own = served.model.mtp.attention.k_cache
    targets = [layer.self_attn for layer in served.model.layers if layer.is_full_attention]
    views = [cache for attn in targets for cache in (attn.k_cache, attn.v_cache)]
    views.append(served.model.mtp.attention.v_cache)
    assert all(own.data_ptr() != view.data_ptr() for view in views)
    assert own.shape == targets[0].k_cache.shape
