"""Every environment variable deltaserve reads, typed, in one place.

Nothing else in the package calls os.environ for a DELTASERVE_* setting; read them through these
functions so a test can set a variable and see the change without re-importing modules.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _positive_float(name: str, default: float) -> float:
    """A number of seconds that must be positive (`default` when unset or blank)."""
    value = os.environ.get(name, "").strip()
    number = float(value) if value else default
    if not number > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


def _positive_int(name: str, default: int) -> int:
    """A count that must be positive (`default` when unset or blank)."""
    value = os.environ.get(name, "").strip()
    number = int(value) if value else default
    if number < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


def fuse_attn_preamble() -> bool:
    """DELTASERVE_FUSE_ATTN_PREAMBLE (default 1): one fused launch for q/k norm + RoPE + gate split.

    0 selects the four-op path (gate split, RMSNorm q, RMSNorm k, 1-D RoPE), which refuses MRoPE positions.
    """
    return _flag("DELTASERVE_FUSE_ATTN_PREAMBLE", True)


def use_triton() -> bool:
    """DELTASERVE_USE_TRITON (default: 1 on CUDA): route kernel ops to Triton instead of the torch twins.

    Under TRITON_INTERPRET=1 on the CPU, tests call the Triton kernels directly; the engine keeps the
    torch twins on the CPU unless this is set explicitly.
    """
    return _flag("DELTASERVE_USE_TRITON", True)


def triton_interpret() -> bool:
    """TRITON_INTERPRET: Triton's own switch for running kernels on the CPU with numpy."""
    return _flag("TRITON_INTERPRET", False)


def profile_labels() -> bool:
    """DELTASERVE_PROFILE_LABELS (default 0): the model's torch.profiler ranges around every layer and op
    (model/labels.py), read once at import; off, the model records nothing."""
    return _flag("DELTASERVE_PROFILE_LABELS", False)


def pdl() -> bool:
    """DELTASERVE_PDL (default 1): launch the decode-path Triton kernels with programmatic dependent launch on
    Hopper and newer (each waits on griddepcontrol before its first dependent access;
    docs/kernels.md#programmatic-dependent-launch); 0 launches them plainly, fully serialised behind the previous
    kernel."""
    return _flag("DELTASERVE_PDL", True)


def enable_multiprocessing() -> bool:
    """DELTASERVE_ENABLE_MULTIPROCESSING (default 1): the server runs its engine core in a process of its own
    (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING); 0 keeps it on a thread of the API process."""
    return _flag("DELTASERVE_ENABLE_MULTIPROCESSING", True)


def vllm_api_key() -> str | None:
    """VLLM_API_KEY: the API key `deltaserve serve` requires when --api-key is not given (vLLM's variable)."""
    return os.environ.get("VLLM_API_KEY") or None


def vllm_http_timeout_keep_alive() -> float:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE (vLLM's, default 5): seconds an idle keep-alive connection stays open."""
    value = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "").strip()
    return float(value) if value else 5.0


def vllm_attention_backend() -> str | None:
    """VLLM_ATTENTION_BACKEND as set (None: unset). vLLM 0.26 no longer reads it (its backend comes from
    --attention-backend alone), and neither does deltaserve: runner/device_setup.py only warns that it is ignored."""
    return os.environ.get("VLLM_ATTENTION_BACKEND") or None


def vllm_server_dev_mode() -> bool:
    """VLLM_SERVER_DEV_MODE (vLLM's, default 0): serve the development routes (POST /reset_prefix_cache)."""
    return _flag("VLLM_SERVER_DEV_MODE", False)


def vllm_log_stats_interval() -> float:
    """VLLM_LOG_STATS_INTERVAL (vLLM's, default 10): seconds between two periodic stats lines of the server."""
    return _positive_float("VLLM_LOG_STATS_INTERVAL", 10.0)


def max_completion_prompts() -> int:
    """VLLM_MAX_COMPLETION_PROMPTS (vLLM's, default 1024): the most prompts one /v1/completions request may batch."""
    return _positive_int("VLLM_MAX_COMPLETION_PROMPTS", 1024)


def max_n_sequences() -> int:
    """VLLM_MAX_N_SEQUENCES (vLLM's, default 16384): the largest n a request may ask for."""
    return _positive_int("VLLM_MAX_N_SEQUENCES", 16384)


# The VLLM_* variables deltaserve reads (the functions above; VLLM_ATTENTION_BACKEND only to warn that it is ignored,
# runner/device_setup.py): any other one set is logged by `deltaserve serve` as ignored, never dropped in silence.
READ_VLLM_VARIABLES = (
    "VLLM_API_KEY",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_LOG_STATS_INTERVAL",
    "VLLM_MAX_COMPLETION_PROMPTS",
    "VLLM_MAX_N_SEQUENCES",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
)


def unread_vllm_variables() -> list[str]:
    """The VLLM_* environment variables set that deltaserve does not read, sorted: those of vLLM launch scripts
    (VLLM_USE_FLASHINFER_SAMPLER=1, VLLM_USE_DEEP_GEMM=0, VLLM_USE_MODELSCOPE=true, ...) pick vLLM's kernels or
    sources, which deltaserve does not have. vLLM reads its own silently and warns of unknown ones
    (vllm/envs.py validate_environ); deltaserve reads none of them, so it names each."""
    return sorted(name for name in os.environ if name.startswith("VLLM_") and name not in READ_VLLM_VARIABLES)


def log_level() -> str:
    """DELTASERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("DELTASERVE_LOG_LEVEL", "INFO").upper()


def allow_long_max_model_len() -> bool:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN or DELTASERVE_ALLOW_LONG_MAX_MODEL_LEN (default 0): admit a --max-model-len
    above the model's max_position_embeddings with a warning instead of refusing it, as vLLM does ("1" or "true")."""
    return any(
        os.environ.get(name, "0").strip().lower() in ("1", "true")
        for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "DELTASERVE_ALLOW_LONG_MAX_MODEL_LEN")
    )


def cpu_threads() -> int | None:
    """DELTASERVE_CPU_THREADS: torch intra-op threads for CPU execution (default: torch's own choice, except
    1 for tiny models, whose matmuls are far too small to pay for thread hand-offs)."""
    value = os.environ.get("DELTASERVE_CPU_THREADS")
    return int(value) if value else None


# below this hidden size a model counts as tiny for cpu_threads_for
TINY_HIDDEN_SIZE = 512


def cpu_threads_for(hidden_size: int) -> int | None:
    """The CPU thread rule of the engine and of the gates' references alike: DELTASERVE_CPU_THREADS, else 1 for a
    tiny model, else None (torch's own choice)."""
    return cpu_threads() or (1 if hidden_size < TINY_HIDDEN_SIZE else None)


def git_commit() -> str | None:
    """DELTASERVE_GIT_COMMIT: the project commit a benchmark record states, when it wins over `git rev-parse`
    (the device machine's copy of the tree carries no trustworthy .git)."""
    return os.environ.get("DELTASERVE_GIT_COMMIT") or None


def grid_pidfile() -> Path:
    """DELTASERVE_GRID_PIDFILE (default /tmp/deltaserve-grid-server.pgid): where `bench grid` notes its running
    server's process group, so a later call can stop a server that a killed grid left behind."""
    return Path(os.environ.get("DELTASERVE_GRID_PIDFILE", "/tmp/deltaserve-grid-server.pgid"))


# -- tensor parallelism (torch.distributed) -------------------------------------------------------------------

NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _int_or_none(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def dist_world_size() -> int | None:
    """WORLD_SIZE (torchrun's): the number of ranks when an outside launcher started one process per rank."""
    return _int_or_none("WORLD_SIZE")


def dist_rank() -> int | None:
    """RANK (torchrun's): this process's global rank under an outside launcher."""
    return _int_or_none("RANK")


def dist_local_rank() -> int | None:
    """LOCAL_RANK (torchrun's): this process's rank on its host, which picks its GPU."""
    return _int_or_none("LOCAL_RANK")


def master_addr() -> str | None:
    """MASTER_ADDR: the host of rank 0's rendezvous store (default for spawned workers: 127.0.0.1)."""
    return os.environ.get("MASTER_ADDR") or None


def master_port() -> int | None:
    """MASTER_PORT: the port of rank 0's rendezvous store (default for spawned workers: a free port)."""
    return _int_or_none("MASTER_PORT")


def dist_timeout_s() -> float:
    """DELTASERVE_DIST_TIMEOUT_S (default 600): how long a collective inside a step, and the workers' start-up
    rendezvous, may wait for a rank before failing."""
    value = os.environ.get("DELTASERVE_DIST_TIMEOUT_S", "").strip()
    return float(value) if value else 600.0


def engine_heartbeat_timeout_s() -> float:
    """DELTASERVE_ENGINE_HEARTBEAT_TIMEOUT_S (default 10): /health fails once the engine-core process has sent
    nothing, not even its heartbeat, for this long (a frozen or stopped core)."""
    return _positive_float("DELTASERVE_ENGINE_HEARTBEAT_TIMEOUT_S", 10.0)


def disable_nvlink_multicast() -> None:
    """Sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in this process (and so
    in every process it starts): NVLink multicast can put a shared host's GPUs out of service, so tensor
    parallelism on CUDA never uses it, whatever the caller's environment says."""
    os.environ.update(NVLINK_MULTICAST_OFF)


@contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """Sets a DELTASERVE_* variable for the block and restores it after (the media gate's four-op check)."""
    if not name.startswith("DELTASERVE_"):
        raise ValueError(f"{name} is not a deltaserve setting")
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
