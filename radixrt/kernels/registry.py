"""Picks an attention backend by name, importing GPU backends only when chosen."""

from __future__ import annotations

import importlib
import importlib.util

from radixrt.kernels.base import AttentionBackend
from radixrt.memory.kv_cache import KVCache

# name -> (module, class, the pip package its kernels come from; None: plain torch)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "flashinfer": ("radixrt.kernels.flashinfer_backend", "FlashInferAttentionBackend", "flashinfer"),
    "triton": ("radixrt.kernels.triton_backend", "TritonAttentionBackend", "triton"),
    "torch": ("radixrt.kernels.torch_backend", "TorchAttentionBackend", None),
}
BACKEND_NAMES = ("auto", *_BACKENDS)


def create_backend(
    name: str | None,
    kv_cache: KVCache,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int = 1,
) -> AttentionBackend:
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
        if _BACKENDS[name][2] is not None and not on_cuda:
            raise ValueError(
                f"attention_backend {name!r} needs a CUDA KV cache, got device {kv_cache.device}; use 'torch' or 'auto'"
            )
        backend_class = _load(name)
    return backend_class(kv_cache, num_q_heads, num_kv_heads, head_dim, page_size)


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


def _auto(on_cuda: bool) -> type[AttentionBackend]:
    """The best backend that imports: a broken GPU install falls back instead of failing."""
    if on_cuda:
        for name in ("flashinfer", "triton"):
            package = _BACKENDS[name][2]
            if package is None or importlib.util.find_spec(package) is None:
                continue
            try:
                return _load(name)
            except ImportError:
                continue
    return _load("torch")
