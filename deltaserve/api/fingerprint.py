"""The `system_fingerprint` that completions and chat responses carry, as vLLM 0.26 builds it (--fingerprint-mode).

Modes, vLLM's names: `full` (default) `deltaserve-<version>[-tp<N>][-ep]-<hash8>`, `hash` the same without the
parallelism, `custom` the literal --fingerprint-value, `none` no fingerprint (the field is null). vLLM's prefix is its
own name and version; ours names the engine that answered, so a client that logs fingerprints can tell the two apart.
The hash is the first 8 hex digits of a sha256 over the engine configuration, every field (model path, dtype,
quantization, speculative decoding, cache and scheduler settings): a restart with any other setting changes it, as
vLLM's `compute_hash` does for the settings that shape its computation. Computed once at start-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from deltaserve.engine_config import EngineConfig
from deltaserve.version import __version__

FINGERPRINT_MODES = ("full", "hash", "custom", "none")


def config_hash(config: EngineConfig) -> str:
    """8 hex digits that change with any field of the engine configuration."""
    fields = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(fields.encode()).hexdigest()[:8]


def system_fingerprint(config: EngineConfig, mode: str = "full", custom_value: str | None = None) -> str | None:
    """vLLM's build_system_fingerprint for deltaserve (mode one of FINGERPRINT_MODES; custom without a value: None,
    as vLLM's)."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"--fingerprint-mode must be one of {', '.join(FINGERPRINT_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "custom":
        return custom_value
    parts = [f"deltaserve-{__version__}"]
    if mode == "full":
        if config.tensor_parallel_size > 1:
            parts.append(f"tp{config.tensor_parallel_size}")
        if config.enable_expert_parallel:
            parts.append("ep")
    parts.append(config_hash(config))
    return "-".join(parts)
