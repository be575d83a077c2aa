"""The `bench` extra: the libraries only the benchmark harness uses (aiohttp, matplotlib), loaded on use.

`pip install -e .` installs what serving needs; `pip install -e '.[bench]'` adds these. Bench modules load them
through `require`, where they use them, so importing a bench module (as the gates and the tests do) needs neither,
and a missing one is one error naming the extra instead of a bare ModuleNotFoundError.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "bench"


class MissingExtraError(ImportError):
    """A library of the `bench` extra is not installed."""


def require(module: str) -> ModuleType:
    """Import `module` (e.g. "aiohttp", "matplotlib.pyplot"); if its package is missing, say which extra has it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        package = module.split(".")[0]
        # Only the package itself missing is the extra's business; a broken install of it raises as it is.
        if (exc.name or "").split(".")[0] != package:
            raise
        raise MissingExtraError(
            f"{package} is not installed: deltaserve's benchmark tools need the `{EXTRA}` extra "
            f"(pip install -e '.[{EXTRA}]' in a clone, or pip install 'deltaserve[{EXTRA}]')"
        ) from exc
