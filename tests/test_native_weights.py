"""weights="native": a GGUF file's 4-bit projections, kept as stored and multiplied by directly."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixrt import Runtime
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.model import gguf_int4, linear
from radixrt.model.executors import LayerByLayer
from radixrt.model.gguf_file import GGUFTensor
from radixrt.model.gguf_int4 import Int4Weight, Int8Weight, read_lm_head, read_projections
from radixrt.model.loader import bundled_model_path, load_model


def fake_tensor(kind: str, rows: list[bytes], name: str = "w") -> GGUFTensor:
    data = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
    return GGUFTensor(name, kind, (len(rows), 32), data)


def nibbles(codes: list[int]) -> bytes:
    """32 codes as GGML packs them: byte j = element j (low nibble) | element j + 16 (high)."""
    return bytes(codes[j] | codes[j + 16] << 4 for j in range(16))


def test_q4_1_and_q4_0_blocks_are_read_as_ggml_writes_them():
    codes = [(7 * i + 3) % 16 for i in range(32)]
    q4_1 = struct.pack("<ee", 0.25, -1.5) + nibbles(codes)
    weight = gguf_int4.int4_weight(fake_tensor("Q4_1", [q4_1]))
    assert weight.codes.tolist() == [codes]
    assert torch.equal(weight.dequantize(), torch.tensor([[0.25 * q - 1.5 for q in codes]]))
    q4_0 = struct.pack("<e", 0.5) + nibbles(codes)
    weight = gguf_int4.int4_weight(fake_tensor("Q4_0", [q4_0]))
    assert torch.equal(weight.dequantize(), torch.tensor([[0.5 * (q - 8) for q in codes]]))


def test_a_q8_0_block_is_read_as_stored_and_splits_into_two_4bit_weights():
    values = [-128, 127, 0, -1, 1, 64, -65, 15, 16, -16, *range(-40, 70, 5)]
    assert len(values) == 32
    block = struct.pack("<e", 0.125) + np.array(values, dtype=np.int8).tobytes()
    weight = gguf_int4.int8_weight(fake_tensor("Q8_0", [block]))
    assert weight.codes.tolist() == [values]
    assert torch.equal(weight.dequantize(), torch.tensor([[0.125 * q for q in values]]))
    high, low = weight.as_int4_pair()
    assert high.codes.max() <= 15 and low.codes.max() <= 15
    assert torch.equal(high.dequantize() + low.dequantize(), weight.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # radixrt's kernel where it runs, torch's
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_lm_heads_are_the_dense_product_in_float32(dtype, bits):
    weight = random_int4(64, 96, seed=1) if bits == 4 else random_int8(64, 96, seed=2)
    x = torch.randn(3, 96).to(dtype)
    out = linear.lm_head(weight, dtype)(x)
    expected = F.linear(x.float(), weight.dequantize())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_other_quantization_types_are_refused_by_name():
    with pytest.raises(ValueError, match=r"blk\.0\.w is Q8_0: the 4-bit kernels take Q4_0, Q4_1"):
        gguf_int4.int4_weight(fake_tensor("Q8_0", [bytes(34)], name="blk.0.w"))
    with pytest.raises(ValueError, match=r"blk\.0\.w is Q4_0: the 8-bit kernel takes Q8_0"):
        gguf_int4.int8_weight(fake_tensor("Q4_0", [bytes(18)], name="blk.0.w"))


def random_int4(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    generator = torch.Generator().manual_seed(seed)
    groups = cols // gguf_int4.GROUP_SIZE
    return Int4Weight(
        torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8),
        (torch.rand(rows, groups, generator=generator) * 0.02).half().float(),
        (torch.randn(rows, groups, generator=generator) * 0.05).half().float(),
    )


def random_int8(rows: int, cols: int, seed: int = 0) -> Int8Weight:
    generator = torch.Generator().manual_seed(seed)
    return Int8Weight(
        torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8),
        (torch.rand(rows, cols // gguf_int4.GROUP_SIZE, generator=generator) * 0.002).half().float(),
    )


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_int4_linear_equals_the_dense_product_of_its_weights(dtype, tolerance):
    weight = random_int4(96, 128)
    bias = torch.randn(96).to(dtype)
    x = torch.randn(5, 128).to(dtype)
    expected = F.linear(x.float(), weight.dequantize(), bias.float())
    out = linear.int4(weight, dtype, bias)(x)
    assert out.dtype == dtype and out.shape == (5, 96)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.slow
def test_native_projections_are_exactly_the_dense_weights(smollm2):
    layers = read_projections(bundled_model_path(), smollm2.config)
    for layer, native in zip(smollm2.model.layers, layers):
        for name, dense in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", layer.gate_up_proj),
                            ("down", layer.down_proj)):
            assert torch.equal(native[name].dequantize(), dense), f"layer {layer.index} {name}"
    head = read_lm_head(bundled_model_path())
    assert isinstance(head, Int8Weight), "the bundled file stores its (tied) LM head as Q8_0"
    assert torch.equal(head.dequantize(), smollm2.model.lm_head)


@pytest.mark.slow
def test_native_model_is_close_to_dense():
    dense = load_model(None, dtype="bfloat16")
    native = load_model(None, dtype="bfloat16", weights="native")
    assert native.path == bundled_model_path(), "read from the GGUF file itself"
    ids = native.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))])
    logits = {}
    for label, loaded in (("dense", dense), ("native", native)):
        from radixrt.kernels.registry import create_backend
        from radixrt.memory import KVCache

        config = loaded.config
        cache = KVCache(config.kv_shape(torch.bfloat16), 64)
        backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
        with torch.inference_mode():
            hidden = loaded.model.forward(batch, backend, LayerByLayer(loaded.model, backend, False).plan(batch))
            logits[label] = loaded.model.compute_logits(hidden[-1:]).log_softmax(-1)[0]
    best = int(logits["dense"].argmax())
    # The dense model rounds each weight to bf16, the native one does not: the dense model's
    # choice stays (near-)top for the native one.
    assert logits["native"].max() - logits["native"][best] < 0.5
    assert torch.corrcoef(torch.stack([logits["dense"], logits["native"]]).float())[0, 1] > 0.99


@pytest.mark.slow
def test_native_weights_hold_no_dense_projections_and_large_steps_run_on_them():
    dense = load_model(None, dtype="bfloat16", weights="dense")
    native = load_model(None, dtype="bfloat16", weights="native")
    from radixrt.kernels.registry import create_backend
    from radixrt.memory import KVCache
    from radixrt.model.runner import ModelRunner

    for layer in native.model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert getattr(layer, name).numel() == 0, f"layer {layer.index} keeps a dense {name}"
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.model.parameters())
    native_bytes = sum(p.numel() * p.element_size() for p in native.model.parameters())
    assert native_bytes < dense_bytes / 3, "the native model's parameters are the embedding and norms"
    ids = list(range(100, 300))  # 200 tokens: past the 4-bit kernels' C step sizes
    logits = []
    for loaded in (dense, native):
        config = loaded.config
        cache = KVCache(config.kv_shape(torch.bfloat16), 256)
        backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
        runner = ModelRunner(loaded.model, cache, backend, deterministic=False)
        logits.append(runner.forward(ForwardBatch.build([ids], [0], [torch.arange(len(ids))]))[-1].float())
    assert torch.corrcoef(torch.stack(logits))[0, 1] > 0.99


@pytest.mark.slow
def test_runtime_with_native_weights_generates():
    with Runtime(weights="native", max_total_tokens=4096) as rt:
        out = rt.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 8 and out["text"]


def test_native_weights_need_a_gguf_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="weights='native' needs a GGUF model.*Hugging Face folder"):
        load_model(tiny_llama_dir, weights="native")
    with pytest.raises(ValueError, match="weights must be one of auto, dense, native"):
        load_model(tiny_llama_dir, weights="int3")
    with pytest.raises(ValueError, match="weights must be one of"):
        Runtime(tiny_llama_dir, weights="int3")


@pytest.mark.slow
def test_auto_is_native_only_for_a_4bit_gguf_in_bfloat16(tiny_llama_dir):
    assert load_model(None, dtype="bfloat16", weights="auto").weights == "native"
    assert load_model(None, dtype="float32", weights="auto").weights == "dense"
    assert load_model(tiny_llama_dir, dtype="bfloat16", weights="auto").weights == "dense"
