"""radixrt: a RadixAttention inference runtime.

Importing the package is cheap and needs no GPU: the heavy pieces load when
first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Runtime": "radixrt.runtime",
    "RuntimeConfig": "radixrt.config",
    "SamplingParams": "radixrt.sampling",
    "function": "radixrt.lang",
    "gen": "radixrt.lang",
    "select": "radixrt.lang",
    "system": "radixrt.lang",
    "user": "radixrt.lang",
    "assistant": "radixrt.lang",
    "set_default_runtime": "radixrt.lang",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
