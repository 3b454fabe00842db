"""The one interface every attention backend implements.

The runner calls `plan(batch)` once per step; the model then calls
`forward(q, k, v, layer, plan)` in every layer. `forward` first stores the new
tokens' K/V into the pool at `batch.out_slots`, then attends each sequence's
new queries over its whole `kv_slots` (prefix + new) with the causal mask
offset by its prefix length: new token j of a sequence with prefix p sees
positions 0 .. p + j.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from radixrt.memory.kv_cache import KVCache
from radixrt.model.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = ""

    def __init__(self, kv_cache: KVCache, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 1):
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.scale = head_dim**-0.5

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> Any:
        """Build this step's metadata once (index arrays, kernel plans)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, plan: Any
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq, D]."""
