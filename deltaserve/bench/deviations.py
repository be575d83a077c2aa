"""Sites and deviations: where the oracle runs, and every way a site forces it off its production configuration.

A `Deviation` is named, with the reason it is forced, the direction it moves the ratios and its magnitude; the
oracle registry (registry.py) adds a site's deviations to every launch it builds, records carry their names, a
deviation that can move a metric becomes the arm's denominator note, and `bench report` marks the ratios it can
move. A record's launch is recognised by its argv and environment too (`deviations_in`), so records written
before a deviation was named are still marked. `deltaserve check oracle-flags` refuses a `Deviation(...)`
without its reason, direction or magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Serve flags that pick a kernel backend vLLM would otherwise choose itself (vLLM 0.26 `EngineArgs`); a launch that
# sets one overrides production and needs a registry deviation or an exemption with its reason.
BACKEND_FLAGS: tuple[str, ...] = (
    "--attention-backend",
    "--gdn-prefill-backend",
    "--mamba-backend",
    "--moe-backend",
    "--linear-backend",
    "--mm-encoder-attn-backend",
)
# Environment variables with the same effect (read by vLLM's envs.py).
BACKEND_ENV: tuple[str, ...] = ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND")
# The metrics a prefill-side deviation can move (record metric names, as in the grid's ratios).
PREFILL_METRICS = ("median_ttft_ms", "p99_ttft_ms", "output_throughput")


@dataclass(frozen=True)
class Deviation:
    """A named, reasoned departure from vLLM's production configuration that a site forces."""

    name: str
    reason: str
    direction: str
    magnitude: str
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    engine_kwargs: tuple[tuple[str, Any], ...] = ()  # the same setting for an in-process vllm.LLM
    affects: tuple[str, ...] = ()  # record metrics it can move; empty: none
    # The exact note texts earlier records carry for this deviation (its wording before a measurement updated it),
    # so the report still recognises them and prints the current note in their place.
    former_notes: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """The denominator note every record of a launch with this deviation carries."""
        return f"{self.name}: {self.reason}. Direction: {self.direction}. Magnitude: {self.magnitude}."

    @property
    def notes(self) -> tuple[str, ...]:
        """Every wording of the note a record may carry, the current one first."""
        return (self.note, *self.former_notes)


# The 80 GB card's step-budget deviation: the registry adds it to a launch where it binds (not a site's fixed list).
BATCHED_TOKENS_80GB = "batched-tokens-80gb"
DEVIATIONS: dict[str, Deviation] = {
    "gdn-prefill-triton": Deviation(
        name="gdn-prefill-triton",
        reason=(
            "--gdn-prefill-backend triton: on SM90 vLLM 0.26 picks FlashInfer's GDN prefill kernel by default "
            "(qwen_gdn_linear_attn._resolve_gdn_prefill_backend, a CuTe-DSL kernel of flashinfer-python 0.6.14 "
            "compiled in process by nvidia-cutlass-dsl 4.6.0); a site without the FlashInfer bundle "
            "(benchmarks/oracle/flashinfer.md) must force vLLM's Triton/FLA kernel, since `auto` would select "
            "FlashInfer anyway and fail at the first prefill"
        ),
        direction=(
            "favours deltaserve on TTFT and, with long prompts, on output throughput; none on TPOT (the decode "
            "kernels are the same)"
        ),
        magnitude=(
            "measured once on the 35B-A3B shape (benchmarks/results/grids/h200_gdn_backend-35b-a3b-20261204.json, "
            "vLLM Triton / vLLM FlashInfer in one grid): random 16384/128 TTFT median x1.181 / 1.121 / 1.320 and "
            "output tok/s x0.938 / 0.926 / 0.906 at c1 / 8 / 32; random 1024/128 TTFT x0.971 at c1 (noise) and "
            "x1.152 at c32, output x1.002 / 0.967 (c8 not comparable: the FlashInfer arm compiled kernels during "
            "that run); TPOT within 2.5 % everywhere. The 27B shape is unmeasured"
        ),
        flags=("--gdn-prefill-backend", "triton"),
        engine_kwargs=(("gdn_prefill_backend", "triton"),),
        affects=PREFILL_METRICS,
        former_notes=(
            # the note every record carries from 2026-12-01 until the measurement of 2026-12-04
            (
                "gdn-prefill-triton: --gdn-prefill-backend triton: on SM90 vLLM 0.26 picks FlashInfer's GDN "
                "prefill kernel by default (qwen_gdn_linear_attn._resolve_gdn_prefill_backend), but FlashInfer "
                "is not in the offline bundle (its SM90 kernel is a CuTe-DSL kernel of flashinfer-python 0.6.14 "
                "that needs nvidia-cutlass-dsl 4.6.0 with its cu13 libraries; benchmarks/oracle/flashinfer.md), "
                "and with `auto` vLLM would select it anyway and fail at the first prefill. Direction: favours "
                "deltaserve on TTFT (and on throughput at high concurrency, where prefill shares the steps). "
                "Magnitude: unmeasured (benchmarks/grids/h200_gdn_backend.toml and "
                "benchmarks/oracle/gdn_prefill_kernels.py measure it once FlashInfer runs on the H200)."
            ),
        ),
    ),
    "flashinfer-sampler-off": Deviation(
        name="flashinfer-sampler-off",
        reason=(
            "VLLM_USE_FLASHINFER_SAMPLER=0: FlashInfer's top-k/top-p sampler is not in the offline bundle; "
            "vLLM falls back to its own"
        ),
        direction="none for greedy runs: all-greedy batches never reach the top-k/top-p sampler (v1 Sampler.sample)",
        magnitude="none at temperature 0 (every harness run); unmeasured for sampled runs",
        env=(("VLLM_USE_FLASHINFER_SAMPLER", "0"),),
    ),
    "max-num-seqs-256": Deviation(
        name="max-num-seqs-256",
        reason=(
            "--max-num-seqs 256: on an 80 GB card vLLM 0.26 refuses to start the 27B shape with its default 1024 "
            '("max_num_seqs (1024) exceeds available Mamba cache blocks (256) ... Please lower max_num_seqs to at '
            'most 256", gpu_memory_utilization 0.85, prefix caching on; an H100 on 2026-12-05, '
            "benchmarks/results/grids/h100_prefix-27b-c32-20261205-s25.json); 256 is the value its message asks for"
        ),
        direction=(
            "none on scheduling at the grids' concurrencies (at most 64 running, below 256; CUDA graphs are captured "
            "up to 512 tokens either way); if anything it favours vLLM: its profile run samples 256 rows instead of "
            "1,024, which leaves it more KV cache"
        ),
        magnitude="unmeasured; the profile's sampler rows are its only effect below 256 running requests",
        flags=("--max-num-seqs", "256"),
    ),
    # Applied by the registry only where it changes the launch (registry.vllm_launch: a site's max_batched_tokens
    # below 2 x ISL), so records of shorter prompts do not carry it.
    BATCHED_TOKENS_80GB: Deviation(
        name=BATCHED_TOKENS_80GB,
        reason=(
            "--max-num-batched-tokens max(ISL, 65536) instead of the registry's 2 x ISL: on an 80 GB card vLLM 0.26 "
            "cannot profile a 131,072-token step on the 27B shape (torch.OutOfMemoryError in "
            "determine_available_memory: 8.50 GiB asked, 5.63 GiB free; an H100 on 2026-12-06, "
            "benchmarks/results/grids/h100_long-27b-20261206-s31.json), so the 65,536-token points could not run; "
            "one whole prompt still fits a step"
        ),
        direction=(
            "may favour deltaserve on TTFT at concurrency >= 2 (vLLM prefills one 65,536-token prompt a step where "
            "2 x ISL let it prefill two; both are compute-bound, so the step time roughly doubles with the tokens); "
            "none at c1 and none on TPOT"
        ),
        magnitude="unmeasured; an H200 (141 GB) runs the 2 x ISL budget and can size it",
        affects=PREFILL_METRICS,
    ),
}

# Where the oracle runs: the environment its process needs and the deviations the site forces.
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
SITES: dict[str, dict[str, Any]] = {
    # The offline H200 in production configuration: the vLLM bundle and the FlashInfer bundle (unpack.sh vllm,
    # unpack.sh flashinfer), so vLLM picks its own GDN prefill (FlashInfer's CuTe-DSL kernel) and its CuTe-DSL
    # router GEMM (quack-kernels). The second PYTHONPATH entry stands for nvidia-cutlass-dsl's .pth file, which a
    # PYTHONPATH folder does not read. The sampler stays off FlashInfer (no effect at temperature 0; its C++ JIT
    # would need nvcc at start-up).
    "h200-offline": {
        "deviations": ["flashinfer-sampler-off"],
        "env": {
            "PYTHONPATH": "/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site",
            **_OFFLINE_ENV,
            "PYTHONUNBUFFERED": "1",
        },
    },
    # The offline H200 with the vLLM bundle alone (every record before 2026-12-04 ran here): the GDN prefill forced
    # to Triton/FLA. The in-process exactness gates run here too: deltaserve's GDN prefill follows the rounding of
    # vLLM's Triton/FLA kernel, and the gates' calls carry only the vLLM bundle.
    "h200-offline-triton-gdn": {
        "deviations": ["gdn-prefill-triton", "flashinfer-sampler-off"],
        "env": {"PYTHONPATH": "/tmp/vllm_site", **_OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
    },
    "online": {"deviations": [], "env": {"VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}},
}
# The same sites on an 80 GB card (an H100, when no H200 is lent): vLLM needs a max_num_seqs its state pool holds,
# and a step budget its memory profile fits (max_batched_tokens, the batched-tokens-80gb deviation where it binds).
for _name in ("h200-offline", "h200-offline-triton-gdn"):
    SITES[_name.replace("h200-", "h100-", 1)] = {
        "deviations": [*SITES[_name]["deviations"], "max-num-seqs-256"],
        "env": dict(SITES[_name]["env"]),
        "max_batched_tokens": 65536,
    }
# `bench grid --card h100` runs every arm of an h200-* site at its h100-* twin.
CARD_SITE_PREFIX = {"h200": "h200-", "h100": "h100-"}
# Where servers run unless told otherwise (grids, `bench oracle-cmd`): production.
DEFAULT_SITE = "h200-offline"
# Where the in-process exactness gates run vLLM (vllm_engine, `gate tokens --reference vllm`): the Triton/FLA GDN
# prefill whose rounding deltaserve follows, with only the vLLM bundle carried.
GATE_SITE = "h200-offline-triton-gdn"


def site_deviations(site: str) -> list[Deviation]:
    """The deviations a site forces, in order."""
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; known: {', '.join(SITES)}")
    return [DEVIATIONS[name] for name in SITES[site]["deviations"]]


def site_max_batched_tokens(site: str) -> int | None:
    """The largest step budget the site's card profiles (None: no limit below the registry's 2 x ISL)."""
    return SITES[site].get("max_batched_tokens") if site in SITES else None


def site_flags(site: str) -> list[str]:
    return [flag for deviation in site_deviations(site) for flag in deviation.flags]


def site_env(site: str) -> dict[str, str]:
    env = dict(SITES[site]["env"]) if site in SITES else {}
    for deviation in site_deviations(site):
        env.update(dict(deviation.env))
    return env


def _split_equals(argv: list[str]) -> list[str]:
    """argv with every `--flag=value` word split into `--flag value`."""
    words: list[str] = []
    for word in argv:
        words += word.split("=", 1) if word.startswith("--") and "=" in word else [word]
    return words


def deviations_in(argv: list[str], env: dict[str, str] | None = None) -> list[Deviation]:
    """The registry deviations a recorded launch carries, recognised from its argv and environment."""
    words = _split_equals(argv)
    env = env or {}
    found = []
    for deviation in DEVIATIONS.values():
        size = len(deviation.flags)
        has_flags = size > 0 and any(words[i : i + size] == list(deviation.flags) for i in range(len(words)))
        has_env = bool(deviation.env) and all(env.get(k) == v for k, v in deviation.env)
        if has_flags or has_env:
            found.append(deviation)
    return found


def backend_overrides(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The backend flags and variables of a launch (each overrides a choice vLLM's defaults would make)."""
    words = _split_equals(argv)
    found = [
        f"{w} {words[i + 1] if i + 1 < len(words) else ''}".strip() for i, w in enumerate(words) if w in BACKEND_FLAGS
    ]
    found += [f"{k}={v}" for k, v in (env or {}).items() if k in BACKEND_ENV]
    return found


def denominator_note(deviations: list[Deviation]) -> str | None:
    """One note for every deviation of a launch that can move a metric (None when there is none)."""
    notes = [d.note for d in deviations if d.affects]
    return " ".join(notes) or None
