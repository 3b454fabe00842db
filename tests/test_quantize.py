"""Quantizing a dense model at load (`quantize="q8_0" | "q4_0"`), and bf16 folders loaded without a copy.

The tiny models: the session's random Llama folder rewritten in bf16, and a random F16 GGUF
(`radixrt.benchmarks.gguf_models`). What is checked: the blocks equal gguf's reference
quantizer's bit for bit, packed as a GGUF file of those blocks packs; the logits stay near a
float32 run on the dequantized weights; no dense projection is left; deterministic steps stay
batch-invariant; bad inputs fail before anything loads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixrt import Runtime
from radixrt.benchmarks.gguf_models import LlamaShape, write_llama_gguf
from radixrt.kernels import cpu
from radixrt.model import quantize as quantizer
from radixrt.model.checkpoint import checkpoint_weights
from radixrt.model.gguf_file import GGUFTensor
from radixrt.model.gguf_int4 import int4_weight, int8_weight
from radixrt.model.llama import checkpoint_projections
from radixrt.model.loader import load_model
from radixrt.paths import CACHE_ENV_VAR

needs_kernels = pytest.mark.skipif(cpu.quantized_matmul() is None or cpu.decode_stack() is None,
                                   reason="quantize runs on radixrt's quantized kernels (AVX512-BF16)")
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
PROMPTS = ["The quick brown fox jumps", "A radix tree shares", "Paged attention stores each token's keys",
           "What is the age of John Doe?"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV_VAR, str(tmp_path_factory.mktemp("radixrt-cache")))
        yield


def rewritten(source: Path, target: Path, cast) -> Path:
    """A copy of the folder `source` with every tensor replaced by `cast(name, tensor)`."""
    shutil.copytree(source, target)
    state = load_file(str(source / "model.safetensors"))
    save_file({name: cast(name, tensor).contiguous() for name, tensor in state.items()},
              str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / ".radixrt").exists() and shutil.rmtree(target / ".radixrt")
    return target


@pytest.fixture(scope="module")
def bf16_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rewritten(tiny_llama_dir, tmp_path_factory.mktemp("bf16") / "model", lambda _, t: t.to(torch.bfloat16))


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = LlamaShape(vocab=1024)
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "f16.gguf", shape, projection_type="F16",
                            embedding_type="F16")


def reference(values: torch.Tensor, kind: str):
    """gguf's reference quantizer's blocks of `values`, read back as codes and scales."""
    blocks = gguf.quants.quantize(values.float().numpy(), GGUF_TYPES[kind])
    tensor = GGUFTensor("reference", kind.upper(), tuple(values.shape), blocks)
    return int8_weight(tensor) if kind == "q8_0" else int4_weight(tensor)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_equal_ggufs_reference_quantizer_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((48, 256)).astype(np.float32) * rng.choice([1e-6, 1e-3, 0.05, 3.0, 300.0], (48, 1))
    rows[0, :32] = 0  # an all-zero block
    rows[1, :32] = 0.5  # ties: the first of the largest |x|, halves rounded away from zero
    rows[1, 7] = -0.5
    rows[2] = rng.integers(-127, 128, 256) * 2.0**-7  # exact multiples of the scale
    rows[3, :32] = np.float32(2.0**-20) * rng.standard_normal(32).astype(np.float32)  # float16-subnormal scales
    for values in (torch.from_numpy(rows), torch.from_numpy(rows).to(torch.bfloat16)):
        ours = quantizer.quantize_q8_0(values) if kind == "q8_0" else quantizer.quantize_q4_0(values)
        expected = reference(values, kind)
        assert torch.equal(ours.codes, expected.codes) and torch.equal(ours.scales, expected.scales)
        if kind == "q4_0":
            assert torch.equal(ours.offsets, expected.offsets)


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_packed_weights_are_those_of_a_gguf_file_of_the_reference_blocks(kind):
    matmul = cpu.quantized_matmul()
    rows = torch.randn(64, 192, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = reference(rows, kind)
    packed = (matmul.pack_int8(expected.codes, expected.scales) if kind == "q8_0"
              else matmul.pack_int4(expected.codes, expected.scales, expected.offsets))  # fmt: skip
    ours = quantizer.pack_quantized(matmul, rows, 8 if kind == "q8_0" else 4)
    assert ours.bits == packed.bits and torch.equal(ours.data, packed.data)


def live_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def norms_bytes(config) -> int:
    return (1 + 2 * config.num_layers) * config.hidden_size * 2


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_bf16_folder_quantized_keeps_no_dense_projection_and_packs_the_reference_blocks(bf16_dir, kind):
    loaded = load_model(bf16_dir, dtype="bfloat16", quantize=kind)
    model, config = loaded.model, loaded.config
    assert loaded.weights == kind
    assert live_bytes(model) == norms_bytes(config), "norms only: the tied head is the embedding, quantized"
    checkpoint = checkpoint_weights(bf16_dir)
    matmul = cpu.quantized_matmul()
    layer = model.layers[1]
    parts = checkpoint_projections(config, 1)["gate_up"]
    dense = torch.cat([checkpoint[name] for name, _ in parts])
    expected = reference(dense, kind)
    expected_packed = (matmul.pack_int8(expected.codes, expected.scales) if kind == "q8_0"
                       else matmul.pack_int4(expected.codes, expected.scales, expected.offsets))  # fmt: skip
    assert torch.equal(gate_up_of(layer).data, expected_packed.data)
    head = reference(checkpoint["model.embed_tokens.weight"], "q8_0")
    assert torch.equal(model._invariant_lm_head.packed.data, matmul.pack_int8(head.codes, head.scales).data)
    assert (model._stack is not None) == (kind == "q4_0"), "4-bit layers run the whole-step kernel"


def gate_up_of(layer) -> cpu.PackedWeight:
    return layer.int4_steps.gate_up if layer.int4_steps is not None else layer.packed_projections["gate_up"]
