"""The one interface every attention backend implements.

The runner calls `plan(batch)` once per step; the model then calls
`forward(q, k, v, layer, batch, plan)` in every layer. `forward` stores the
new tokens' K/V into the pool at `batch.out_slots` (here, once for every
backend), then the backend's `attend` runs each sequence's new queries over
its whole `kv_slots` (prefix + new) with the causal mask offset by its prefix
length: new token j of a sequence with prefix p sees positions 0 .. p + j.

How a layer attends (its sliding window, softmax scale, score soft-capping)
is a `LayerAttention`; a model whose layers differ plans once per distinct
`LayerAttention` and hands each layer its own plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from radixrt.kernels import DEFAULT_SHARED_PREFIX_MIN_TOKENS, cpu
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.segments import AttentionSegments
from radixrt.memory.kv_cache import KVCache

PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of two layers, beyond their K/V.

    `sliding_window`: a query at position i sees only the keys at positions
    i - sliding_window + 1 .. i (itself and the window - 1 before it);
    None: every earlier key. `scale`: the softmax scale (None: head_dim**-0.5).
    `logit_softcap`: scores become cap * tanh(score / cap) before the mask
    (Gemma 2); None: no capping.
    """

    sliding_window: int | None = None
    scale: float | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0 or None, got {self.logit_softcap}")

    def first_visible_key(self, position: int) -> int:
        """The oldest key position a query at `position` attends."""
        return 0 if self.sliding_window is None else max(0, position - self.sliding_window + 1)


FULL_ATTENTION = LayerAttention()


class AttentionBackend(ABC, Generic[PlanT]):
    """Attention over a `KVCache`; `PlanT` is what `plan` builds and every layer's `attend` reads.

    `shared_prefix_min_tokens`: sequences sharing at least this many cached
    slots may attend them in one call (backends without a shared-prefix path
    ignore it).
    """

    name: str = ""

    def __init__(
        self,
        kv_cache: KVCache,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        *,
        shared_prefix_min_tokens: int = DEFAULT_SHARED_PREFIX_MIN_TOKENS,
    ):
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
            )
        if (num_kv_heads, head_dim) != (kv_cache.shape.num_kv_heads, kv_cache.shape.head_dim):
            raise ValueError(
                f"num_kv_heads/head_dim ({num_kv_heads}, {head_dim}) must match the KV cache "
                f"({kv_cache.shape.num_kv_heads}, {kv_cache.shape.head_dim})"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if shared_prefix_min_tokens < 1:
            raise ValueError(f"shared_prefix_min_tokens must be >= 1, got {shared_prefix_min_tokens}")
        self.kv_cache = kv_cache
        # bf16 on the CPU: radixrt's C copy, one call a layer instead of two indexed assignments
        on_cpu_bf16 = kv_cache.device.type == "cpu" and kv_cache.shape.dtype == torch.bfloat16
        self._store_rows = cpu.kv_store() if on_cpu_bf16 else None
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        self.scale = head_dim**-0.5
        self._setup()

    def _setup(self) -> None:
        """Backend-specific checks and state, after the shared ones (a hook, so no backend repeats
        the constructor's parameters just to add its own)."""

    def _require_kv_dtype(self, supported: tuple[torch.dtype, ...]) -> None:
        """Reject a KV cache whose dtype this backend's kernels were not built for, at construction."""
        if self.kv_cache.shape.dtype not in supported:
            raise ValueError(f"kv_cache dtype must be one of {supported}, got {self.kv_cache.shape.dtype}")

    @abstractmethod
    def plan(self, batch: ForwardBatch, attention: LayerAttention = FULL_ATTENTION) -> PlanT:
        """Build this step's metadata once (index arrays, kernel plans) for layers attending as
        `attention` says."""

    @property
    def reads_pool_in_place(self) -> bool:
        """Whether radixrt's C attention reads this pool where it lies, so a whole-step kernel
        (`model.executors.WholeStep`) may attend in this backend's place."""
        return False

    @property
    def attends_segments(self) -> bool:
        """Whether `plan_segments` works here: radixrt's C attention, batch-invariant by
        construction, reads this pool (the condition for deterministic steps)."""
        return False

    @property
    def attention_chunk(self) -> int:
        """How many keys the C attention reduces as one piece (needs `attends_segments`)."""
        raise ValueError(f"the {self.name} attention backend does not attend segments")

    def plan_segments(self, segments: AttentionSegments, attention: LayerAttention = FULL_ATTENTION) -> PlanT:
        """A plan that attends every row of a batch as `segments` say (they carry the causal mask
        and any window; needs `attends_segments`)."""
        raise ValueError(f"the {self.name} attention backend does not attend segments")

    def softmax_scale(self, attention: LayerAttention) -> float:
        return self.scale if attention.scale is None else attention.scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, plan: PlanT
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq, D].

        The new K/V enter the pool first, so `attend` reads every key, new or
        cached, from one place.
        """
        slots, store = batch.out_slots, self._store_rows
        if store is not None and store.takes(k, slots) and store.takes(v, slots):
            store(k, v, slots, self.kv_cache.k[layer], self.kv_cache.v[layer])
        else:
            self.kv_cache.store(layer, slots, k, v)
        return self.attend(q, k, v, layer, batch, plan)

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, plan: PlanT
    ) -> torch.Tensor:
        """Attention output [T, Hq, D]; the new tokens' K/V (`k`, `v`) are already in the pool."""
