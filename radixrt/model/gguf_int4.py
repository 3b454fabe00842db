"""4-bit projection weights read from a GGUF file as they are stored (`weights="native"`).

A CPU decode step reads every projection weight once, so its speed is set
by the bytes read. The bundled model is a Q4_1 GGUF: expanding it to bf16
reads 4x more bytes per step than the file holds. Here the Q4_0/Q4_1 blocks
are kept as 4-bit codes with one scale and offset per block of 32 along the
input dimension, exactly the file's values:

    Q4_1 block (20 bytes): scale d (fp16) | offset m (fp16) | 16 bytes of codes   w = d * q + m
    Q4_0 block (18 bytes): scale d (fp16) | 16 bytes of codes                      w = d * (q - 8)
    codes: byte j holds element j (low nibble) and element j + 16 (high nibble)

The LM head is the largest single weight of a small model (SmolLM2: 57 MB of
the 123 MB a 4-bit step reads). Files usually store it as Q8_0 (a scale per
32 signed bytes, w = d * q): it is kept so (`Int8Weight`) for radixrt's own
kernel. torch has no 8-bit kernel with per-block scales, but an 8-bit code
is two 4-bit ones, q + 128 = 16 * hi + lo, so where torch's 4-bit kernel runs
the head is two 4-bit weights whose products sum to the file's:

    hi: codes hi, scale 16 d, offset -128 d      lo: codes lo, scale d, offset 0

llama.cpp's converter reorders the rows of each q and k projection (its
rotary layout); they are put back in Hugging Face order here, as
transformers does when it reads the file, so `dequantize()` equals the
weights the dense path loads, bit for bit (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile, GGUFTensor

GROUP_SIZE = 32
SUPPORTED_TYPES = ("Q4_0", "Q4_1")
LM_HEAD_TYPES = (*SUPPORTED_TYPES, "Q8_0")

# Our fused projections and the GGUF tensors they are made of, in row order.
PROJECTIONS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


@dataclass(frozen=True)
class Int4Weight:
    """A [N, K] weight as 4-bit codes with a scale and an offset per group of 32 along K: w = q * scale + offset."""

    codes: torch.Tensor  # [N, K] uint8, each in [0, 15]
    scales: torch.Tensor  # [N, K // GROUP_SIZE] float32
    offsets: torch.Tensor  # [N, K // GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        scales = self.scales.repeat_interleave(GROUP_SIZE, dim=1)
        offsets = self.offsets.repeat_interleave(GROUP_SIZE, dim=1)
        return self.codes.float() * scales + offsets

    @staticmethod
    def stack_rows(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
        )

    def rows(self, order: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.codes[order], self.scales[order], self.offsets[order])


@dataclass(frozen=True)
class Int8Weight:
    """A [N, K] weight as signed 8-bit codes with a scale per group of 32 along K: w = q * scale (Q8_0)."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        return self.codes.float() * self.scales.repeat_interleave(GROUP_SIZE, dim=1)

    def as_int4_pair(self) -> list[Int4Weight]:
        """Two 4-bit weights whose sum is this one, exactly (see the module docstring)."""
        shifted = (self.codes.to(torch.int16) + 128).to(torch.uint8)
        high = Int4Weight(shifted >> 4, 16 * self.scales, -128 * self.scales)
        low = Int4Weight(shifted & 0x0F, self.scales, torch.zeros_like(self.scales))
        return [high, low]


@dataclass(frozen=True)
class NativeWeights:
    """What `weights="native"` multiplies by: per layer its fused projections, and the LM head as
    the file stores it (None when that is a type without a kernel: the head then stays dense)."""

    layers: list[dict[str, Int4Weight]]
    lm_head: Int4Weight | Int8Weight | None


def int4_weight(tensor: GGUFTensor) -> Int4Weight:
    """A Q4_0 or Q4_1 tensor's codes, scales and offsets, exactly as stored (ValueError naming it otherwise)."""
    kind = tensor.type_name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{tensor.name} is {kind}: the 4-bit kernels take {', '.join(SUPPORTED_TYPES)}")
    num_rows = tensor.data.shape[0]
    block_bytes = 20 if kind == "Q4_1" else 18
    blocks = tensor.data.reshape(num_rows, -1, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offsets = -8 * scales
    packed = blocks[..., block_bytes - 16 :]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(num_rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets))


def int8_weight(tensor: GGUFTensor) -> Int8Weight:
    """A Q8_0 tensor's codes and scales, exactly as stored (ValueError naming it otherwise)."""
    if tensor.type_name != "Q8_0":
        raise ValueError(f"{tensor.name} is {tensor.type_name}: the 8-bit kernel takes Q8_0")
    num_rows = tensor.data.shape[0]
    blocks = tensor.data.reshape(num_rows, -1, 34)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(num_rows, -1))
    return Int8Weight(codes, scales)


def quantized_head(tensor: GGUFTensor) -> Int4Weight | Int8Weight | None:
    """An LM head as the file stores it, if a kernel takes its type (Q4_0, Q4_1, Q8_0); else None."""
    if tensor.type_name == "Q8_0":
        return int8_weight(tensor)
    return int4_weight(tensor) if tensor.type_name in SUPPORTED_TYPES else None


def projection(file: GGUFFile, layer: int, fused: str, config: ModelConfig) -> Int4Weight:
    """Layer `layer`'s fused projection `fused` ("qkv", "o", "gate_up", "down") as stored, q and k
    rows put back in Hugging Face order (ValueError naming a tensor that is missing or not 4-bit)."""
    parts = []
    for name in PROJECTIONS[fused]:
        tensor = file.tensors.get(f"blk.{layer}.{name}.weight")
        if tensor is None:
            raise ValueError(f"{file.path} has no tensor blk.{layer}.{name}.weight")
        weight = int4_weight(tensor)
        if name in ("attn_q", "attn_k"):
            heads = config.num_heads if name == "attn_q" else config.num_kv_heads
            weight = weight.rows(unpermute_rows(weight.shape[0], heads))
        parts.append(weight)
    return Int4Weight.stack_rows(parts)


def read_projections(path: Path, config: ModelConfig) -> list[dict[str, Int4Weight]]:
    """Per layer, its fused projections as stored in the GGUF file (ValueError naming a tensor
    without a 4-bit kernel)."""
    file = GGUFFile(path)
    return [{fused: projection(file, index, fused, config) for fused in PROJECTIONS}
            for index in range(config.num_layers)]


def read_lm_head(path: Path) -> Int4Weight | Int8Weight | None:
    """The LM head (`output.weight`, or `token_embd.weight` when the embedding is tied) as the
    file stores it, if that is Q4_0, Q4_1 or Q8_0; else None (the head then stays dense)."""
    tensors = GGUFFile(path).tensors
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    return None if tensor is None else quantized_head(tensor)


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary reordering of a q or k projection."""
    head_dim = num_rows // num_heads
    return torch.arange(num_rows).reshape(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(num_rows)
