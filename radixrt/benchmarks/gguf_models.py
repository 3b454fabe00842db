"""Random-weight Llama models written as GGUF files, as llama.cpp lays them out: for tests and
benchmarks of loading (never committed: they are rebuilt from a seed).

The tokenizer is the bundled SmolLM2's (its `tokenizer.*` metadata copied), so
transformers reads it as it reads any llama.cpp file. Weights are drawn from a
seeded normal distribution in Hugging Face row order, q and k rows permuted as
llama.cpp's converter does, then quantized with gguf's reference quantizer
(`gguf.quants.quantize`: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). K-quant
tensors (Q4_K, Q5_K, Q6_K), which gguf cannot quantize, are random valid
blocks whose weights are of the normal ones' size; `q4_k_m_types` (and `mix`:
Q4_K_M, Q5_K_M) gives llama.cpp's choice per tensor, so a K-quant file of any
size is written without a dense intermediate. Tensors are
drawn and written one at a time, so memory holds one tensor, not the model.
The metadata depends on the shape alone (no name, no file type), so files of
one shape share a start record. A vocabulary larger than the tokenizer's is
padded with unused tokens, so the token list matches the embedding's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from radixrt.model.gguf_file import GGUFFile

_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")  # fmt: skip


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    num_heads: int = 2
    num_kv_heads: int = 1
    vocab: int = 49152  # the bundled tokenizer's
    context: int = 2048
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


SMOLLM2_1_7B = LlamaShape(num_layers=24, hidden=2048, intermediate=8192, num_heads=32, num_kv_heads=32,
                          context=8192)  # fmt: skip
# Llama-3.1-8B's tensor shapes (its own vocabulary size; the token list is SmolLM2's, padded)
LLAMA_3_1_8B = LlamaShape(num_layers=32, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8,
                          vocab=128256, context=8192, tied=False)  # fmt: skip


# K-quant blocks: where their fp16 super-block scales sit (byte offsets; the rest of a block is
# codes and sub-block scales), and the largest sub-block scale times code, so that the weights
# stay below ~0.15 like the normal ones
_K_QUANT_SCALES = {"Q2_K": ((80, 82), 15 * 3), "Q3_K": ((108,), 32 * 4), "Q4_K": ((0, 2), 63 * 15),
                   "Q5_K": ((0, 2), 63 * 31), "Q6_K": ((208,), 128 * 32)}  # fmt: skip

# the types gguf's reference quantizer writes (`gguf.quants.quantize`)
_QUANTIZED = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

def _random_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random codes and sub-block scales in valid K-quant blocks, the fp16 scales small and finite."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block_size, block_bytes), dtype=np.uint8)
    offsets, largest = _K_QUANT_SCALES[qtype.name]
    for offset in offsets:
        scale = (rng.random((shape[0], shape[1] // block_size)) * 0.15 / largest).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(shape[0], -1)


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_types(shape: LlamaShape) -> dict[str, str]:
    """The type llama.cpp's quantizer gives each 2-D tensor of a Llama for ftype Q4_K_M.

    From `llama_tensor_get_type` (src/llama-quant.cpp; dense Llama, no imatrix,
    not a 70B): the head (the embedding when tied) Q6_K; attn_v and ffn_down
    Q6_K in the layers `_use_more_bits` picks, Q4_K elsewhere; every other
    matrix, an untied embedding included, Q4_K. A row length that is not a
    multiple of 256 falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0).
    Norms stay F32 and are not listed.
    """
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][0]
    fallback = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}

    def fit(kind: str, row_length: int) -> str:
        return kind if row_length % block == 0 else fallback[kind]

    h, n = shape.hidden, shape.num_layers
    types = {"token_embd.weight": fit("Q6_K" if shape.tied else "Q4_K", h)}
    if not shape.tied:
        types["output.weight"] = fit("Q6_K", h)
    for i in range(n):
        more = "Q6_K" if _use_more_bits(i, n) else "Q4_K"
        for name, kind, row_length in (("attn_q", "Q4_K", h), ("attn_k", "Q4_K", h), ("attn_v", more, h),
                                       ("attn_output", "Q4_K", shape.num_heads * shape.head_dim),
                                       ("ffn_gate", "Q4_K", h), ("ffn_up", "Q4_K", h),
                                       ("ffn_down", more, shape.intermediate)):
            types[f"blk.{i}.{name}.weight"] = fit(kind, row_length)
    return types


# llama.cpp's K-quant file types this module writes: Q4_K_M, and Q5_K_M (Q5_K where Q4_K_M has Q4_K)
MIXES = ("Q4_K_M", "Q5_K_M")


def mix_types(mix: str, shape: LlamaShape) -> dict[str, str]:
    """The per-tensor types of llama.cpp's file type `mix` (one of MIXES) for a model of `shape`."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, not {mix!r}")
    types = q4_k_m_types(shape)
    return types if mix == "Q4_K_M" else {name: "Q5_K" if kind == "Q4_K" else kind for name, kind in types.items()}


def write_q4_k_m_gguf(path: Path, shape: LlamaShape, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A random Llama of `shape` stored as llama.cpp's Q4_K_M mix (`q4_k_m_types`), K-quant blocks random."""
    return write_llama_gguf(path, shape, types=q4_k_m_types(shape), seed=seed, tokenizer_from=tokenizer_from)


def tensor_type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each type a GGUF file holds."""
    counts: dict[str, int] = {}
    for tensor in GGUFFile(path).tensors.values():
        counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    return dict(sorted(counts.items()))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a q or k projection (`LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(path: Path, shape: LlamaShape = LlamaShape(), projection_type: str = "Q4_0",
                     embedding_type: str = "Q8_0", types: dict[str, str] | None = None, seed: int = 0,
                     tokenizer_from: Path | None = None, omit: tuple[str, ...] = (), mix: str | None = None) -> Path:
    """A random Llama of `shape` at `path`: projections stored as `projection_type`, the
    embedding (and an untied head) as `embedding_type`, norms F32; `mix` (one of MIXES) sets
    every tensor's type as llama.cpp's file type does; `types` overrides the type of single
    tensors by GGUF name (K-quants Q2_K .. Q6_K, which gguf cannot quantize, as random valid
    blocks; any other type gguf cannot quantize as random bytes); `omit` leaves tensors out. `tokenizer_from`: the GGUF file whose
    tokenizer to copy (default: the bundled model's)."""
    if tokenizer_from is None:
        from radixrt.model.loader import bundled_model_path

        tokenizer_from = bundled_model_path()
    source = GGUFFile(tokenizer_from).metadata
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    tokens, token_types = _token_list(source, shape.vocab)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(source["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(source["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(source["tokenizer.ggml.add_bos_token"])
    writer.add_add_space_prefix(source["tokenizer.ggml.add_space_prefix"])
    writer.add_chat_template(source["tokenizer.chat_template"])
    rng = np.random.default_rng(seed)
    types = {**(mix_types(mix, shape) if mix is not None else {}), **(types or {})}
    # (name, kind, dims, values): `values` draws the dense tensor when its type needs one; a
    # K-quant tensor draws only its blocks, so a large K-quant model never exists dense
    plan: list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]] = []

    def add(name: str, dims: tuple[int, ...], kind: str, values: Callable[[], np.ndarray]) -> None:
        if name not in omit:
            plan.append((name, types.get(name, kind), dims, values))

    def normal(*dims: int, std: float = 0.05, mean: float = 0.0) -> Callable[[], np.ndarray]:
        return lambda: rng.standard_normal(dims, dtype=np.float32) * std + mean

    def permuted(rows: int, heads: int) -> Callable[[], np.ndarray]:
        return lambda: llama_cpp_permute(normal(rows, shape.hidden)(), heads)

    h, head = shape.hidden, shape.head_dim
    add("token_embd.weight", (shape.vocab, h), embedding_type, normal(shape.vocab, h, std=0.5))
    add("output_norm.weight", (h,), "F32", normal(h, std=0.1, mean=1.0))
    if not shape.tied:
        add("output.weight", (shape.vocab, h), embedding_type, normal(shape.vocab, h))
    for i in range(shape.num_layers):
        block = f"blk.{i}."
        q_rows, kv_rows = shape.num_heads * head, shape.num_kv_heads * head
        add(block + "attn_norm.weight", (h,), "F32", normal(h, std=0.1, mean=1.0))
        add(block + "ffn_norm.weight", (h,), "F32", normal(h, std=0.1, mean=1.0))
        add(block + "attn_q.weight", (q_rows, h), projection_type, permuted(q_rows, shape.num_heads))
        add(block + "attn_k.weight", (kv_rows, h), projection_type, permuted(kv_rows, shape.num_kv_heads))
        add(block + "attn_v.weight", (kv_rows, h), projection_type, normal(kv_rows, h))
        add(block + "attn_output.weight", (h, q_rows), projection_type, normal(h, q_rows))
        add(block + "ffn_gate.weight", (shape.intermediate, h), projection_type, normal(shape.intermediate, h))
        add(block + "ffn_up.weight", (shape.intermediate, h), projection_type, normal(shape.intermediate, h))
        add(block + "ffn_down.weight", (h, shape.intermediate), projection_type, normal(h, shape.intermediate))
    # first every tensor's header entry (sizes follow from type and shape), then the data in that order
    for name, kind, dims, _ in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims[:-1], dtype=np.int64)) * dims[-1] // block_size * block_bytes
        writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, kind, dims, values in plan:
        writer.write_tensor_data(_encode(kind, dims, values, rng))
    writer.close()
    return path


def written(writer: gguf.GGUFWriter, path: Path) -> Path:
    """`path`, once `writer`'s header, metadata and the tensors given to `add_tensor` are in it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _token_list(source: Mapping[str, Any], vocab: int) -> tuple[list[str], list[int]]:
    """The source's tokens and their types, cut or padded to `vocab`: a padding token is unused
    (llama.cpp and transformers load it; no text maps to it)."""
    tokens = list(source["tokenizer.ggml.tokens"][:vocab])
    token_types = list(source["tokenizer.ggml.token_type"][:vocab])
    padding = range(len(tokens), vocab)
    tokens += [f"<unused_{i}>" for i in padding]
    token_types += [int(gguf.TokenType.UNUSED)] * len(padding)
    return tokens, token_types


def _encode(kind: str, dims: tuple[int, ...], values: Callable[[], np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes as stored: random blocks for a K-quant, else `values` quantized (or cast)."""
    if kind in _K_QUANT_SCALES:
        return _random_blocks(gguf.GGMLQuantizationType[kind], dims, rng)
    if kind == "F32":
        return values().astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _QUANTIZED:  # a type no writer here quantizes: random bytes of its block size
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (dims[0], dims[1] // block_size * block_bytes), dtype=np.uint8)
    return gguf.quants.quantize(values(), qtype)
