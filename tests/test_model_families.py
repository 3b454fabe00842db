"""Qwen3, Gemma 2/3, Phi-3, sliding windows and the rope scaling types against transformers,
end to end (fp32, CPU).

Each family is a tiny random-weight checkpoint (2 layers, hidden 64, GQA)
saved with `save_pretrained` and loaded from its folder. Logits: max
|ours - transformers| <= 1e-4 * max(1, max |transformers logit|). Greedy
tokens through `radixrt.Runtime` must equal transformers' `generate`, for
prompts sharing a prefix, with the cache cold and warm, pages of 1 and 16,
and shared-prefix attention on (a low `shared_prefix_min_tokens`). The
windowed families use windows of 8-24 tokens: the prompts (17-21 tokens) and
their outputs run past them.

"dynamic" and "longrope" agree with transformers only where transformers'
choice of frequencies does not depend on the batch: sequences within the
trained length, and one sequence decoded one token at a time past it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import radixrt
from radixrt.model.config import ModelConfig
from radixrt.model.loader import load_model
from radixrt.model.rope import RotaryEmbedding, rope_parameters
from tests.test_model import assert_prefill_matches_transformers

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
_HALF = 16  # head_dim 32 // 2
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.05 * i for i in range(_HALF)],
    long_factor=[1.0 + 0.6 * i for i in range(_HALF)],
    original_max_position_embeddings=32,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)  # fmt: skip
# Phi-4-mini's shape: longrope over the leading 3/4 of each head (24 of 32 dims: 12 factors each)
PHI_LONGROPE = dict(LONGROPE, partial_rotary_factor=0.75, short_factor=LONGROPE["short_factor"][:12],
                    long_factor=LONGROPE["long_factor"][:12])  # fmt: skip
# Phi-3's own config check reads head_dim as hidden_size // heads: keep the two equal
PHI = dict(SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=32, pad_token_id=0)
GEMMA = dict(SMALL, head_dim=32, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
GEMMA3_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
               "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0)}  # fmt: skip

# name -> (architecture, config overrides), 2 layers (the factory's default). Prompts plus
# outputs (at most 30 tokens) stay within the trained length: 32 for longrope, 128 for dynamic.
FAMILIES = {
    # head_dim 32 * 4 heads != hidden 64: the explicit head_dim is what counts
    "qwen3": ("qwen3", dict(SMALL, head_dim=32, max_position_embeddings=128)),
    "qwen3-bias-tied": ("qwen3", dict(SMALL, head_dim=32, attention_bias=True, tie_word_embeddings=True)),
    "llama-dynamic": (
        "llama",
        dict(SMALL, head_dim=32, max_position_embeddings=128, rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, factor=4.0)),
    ),
    "qwen3-yarn": ("qwen3", dict(SMALL, head_dim=32, max_position_embeddings=128, rope_parameters=YARN)),
    "llama-longrope": ("llama", dict(SMALL, head_dim=32, max_position_embeddings=128, rope_parameters=LONGROPE)),
    "qwen3-linear": ("qwen3", dict(SMALL, head_dim=32, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-llama3": ("llama", dict(SMALL, head_dim=32, rope_parameters=LLAMA3)),
    "mistral-window": ("mistral", dict(SMALL, head_dim=32, sliding_window=8)),
    # layer 0 full, layer 1 sliding
    "qwen2-window": ("qwen2", dict(SMALL, head_dim=32, use_sliding_window=True, sliding_window=12,
                                   max_window_layers=1)),
    "gemma2": ("gemma2", dict(GEMMA, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(GEMMA, sliding_window=24, rope_parameters=GEMMA3_ROPE)),
    "phi3": ("phi3", PHI),
    "phi3-window": ("phi3", dict(PHI, sliding_window=8)),
    "phi3-longrope-partial": ("phi3", dict(PHI, max_position_embeddings=128, rope_parameters=PHI_LONGROPE)),
}  # fmt: skip

PREFIX = list(range(3, 19))
PROMPTS = [PREFIX + tail for tail in ([40, 41, 42], [50, 51], [60, 61, 62, 63, 64], [70])]
MAX_NEW_TOKENS = 8


def save_family(
    name: str, folder: Path, make_tiny_hf_model, tokenizer: transformers.PreTrainedTokenizerBase
) -> transformers.PreTrainedModel:
    architecture, overrides = FAMILIES[name]
    hf_model = make_tiny_hf_model(architecture, **overrides)
    hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hf_model.generation_config.eos_token_id = None  # radixrt ignores EOS below too
    return hf_model


def hf_generate(hf_model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, tmp_path, make_tiny_hf_model, tiny_tokenizer, make_runner):
    hf_model = save_family(family, tmp_path, make_tiny_hf_model, tiny_tokenizer)
    model = load_model(tmp_path, dtype="float32").model
    hf_rope = hf_model.model.rotary_emb
    if model.local_rope is None:
        assert torch.equal(model.rope.inv_freq, hf_rope.inv_freq)
        assert model.rope.attention_scaling == hf_rope.attention_scaling
    else:  # Gemma 3: one table per layer type
        assert torch.equal(model.rope.inv_freq, hf_rope.full_attention_inv_freq)
        assert torch.equal(model.local_rope.inv_freq, hf_rope.sliding_attention_inv_freq)
    assert_prefill_matches_transformers(hf_model, model, make_runner, 30)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_match_generate(family, tmp_path, make_tiny_hf_model, tiny_tokenizer):
    hf_model = save_family(family, tmp_path, make_tiny_hf_model, tiny_tokenizer)
    expected = [hf_generate(hf_model, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for page_size in (1, 16):
        config = dict(dtype="float32", page_size=page_size, max_total_tokens=2048, check_invariants=True,
                      shared_prefix_min_tokens=8)  # fmt: skip
        with radixrt.Runtime(tmp_path, **config) as rt:
            cold = [out["output_ids"] for out in rt.generate(input_ids=PROMPTS, sampling_params=params)]
            cached_before = rt.cache_stats()["cached_prompt_tokens"]
            warm = [out["output_ids"] for out in rt.generate(input_ids=PROMPTS, sampling_params=params)]
            assert rt.cache_stats()["cached_prompt_tokens"] - cached_before >= len(PREFIX) * len(PROMPTS)
        assert cold == expected, f"page_size={page_size}, cold cache"
        assert warm == expected, f"page_size={page_size}, warm cache"


@pytest.mark.parametrize("family", ["llama-dynamic", "llama-longrope"])
def test_one_sequence_past_the_trained_length_matches_generate(
    family, tmp_path, make_tiny_hf_model, tiny_tokenizer
):
    """Past the trained length (32 tokens for longrope, 128 for dynamic) each token uses the
    frequencies for a sequence ending at it: what transformers' one-sequence decode does."""
    hf_model = save_family(family, tmp_path, make_tiny_hf_model, tiny_tokenizer)
    trained = 32 if family == "llama-longrope" else 128
    prompt = PROMPTS[0]
    max_new_tokens = trained + 12 - len(prompt)
    expected = hf_generate(hf_model, prompt, max_new_tokens)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    with radixrt.Runtime(tmp_path, dtype="float32", max_total_tokens=2048) as rt:
        assert rt.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected


def _hf_config(rope: dict, **overrides: object) -> transformers.LlamaConfig:
    kwargs = dict(SMALL, head_dim=32, max_position_embeddings=128, rope_parameters=dict(rope))
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


ROPE_TABLES = {
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.5),
    "dynamic": dict(rope_type="dynamic", rope_theta=500000.0, factor=3.0),
    "yarn": YARN,
    "yarn-betas-untruncated": dict(YARN, beta_fast=16, beta_slow=2, truncate=False),
    "yarn-mscale": dict(YARN, factor=40.0, mscale=0.707, mscale_all_dim=0.707, rope_theta=1e6),
    "yarn-attention-factor": dict(YARN, attention_factor=0.8),
    "yarn-no-factor": {k: v for k, v in YARN.items() if k != "factor"} | {"factor": None},
    "longrope": LONGROPE,
    "longrope-attention-factor": dict(LONGROPE, attention_factor=1.3, factor=2.0),
    "llama3": LLAMA3,
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPE_TABLES))
def test_rope_tables_equal_transformers(name):
    hf_config = _hf_config(ROPE_TABLES[name])
    config = ModelConfig.from_hf(hf_config)
    inv_freq, attention_scaling = rope_parameters(config.head_dim, config.rope_theta, config.rope_scaling)
    rope_type = hf_config.rope_parameters["rope_type"]
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    assert torch.equal(inv_freq, expected)
    assert attention_scaling == expected_scaling
    rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    if rope.long_position_threshold is None:
        return
    # a token at position p past the threshold: transformers' frequencies for p + 1 tokens
    threshold = rope.long_position_threshold
    positions = torch.tensor([threshold - 1, threshold, threshold + 50])
    angles = rope._frequencies(positions)
    for position, row in zip(positions.tolist(), angles):
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, seq_len=position + 1)
        assert torch.equal(row, position * hf_inv_freq), position


def test_rope_does_not_depend_on_the_batch():
    config = ModelConfig.from_hf(_hf_config(LONGROPE))
    rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    alone = rope.cos_sin(torch.arange(10), torch.float32)
    with_long_neighbour = rope.cos_sin(torch.cat([torch.arange(10), torch.tensor([100])]), torch.float32)
    assert all(torch.equal(a, b[:10]) for a, b in zip(alone, with_long_neighbour))


@pytest.mark.parametrize("scaling", ["linear", "llama3", "dynamic", "longrope"])
def test_rope_tables_hold_what_cos_sin_gives_each_position(scaling):
    """The whole-step kernel looks positions up in `tables` instead of calling `cos_sin`: the
    same values at every position, also past the threshold where the frequencies change."""
    config = ModelConfig.from_hf(_hf_config(ROPE_TABLES[scaling]))
    rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 127, 128, 129, 300, 5000])
    for dtype in (torch.bfloat16, torch.float32):
        cos, signed_sin = rope.cos_sin(positions, dtype)
        table_cos, table_sin = rope.tables(int(positions.max()) + 1, dtype)
        assert table_cos.shape[0] >= 5001 and table_cos.is_contiguous()
        assert torch.equal(table_cos[positions], cos[:, 0]) and torch.equal(table_sin[positions], signed_sin[:, 0])
    assert rope.tables(10, torch.float32)[0].shape[0] >= 5001, "a table only grows"


def test_dynamic_context_len_is_extended_by_factor():
    config = ModelConfig.from_hf(_hf_config(ROPE_TABLES["dynamic"]))
    assert config.context_len == 3 * 128


def test_qwen3_config_fields(make_tiny_hf_model):
    config = ModelConfig.from_hf(make_tiny_hf_model("qwen3", **SMALL, head_dim=32).config)
    assert config.qk_norm and config.head_dim == 32 and not config.attention_bias and not config.o_proj_bias
    biased = ModelConfig.from_hf(make_tiny_hf_model("qwen3", **SMALL, attention_bias=True).config)
    assert biased.attention_bias and biased.o_proj_bias
    assert not ModelConfig.from_hf(make_tiny_hf_model("llama", **SMALL).config).qk_norm


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(architectures=["MixtralForCausalLM"]), "supported: LlamaForCausalLM, .*Qwen3ForCausalLM, "
         "Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM"),
        (dict(architectures=None, model_type="gemma"), "model_type 'gemma'; supported: llama, mistral, qwen2, qwen3, "
         "gemma2, gemma3_text, phi3"),
        (dict(layer_types=["chunked_attention", "full_attention"]), r"layer_types \['chunked_attention'\]"),
        (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}),
         "rope_type 'mrope'; supported: default, linear, dynamic, yarn, longrope, llama3"),
        (dict(rope_parameters=dict(YARN, mrope_section=[8, 8])), r"yarn rope parameters \['mrope_section'\]"),
        (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer rope parameters"),
        (dict(rope_parameters=dict(LONGROPE, long_factor=[1.0] * 4)), "long_factor must have rotary_dim // 2 = 16"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.3}), "partial_rotary_factor"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "dynamic rope scaling needs a 'factor'"),
        (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
        (dict(quantization_config={"quant_method": "awq", "bits": 4}), "quantization_config 'awq'"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_early(change, message, make_tiny_hf_model):
    hf_config = make_tiny_hf_model("llama", **SMALL, head_dim=32).config
    for key, value in change.items():
        setattr(hf_config, key, value)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf_config)


def test_gemma_config_fields_and_activation(make_tiny_hf_model):
    config = ModelConfig.from_hf(make_tiny_hf_model("gemma2", **FAMILIES["gemma2"][1]).config)
    assert config.is_gemma and config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 24
    assert [config.layer_window(i) for i in range(2)] == [8, None]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    gemma3 = ModelConfig.from_hf(make_tiny_hf_model("gemma3_text", **FAMILIES["gemma3"][1]).config)
    assert gemma3.qk_norm and gemma3.local_rope_theta == 10000.0 and gemma3.rope_theta == 1e6
    hf_config = make_tiny_hf_model("gemma2", **GEMMA).config
    hf_config.hidden_activation = "gelu"
    with pytest.raises(ValueError, match="hidden_activation must be 'gelu_pytorch_tanh'"):
        ModelConfig.from_hf(hf_config)
