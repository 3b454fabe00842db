"""Picks an attention backend by name, importing GPU backends only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from radixrt.kernels import BACKEND_NAMES, BACKENDS, DEFAULT_SHARED_PREFIX_MIN_TOKENS
from radixrt.kernels.base import AttentionBackend
from radixrt.memory.kv_cache import KVCache


def create_backend(
    name: str | None,
    kv_cache: KVCache,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int = 1,
    shared_prefix_min_tokens: int = DEFAULT_SHARED_PREFIX_MIN_TOKENS,
) -> AttentionBackend[Any]:
    """Build the named backend over `kv_cache`.

    None or "auto": on a CUDA cache the first of flashinfer, triton that
    imports, else torch; on any other device torch. Naming a GPU backend for
    a non-CUDA cache, or an unknown name, is a ValueError; a named backend
    whose package is missing raises the ImportError.
    """
    if name is None:
        name = "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    on_cuda = kv_cache.device.type == "cuda"
    if name == "auto":
        backend_class = _auto(on_cuda)
    else:
        if BACKENDS[name][2] is not None and not on_cuda:
            raise ValueError(
                f"attention_backend {name!r} needs a CUDA KV cache, got device {kv_cache.device}; use 'torch' or 'auto'"
            )
        backend_class = _load(name)
    return backend_class(
        kv_cache, num_q_heads, num_kv_heads, head_dim, page_size, shared_prefix_min_tokens=shared_prefix_min_tokens
    )


def _load(name: str) -> type[AttentionBackend[Any]]:
    module_name, class_name, _ = BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


def _auto(on_cuda: bool) -> type[AttentionBackend[Any]]:
    """The best backend that imports: a broken GPU install falls back instead of failing."""
    if on_cuda:
        for name in ("flashinfer", "triton"):
            package = BACKENDS[name][2]
            if package is None or importlib.util.find_spec(package) is None:
                continue
            try:
                return _load(name)
            except ImportError:
                continue
    return _load("torch")
