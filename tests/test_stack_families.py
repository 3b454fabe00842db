"""Every family on the whole-step kernel (kernels/cpu/decode_stack.c, decode_run.c).

Each family is a tiny random-weight checkpoint (tests/test_model_families.py's factory) loaded in
bf16 with `quantize="q8_0"`: packed projections and head, as a GGUF's, so the whole-step kernel
applies. For each: the model takes the kernel; its logits agree with the per-layer path over the
same packed weights (bit for bit where the arithmetic is the same: decodes of the families whose
layers the kernel computes op for op as the torch layer rounds them; else within a tolerance);
deterministic steps are batch-invariant; a decode run equals as many single steps. A dense Gemma 2
(no kernel: layer by layer) takes its score cap into deterministic steps' C attention too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from radixrt.kernels import cpu
from radixrt.memory import huge_pages
from radixrt.model.executors import WholeStep
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.gguf_int4 import NativeWeights
from radixrt.model.loader import load_model
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import run_sampling
from tests.conftest import _CONFIG_CLASSES, TINY_VOCAB, randomize_weights
from tests.test_decode_run import deterministic_runner, sequences, step_by_step
from tests.test_decode_stack import both_paths, filled_runner, make_batch
from tests.test_deterministic import Sequence, differences, logits_of_every_token, runner_for
from tests.test_model import prepacked
from tests.test_model_families import FAMILIES
from tests.test_native_weights import random_int4, random_int8

STACK_FAMILIES = ["llama-llama3", "mistral-window", "qwen2-window", "qwen3", "qwen3-bias-tied", "phi3-longrope-partial",
                  "gemma2", "gemma3"]  # fmt: skip
# Families whose decodes the kernel computes op for op as the per-layer path does (its norms, biases,
# q/k norms, partial RoPE and attention in the same roundings; the windows here stay inside one
# 256-key chunk, where the kernel's aligned pieces are the layer path's one piece). Gemma's norms,
# GELU-tanh and caps reduce in another order than torch's or use libm's tanhf: within TOLERANCE.
EXACT = {"llama-llama3", "mistral-window", "qwen2-window", "qwen3", "qwen3-bias-tied", "phi3-longrope-partial"}
# |stack - layers| <= TOLERANCE * max(1, max |layers|): bf16 differences of one step, grown through
# two random layers
TOLERANCE = 0.05
# float32 runs of the same weights in another order of operations (tests/test_model_families.py's bound)
FLOAT32_TOLERANCE = 1e-4


def longest_context(name: str) -> int:
    """Positions within the family's trained length (Phi-4-mini's longrope: 128)."""
    return 100 if name == "phi3-longrope-partial" else 300


@pytest.fixture(scope="module", params=STACK_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_tokenizer: transformers.PreTrainedTokenizerBase) -> tuple[str, LlamaForCausalLM]:
    """(name, the family's tiny model in bf16 with Q8_0 projections and head)."""
    if cpu.decode_stack() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: no quantized kernels")
    name = request.param
    architecture, overrides = FAMILIES[name]
    kwargs = dict(vocab_size=TINY_VOCAB, num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_CONFIG_CLASSES[architecture](**kwargs),
                                                             dtype=torch.float32)  # fmt: skip
    randomize_weights(hf_model, seed=0)
    folder: Path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return name, load_model(folder, dtype="bfloat16", quantize="q8_0").model


def test_the_family_runs_on_the_whole_step_kernel(family):
    name, model = family
    batch, num_slots = make_batch([(40, 1), (12, 3)], shared=0, seed=0)
    runner = filled_runner(model, num_slots, seed=0)
    assert isinstance(runner.executor(batch), WholeStep), f"{name}: every layer in the whole-step kernel"
    assert model.deterministic_problem(runner.backend) is None
    assert deterministic_runner(model, num_slots).runs_decodes
    config = model.config
    windows = {config.layer_window(i) for i in range(config.num_layers)}
    assert runner.whole_step is not None and set(runner.whole_step.stack.windows) == windows


def agreement(stacked: torch.Tensor, layered: torch.Tensor) -> float:
    return float((stacked - layered).abs().max() / max(1.0, float(layered.abs().max())))


def test_decodes_agree_with_the_layer_path(family):
    """Decodes over several 256-key chunks and past the windows: bit for bit for the EXACT
    families, the same K/V written."""
    name, model = family
    longest = longest_context(name)
    batch, num_slots = make_batch([(longest - 7, 1), (5, 1), (0, 1), (longest // 2, 1)], shared=0, seed=1)
    (stacked, stacked_k), (layered, layered_k) = both_paths(model, batch, num_slots, seed=1)
    if name in EXACT:
        assert torch.equal(stacked, layered)
        assert all(torch.equal(a, b) for a, b in zip(stacked_k, layered_k))
    else:
        assert agreement(stacked, layered) <= TOLERANCE


def test_mixed_steps_with_shared_prefixes_agree_with_the_layer_path(family):
    """Extends and decodes in one step, a shared prefix read once: the layer path attends the
    extends through SDPA, in another order, so within the tolerance."""
    name, model = family
    longest = longest_context(name)
    specs = [(longest - 20, 1), (longest - 40, 4), (24, 1), (30, 6)]
    batch, num_slots = make_batch(specs, shared=20, seed=2)
    (stacked, stacked_k), (layered, layered_k) = both_paths(model, batch, num_slots, seed=2)
    assert agreement(stacked, layered) <= TOLERANCE
    for a, b in zip(stacked_k, layered_k):
        assert agreement(a.float(), b.float()) <= TOLERANCE


def test_deterministic_steps_are_batch_invariant(family):
    """A prompt in chunks, then two sequences sharing it, against each prompt alone: every
    token's logits bit for bit."""
    name, model = family
    prompts, steps = chunked_then_shared(longest_context(name))
    assert differences(model, prompts, steps, deterministic=True) == 0


def chunked_then_shared(length: int) -> tuple[list[Sequence], list[list[tuple[int, int, int]]]]:
    """A prompt of `length` random tokens and 3 more in chunks, then a second sequence sharing
    its first `length` tokens, as `differences` takes them."""
    rng = random.Random(0)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(length)]
    own_slots = torch.arange(length + 3, length + 5)
    prompts = [Sequence(shared + [5, 6, 7], torch.arange(length + 3), length, True),
               Sequence(shared + [8, 9], torch.cat([torch.arange(length), own_slots]), length, False)]
    return prompts, [[(0, 0, 37)], [(0, 37, length)], [(0, length, length + 3), (1, length, length + 2)]]


def test_a_decode_run_equals_as_many_single_steps(family):
    """Greedy and sampled rows, a shared prefix, contexts crossing a 256-key chunk and the windows
    during the run: tokens and log-probabilities bit for bit, the same K/V written."""
    name, model = family
    steps = 6
    contexts = [98, 20, 50] if longest_context(name) < 256 else [253, 20, 290]
    slots, num_slots = sequences(contexts, 16, steps, seed=3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=0, top_logprobs_num=3)]  # fmt: skip
    seeds, tokens, stops = [1, 12, 23], [3, 10, 17], [[], [], []]
    reference = deterministic_runner(model, num_slots)
    want_tokens, want_logprobs, _ = step_by_step(reference, tokens, contexts, slots, params, seeds, stops, steps)
    runner = deterministic_runner(model, num_slots)
    sampling = run_sampling(params, seeds, [[], [], []], [[], [], []], stops, steps, TINY_VOCAB)
    out = runner.decode_run(tokens, contexts, slots, sampling, steps)
    assert torch.equal(out.tokens, want_tokens)
    assert torch.equal(out.logprobs, want_logprobs)
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.k, reference.kv_cache.k))


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)  # the family with a final logit cap
def test_the_final_soft_cap_is_applied_to_the_kernels_logits(family):
    """Gemma 2's logits out of the kernel are capped as `compute_logits` caps the hidden states'."""
    name, model = family
    cap = model.config.final_logit_softcapping
    assert cap is not None
    batch, num_slots = make_batch([(30, 1), (8, 1)], shared=0, seed=4)
    logits = filled_runner(model, num_slots, seed=4).forward(batch)
    other = filled_runner(model, num_slots, seed=4)
    whole_step = other.whole_step
    assert whole_step is not None
    hidden = whole_step.stack.hidden_states(model.embedding_table(), model.rope_tables(max(batch.seq_lens)), batch,
                                            other.kv_cache, whole_step.plan(batch))  # fmt: skip
    hidden = model.final_norm(hidden)
    uncapped = model._lm_head(hidden).float()
    assert float(uncapped.abs().max()) > cap, "the cap changes these logits"
    assert float(logits.abs().max()) < cap
    assert agreement(logits, model.compute_logits(hidden)) <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen2-window", "gemma3"])
def test_native_weights_of_a_family_lie_side_by_side_and_run_on_the_kernel(name, make_tiny_hf_model):
    """A family on native 4-bit weights (as a GGUF file gives them): its packed weights moved into
    one buffer in the order a step reads them, the kernel reading those copies, its decodes as the
    layer path's (biases kept on the moved weights)."""
    if cpu.decode_stack() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: no quantized kernels")
    architecture, overrides = FAMILIES[name]
    model = prepacked(make_tiny_hf_model(architecture, **overrides), torch.bfloat16)
    shapes = model.decoder_layers()[0].projection_shapes()
    layers = [{part: random_int4(*shape, seed=10 * i + j) for j, (part, shape) in enumerate(shapes.items())}
              for i in range(model.config.num_layers)]  # fmt: skip
    model.use_int4_projections(NativeWeights(layers, random_int8(TINY_VOCAB, model.config.hidden_size, seed=99)))
    stack = WholeStep.stack_for(model)
    assert stack is not None
    packed = [weight for layer in model.decoder_layers() for weight in layer.stack_steps.packed_weights()]
    at = packed[0].data.data_ptr()
    for weight in packed:
        assert weight.data.data_ptr() == at
        at += -(-weight.data.numel() // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT
    handle = stack.weights(model.embedding_table())
    for i, layer in enumerate(model.decoder_layers()):
        steps = layer.stack_steps
        addresses = [weight.data.data_ptr() for weight in steps.packed_weights()]
        assert [handle.layer_addresses(i)[j] for j in (1, 2, 4, 5)] == addresses
        assert layer.qkv.weight.data.data_ptr() == steps.qkv.data.data_ptr() and layer.qkv.bias is layer.qkv_bias
        assert [weight.data.data_ptr() for weight in layer.packed_projections.values()] == addresses, "no stale copy"
    batch, num_slots = make_batch([(70, 1), (5, 1), (30, 1)], shared=0, seed=6)
    (stacked, _), (layered, _) = both_paths(model, batch, num_slots, seed=6)
    if name in EXACT:
        assert torch.equal(stacked, layered)
    else:
        assert agreement(stacked, layered) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_a_dense_gemma2_is_batch_invariant_with_its_score_cap(dtype, make_tiny_hf_model):
    """Gemma 2 on dense weights, deterministic steps layer by layer: the C attention caps the scores
    (each layer's window too). Every token's logits are those it gets alone, bit for bit, and within
    the tolerance of the default path's (which caps explicit scores in torch); the same weights
    without the cap are far outside it, so a cap left out would show."""
    if cpu.rowwise_matmul() is None:
        pytest.skip("no C compiler: deterministic mode needs radixrt's kernels")
    architecture, overrides = FAMILIES["gemma2"]
    model = prepacked(make_tiny_hf_model(architecture, **overrides), dtype)
    assert model.config.attn_logit_softcapping is not None and WholeStep.stack_for(model) is None
    uncapped = prepacked(make_tiny_hf_model(architecture, **dict(overrides, attn_logit_softcapping=None)), dtype)
    length = 300
    prompts, steps = chunked_then_shared(length)
    assert differences(model, prompts, steps, deterministic=True) == 0
    num_slots = length + 5
    deterministic = logits_of_every_token(runner_for(model, num_slots, True), prompts, steps)
    default = logits_of_every_token(runner_for(model, num_slots, False), prompts, steps)
    without_cap = logits_of_every_token(runner_for(uncapped, num_slots, False), prompts, steps)
    tolerance = TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE
    assert max(agreement(deterministic[key], default[key]) for key in default) <= tolerance
    assert max(agreement(without_cap[key], default[key]) for key in default) > 10 * tolerance
