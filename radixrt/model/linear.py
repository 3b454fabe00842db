"""Linear projections, with weights prepacked for oneDNN on a CPU in bf16.

CPU decode reads every weight once per step. Handing oneDNN a weight
already reordered into its blocked layout, once at load time, makes the bf16
matmul faster at decode-sized batches (docs/model.md has the timing) and
gives bit-identical results, which `pack` checks before using it.
fp32 is left on `F.linear` (MKL): the packed fp32 path rounds differently,
and fp32 is the dtype our exactness tests compare against transformers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]


def plain(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """`F.linear` over the live parameters (they may be loaded into later)."""
    return lambda x: F.linear(x, weight, bias)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A prepacked oneDNN linear when the platform supports it exactly, else `plain`."""
    if not _can_pack(weight):
        return plain(weight, bias)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        fn = _packed_linear(packed, None if bias is None else bias.detach())
        probe = torch.randn(17, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        if not torch.equal(fn(probe), F.linear(probe, weight, bias)):
            return plain(weight, bias)
    except (RuntimeError, AttributeError):
        return plain(weight, bias)
    return fn


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packed_linear(packed: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    return linear
