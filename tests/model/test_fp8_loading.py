"""Issue 37, loading: block-FP8 copies of the trained tiny checkpoints (deltaserve/tiny/fp8.py, the format of Qwen's
-FP8 releases) load into Fp8Weight projections and serve on the CPU through the *_ref kernels.

- structure: every projection the releases quantize holds float8_e4m3fn values and block scales, and its
  dequantized value equals, bit for bit, the same projection of the checkpoint dequantized to fp32 loaded as a plain
  one (so fusing, de-interleaving and the per-expert layout are the plain loader's, which is exact against
  transformers); everything the releases keep unquantized stays a plain tensor; GDN's qkvz and ba stay two GEMMs;
- the ref is the spec: greedy tokens (and logits within SPEC_TOLERANCE) equal those of the same model computed as
  dequantized weights times fake-quantized activations, one fp32 matmul per projection, except at a near-tie that
  the two sums' fp32 rounding decides (the spec's margin there within their logit difference; measured: one of the
  dense checkpoint's three prompts, at its 4th token);
- against transformers: FineGrainedFP8Config(dequantize=True) on the CPU gives the logits of deltaserve with the
  activation quantization switched off, within fp32 rounding (dense and MoE, and all three FP8 gate checkpoints
  at width 128, untrained, Qwen3-Next's included; the tiny Qwen3-Next is left out: see the test);
- refusals by name: an FP8 tensor for a module kept unquantized, a missing or mis-shaped scale, a quantized module
  stored unquantized;
- the Triton kernels composed into the whole model (under the interpreter) give the ref model's logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from deltaserve.engine.llm import LLM
from deltaserve.kernels import fp8 as fp8_kernels
from deltaserve.kernels import fp8_moe
from deltaserve.kernels import moe as moe_kernels
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, plain, quantize_activation_ref
from deltaserve.kernels.moe import FP8_BLOCK_MAX_TOKENS
from deltaserve.model.checkpoint_files import CheckpointError
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.fp8 import quantize_block_fp8, write_fp8_checkpoint
from deltaserve.tiny.mtp import corpus_split
from deltaserve.tiny.trained import trained_model_dir
from tests.support.engines import share

VARIANTS = ("dense", "moe", "next")
# the FP8 gate's checkpoints at widths vLLM's block kernels take (docs/fp8.md, test_fp8_wide.py), untrained here
WIDE = ("dense-w128", "moe-w128", "next-w128")
PROMPT_TOKENS = 24  # the head of a training paragraph: the trained checkpoints continue it with varied tokens
NUM_TOKENS = 6
LOGIT_TOLERANCE = 1e-4  # fp32: the same products summed in another order
# The spec sums each projection in one matmul, the ref per K block: fp32-level differences, which now and then move
# an activation across an e4m3 rounding boundary in the next layer (one element off by up to 1/16): measured
# 2e-7 .. 2e-3 relative on these prompts, against 6e-2 .. 1e-1 for switching the activation quantization off
SPEC_TOLERANCE = 1e-2


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint with every quantized weight replaced by q · scale in fp32 and its scale dropped."""
    out.mkdir()
    tensors = load_file(fp8_dir / "model.safetensors")
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix(".weight") + ".weight_scale_inv"]
            tensor = Fp8Weight.of(tensor, scale, 128).dequantize()
        plain[name] = tensor
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((fp8_dir / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def fp8_llm(tmp_path_factory: pytest.TempPathFactory, wide_dirs: dict[str, Path]) -> Callable[[str], tuple[Path, LLM]]:
    """variant -> (its FP8 checkpoint, an LLM serving it), each made once for the module; the -w128 ones from the
    untrained checkpoints (the conftest's `wide_dirs`: the trained ones are made on the H200 at gate time)."""
    made: dict[str, tuple[Path, LLM]] = {}

    def get(name: str) -> tuple[Path, LLM]:
        if name not in made:
            source = wide_dirs[name] if name in wide_dirs else trained_model_dir(name)
            folder = write_fp8_checkpoint(source, tmp_path_factory.mktemp(f"fp8-{name}") / "fp8")
            made[name] = folder, LLM(folder, dtype="float32", device="cpu")
        return made[name]

    return get


def _prompts(folder: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    paragraphs = corpus_split()[0].split("\n\n")
    return [tokenizer.encode(paragraphs[i]).ids[:PROMPT_TOKENS] for i in (0, 5, 11)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _projections(model: torch.nn.Module) -> Iterator[tuple[str, object]]:
    """(label, weight) of every projection site of the decoder."""
    for i, layer in enumerate(model.layers):
        mixer = layer.mixer
        names = ("qkv_proj", "o_proj") if layer.is_full_attention else ("in_proj_qkvz", "in_proj_ba", "out_proj")
        for name in names:
            yield f"layers.{i}.{name}", getattr(mixer, name)
        mlp = layer.mlp
        if hasattr(mlp, "w13"):
            yield from ((f"layers.{i}.mlp.{n}", getattr(mlp, n)) for n in ("w13", "w2", "gate", "shared_expert_gate"))
            mlp = mlp.shared_expert
        yield from ((f"layers.{i}.mlp.{n}", getattr(mlp, n)) for n in ("gate_up_proj", "down_proj"))


KEPT = ("in_proj_ba", "mlp.gate", "shared_expert_gate")


@pytest.mark.parametrize("name", VARIANTS + WIDE)
def test_projections_hold_fp8_equal_to_the_dequantized_checkpoint(
    name: str, fp8_llm: Callable[[str], tuple[Path, LLM]], tmp_path: Path
) -> None:
    folder, llm = fp8_llm(name)
    model = llm.engine.runner.model
    plain = LLM(_dequantized_copy(folder, tmp_path / "plain"), dtype="float32", device="cpu").engine.runner.model
    plain_weights = dict(_projections(plain))
    checked = 0
    for label, weight in _projections(model):
        if label.endswith(KEPT):
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32, label
            continue
        assert isinstance(weight, Fp8Weight) and weight.weight.dtype == torch.float8_e4m3fn, label
        assert weight.scale.dtype == torch.float32, label
        expected = plain_weights[label]
        if label.endswith("in_proj_qkvz"):  # the plain model fused qkvz with ba: its rows come first
            expected = expected[: weight.shape[0]]
        assert torch.equal(weight.dequantize(), expected), label
        checked += 1
    assert checked >= 4 * len(model.layers)
    for layer in model.layers:  # never one FP8 GEMM over qkvz and ba
        assert layer.is_full_attention or layer.linear_attn.in_proj is None
    for kept in (model.embed_tokens, model.lm_head, model.norm, model.layers[0].input_layernorm):
        assert isinstance(kept, torch.Tensor) and kept.dtype == torch.float32
    assert f"block FP8: {checked} projections" in llm.engine.runner.load_report.summary()


def _spec_linear(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block-FP8 linear as its definition reads: fake-quantized activations times dequantized weights (rows a
    norm quantized are quantized again here from their values)."""
    x = plain(x)
    q, scale = quantize_activation_ref(x.reshape(-1, x.shape[-1]))
    x_fake = (q.float() * scale.repeat_interleave(128, dim=1)[:, : x.shape[-1]]).reshape(x.shape)
    out = (x_fake @ weight.dequantize().T).to(x.dtype)
    return out if bias is None else out + bias


def _unquantized_linear(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The activation quantization switched off: x times the dequantized weight (a norm's quantization unread)."""
    x = plain(x)
    out = (x.float() @ weight.dequantize().T).to(x.dtype)
    return out if bias is None else out + bias


def _with_linear(monkeypatch: pytest.MonkeyPatch, linear: Callable[..., torch.Tensor]) -> None:
    monkeypatch.setattr(fp8_kernels, "fp8_linear_ref", linear)
    monkeypatch.setattr(fp8_moe, "fp8_linear_ref", linear)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_same_or_explained_tie(
    llm: LLM, prompt: list[int], ours: list[int], spec: list[int], patch: Callable[[], pytest.MonkeyPatch]
) -> None:
    """Greedy tokens equal, or at their first divergence the spec's margin between the two tokens (its size: prefill
    and decode round differently) is within the two implementations' logit difference at that position: a near-tie
    that their fp32 rounding, through the next layers' activation quantization, decides."""
    if ours == spec:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, spec, strict=True)) if a != b)
    prefix = prompt + ours[:first]
    our_last = llm.prefill_logits(prefix)[-1]
    with patch() as patched:
        _with_linear(patched, _spec_linear)
        spec_last = llm.prefill_logits(prefix)[-1]
    margin = float(spec_last[spec[first]] - spec_last[ours[first]])
    difference = float((our_last - spec_last).abs().max())
    assert abs(margin) <= 2 * difference, (first, ours, spec, margin, difference)


@pytest.mark.parametrize("name", VARIANTS)
def test_ref_is_the_spec_greedy_and_logits(
    name: str, fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, llm = fp8_llm(name)
    prompts = _prompts(folder)
    ours, our_logits = _greedy(llm, prompts), llm.prefill_logits(prompts[1])
    with monkeypatch.context() as patch:
        _with_linear(patch, _spec_linear)
        spec, spec_logits = _greedy(llm, prompts), llm.prefill_logits(prompts[1])
    for prompt, our_tokens, spec_tokens in zip(prompts, ours, spec, strict=True):
        _assert_same_or_explained_tie(llm, prompt, our_tokens, spec_tokens, monkeypatch.context)
    assert sum(a == b for a, b in zip(ours, spec, strict=True)) >= len(prompts) - 1, (ours, spec)
    assert _relative(our_logits, spec_logits) < SPEC_TOLERANCE
    with monkeypatch.context() as patch:  # the check can fail: without the activation quantization it differs
        _with_linear(patch, _unquantized_linear)
        assert _relative(our_logits, llm.prefill_logits(prompts[1])) > 3 * SPEC_TOLERANCE


# Qwen3-Next at the tiny widths is left out: transformers' dequantizer takes a block's height from the scale grid
# (rows // grid rows), so the tiny Next's 192-row in_proj_qkvz, whose grid is ceil(192 / 128) = 2 rows, is read as
# two 96-row blocks instead of 128 + 64 (docs/fp8.md#checking-against-transformers); next-w128's sides are all
# multiples of 128, which transformers reads right
@pytest.mark.parametrize("name", ["dense", "moe", *WIDE])
def test_matches_transformers_dequantized_without_activation_quantization(
    name: str, fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from transformers import FineGrainedFP8Config

    folder, llm = fp8_llm(name)
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    reference, info = getattr(transformers, architecture).from_pretrained(
        folder, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    ids = _prompts(folder)[1]
    with torch.no_grad():
        ref_logits = reference.eval()(torch.tensor([ids])).logits[0].float()
    with monkeypatch.context() as patch:
        _with_linear(patch, _unquantized_linear)
        assert _relative(llm.prefill_logits(ids), ref_logits) < LOGIT_TOLERANCE
    assert _relative(llm.prefill_logits(ids), ref_logits) > 10 * LOGIT_TOLERANCE  # quantized activations differ


def _edit(folder: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the FP8 checkpoint folder whose tensors went through `change`."""
    out.mkdir()
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in folder.iterdir():
        if extra.name != "model.safetensors":
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


P = "model.language_model.layers."
IN_PROJ_A, K_PROJ, O_PROJ = P + "0.linear_attn.in_proj_a.weight", P + "3.self_attn.k_proj", P + "3.self_attn.o_proj"


def _quantize(tensors: dict[str, torch.Tensor], name: str) -> None:
    tensors[name], tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize_block_fp8(tensors[name])


def _unquantize(tensors: dict[str, torch.Tensor], module: str) -> None:
    scale = tensors.pop(module + ".weight_scale_inv")
    tensors[module + ".weight"] = Fp8Weight.of(tensors[module + ".weight"], scale, 128).dequantize().bfloat16()


def _nan(tensors: dict[str, torch.Tensor], name: str) -> None:
    raw = tensors[name].view(torch.uint8).clone()
    raw.view(-1)[3] = 0x7F  # e4m3fn's NaN
    tensors[name] = raw.view(torch.float8_e4m3fn)


REFUSALS = [
    ("fp8 module kept unquantized", lambda t: _quantize(t, IN_PROJ_A), ["in_proj_a", "keeps this module unquantized"]),
    ("scale missing", lambda t: t.pop(K_PROJ + ".weight_scale_inv"), [f"`{K_PROJ}.weight`", "is missing"]),
    (
        "scale mis-shaped",
        lambda t: t.update({K_PROJ + ".weight_scale_inv": torch.ones(2, 1)}),
        [f"`{K_PROJ}.weight_scale_inv` has shape [2, 1], expected [1, 1]"],
    ),
    ("quantized module stored unquantized", lambda t: _unquantize(t, O_PROJ), ["o_proj", "stored unquantized"]),
    ("NaN in the fp8 values", lambda t: _nan(t, O_PROJ + ".weight"), ["o_proj", "NaN"]),
]


@pytest.mark.parametrize(("change", "expected"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_fp8_tensors_are_refused_by_name(
    change: Callable[[dict[str, torch.Tensor]], None],
    expected: list[str],
    fp8_llm: Callable[[str], tuple[Path, LLM]],
    tmp_path: Path,
) -> None:
    folder = _edit(fp8_llm("dense")[0], tmp_path / "bad", change)
    with pytest.raises(CheckpointError) as info:
        LLM(folder, dtype="float32", device="cpu")
    message = str(info.value)
    assert all(part in message for part in expected) and "\n" not in message, message


def test_dummy_weights_fill_fp8_projections_as_vllm(fp8_llm: Callable[[str], tuple[Path, LLM]]) -> None:
    llm = LLM(fp8_llm("moe")[0], dtype="float32", device="cpu", load_format="dummy")
    w13 = llm.engine.runner.model.layers[0].mlp.w13
    values = w13.weight.float()
    # U(-1e-3, 1e-3) cast to e4m3: 0 or its smallest subnormal, 2^-9 (as vLLM's dummy FP8 weights are)
    assert isinstance(w13, Fp8Weight) and set(values.abs().unique().tolist()) == {0.0, 2.0**-9}
    assert w13.scale.abs().max() <= 1e-3 and w13.scale.abs().max() > 0
    assert len(_greedy(llm, [[5, 6, 7]])[0]) == NUM_TOKENS


def test_serve_preflight_accepts_the_fp8_checkpoint(fp8_llm: Callable[[str], tuple[Path, LLM]]) -> None:
    """`deltaserve serve`'s torch-free start-up checks read the float8 tensors as the loader does, and take
    `--quantization fp8` on it (the config decides; the two agree)."""
    from deltaserve.model.preflight import preflight

    assert preflight(str(fp8_llm("moe")[0])).fp8 is not None
    assert preflight(str(fp8_llm("moe")[0]), quantization="fp8").fp8 is not None
    with pytest.raises(ValueError, match="--quantization fp8 .*no quantization_config.*online"):
        preflight(str(trained_model_dir("moe")), quantization="fp8")


def test_offline_quantization_fp8_serves_the_fp8_checkpoint(fp8_llm: Callable[[str], tuple[Path, LLM]]) -> None:
    """LLM(quantization="fp8") as vLLM's: on a block-FP8 checkpoint the same model and tokens as without it; on an
    unquantized checkpoint (vLLM would quantize online) or with another method, refused by name before loading."""
    folder, plain = fp8_llm("dense")
    llm = LLM(folder, dtype="float32", device="cpu", quantization="fp8")
    assert isinstance(llm.engine.runner.model.layers[0].mlp.down_proj, Fp8Weight)
    assert _greedy(llm, _prompts(folder)[:1]) == _greedy(plain, _prompts(folder)[:1])
    with pytest.raises(ValueError, match="--quantization fp8 .*no quantization_config.*per-tensor dynamic FP8"):
        LLM(trained_model_dir("dense"), dtype="float32", device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="--quantization awq .*not supported.*declares block FP8"):
        LLM(folder, dtype="float32", device="cpu", quantization="awq")


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_triton_kernels_compose_to_the_ref_model(
    name: str, fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole FP8 model with its FP8 ops on the Triton kernels (the CUDA path: up to FP8_BLOCK_MAX_TOKENS tokens
    the MoE block's decode-path op, above it the composition with the FP8 grouped GEMMs) against the same model on
    the refs, fp32, to fp32 rounding: under the interpreter on the CPU, natively on a GPU host (whose Triton cannot
    launch on CPU tensors: the engine is built on cuda there)."""
    folder, llm = fp8_llm(name)
    if torch.cuda.is_available():
        llm = LLM(folder, dtype="float32", device="cuda", **share())
    prompt = _prompts(folder)[0]
    assert len(prompt) > FP8_BLOCK_MAX_TOKENS
    for ids in (prompt[:4], prompt):
        logits = {}
        for on in (False, True):
            for module in (fp8_kernels, fp8_moe, moe_kernels):
                monkeypatch.setattr(module, "use_triton", lambda t, on=on: on)
            logits[on] = llm.prefill_logits(ids)
        assert _relative(logits[True], logits[False]) < LOGIT_TOLERANCE, len(ids)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_producers_quantize_for_the_fp8_projections_and_change_no_logit(
    name: str, fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In an FP8 model the launches before FP8 projections quantize their own rows (kernels/fp8.py's Fp8Rows): both
    RMSNorms of every decoder layer (the MTP layer's too), SiLU-and-mul before each down projection, the attention
    output gate before o_proj, the GDN's gated norm before out_proj; the projections and experts read that
    quantization instead of quantizing again. The logits equal the model's with the plain ops (each projection
    quantizing its input itself), bit for bit."""
    from deltaserve.kernels.activation import sigmoid_gate_mul, silu_and_mul
    from deltaserve.kernels.fp8 import gated_rms_norm_fp8, rms_norm_fp8, sigmoid_gate_mul_fp8, silu_and_mul_fp8
    from deltaserve.kernels.norm import gated_rms_norm, rms_norm
    from deltaserve.model.layers.attention import GatedAttention
    from deltaserve.model.layers.gdn import GatedDeltaNet
    from deltaserve.model.layers.mlp import DenseMLP
    from deltaserve.model.qwen3_5 import DecoderLayer

    folder, llm = fp8_llm(name)
    producers = {
        DecoderLayer: ("rms_norm_op", rms_norm_fp8, rms_norm),
        DenseMLP: ("act", silu_and_mul_fp8, silu_and_mul),
        GatedAttention: ("gate_mul", sigmoid_gate_mul_fp8, sigmoid_gate_mul),
        GatedDeltaNet: ("out_norm_op", gated_rms_norm_fp8, gated_rms_norm),
    }
    found = {kind: [m for m in llm.engine.runner.model.modules() if type(m) is kind] for kind in producers}
    for kind, (attribute, fused, _) in producers.items():
        assert found[kind] and all(getattr(m, attribute) is fused for m in found[kind]), kind
    ids = _prompts(folder)[0][:6]
    quantizing = llm.prefill_logits(ids)
    for kind, (attribute, _, plain_op) in producers.items():
        for module in found[kind]:
            monkeypatch.setattr(module, attribute, plain_op)
    assert torch.equal(llm.prefill_logits(ids), quantizing)


def test_fp8_moe_routes_and_gates_the_shared_expert_from_one_router_pass(
    fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FP8 MoE block's router and shared-expert gate logits come from one router_logits call (one launch on the
    GPU, as the bf16 block's), the gate as its last column; on the CPU the twin is the two F.linear calls it was. A
    prompt longer than FP8_BLOCK_MAX_TOKENS, so the block composes its ops (below it the block is one op, whose ref
    makes the same one call: tests/kernels/test_moe_decode_fp8.py)."""
    import deltaserve.model.layers.mlp as mlp_module
    from deltaserve.kernels.moe import router_logits_ref
    from deltaserve.model.layers.mlp import MoEBlock

    folder, llm = fp8_llm("moe")
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEBlock)]
    ids = _prompts(folder)[0]
    assert len(ids) > FP8_BLOCK_MAX_TOKENS
    expected = llm.prefill_logits(ids)
    calls: list[torch.Tensor | None] = []

    def spy(x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        calls.append(gate)
        return router_logits_ref(x, router, gate)

    monkeypatch.setattr(mlp_module, "router_logits", spy)
    assert torch.equal(llm.prefill_logits(ids), expected)
    assert len(calls) == len(blocks) and all(g is b.shared_expert_gate for g, b in zip(calls, blocks, strict=True))


def test_whole_experts_take_the_routes_as_they_are(
    fp8_llm: Callable[[str], tuple[Path, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one rank the FP8 MoE's routes are already local ids: the expert-parallel mapping (five elementwise launches
    a layer on a GPU) is an identity there, and it is not run."""
    from deltaserve.kernels.moe import moe_route_ref
    from deltaserve.model.layers.mlp import MoEBlock

    folder, llm = fp8_llm("moe")
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, MoEBlock))
    assert block.experts.is_whole and block.is_fp8
    weights, experts = moe_route_ref(torch.randn(5, block.gate.shape[0]), block.top_k, True)
    mapped = block._local_routes(weights, experts)
    assert torch.equal(mapped[0], weights) and torch.equal(mapped[1], experts)

    def refused(self: MoEBlock, *routes: torch.Tensor) -> None:
        raise AssertionError("the expert-parallel mapping ran on whole experts")

    monkeypatch.setattr(MoEBlock, "_local_routes", refused)
    assert torch.isfinite(llm.prefill_logits(_prompts(folder)[0][:4])).all()
