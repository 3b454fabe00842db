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

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from radixrt.model.config import ModelConfig

if TYPE_CHECKING:
    import gguf  # imported where a GGUF file is parsed: 0.2 s that a start from the cache does not need

GROUP_SIZE = 32
SUPPORTED_TYPES = ("Q4_0", "Q4_1")
LM_HEAD_TYPES = (*SUPPORTED_TYPES, "Q8_0")
SUPPORTED_ARCHITECTURES = ("llama",)

# Our fused projections and the GGUF tensors they are made of, in row order.
_PROJECTIONS = {
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


CACHE_FILE = "int4_projections.safetensors"


def has_int4_projections(path: Path) -> bool:
    """Whether `read_projections` can read this file: a supported architecture, every projection 4-bit."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    if _architecture(reader) not in SUPPORTED_ARCHITECTURES:
        return False
    suffixes = {f"{name}.weight" for names in _PROJECTIONS.values() for name in names}
    projections = [t for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".", 2)[2] in suffixes]
    return bool(projections) and all(t.tensor_type.name in SUPPORTED_TYPES for t in projections)


def load_projections(gguf_path: Path, cache_folder: Path, config: ModelConfig) -> NativeWeights:
    """`read_projections` and `read_lm_head`, cached beside the converted dense weights: parsing
    the GGUF file's blocks takes seconds, reading the cached codes a fraction of one."""
    cached = cache_folder / CACHE_FILE
    if cached.is_file():
        tensors = load_file(cached)
        if "lm_head.bits" in tensors:  # older caches kept the head otherwise: rebuilt once
            return NativeWeights(
                [{name: _cached(tensors, f"{i}.{name}") for name in _PROJECTIONS} for i in range(config.num_layers)],
                _cached_head(tensors),
            )
    native = NativeWeights(read_projections(gguf_path, config), read_lm_head(gguf_path))
    flat = {
        f"{i}.{name}.{part}": getattr(weight, part).contiguous()
        for i, layer in enumerate(native.layers)
        for name, weight in layer.items()
        for part in ("codes", "scales", "offsets")
    }
    head = native.lm_head
    flat["lm_head.bits"] = torch.tensor(0 if head is None else 8 if isinstance(head, Int8Weight) else 4)
    if head is not None:
        flat.update({f"lm_head.{part}": getattr(head, part).contiguous() for part in ("codes", "scales")})
    if isinstance(head, Int4Weight):
        flat["lm_head.offsets"] = head.offsets.contiguous()
    tmp = cache_folder / f".{CACHE_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    save_file(flat, tmp)
    os.replace(tmp, cached)  # readers see the whole file or none
    return native


def _cached(tensors: dict[str, torch.Tensor], key: str) -> Int4Weight:
    return Int4Weight(tensors[f"{key}.codes"], tensors[f"{key}.scales"], tensors[f"{key}.offsets"])


def _cached_head(tensors: dict[str, torch.Tensor]) -> Int4Weight | Int8Weight | None:
    bits = int(tensors["lm_head.bits"])
    if bits == 8:
        return Int8Weight(tensors["lm_head.codes"], tensors["lm_head.scales"])
    return _cached(tensors, "lm_head") if bits == 4 else None


def read_lm_head(path: Path) -> Int4Weight | Int8Weight | None:
    """The LM head (`output.weight`, or `token_embd.weight` when the embedding is tied) as the
    file stores it, if that is Q4_0, Q4_1 or Q8_0; else None (the head then stays dense)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    tensor = tensors.get(name)
    if tensor is None or tensor.tensor_type.name not in LM_HEAD_TYPES:
        return None
    if tensor.tensor_type.name == "Q8_0":
        return _read_q8_0(tensor)
    return _read(tensors, name)


def _read_q8_0(tensor: gguf.ReaderTensor) -> Int8Weight:
    blocks = np.asarray(tensor.data, dtype=np.uint8)
    num_rows = blocks.shape[0]
    blocks = blocks.reshape(num_rows, -1, 34)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(num_rows, -1))
    return Int8Weight(codes, scales)


def read_projections(path: Path, config: ModelConfig) -> list[dict[str, Int4Weight]]:
    """Per layer, its fused projections ("qkv", "o", "gate_up", "down") as stored in the GGUF file.

    Raises ValueError naming the tensor when a projection is stored in a type
    without a 4-bit kernel, or the file's architecture is not supported.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    architecture = _architecture(reader)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"weights='native' supports GGUF architectures {', '.join(SUPPORTED_ARCHITECTURES)}; "
            f"{path.name} is {architecture!r}"
        )
    tensors = {t.name: t for t in reader.tensors}
    layers = []
    for index in range(config.num_layers):
        layer = {}
        for fused, names in _PROJECTIONS.items():
            parts = []
            for name in names:
                weight = _read(tensors, f"blk.{index}.{name}.weight")
                if name == "attn_q":
                    weight = weight.rows(_unpermute_rows(weight.shape[0], config.num_heads))
                elif name == "attn_k":
                    weight = weight.rows(_unpermute_rows(weight.shape[0], config.num_kv_heads))
                parts.append(weight)
            layer[fused] = Int4Weight.stack_rows(parts)
        layers.append(layer)
    return layers


def _architecture(reader: gguf.GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return "unknown"
    return bytes(field.parts[field.data[0]]).decode()


def _read(tensors: dict[str, gguf.ReaderTensor], name: str) -> Int4Weight:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"the GGUF file has no tensor {name}")
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f"weights='native' needs 4-bit projections ({', '.join(SUPPORTED_TYPES)}); {name} is {kind}"
        )
    blocks = np.asarray(tensor.data, dtype=np.uint8)
    num_rows = blocks.shape[0]
    block_bytes = 20 if kind == "Q4_1" else 18
    blocks = blocks.reshape(num_rows, -1, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offsets = -8 * scales
    packed = blocks[..., block_bytes - 16 :]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(num_rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets))


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary reordering of a q or k projection."""
    head_dim = num_rows // num_heads
    return torch.arange(num_rows).reshape(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(num_rows)
