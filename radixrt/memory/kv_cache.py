"""Per-layer K and V storage addressed by slot index."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.memory.huge_pages import anonymous_bytes


@dataclass(frozen=True)
class KVShape:
    """What one token's KV costs: the runner sizes the pool from a memory budget with it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def tokens_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_token


class KVCache:
    """K and V tensors of shape [num_slots, num_kv_heads, head_dim] per layer.

    The layout is FlashInfer's "NHD": `k[layer].view(num_pages, page_size, H, D)`
    is its paged layout, so every backend reads the same memory.
    """

    def __init__(self, shape: KVShape, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.device = torch.device(device)
        size = (num_slots, shape.num_kv_heads, shape.head_dim)
        self.k = [_zeros(size, shape.dtype, self.device) for _ in range(shape.num_layers)]
        self.v = [_zeros(size, shape.dtype, self.device) for _ in range(shape.num_layers)]

    @property
    def total_bytes(self) -> int:
        return self.shape.bytes_per_token * self.num_slots

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([T, H, D]) into their slots."""
        self.k[layer][slots] = k.to(self.shape.dtype)
        self.v[layer][slots] = v.to(self.shape.dtype)


def _zeros(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU in fresh anonymous memory, which the kernel zeroes page by page on first touch.

    `torch.zeros` writes every byte at once, paying a page fault for every
    page of the pool at start, for pages most runs never use
    (docs/benchmarks.md, "Fresh memory on the 2-core VM").
    """
    memory = anonymous_bytes(torch.Size(size).numel() * dtype.itemsize) if device.type == "cpu" else None
    if memory is None:
        return torch.zeros(size, dtype=dtype, device=device)
    return memory.view(dtype).view(size)
