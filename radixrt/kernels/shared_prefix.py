"""Shared-prefix ("cascade") attention: read a prefix many sequences share once.

Requests that hit the same radix-tree node borrow the same KV slots, so in a
few-shot batch or a fork of k samples, every sequence's slot list starts with
the same hundreds of slots. Attending each sequence separately reads that
prefix once per sequence and runs one skinny matrix-vector product per
sequence; attending all their queries at once against the prefix reads it
once and runs one matrix-matrix product, which is what a CPU (and a GPU) does
well. Each sequence then attends its own tail (the keys after the shared
prefix), and the two partial results are merged exactly with their
log-sum-exps:

    out = out_prefix * w + out_tail * (1 - w),   w = sigmoid(lse_prefix - lse_tail)

No masking is needed against the shared prefix: it is cached, so it lies
before every new token of every sequence that shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """Sequences of a batch whose slot lists start with the same `length` slots."""

    members: tuple[int, ...]  # sequence indices in the batch
    length: int
    slots: torch.Tensor  # [length] pool slots of the shared prefix
    contiguous_start: int | None  # first slot when the slots are consecutive (read in place)


def find_shared_prefixes(
    kv_indices: torch.Tensor,
    kv_starts: Sequence[int],
    prefix_lens: Sequence[int],
    min_length: int,
) -> list[SharedPrefix]:
    """Group sequences by their first cached slot and measure how far their slots agree.

    Only the cached prefix (`prefix_lens`) can be shared: new tokens always
    get fresh slots. One level is found per group: sequences that branch
    further (a tree of thought) share their common root here.
    """
    by_first_slot: dict[int, list[int]] = {}
    firsts = kv_indices[list(kv_starts)].tolist() if kv_starts else []
    for index, (first, prefix) in enumerate(zip(firsts, prefix_lens)):
        if prefix >= min_length:
            by_first_slot.setdefault(first, []).append(index)
    shared = []
    for members in by_first_slot.values():
        if len(members) < 2:
            continue
        limit = min(prefix_lens[i] for i in members)
        starts = torch.tensor([kv_starts[i] for i in members], device=kv_indices.device)
        slots = kv_indices[starts[:, None] + torch.arange(limit, device=kv_indices.device)]
        agree = (slots == slots[:1]).all(dim=0)
        length = limit if bool(agree.all()) else int(agree.to(torch.int8).argmin())
        if length < min_length:
            continue
        prefix_slots = slots[0, :length]
        first = int(prefix_slots[0])
        consecutive = int(prefix_slots[-1]) - first == length - 1 and bool((prefix_slots.diff() == 1).all())
        shared.append(SharedPrefix(tuple(members), length, prefix_slots, first if consecutive else None))
    return shared


def prefix_keys(pool: torch.Tensor, prefix: SharedPrefix) -> torch.Tensor:
    """The prefix's K or V as [1, H, length, D]: a view of the pool when its slots are consecutive."""
    if prefix.contiguous_start is not None:
        rows = pool.narrow(0, prefix.contiguous_start, prefix.length)
    else:
        rows = pool.index_select(0, prefix.slots)
    return rows.transpose(0, 1).unsqueeze(0)


def _flash_cpu() -> Callable | None:
    """torch's CPU flash-attention kernel, which also returns the log-sum-exp."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH_CPU = _flash_cpu()


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each query row's log-sum-exp (fp32).

    q: [B, H, Lq, D], k/v: [B, H, Lk, D], mask additive and broadcastable to
    [B, H, Lq, Lk]. Every query row must see at least one key. `softcap`:
    scores become softcap * tanh(score / softcap) before the mask (no fused
    kernel does that, so the scores are then computed explicitly, in fp32).
    """
    if q.device.type == "cpu" and _FLASH_CPU is not None and softcap is None:
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine two attentions of the same queries over disjoint key sets.

    out_*: [T, H, D], lse_*: [T, H]. The weight of part a is its share of the
    total softmax mass, exp(lse_a) / (exp(lse_a) + exp(lse_b)).
    """
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    merged = out_b.float() + (out_a.float() - out_b.float()) * weight_a
    return merged.to(out_a.dtype)


def fold_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Lq, Hq, D] -> [B, Hkv, Lq * G, D]: the G query heads of a KV head become rows.

    Grouped-query attention then needs no repeated K/V, and the kernel sees
    one tall query matrix per KV head.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    folded = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    return folded.reshape(batch, num_kv_heads, -1, head_dim)


def unfold_heads(out: torch.Tensor, lse: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fold_heads` for the output [B, Hkv, Lq*G, D] and lse [B, Hkv, Lq*G].

    Returns out [B * Lq, Hq, D] and lse [B * Lq, Hq].
    """
    batch, num_kv_heads, rows, head_dim = out.shape
    group = rows // q_len
    out = out.view(batch, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    lse = lse.view(batch, num_kv_heads, q_len, group).permute(0, 2, 1, 3)
    return out.reshape(batch * q_len, num_kv_heads * group, head_dim), lse.reshape(batch * q_len, -1)


def repeat_mask_rows(mask: torch.Tensor, group: int) -> torch.Tensor:
    """An additive [B, 1, Lq, Lk] mask for folded queries ([B, Hkv, Lq*G, ...])."""
    return mask.repeat_interleave(group, dim=2)

