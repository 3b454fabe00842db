"""Random-weight Llama models written as GGUF files, as llama.cpp lays them out: for tests and
benchmarks of loading (never committed: they are rebuilt from a seed).

The tokenizer is the bundled SmolLM2's (its `tokenizer.*` metadata copied), so
transformers reads it as it reads any llama.cpp file. Weights are drawn from a
seeded normal distribution in Hugging Face row order, q and k rows permuted as
llama.cpp's converter does, then quantized with gguf's reference quantizer
(`gguf.quants.quantize`: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); K-quants,
which gguf cannot quantize, are random valid blocks whose weights are of the
same small size. `mix` writes llama.cpp's per-tensor choices of a K-quant
file type (Q4_K_M, Q5_K_M). The metadata depends on the shape alone (no name,
no file type), so files of one shape share a start record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


# K-quant blocks: where their fp16 super-block scales sit (byte offsets; the rest of a block is
# codes and sub-block scales), and the largest sub-block scale times code, so that the weights
# stay below ~0.15 like the normal ones
_K_QUANT_SCALES = {"Q2_K": ((80, 82), 15 * 3), "Q3_K": ((108,), 32 * 4), "Q4_K": ((0, 2), 63 * 15),
                   "Q5_K": ((0, 2), 63 * 31), "Q6_K": ((208,), 128 * 32)}  # fmt: skip

# the types gguf's reference quantizer writes (`gguf.quants.quantize`)
_QUANTIZED = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# llama.cpp's K-quant file types (`llama_tensor_get_type`): every tensor of the base type, but
# attn_v and ffn_down of the layers `_more_bits` picks and the output in the richer one
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def mix_types(mix: str, shape: LlamaShape) -> dict[str, str]:
    """The per-tensor types of llama.cpp's file type `mix` (one of MIXES) for a model of `shape`."""
    base, richer = MIXES[mix]
    types = {"token_embd.weight": base, "output.weight": richer}
    for i in range(shape.num_layers):
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{name}.weight"] = base
        for name in ("attn_v", "ffn_down"):
            types[f"blk.{i}.{name}.weight"] = richer if _more_bits(i, shape.num_layers) else base
    return types


def _random_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random codes and sub-block scales in valid K-quant blocks, the fp16 scales small and finite."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block_size, block_bytes), dtype=np.uint8)
    offsets, largest = _K_QUANT_SCALES[qtype.name]
    for offset in offsets:
        scale = (rng.random((shape[0], shape[1] // block_size)) * 0.15 / largest).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(shape[0], -1)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a q or k projection (`LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(path: Path, shape: LlamaShape = LlamaShape(), projection_type: str = "Q4_0",
                     embedding_type: str = "Q8_0", types: dict[str, str] | None = None, seed: int = 0,
                     tokenizer_from: Path | None = None, omit: tuple[str, ...] = (), mix: str | None = None) -> Path:
    """A random Llama of `shape` at `path`: projections stored as `projection_type`, the
    embedding (and an untied head) as `embedding_type`, norms F32; `mix` (a key of MIXES) sets
    every tensor's type as llama.cpp's file type does; `types` overrides the type of single
    tensors by GGUF name (K-quants Q2_K .. Q6_K, which gguf cannot quantize, as random valid
    blocks; any other type as random bytes); `omit` leaves tensors out. `tokenizer_from`: the GGUF file whose tokenizer to copy
    (default: the bundled model's)."""
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
    writer.add_token_list(source["tokenizer.ggml.tokens"][: shape.vocab])
    writer.add_token_types(source["tokenizer.ggml.token_type"][: shape.vocab])
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

    def add(name: str, values: np.ndarray, kind: str) -> None:
        kind = types.get(name, kind)
        if name in omit:
            return
        if kind in _K_QUANT_SCALES:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, _random_blocks(qtype, values.shape, rng), raw_dtype=qtype)
            return
        if kind == "F32":
            writer.add_tensor(name, values.astype(np.float32))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        if kind not in _QUANTIZED:  # a type no writer here quantizes: random bytes of its block size
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block_size * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            return
        writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)

    def normal(*dims: int, std: float = 0.05) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32) * std

    h, head = shape.hidden, shape.head_dim
    add("token_embd.weight", normal(shape.vocab, h, std=0.5), embedding_type)
    add("output_norm.weight", 1 + normal(h, std=0.1), "F32")
    if not shape.tied:
        add("output.weight", normal(shape.vocab, h), embedding_type)
    for i in range(shape.num_layers):
        block = f"blk.{i}."
        add(block + "attn_norm.weight", 1 + normal(h, std=0.1), "F32")
        add(block + "ffn_norm.weight", 1 + normal(h, std=0.1), "F32")
        add(block + "attn_q.weight", llama_cpp_permute(normal(shape.num_heads * head, h), shape.num_heads),
            projection_type)
        add(block + "attn_k.weight", llama_cpp_permute(normal(shape.num_kv_heads * head, h), shape.num_kv_heads),
            projection_type)
        add(block + "attn_v.weight", normal(shape.num_kv_heads * head, h), projection_type)
        add(block + "attn_output.weight", normal(h, shape.num_heads * head), projection_type)
        add(block + "ffn_gate.weight", normal(shape.intermediate, h), projection_type)
        add(block + "ffn_up.weight", normal(shape.intermediate, h), projection_type)
        add(block + "ffn_down.weight", normal(h, shape.intermediate), projection_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
