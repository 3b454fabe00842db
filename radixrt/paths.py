"""Where radixrt keeps what it builds once per machine (converted checkpoints, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "RADIXRT_CACHE_DIR"


def cache_root() -> Path:
    """$RADIXRT_CACHE_DIR, else ~/.cache/radixrt."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "radixrt"
