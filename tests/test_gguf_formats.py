"""Every GGUF format with a packed layout on the native path: tiny random Llamas of one type, and
llama.cpp's Q4_K_M mix (Q4_K with Q6_K v/down rows on some layers and a Q6_K output), loaded
straight from the file's blocks into the whole-step kernel, against gguf's dequantizer and a
dense run of the same weights."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixrt.benchmarks.gguf_models import LlamaShape, write_llama_gguf
from radixrt.kernels import cpu
from radixrt.model import gguf_loader, gguf_plan, linear
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile
from radixrt.model.executors import WholeStep
from radixrt.model.gguf_int4 import PROJECTIONS
from radixrt.model.loader import LoadedModel, load_model
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import run_sampling
from tests.test_decode_run import deterministic_runner, sequences, step_by_step
from tests.test_decode_stack import both_paths, make_batch
from tests.test_gguf_native import cache_dir, file_order, logits_of, with_dims  # noqa: F401 (cache_dir: autouse)

# K-quant rows are whole blocks of 256 inputs: every projection's inputs are 256 or 512 wide
SHAPE = LlamaShape(num_layers=3, hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, tied=False)
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Q4_0 projections with parts of other formats fused into them (pack_gguf.c's Q4_0 rows beside
# the formats' own packers in one weight), and a Q5_K embedding beside a Q8_0 head
LEGACY_MIX = {"blk.0.attn_v.weight": "Q5_1", "blk.0.ffn_up.weight": "Q8_0", "blk.1.attn_k.weight": "Q4_1",
              "blk.2.attn_q.weight": "Q6_K", "token_embd.weight": "Q5_K"}  # fmt: skip
# A native run multiplies by the file's exact weights with float32 sums, the dense run by bf16
# weights through bf16 GEMMs: logits (~3 at most here) differ by the weights' bf16 rounding
LOGIT_ATOL = 0.05

pytestmark = pytest.mark.skipif(cpu.quantized_matmul() is None, reason="no packed kernels (no C compiler)")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("formats")
    written = {"Q4_K_M": write_llama_gguf(folder / "q4_k_m.gguf", SHAPE, mix="Q4_K_M", seed=3),
               "legacy mix": write_llama_gguf(folder / "legacy.gguf", SHAPE, types=LEGACY_MIX, seed=9)}
    for seed, kind in enumerate(FORMATS):
        written[kind] = write_llama_gguf(folder / f"{kind.lower()}.gguf", SHAPE, projection_type=kind,
                                         embedding_type=kind, seed=seed)  # fmt: skip
    return written


@pytest.fixture(scope="module")
def mix(files: dict[str, Path]) -> LoadedModel:
    return load_model(files["Q4_K_M"], dtype="bfloat16", weights="native")


def reference(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as gguf's reference dequantizer gives it, float32, file row order."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(str(path)).tensors}  # fmt: skip


def plan_of(path: Path, config: ModelConfig) -> gguf_plan.TensorPlan:
    dtype = torch.bfloat16
    return gguf_plan.plan_tensors(GGUFFile(path), config, True, gguf_loader.native_runs(dtype),
                                  gguf_loader.lookup_runs(dtype))  # fmt: skip


def test_the_q4_k_m_mix_puts_every_tensor_on_the_native_path(files, mix):
    plan = plan_of(files["Q4_K_M"], mix.config)
    assert not plan.fallback and not any(plan.dense)
    assert all(len(layer) == len(PROJECTIONS) for layer in plan.native)
    assert plan.head is not None and plan.head.type_name == "Q6_K"
    assert plan.embedding is not None and plan.embedding.type_name == "Q4_K"
    model = mix.model
    assert WholeStep.stack_for(model) is not None and mix.weights == "native"
    layouts = [[{part.format for part in weight.layout()} for weight in layer.int4_steps.packed_weights()]
               for layer in model.layers]  # fmt: skip
    q4_k, q6_k = cpu.FORMATS["Q4_K"], cpu.FORMATS["Q6_K"]
    assert layouts[0] == [{q4_k}] * 4, "layer 0: every part Q4_K"
    assert layouts[2] == [{q4_k, q6_k}, {q4_k}, {q4_k}, {q6_k}], "layer 2: Q6_K v rows in a Q4_K qkv, Q6_K down"
    assert {part.format for part in model._invariant_lm_head.packed.layout()} == {q6_k}
    # the mix as loaded, every parameter counted once in the format it runs in
    formats = model.weight_formats()
    assert set(formats) == {"Q4_K", "Q6_K", "BF16"}  # BF16: the norms
    file_elements = sum(math.prod(tensor.shape) for tensor in GGUFFile(files["Q4_K_M"]).tensors.values())
    assert sum(formats.values()) == file_elements


def check_packed_weights(loaded: LoadedModel, path: Path) -> None:
    """Every projection's packed rows (q/k in Hugging Face order), the head's and the embedding's,
    dequantized as bf16, equal gguf's float32 values rounded once to bf16."""
    expected = {name: torch.from_numpy(values.copy()) for name, values in reference(path).items()}
    model, matmul = loaded.model, cpu.quantized_matmul()
    assert matmul is not None
    for index, layer in enumerate(model.layers):
        for fused, weight in zip(PROJECTIONS, layer.int4_steps.packed_weights()):
            rows = matmul.rows(weight, torch.arange(weight.num_rows))
            start = 0
            for name in PROJECTIONS[fused]:
                tensor = f"blk.{index}.{name}.weight"
                part = rows[start : start + expected[tensor].shape[0]]
                want = expected[tensor].to(torch.bfloat16).float().numpy()
                assert np.array_equal(file_order(part, tensor, SHAPE), want), tensor
                start += part.shape[0]
    head = model._invariant_lm_head.packed
    assert torch.equal(matmul.rows(head, torch.arange(head.num_rows)), expected["output.weight"].to(torch.bfloat16))
    ids = torch.tensor([0, 1, 15, 16, 4097, SHAPE.vocab - 1])
    assert torch.equal(model._embed(ids), expected["token_embd.weight"][ids].to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["Q4_K_M", "legacy mix", *FORMATS])
def test_each_format_packs_to_ggufs_values_and_runs_as_a_dense_run_of_them(files, kind):
    """The packed weights are gguf's (`check_packed_weights`); logits within LOGIT_ATOL of a dense
    run's and the same greedy token, for a step the whole-step kernel runs and for a prompt longer
    than it takes (projections one at a time)."""
    native = load_model(files[kind], dtype="bfloat16", weights="native")
    check_packed_weights(native, files[kind])
    dense = load_model(files[kind], dtype="bfloat16", weights="dense")
    assert WholeStep.stack_for(native.model) is not None and dense.weights == "dense"
    for text in ("The quick brown fox", "The quick brown fox jumps over the lazy dog. " * 8):
        ids = native.tokenizer.encode(text)
        ours, theirs = logits_of(native, ids), logits_of(dense, ids)
        torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)
        assert ours.argmax() == theirs.argmax()


def test_a_native_load_holds_no_dense_projection_head_or_embedding(mix):
    model = mix.model
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert all(getattr(layer, name).numel() == 0 for layer in model.layers for name in projections)
    assert model.embed_tokens.numel() == 0 and model.lm_head.numel() == 0
    live = sum(p.numel() * p.element_size() for p in model.parameters())
    assert live == (1 + 2 * SHAPE.num_layers) * SHAPE.hidden * 2, "norms only: the rest is the file's, packed"


def test_the_whole_step_kernel_is_bit_identical_to_the_layer_path_on_mixed_formats(mix):
    """Decode steps of the Q4_K_M mix through the whole-step kernel and through the layers one at
    a time (int4_layer.c, the packed embedding looked up in Python, the head's own call): the
    same logits and K/V bit for bit."""
    batch, num_slots = make_batch([(300, 1), (5, 1), (0, 1), (40, 1)], shared=0, seed=4)
    (stacked, stacked_k), (layered, layered_k) = both_paths(mix.model, batch, num_slots, seed=1)
    assert torch.equal(stacked, layered)
    assert all(torch.equal(a, b) for a, b in zip(stacked_k, layered_k))


def test_a_decode_run_gives_what_single_steps_give(mix):
    """k decode steps of the mixed model in one call equal k single steps, tokens and log-probs bit
    for bit, the same K/V written."""
    contexts, steps = [37, 300, 5], 5
    slots, num_slots = sequences(contexts, 0, steps, seed=1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=0, repetition_penalty=1.3)]
    seeds, tokens, stops = [1, 5, 0], [7, 8, 9], [[] for _ in contexts]
    prompts, earlier = [[1, 2, 3]] * 3, [[]] * 3
    reference_runner = deterministic_runner(mix.model, num_slots)
    want_tokens, want_logprobs, _ = step_by_step(reference_runner, tokens, contexts, slots, params, seeds, stops,
                                                 steps, prompts, earlier)  # fmt: skip
    runner = deterministic_runner(mix.model, num_slots)
    sampling = run_sampling(params, seeds, prompts, earlier, stops, steps, SHAPE.vocab)
    out = runner.decode_run(tokens, contexts, slots, sampling, steps)
    assert torch.equal(out.tokens, want_tokens) and torch.equal(out.logprobs, want_logprobs)
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.k, reference_runner.kv_cache.k))
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.v, reference_runner.kv_cache.v))


def test_types_without_a_packed_layout_load_dense_with_a_warning_naming_them(tmp_path, caplog):
    types = {"blk.1.attn_v.weight": "Q2_K", "blk.0.ffn_down.weight": "Q3_K"}
    path = write_llama_gguf(tmp_path / "low.gguf", SHAPE, mix="Q4_K_M", types=types, seed=4)
    with caplog.at_level(logging.WARNING, logger="radixrt.model.gguf_loader"):
        loaded = load_model(path, dtype="bfloat16", weights="native")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "slower dense path" in warnings[0], warnings
    assert "Q2_K: blk.1.attn_v.weight" in warnings[0] and "Q3_K: blk.0.ffn_down.weight" in warnings[0]
    first, second, third = loaded.model.layers
    assert first.down_proj.shape == (SHAPE.hidden, SHAPE.intermediate) and first.qkv_proj.numel() == 0
    assert second.qkv_proj.shape[0] == (SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * SHAPE.head_dim
    assert second.down_proj.numel() == 0 and third.int4_steps is not None
    dense = load_model(path, dtype="bfloat16", weights="dense")
    ids = loaded.tokenizer.encode("The quick brown fox")
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(dense, ids), atol=LOGIT_ATOL, rtol=0)


def test_a_type_without_any_dequantizer_is_refused_by_name(tmp_path):
    path = write_llama_gguf(tmp_path / "q8_k.gguf", SHAPE, mix="Q4_K_M", types={"blk.2.ffn_up.weight": "Q8_K"})
    for weights in ("native", "dense"):
        with pytest.raises(ValueError, match=r"no dequantizer for Q8_K: blk\.2\.ffn_up\.weight"):
            load_model(path, dtype="bfloat16", weights=weights)


def test_a_k_quant_shape_that_does_not_match_its_blocks_is_refused(files, tmp_path):
    rows, cols = SHAPE.intermediate, SHAPE.hidden
    source = files["Q4_K_M"]
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate\.weight \(Q4_K\) .* whole blocks of 256"):
        load_model(with_dims(source, tmp_path / "a.gguf", "blk.0.ffn_gate.weight", (cols + 32, rows)))
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate\.weight runs into tensor .*corrupt"):
        load_model(with_dims(source, tmp_path / "b.gguf", "blk.0.ffn_gate.weight", (cols, rows + 16)))


def test_a_prefill_multiplies_densely_by_the_dequantized_weights(mix):
    """A step of more rows than the whole-step kernel takes (non-deterministic): each projection a
    bf16 GEMM over its weight dequantized, bit for bit F.linear over the packed rows as bf16; a
    step of fewer rows, or one whose rows must not depend on the batch, the quantized kernel."""
    matmul = cpu.quantized_matmul()
    assert matmul is not None
    weight = mix.model.layers[2].int4_steps.qkv  # Q4_K q and k rows, Q6_K v rows
    project = linear.packed(weight)
    x = torch.randn(linear.DENSE_MIN_ROWS + 3, SHAPE.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    dense = torch.nn.functional.linear(x, matmul.rows(weight, torch.arange(weight.num_rows)))
    assert torch.equal(project(x), dense)
    assert torch.equal(project(x[:8]), matmul(x[:8], weight))
    assert torch.equal(project.invariant()(x), matmul(x, weight)), "deterministic steps keep the kernel"
