"""Turn a model name and a RuntimeConfig into a ready Engine.

Sizing the KV pool is the one decision made here: an explicit
`max_total_tokens`, else a share of free GPU memory after the weights, else a
byte budget on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.engine import Engine
from radixrt.kernels.registry import create_backend
from radixrt.memory import KVCache, KVShape, PagePool
from radixrt.model.loader import load_model
from radixrt.model.runner import ModelRunner


def build_engine(model: Any, config: RuntimeConfig) -> tuple[Engine, Any, str]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(model, device=device, dtype=config.dtype)
    device = loaded.model.device
    model_config = loaded.config
    shape = model_config.kv_shape(loaded.model.dtype)
    num_pages = pool_tokens(config, shape, device) // config.page_size
    if num_pages < 1:
        raise ValueError("the KV budget holds less than one page; raise max_total_tokens or the memory budget")
    kv_cache = KVCache(shape, num_pages * config.page_size, device)
    backend = create_backend(
        config.attention_backend,
        kv_cache,
        model_config.num_heads,
        model_config.num_kv_heads,
        model_config.head_dim,
        config.page_size,
    )
    runner = ModelRunner(loaded.model, kv_cache, backend)
    cache = CacheManager(PagePool(num_pages, config.page_size), enable_radix_cache=not config.disable_radix_cache)
    engine = Engine(
        runner,
        cache,
        config,
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded),
        vocab_size=model_config.vocab_size,
        context_len=model_config.context_len,
        device=device,
    )
    return engine, loaded.tokenizer, loaded.name


def pool_tokens(config: RuntimeConfig, shape: KVShape, device: torch.device) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return shape.tokens_for_bytes(int(free_bytes * config.kv_memory_fraction))
    return shape.tokens_for_bytes(config.kv_memory_bytes)


def eos_token_ids(loaded: Any) -> list[int]:
    ids = set(loaded.config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return sorted(ids)
