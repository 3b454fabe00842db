"""Quantizing a dense model at load (`quantize="q8_0" | "q4_0"`), and bf16 folders loaded without a copy.

The tiny models: the session's random Llama folder rewritten in bf16, and a random F16 GGUF
(`radixrt.benchmarks.gguf_models`). What is checked: the blocks equal gguf's reference
quantizer's bit for bit, packed as a GGUF file of those blocks packs; the logits stay near a
float32 run on the dequantized weights; no dense projection is left; deterministic steps stay
batch-invariant; bad inputs fail before anything loads.
"""

from __future__ import annotations

import dataclasses
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
from radixrt.model.executors import WholeStep
from radixrt.model.llama import LlamaForCausalLM, checkpoint_projections
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
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "f16.gguf", projection_type="F16",
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
    assert WholeStep.stack_for(model) is not None, "layers of any packed format run the whole-step kernel"


def gate_up_of(layer) -> cpu.PackedWeight:
    return layer.int4_steps.gate_up if layer.int4_steps is not None else layer.packed_projections["gate_up"]


def dequantized(kind: str):
    """A cast for `rewritten`: projections through `kind`'s blocks, the tied head through Q8_0's, float32."""

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        projection = name.endswith("_proj.weight")
        if not projection and name != "model.embed_tokens.weight":
            return tensor.float()
        qtype = GGUF_TYPES[kind if projection else "q8_0"]
        blocks = gguf.quants.quantize(tensor.float().numpy(), qtype)
        return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(tensor.shape).copy())

    return cast


def prompt_logits(loaded, text: str) -> torch.Tensor:
    from radixrt.kernels.forward_batch import ForwardBatch
    from radixrt.kernels.registry import create_backend
    from radixrt.memory import KVCache
    from radixrt.model.runner import ModelRunner

    ids = loaded.tokenizer.encode(text)
    config = loaded.config
    cache = KVCache(config.kv_shape(loaded.model.dtype), 256)
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(loaded.model, cache, backend, deterministic=False)
    return runner.forward(ForwardBatch.build([ids], [0], [torch.arange(len(ids))]), torch.arange(len(ids))).float()


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_logits_stay_near_a_float32_run_on_the_dequantized_weights(bf16_dir, tmp_path, kind):
    """The quantized model multiplies bf16 activations by the blocks' exact values (8-bit: the
    activations as 16-bit integers per block) with float32 sums; a float32 run on the dequantized
    weights differs from it by the activations' rounding alone, so its logits are no further from
    that run than a dense bf16 model's are from the same model in float32 (x1.5, the margin)."""
    quantized = load_model(bf16_dir, dtype="bfloat16", quantize=kind)
    dequantized_model = load_model(rewritten(bf16_dir, tmp_path / "dequantized", dequantized(kind)), dtype="float32")
    original, original_bf16 = (load_model(bf16_dir, dtype=dtype) for dtype in ("float32", "bfloat16"))
    for text in ("The quick brown fox", "The quick brown fox jumps over the lazy dog. " * 4):  # C steps, prefill rows
        ours, expected = prompt_logits(quantized, text), prompt_logits(dequantized_model, text)
        unquantized = prompt_logits(original, text)
        rounding = (prompt_logits(original_bf16, text) - unquantized).abs().max()
        assert (ours - expected).abs().max() <= 1.5 * rounding
        if kind == "q4_0":  # 4-bit blocks move the logits far more than the rounding: what is run is them
            assert (ours - unquantized).abs().max() > 4 * (ours - expected).abs().max()


@needs_kernels
def test_an_f16_gguf_is_quantized_from_its_own_values(f16_gguf):
    from radixrt.model.gguf_file import GGUFFile

    file = GGUFFile(f16_gguf)
    matmul = cpu.quantized_matmul()
    for kind in ("q8_0", "q4_0"):
        loaded = load_model(f16_gguf, dtype="bfloat16", quantize=kind)
        model, config = loaded.model, loaded.config
        assert loaded.weights == kind and live_bytes(model) == norms_bytes(config)
        qkv = quantizer.gguf_projection(file, config)(1, "qkv")  # F16 values, q and k rows in HF order
        assert qkv.dtype == torch.float16
        expected = reference(qkv, kind)
        packed = (matmul.pack_int8(expected.codes, expected.scales) if kind == "q8_0"
                  else matmul.pack_int4(expected.codes, expected.scales, expected.offsets))  # fmt: skip
        layer = model.layers[1]
        stored = layer.int4_steps.qkv if layer.int4_steps is not None else layer.packed_projections["qkv"]
        assert torch.equal(stored.data, packed.data)
        head = reference(quantizer.gguf_rows(file.tensors["token_embd.weight"]), "q8_0")
        assert torch.equal(model._invariant_lm_head.packed.data, matmul.pack_int8(head.codes, head.scales).data)


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_deterministic_outputs_do_not_depend_on_the_batch(bf16_dir, kind):
    runtime = Runtime(bf16_dir, quantize=kind, deterministic=True, max_total_tokens=2048)
    try:
        params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        together = [out["output_ids"] for out in runtime.generate(PROMPTS, params)]
        runtime.flush_cache()
        alone = [runtime.generate(prompt, params)["output_ids"] for prompt in PROMPTS]
    finally:
        runtime.shutdown()
    assert together == alone


@pytest.mark.parametrize("options, message", [
    ({"quantize": "q5_0"}, r"quantize must be one of q8_0, q4_0 \(or None\), got 'q5_0'"),
    ({"quantize": "q4_0", "device": "cuda"},
     r"quantize='q4_0' runs on radixrt's quantized CPU kernels; device is 'cuda'"),
    ({"quantize": "q8_0", "weights": "native"}, r"quantize='q8_0' quantizes a dense model; weights='native'"),
    ({"quantize": "q8_0", "dtype": "float32"}, r"quantize='q8_0' needs radixrt's quantized kernels: dtype bfloat16"),
])  # fmt: skip
def test_bad_inputs_are_refused_before_anything_loads(bf16_dir, options, message, monkeypatch):
    monkeypatch.setattr("radixrt.model.loader._config_and_tokenizer", lambda *a: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=message):
        load_model(bf16_dir, **options)


def test_an_already_quantized_gguf_is_refused_naming_its_types(tmp_path, monkeypatch):
    q4 = write_llama_gguf(tmp_path / "q4.gguf", LlamaShape(num_layers=1))
    monkeypatch.setattr("radixrt.model.gguf_loader.config_of", lambda *a: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"quantize='q4_0' quantizes a dense model .* q4\.gguf is already "
                                         r"quantized: Q4_0, Q8_0 \(e\.g\. "):  # fmt: skip
        load_model(q4, quantize="q4_0")
    with pytest.raises(ValueError, match=r"quantize must be one of q8_0, q4_0"):
        Runtime(q4, quantize="int4")


def test_the_cli_takes_quantize_before_or_after_the_command(tiny_llama_dir):
    from radixrt.cli import _runtime_options, build_parser

    args = build_parser().parse_args(["--quantize", "q4_0", "generate", "hi"])
    assert _runtime_options(args)["quantize"] == "q4_0"
    args = build_parser().parse_args(["generate", "hi", "--quantize", "q8_0"])
    assert _runtime_options(args)["quantize"] == "q8_0"
    assert _runtime_options(build_parser().parse_args(["generate", "hi"]))["quantize"] is None
    done = subprocess.run([sys.executable, "-m", "radixrt.cli", "generate", "hi", "--quantize", "q3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--quantize: invalid choice: 'q3'" in done.stderr


@needs_kernels
def test_the_cli_generates_from_a_quantized_folder(bf16_dir):
    done = subprocess.run([sys.executable, "-m", "radixrt.cli", "generate", "hello", "--model", str(bf16_dir),
                           "--device", "cpu", "--dtype", "bfloat16", "--quantize", "q4_0", "--max-new-tokens", "4",
                           "--ignore-eos", "--json"], capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"completion_tokens": 4' in done.stdout


def mapped_from(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from the file `path` (Linux's /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_bf16_folder_tensors_become_the_parameters_without_a_copy(bf16_dir):
    loaded = load_model(bf16_dir, dtype="bfloat16")
    model, layer = loaded.model, loaded.model.layers[0]
    ranges = mapped_from(bf16_dir / "model.safetensors")

    def in_file(tensor: torch.Tensor) -> bool:
        return any(start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end for start, end in ranges)

    assert in_file(model.embed_tokens) and model.lm_head is model.embed_tokens
    assert in_file(model.norm) and in_file(layer.input_norm) and in_file(layer.o_proj) and in_file(layer.down_proj)
    # gate and up lie back to back in a name-sorted file: one view; q, k, v do not (k_proj, o_proj, q_proj, v_proj)
    assert in_file(layer.gate_up_proj) and not in_file(layer.qkv_proj)
    copied = load_model(bf16_dir, dtype="float32")  # another dtype: copied, cast
    assert not any(in_file(p) for p in copied.model.parameters())
    assert copied.model.embed_tokens.dtype == torch.float32
    own = LlamaForCausalLM(loaded.config, dtype=torch.bfloat16)
    own.load_hf_state_dict(checkpoint_weights(bf16_dir))  # copied into the model's own memory
    own.prepack()
    assert not any(in_file(p) for p in own.parameters())
    text = "The quick brown fox jumps over the lazy dog. " * 3
    assert torch.equal(prompt_logits(loaded, text), prompt_logits(dataclasses.replace(loaded, model=own), text))


@needs_kernels
def test_an_untied_head_is_quantized_and_its_dense_copy_dropped(make_tiny_hf_model, tiny_tokenizer, tmp_path):
    folder = tmp_path / "untied"
    model = make_tiny_hf_model(architectures=["LlamaForCausalLM"]).to(torch.bfloat16)
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    loaded = load_model(folder, dtype="bfloat16", quantize="q8_0")
    config = loaded.config
    assert not config.tie_word_embeddings and loaded.model.lm_head.numel() == 0
    embedding = config.vocab_size * config.hidden_size * 2
    assert live_bytes(loaded.model) == norms_bytes(config) + embedding, "norms and the looked-up embedding"
    head = reference(checkpoint_weights(folder)["lm_head.weight"], "q8_0")
    matmul = cpu.quantized_matmul()
    assert torch.equal(loaded.model._invariant_lm_head.packed.data, matmul.pack_int8(head.codes, head.scales).data)
