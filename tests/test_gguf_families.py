"""Every family read straight from its GGUF file: tiny random-weight transformers models saved as
Hugging Face folders and written as llama.cpp's converter writes them (`gguf_from_hf`).

A dense load of the F32 (or F16, the weights rounded to it) file equals the folder's load bit
for bit, parameters and logits: names, Llama's q/k reordering, Gemma's stored 1 + w, Phi-3's
fused tensors and the config from the metadata are all undone exactly. A quantized file (Q4_K,
Q5_K, Q6_K and Q8_0 parts) loads natively, its projections packed as stored with no dense copy,
its logits within twice a dense bf16 run's distance of a float32 run of the same weights, and greedy
generation through `radixrt.Runtime` gives the same tokens with the cache cold and warm.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import radixrt
from radixrt.benchmarks.gguf_from_hf import write_hf_gguf
from radixrt.kernels import cpu
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.memory import KVCache
from radixrt.model import gguf_config
from radixrt.model.config import ModelConfig
from radixrt.model.executors import WholeStep
from radixrt.model.loader import LoadedModel, load_model
from radixrt.model.runner import ModelRunner
from radixrt.paths import CACHE_ENV_VAR
from tests.conftest import _CONFIG_CLASSES, TINY_VOCAB, randomize_weights
from tests.test_model_families import GEMMA3_ROPE, PHI, PHI_LONGROPE, SMALL, YARN

# Gemma's query scale is head_dim in every GGUF but the 27B models' (llama.cpp's rule), and its
# head is the embedding
GEMMA = dict(SMALL, head_dim=32, query_pre_attn_scalar=32, tie_word_embeddings=True)
# name -> (model_type, config overrides): the factory's 2 layers, hidden 64 (Gemma 3: 6 layers, so
# that llama.cpp's pattern of five sliding layers in six has a full one)
FAMILIES = {
    "llama": ("llama", dict(SMALL, head_dim=32)),
    "mistral": ("mistral", dict(SMALL, head_dim=32)),
    "qwen2": ("qwen2", dict(SMALL, head_dim=32)),
    "qwen3-bias-tied": ("qwen3", dict(SMALL, head_dim=32, attention_bias=True, tie_word_embeddings=True)),
    "qwen3-yarn": ("qwen3", dict(SMALL, head_dim=32, max_position_embeddings=128, rope_parameters=YARN)),
    "phi3-window": ("phi3", dict(PHI, sliding_window=8)),
    "phi3-longrope-partial": ("phi3", dict(PHI, max_position_embeddings=128, rope_parameters=PHI_LONGROPE)),
    "gemma2": ("gemma2", dict(GEMMA, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(GEMMA, num_hidden_layers=6, sliding_window=24, rope_parameters=GEMMA3_ROPE)),
}  # fmt: skip
# K-quant rows are whole blocks of 256 inputs: every projection's inputs are 256 or 512 wide
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
NATIVE = {
    "qwen2": ("qwen2", WIDE),
    "qwen3": ("qwen3", WIDE),
    "phi3": ("phi3", dict(WIDE, pad_token_id=0)),
    "gemma2": ("gemma2", dict(WIDE, query_pre_attn_scalar=64, tie_word_embeddings=True, sliding_window=8,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(WIDE, query_pre_attn_scalar=64, tie_word_embeddings=True, sliding_window=8)),
}  # fmt: skip
# every part of a projection in a packed format: Q4_K q/k (and Phi-3's fused qkv and gate/up),
# Q6_K v and down, Q8_0 output, Q5_K gate and up; a Q8_0 embedding, a Q6_K untied head
QUANT_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_qkv": "Q4_K", "attn_output": "Q8_0",
               "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}  # fmt: skip
# A bf16 run of the file's weights (native or dense) differs from a float32 run of them by its
# roundings; Gemma's scaled embeddings make them larger. The native run's difference stays within
# twice the dense bf16 run's plus this
LOGIT_ATOL = 0.01
PROMPTS = [list(range(3, 19)) + tail for tail in ([40, 41, 42], [50, 51], [60, 61, 62, 63, 64])]


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("radixrt-cache")
        patch.setenv(CACHE_ENV_VAR, str(path))
        yield path


def make_model(model_type: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """The conftest factory's tiny model, every weight rounded to float16 (so an F16 file holds it exactly)."""
    kwargs: dict[str, object] = dict(vocab_size=TINY_VOCAB, num_hidden_layers=2, max_position_embeddings=1024,
                                     rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_CONFIG_CLASSES[model_type](**kwargs),
                                                          dtype=torch.float32).eval()
    randomize_weights(model, seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (Hugging Face folder, F32 file, F16 file)."""
    out = {}
    for name, (model_type, overrides) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        model = make_model(model_type, **overrides)
        model.save_pretrained(folder / "hf")
        tiny_tokenizer.save_pretrained(folder / "hf")
        out[name] = (folder / "hf", write_hf_gguf(folder / "f32.gguf", model, tiny_tokenizer),
                     write_hf_gguf(folder / "f16.gguf", model, tiny_tokenizer, default_type="F16"))
    return out


def as_float32(config: ModelConfig) -> ModelConfig:
    """`config` with longrope's factors as the float32 values the rope multiplies by (a file stores
    them so; a config may hold 6.3999999999999995 for 6.4)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "longrope":
        return config
    short, long = (tuple(np.float32(f).item() for f in factors)
                   for factors in (scaling.short_factor, scaling.long_factor))
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(scaling, short_factor=short, long_factor=long))


def all_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    config = loaded.config
    cache = KVCache(config.kv_shape(loaded.model.dtype), 256)
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(loaded.model, cache, backend, deterministic=False)
    return runner.forward(ForwardBatch.build([ids], [0], [torch.arange(len(ids))])).float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_dense_load_equals_the_hugging_face_folder_bit_for_bit(written, family):
    folder, f32, f16 = written[family]
    expected = load_model(folder, dtype="float32")
    ids = PROMPTS[0] + list(range(100, 120))  # past the windows (8, 24 tokens)
    want = all_logits(expected, ids)
    for path in (f32, f16):
        loaded = load_model(path, dtype="float32", weights="dense")
        # llama.cpp writes Mistral as a Llama: the same model without a window
        assert as_float32(dataclasses.replace(loaded.config, architecture=expected.config.architecture)) == (
            as_float32(expected.config))
        assert as_float32(ModelConfig.from_hf(loaded.hf_config)) == as_float32(loaded.config), "transformers' reading"
        ours, theirs = loaded.model.state_dict(), expected.model.state_dict()
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"{path.name}: {key}"
        assert torch.equal(all_logits(loaded, ids), want), path.name


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> dict[str, Path]:
    out = {}
    for seed, (name, (model_type, overrides)) in enumerate(NATIVE.items()):
        model = make_model(model_type, seed=seed, **overrides)
        types = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K"}
        types.update({f"blk.{i}.{kind}.weight": t for i in range(2) for kind, t in QUANT_TYPES.items()})
        out[name] = write_hf_gguf(tmp_path_factory.mktemp(name) / "q.gguf", model, tiny_tokenizer, types=types,
                                  seed=seed)
    return out


needs_kernels = pytest.mark.skipif(cpu.quantized_matmul() is None, reason="no packed kernels (no C compiler)")


@needs_kernels
@pytest.mark.parametrize("family", list(NATIVE))
def test_a_quantized_file_runs_natively_as_a_dense_run_of_its_weights(quantized, family, caplog):
    with caplog.at_level(logging.WARNING, logger="radixrt.model.gguf_loader"):
        native = load_model(quantized[family], dtype="bfloat16", weights="native")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "every part runs as stored"
    assert native.weights == "native" and native.path == quantized[family]
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    for layer in native.model.layers:
        assert all(getattr(layer, name).numel() == 0 for name in projections), "no dense copy"
        packed = layer.int4_steps.packed_weights() if layer.int4_steps else layer.packed_projections.values()
        assert len(list(packed)) == 4 and layer.kernel_projections
    if cpu.decode_stack() is not None:
        assert WholeStep.stack_for(native.model) is not None, "every family on the whole-step kernel"
    dense = load_model(quantized[family], dtype="bfloat16", weights="dense")
    exact = load_model(quantized[family], dtype="float32", weights="dense")
    assert dense.weights == "dense" and dense.model.layers[0].qkv_proj.numel() > 0
    native_errors, dense_errors = [], []
    for ids in (PROMPTS[0][:5], PROMPTS[0] * 3):  # a step the C layer steps take, and a longer prompt
        want = all_logits(exact, ids)[-1]
        native_errors.append(float((all_logits(native, ids)[-1] - want).abs().max()))
        dense_errors.append(float((all_logits(dense, ids)[-1] - want).abs().max()))
    # the largest over the prompts: one prompt's difference is a draw of the roundings, and on
    # Gemma 3 the two runs' draws vary twofold from prompt to prompt
    assert max(native_errors) <= 2 * max(dense_errors) + LOGIT_ATOL, (native_errors, dense_errors)


@needs_kernels
@pytest.mark.parametrize("family", list(NATIVE))
def test_greedy_generation_on_a_native_file_is_the_same_cold_and_warm(quantized, family):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with radixrt.Runtime(quantized[family], dtype="bfloat16", weights="native", max_total_tokens=1024,
                         check_invariants=True) as rt:
        cold = [out["output_ids"] for out in rt.generate(input_ids=PROMPTS, sampling_params=params)]
        cached_before = rt.cache_stats()["cached_prompt_tokens"]
        warm = [out["output_ids"] for out in rt.generate(input_ids=PROMPTS, sampling_params=params)]
        assert rt.cache_stats()["cached_prompt_tokens"] - cached_before >= 16 * len(PROMPTS)
    assert all(len(tokens) == 6 for tokens in cold)
    assert warm == cold


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2", "phi3-window", "gemma2"])
def test_quantizing_a_family_file_at_load_equals_quantizing_its_folder(written, family):
    """The same float32 weights (Phi-3's fused tensors, Gemma's norms) quantized to the same codes."""
    folder, f32, _ = written[family]
    from_file = load_model(f32, dtype="bfloat16", quantize="q8_0")
    from_folder = load_model(folder, dtype="bfloat16", quantize="q8_0")
    assert from_file.weights == from_folder.weights == "q8_0"
    ids = PROMPTS[0] + list(range(100, 120))
    assert torch.equal(all_logits(from_file, ids), all_logits(from_folder, ids))


@pytest.mark.parametrize(("family", "omit", "missing"), [
    ("qwen3-bias-tied", "blk.1.attn_k_norm.weight", r"missing \['blk\.1\.attn_k_norm\.weight'\]"),
    ("qwen2", "blk.0.attn_v.bias", r"missing \['blk\.0\.attn_v\.bias'\]"),
    ("gemma2", "blk.1.post_ffw_norm.weight", r"missing \['blk\.1\.post_ffw_norm\.weight'\]"),
    ("phi3-window", "blk.0.attn_qkv.weight", r"missing \['blk\.0\.attn_qkv\.weight'\]"),
    ("phi3-longrope-partial", "rope_factors_short.weight", r"longrope needs tensor rope_factors_short\.weight"),
])  # fmt: skip
def test_a_family_file_missing_a_tensor_is_refused_by_name(tmp_path, tiny_tokenizer, family, omit, missing):
    model_type, overrides = FAMILIES[family]
    path = write_hf_gguf(tmp_path / "partial.gguf", make_model(model_type, **overrides), tiny_tokenizer, omit=(omit,))
    with pytest.raises(ValueError, match=missing):
        load_model(path, dtype="float32")


def test_unsupported_architectures_and_bad_metadata_are_refused_by_name(written, tmp_path):
    source = written["qwen2"][1].read_bytes()
    (tmp_path / "other.gguf").write_bytes(source.replace(b"qwen2", b"mamba", 1))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'; supported: llama, qwen2, qwen3, "
                                         "phi3, gemma2, gemma3"):  # fmt: skip
        load_model(tmp_path / "other.gguf")
    (tmp_path / "keyless.gguf").write_bytes(source.replace(b"qwen2.embedding_length", b"qwen2.embedding_lengtX"))
    with pytest.raises(ValueError, match="metadata qwen2.embedding_length is missing"):
        load_model(tmp_path / "keyless.gguf")


def metadata_file(arch: str, tensors: tuple[str, ...] = (), **keys: object) -> SimpleNamespace:
    """What `gguf_config.hf_config` reads of a file: architecture, metadata, tensor names."""
    defaults = dict(block_count=12, embedding_length=1024, feed_forward_length=4096, context_length=8192,
                    attention__head_count=8, attention__head_count_kv=4, attention__layer_norm_rms_epsilon=1e-6)
    metadata = {f"{arch}.{key.replace('__', '.')}": value for key, value in {**defaults, **keys}.items()}
    embedding = SimpleNamespace(shape=(512, 1024))
    return SimpleNamespace(architecture=arch, metadata=metadata, path=Path(f"{arch}.gguf"),
                           tensors={"token_embd.weight": embedding, **dict.fromkeys(tensors)})


def test_what_a_file_does_not_say_is_what_llama_cpp_assumes():
    gemma3 = ModelConfig.from_hf(gguf_config.hf_config(metadata_file(
        "gemma3", attention__key_length=256, attention__sliding_window=512, rope__freq_base=1e6)))
    assert [gemma3.layer_window(i) for i in range(12)] == ([512] * 5 + [None]) * 2, "five sliding layers in six"
    assert gemma3.local_rope_theta == 10000.0 and gemma3.rope_theta == 1e6
    assert gemma3.query_pre_attn_scalar == 256 and gemma3.tie_word_embeddings and gemma3.rms_norm_eps == 1e-6
    big = gguf_config.hf_config(metadata_file("gemma3", block_count=62, attention__key_length=128))
    assert big["query_pre_attn_scalar"] == 1024 // 8, "the 27B model scales queries by hidden / heads"
    gemma2 = ModelConfig.from_hf(gguf_config.hf_config(metadata_file("gemma2", attention__sliding_window=4096)))
    assert [gemma2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (None, None), "none written, none run"
    phi3 = ModelConfig.from_hf(gguf_config.hf_config(metadata_file("phi3", attention__sliding_window=0)))
    assert phi3.sliding_window is None and phi3.head_dim == 128
    mistral = ModelConfig.from_hf(gguf_config.hf_config(metadata_file("llama", rope__dimension_count=128)))
    assert mistral.architecture == "LlamaForCausalLM" and mistral.sliding_window is None


@pytest.mark.parametrize(("keys", "message"), [
    (dict(rope__scaling__type="su"), "metadata gemma3.rope.scaling.type is 'su'; supported: none, linear, yarn"),
    (dict(attention__head_count_kv=[4, 4]), r"metadata gemma3\.attention\.head_count_kv must be one integer >= 1"),
    (dict(attention__sliding_window=64, attention__sliding_window_pattern=[True]),
     "sliding_window_pattern has 1 entries, the model 12 layers"),
    (dict(attention__layer_norm_rms_epsilon=None), r"gemma3\.attention\.layer_norm_rms_epsilon"),
])  # fmt: skip
def test_bad_metadata_is_refused_naming_the_key(keys, message):
    file = metadata_file("gemma3", **keys)
    file.metadata = {key: value for key, value in file.metadata.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        gguf_config.hf_config(file)


def test_generation_ends_at_the_end_of_turn_token_too():
    file = metadata_file("gemma3")
    file.metadata.update({"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 106})
    assert ModelConfig.from_hf(gguf_config.hf_config(file)).eos_token_ids == (1, 106)
    file.metadata["tokenizer.ggml.eot_token_id"] = 1
    assert ModelConfig.from_hf(gguf_config.hf_config(file)).eos_token_ids == (1,)
