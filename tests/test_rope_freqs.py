"""A Llama 3 GGUF's `rope_freqs.weight`: llama.cpp's converter stores the "llama3" rope scaling as
one divisor per rotary frequency, and llama.cpp divides each frequency by it (before the linear or
YaRN scaling the metadata names). radixrt folds the divisors into the rope's inverse frequencies,
so the layer path's cos/sin and the whole-step kernel's tables both carry them.

The tiny model's scaling is Llama 3.1's (base 500000, factor 8, low/high frequency factors 1 and 4)
at a trained length of 128, where all three bands hold frequencies (kept, divided by 8, blended)
and each divided frequency is transformers' llama3 one bit for bit: a file written as the
converter writes it then loads equal to its Hugging Face folder, logits included. At other
lengths a blended frequency may differ from transformers' in its last bit (the converter rounds
the divisor to float32, transformers blends the frequencies), as llama.cpp's own run does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from radixrt.benchmarks.gguf_from_hf import llama3_rope_freqs, write_hf_gguf
from radixrt.kernels import cpu
from radixrt.model.config import ModelConfig, RopeScaling
from radixrt.model.executors import WholeStep
from radixrt.model.loader import load_model
from radixrt.model.rope import RotaryEmbedding, rope_parameters
from tests.test_decode_stack import both_paths, filled_runner, make_batch
from tests.test_gguf_families import PROMPTS, all_logits, make_model

LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=128)  # fmt: skip
LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             rope_parameters=LLAMA3)  # fmt: skip
HALF = 16  # head_dim 32 // 2


def plain_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return rope_parameters(head_dim, theta, None)[0]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> tuple[Path, Path]:
    """(Hugging Face folder, F32 file) of the tiny Llama with "llama3" rope scaling."""
    folder = tmp_path_factory.mktemp("llama3")
    model = make_model("llama", **LLAMA)
    model.save_pretrained(folder / "hf")
    tiny_tokenizer.save_pretrained(folder / "hf")
    return folder / "hf", write_hf_gguf(folder / "f32.gguf", model, tiny_tokenizer)


def test_the_writer_stores_the_three_bands_as_the_converter_does(written):
    factors = llama3_rope_freqs(make_model("llama", **LLAMA).config, LLAMA3)
    assert factors.dtype == np.float32 and factors.shape == (HALF,)
    kept, divided = int((factors == 1).sum()), int((factors == 8).sum())
    assert kept >= 2 and divided >= 2 and kept + divided < HALF, "every band holds frequencies"
    blended = factors[(factors != 1) & (factors != 8)]
    assert ((blended > 1) & (blended < 8)).all()


def test_a_llama3_file_loads_equal_to_its_folder_bit_for_bit(written):
    folder, f32 = written
    expected = load_model(folder, dtype="float32")
    loaded = load_model(f32, dtype="float32", weights="dense")
    config = loaded.config
    assert config.rope_scaling is None and config.rope_theta == 500000.0, "the file has no scaling metadata"
    want = tuple(float(f) for f in llama3_rope_freqs(expected.hf_config, LLAMA3))
    assert config.rope_freq_factors == want
    assert ModelConfig.from_hf(loaded.hf_config) == config, "transformers' reading of the file's config"
    inv_freq = loaded.model.rope.inv_freq
    assert torch.equal(inv_freq, expected.model.rope.inv_freq)
    assert not torch.equal(inv_freq, plain_inv_freq(32, 500000.0)), "the plain rope differs: the test can fail"
    ours, theirs = loaded.model.state_dict(), expected.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items())
    ids = PROMPTS[0] + list(range(100, 140))
    assert torch.equal(all_logits(loaded, ids), all_logits(expected, ids))


needs_stack = pytest.mark.skipif(cpu.decode_stack() is None, reason="no C compiler or no AVX512-BF16: no kernel")


@needs_stack
def test_the_whole_step_kernel_runs_the_files_frequencies(written):
    """Its tables are the folder's llama3 tables; its decodes are the layer path's bit for bit, and
    its steps give the logits the folder's model gives on the same kernel."""
    folder, f32 = written
    from_file = load_model(f32, dtype="bfloat16", quantize="q8_0").model
    from_folder = load_model(folder, dtype="bfloat16", quantize="q8_0").model
    assert WholeStep.stack_for(from_file) is not None
    for ours, theirs in zip(from_file.rope_tables(300), from_folder.rope_tables(300)):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    plain = RotaryEmbedding(32, 500000.0, None, torch.device("cpu")).tables(300, torch.bfloat16)
    assert not torch.equal(from_file.rope_tables(300)[0][0], plain[0])
    batch, num_slots = make_batch([(293, 1), (5, 1), (0, 1), (150, 1)], shared=0, seed=1)
    (stacked, stacked_k), (layered, layered_k) = both_paths(from_file, batch, num_slots, seed=1)
    assert torch.equal(stacked, layered)
    assert all(torch.equal(a, b) for a, b in zip(stacked_k, layered_k))
    mixed, num_slots = make_batch([(100, 1), (40, 6), (0, 9)], shared=0, seed=2)
    runners = [filled_runner(model, num_slots, seed=2) for model in (from_file, from_folder)]
    assert all(isinstance(runner.executor(mixed), WholeStep) for runner in runners)
    assert torch.equal(runners[0].forward(mixed), runners[1].forward(mixed))


def test_rope_freqs_go_with_the_scaling_the_metadata_names(tmp_path, tiny_tokenizer):
    """llama.cpp divides by the factors, then applies linear scaling on top: both are run."""
    model = make_model("llama", **dict(LLAMA, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                   factor=2.0)))
    factors = np.linspace(1.0, 6.0, HALF, dtype=np.float32)
    path = write_hf_gguf(tmp_path / "linear.gguf", model, tiny_tokenizer, extra={"rope_freqs.weight": factors})
    loaded = load_model(path, dtype="float32", weights="dense")
    assert loaded.config.rope_scaling == RopeScaling("linear", 2.0)
    want = plain_inv_freq(32, 10000.0) / torch.from_numpy(factors) / 2.0
    assert torch.equal(loaded.model.rope.inv_freq, want)


def test_the_factors_divide_the_frequencies_as_llama_cpp_does():
    """Llama 3.1 8B's shape: the file's divisors give transformers' llama3 frequencies (to the last
    bit in the blended band); with YaRN both its kept and its interpolated frequencies are divided."""
    scaling = RopeScaling("llama3", 8.0, original_max_position_embeddings=8192)
    config = make_model("llama", **dict(LLAMA, head_dim=128)).config
    factors = tuple(float(f) for f in llama3_rope_freqs(config, dict(LLAMA3, original_max_position_embeddings=8192)))
    plain = plain_inv_freq(128, 500000.0)
    ours = rope_parameters(128, 500000.0, None, factors)[0]
    assert torch.equal(ours, plain / torch.tensor(factors))
    torch.testing.assert_close(ours, rope_parameters(128, 500000.0, scaling)[0], rtol=2e-7, atol=0)
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=2048)
    ones = rope_parameters(128, 500000.0, yarn, (1.0,) * 64)
    assert torch.equal(ones[0], rope_parameters(128, 500000.0, yarn)[0]) and ones[1] == rope_parameters(
        128, 500000.0, yarn)[1]
    twos = rope_parameters(128, 500000.0, yarn, (2.0,) * 64)[0]
    assert torch.equal(twos, ones[0] / 2), "dividing every frequency by a power of two is exact"


@pytest.mark.parametrize(("values", "message"), [
    (np.ones(HALF - 1, dtype=np.float32), r"must be F32 of shape \(16,\) \(rotary dims / 2\), got F32 \(15,\)"),
    (np.ones(HALF, dtype=np.float16), r"must be F32 of shape \(16,\) \(rotary dims / 2\), got F16 \(16,\)"),
    (np.array([1.0] * 15 + [0.0], dtype=np.float32), r"must hold finite values > 0; entries \[15\] are \[0\.0\]"),
    (np.array([-2.0] + [1.0] * 15, dtype=np.float32), r"must hold finite values > 0; entries \[0\] are \[-2\.0\]"),
    (np.array([1.0] * 14 + [np.inf, np.nan], dtype=np.float32), r"must hold finite values > 0; entries \[14, 15\] are \[inf, nan\]"),
])  # fmt: skip
def test_a_bad_rope_freqs_tensor_is_refused_by_name(tmp_path, tiny_tokenizer, values, message):
    model = make_model("llama", **dict(LLAMA, rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
    path = write_hf_gguf(tmp_path / "bad.gguf", model, tiny_tokenizer, extra={"rope_freqs.weight": values})
    with pytest.raises(ValueError, match=r"tensor rope_freqs\.weight " + message):
        load_model(path, dtype="float32")


def test_rope_freqs_in_a_family_llama_cpp_does_not_read_it_for_is_refused(tmp_path, tiny_tokenizer):
    model = make_model("qwen2", **dict(LLAMA, rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
    path = write_hf_gguf(tmp_path / "qwen2.gguf", model, tiny_tokenizer,
                         extra={"rope_freqs.weight": np.ones(HALF, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"tensor rope_freqs\.weight is llama\.cpp's rope factors of Llama files"):
        load_model(path, dtype="float32")


def test_a_config_with_bad_factors_is_refused_naming_the_field():
    base = dict(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                attention_bias=False, o_proj_bias=False, tie_word_embeddings=False, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"rope_freq_factors must have rotary_dim // 2 = 16 entries, got 3"):
        ModelConfig(**base, rope_freq_factors=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="rope_freq_factors must be finite and > 0"):
        ModelConfig(**base, rope_freq_factors=(1.0,) * 15 + (float("nan"),))
    dynamic = RopeScaling("dynamic", 2.0)
    with pytest.raises(ValueError, match="rope_freq_factors combine only with no rope scaling, linear or yarn"):
        ModelConfig(**dict(base, rope_scaling=dynamic), rope_freq_factors=(1.0,) * 16)
