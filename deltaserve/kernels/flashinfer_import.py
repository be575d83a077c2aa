"""What deltaserve's FlashInfer paths (kernels/gdn_flashinfer.py, kernels/attention_flashinfer.py) share at start-up:
importing a flashinfer module with the reason it cannot be served when that fails, and the installed version for
the start-up log. flashinfer is imported only here and when a path is served, never at deltaserve's import."""

from __future__ import annotations

import importlib
from types import ModuleType

# the release deltaserve's FlashInfer paths are built and tested against (the `flashinfer` extra pins it)
FLASHINFER_RELEASE = "0.6.14"


def import_or_reason(module: str) -> tuple[ModuleType | None, str | None]:
    """(the module, None), or (None, why it does not import, with the install hint)."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # a broken install raises more than ImportError (a missing CUDA library, say)
        return None, (
            f"{module} does not import ({type(exc).__name__}: {exc}); install flashinfer-python {FLASHINFER_RELEASE} "
            "(pip install 'deltaserve[flashinfer]')"
        )


def flashinfer_version() -> str:
    """The installed flashinfer's version (for the start-up log)."""
    return str(getattr(importlib.import_module("flashinfer"), "__version__", "unknown"))
