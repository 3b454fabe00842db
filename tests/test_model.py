"""Our Llama-family forward pass against transformers on the same weights (fp32, CPU).

Tolerance for logits: max |ours - transformers| <= 1e-4 * max(1, max |transformers logit|),
i.e. 1e-4 relative to the logit range. Greedy tokens must match exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.model.config import ModelConfig, RopeScaling
from radixrt.model.llama import LlamaForCausalLM

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

# (architecture, config overrides): head counts, GQA ratios 1/3/4, head_dim 64/128,
# rope scaling, q/k/v bias (Qwen2), all-projection bias, tied embeddings.
VARIANTS = {
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa3": ("llama", dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2)),
    "llama3-rope-gqa4-d128": (
        "llama",
        dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope-bias": (
        "llama",
        dict(attention_bias=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    ),
    "qwen2-gqa3-tied": (
        "qwen2",
        dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "mistral-gqa4": ("mistral", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32)),
}


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = max(1.0, reference.abs().max().item())
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-4 * scale, f"max abs diff {diff:.3g} > 1e-4 * {scale:.3g}"


def assert_prefill_matches_transformers(
    hf_model: transformers.PreTrainedModel, model: LlamaForCausalLM, make_runner, length: int
) -> None:
    """Every position's logits of one random prompt of `length` tokens, against transformers'."""
    runner, pool = make_runner(model, num_pages=256)
    ids = torch.randint(0, hf_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = hf_model(ids[None]).logits[0]
    batch = ForwardBatch.build([ids.tolist()], [0], [pool.alloc(length)])
    assert_logits_close(runner.forward(batch, torch.arange(length)), reference)


def ours_from(hf_model: transformers.PreTrainedModel) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_model.config))
    model.load_hf_state_dict(hf_model.state_dict())
    return model


def prepacked(hf_model: transformers.PreTrainedModel, dtype: torch.dtype) -> LlamaForCausalLM:
    """Our model on `hf_model`'s weights in `dtype`, packed as the loader packs it."""
    ours = ours_from(hf_model).to(dtype)
    ours.prepack()
    return ours


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(variant, make_tiny_hf_model, make_runner):
    architecture, overrides = VARIANTS[variant]
    hf_model = make_tiny_hf_model(architecture, **overrides)
    model = ours_from(hf_model)
    assert torch.equal(model.rope.inv_freq, hf_model.model.rotary_emb.inv_freq)  # rope scaling, bit for bit
    assert_prefill_matches_transformers(hf_model, model, make_runner, 100)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_after_scattered_prefix_matches_full_prefill(page_size, make_tiny_hf_model, make_runner):
    hf_model = make_tiny_hf_model("llama", hidden_size=192, num_attention_heads=6, num_key_value_heads=2)
    num_pages = 64 // page_size * 8
    runner, _ = make_runner(ours_from(hf_model), num_pages=num_pages, page_size=page_size)
    ids = torch.randint(0, hf_model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        reference = hf_model(torch.tensor([ids])).logits[0]
    # Hand the request shuffled pages (slots stay in order inside a page), as a long-running pool does.
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3))[: -(-90 // page_size)]
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:90]
    runner.forward(ForwardBatch.build([ids[:57]], [0], [slots[:57]]))  # an earlier request fills the prefix
    logits = runner.forward(ForwardBatch.build([ids[57:]], [57], [slots]), torch.arange(33))
    assert_logits_close(logits, reference[57:])


def test_mixed_batch_equals_each_sequence_alone(make_tiny_hf_model, make_runner):
    hf_model = make_tiny_hf_model("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    runner, pool = make_runner(ours_from(hf_model), num_pages=80, page_size=4)
    generator = torch.Generator().manual_seed(4)
    # (prefix_len, extend_len): prefills, extends after prefixes of different lengths, decodes.
    specs = [(0, 9), (20, 7), (13, 1), (0, 1), (31, 1), (5, 12), (40, 30), (2, 1)]
    sequences = [torch.randint(0, 300, (p + e,), generator=generator).tolist() for p, e in specs]
    slots = [pool.alloc(p + e)[: p + e] for p, e in specs]
    for (prefix, _), ids, seq_slots in zip(specs, sequences, slots):
        if prefix:
            runner.forward(ForwardBatch.build([ids[:prefix]], [0], [seq_slots[:prefix]]))

    def batch_of(indices: list[int]) -> ForwardBatch:
        return ForwardBatch.build(
            [sequences[i][specs[i][0] :] for i in indices], [specs[i][0] for i in indices], [slots[i] for i in indices]
        )

    mixed = batch_of(list(range(len(specs))))
    together = runner.forward(mixed, torch.arange(mixed.num_tokens))
    for i in range(len(specs)):
        alone = runner.forward(batch_of([i]), torch.arange(specs[i][1]))
        rows = slice(mixed.qo_offsets[i], mixed.qo_offsets[i + 1])
        assert_logits_close(together[rows], alone)


def test_logit_rows_default_and_validation(tiny_llama, make_runner):
    runner, pool = make_runner(tiny_llama.model, num_pages=64)
    batch = ForwardBatch.build([[5, 6, 7], [8, 9]], [0, 0], [pool.alloc(3), pool.alloc(2)])
    every_row = runner.forward(batch, torch.arange(5))
    last = runner.forward(batch)
    assert last.dtype == torch.float32 and last.shape == (2, tiny_llama.config.vocab_size)
    torch.testing.assert_close(last, every_row[[2, 4]])
    with pytest.raises(TypeError, match="logit_rows"):
        runner.forward(batch, [0, 1])


def test_greedy_tiny_model_matches_transformers(tiny_llama, tiny_llama_hf, make_runner, paged_greedy, hf_greedy):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=generator).tolist() for n in [3, 17, 40, 8, 25, 1, 60, 12] * 2]
    runner, pool = make_runner(tiny_llama.model, num_pages=200, page_size=8)
    assert paged_greedy(runner, pool, prompts, 32) == hf_greedy(tiny_llama_hf, prompts, 32)
    assert pool.available == pool.num_slots


@pytest.mark.slow
def test_greedy_smollm2_matches_transformers(smollm2, smollm2_hf, make_runner, paged_greedy, hf_greedy):
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain in one paragraph why the sky is blue, and mention Rayleigh scattering.",
        "Hi!",
        "Translate 'good morning' into Spanish.",
        "What is 12 times 7?",
        "Give me a name for a cat.",
    ]
    tokenizer = smollm2.tokenizer
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    plain = [tokenizer("Once upon a time, " * n)["input_ids"] for n in (1, 2, 3, 5)]
    plain += [
        tokenizer(text)["input_ids"] for text in ("def fibonacci(n):", "The table below lists", "1, 2, 3,", "Paris is")
    ]
    prompts = [list(p) for p in chats + plain]
    runner, pool = make_runner(smollm2.model, num_pages=160, page_size=16)
    # transformers runs the 16 prompts as one left-padded batch: one prompt at a time
    # gives the same tokens but takes minutes on a 2-core CPU.
    assert paged_greedy(runner, pool, prompts, 32) == hf_greedy(smollm2_hf, prompts, 32, batched=True)


def test_config_reads_transformers4_spelling():
    hf4 = SimpleNamespace(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=[7, 8], bos_token_id=1,
    )  # fmt: skip
    config = ModelConfig.from_hf(hf4)
    assert config.rope_theta == 50000.0 and config.rope_scaling == RopeScaling("linear", 2.0)
    assert config.head_dim == 16 and config.num_query_groups == 4 and config.eos_token_ids == (7, 8)


def test_config_rejects_what_we_cannot_run(make_tiny_hf_model):
    hf_config = make_tiny_hf_model("llama").config
    hf_config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf(hf_config)
    hf_config.architectures = None  # as in GGUF-derived configs: fall back to model_type
    assert ModelConfig.from_hf(hf_config).architecture == "LlamaForCausalLM"
    hf_config.rope_parameters = {"rope_type": "proportional", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'proportional'; supported: default, linear, dynamic, yarn"):
        ModelConfig.from_hf(hf_config)
    qwen = ModelConfig.from_hf(make_tiny_hf_model("qwen2").config)
    assert qwen.attention_bias and not qwen.o_proj_bias


def test_load_hf_state_dict_reports_mismatches(make_tiny_hf_model):
    hf_model = make_tiny_hf_model("llama")
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_model.config))
    state = dict(hf_model.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*model.extra.weight"):
        model.load_hf_state_dict(state)
    state = dict(hf_model.state_dict())
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight: checkpoint shape"):
        model.load_hf_state_dict(state)
