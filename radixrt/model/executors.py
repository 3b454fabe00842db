"""How a step is computed: planned once, then run, by one of two executors the runner picks.

    ModelRunner.forward(batch)
        executor = whole_step if whole_step.takes(batch) else layers
        plan = executor.plan(batch)           # the step's attention, planned here and only here
        logits = executor.logits(batch, plan, rows)   # executor.run(batch, rows): both

`LayerByLayer` is the reference: the model's own forward (`LlamaForCausalLM`),
one layer class after another, each projection a `Linear` in the format its
weights were loaded in; its plan is the backend's plan for each distinct
`LayerAttention` of the layers (segments cut at whole chunks in deterministic
steps). `WholeStep` runs every layer of a step in one C call
(`Int4DecodeStack`, `kernels/cpu/decode_stack.c`) over the same packed
weights, from the embedding lookup to the logits, and runs several decode
steps in one call (`decode_run`); its plan is the step's attention as
segments, which the C kernel attends itself. The runner picks it where it
applies, as GPU engines pick graph replay: a model whose every layer runs on
packed weights (any family: `int4_layer`'s docstring lists what the kernel
runs; at most two distinct windows among the layers), a bf16 pool radixrt's C
attention reads in place, and a step of at most `STACK_MAX_ROWS` tokens
(every step, when steps are deterministic).

Both give the same logits for a step bit for bit where their arithmetic is
the same (`tests/test_decode_stack.py` says where), and deterministic steps
are batch-invariant through either (`docs/determinism.md`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from radixrt.kernels import cpu
from radixrt.kernels.base import AttentionBackend, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.segments import (
    AttentionSegments,
    aligned_attention_segments,
    attention_segments,
    shared_chunk_owners,
)
from radixrt.model import linear
from radixrt.model.int4_layer import Int4DecodeStack
from radixrt.model.llama import LlamaForCausalLM

# Steps of at most this many tokens the whole-step kernel runs when steps are not deterministic:
# without the layer path's torch ops between products it is the faster one for decodes, extends
# and mixes of both up to here; beyond, the step is compute-bound and the dense GEMM wins
# (measured: docs/benchmarks.md, "The whole-step kernel's row limit").
STACK_MAX_ROWS = 64


class LayerByLayer:
    """The model's own forward over `backend`: one plan per distinct `LayerAttention`."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend[Any], deterministic: bool):
        self.model = model
        self.backend = backend
        self.deterministic = deterministic

    def plan(self, batch: ForwardBatch) -> Mapping[LayerAttention, Any]:
        """The backend's plan of `batch` for each way the layers attend; in deterministic steps,
        segment plans cut at whole chunks (`aligned_attention_segments`), one per window."""
        backend, kinds = self.backend, self.model.attention_kinds
        if not self.deterministic:
            return {kind: backend.plan(batch, kind) for kind in kinds}
        min_shared, chunk = backend.shared_prefix_min_tokens, backend.attention_chunk
        chunked = {window: aligned_attention_segments(batch, min_shared, chunk, window)
                   for window in {kind.sliding_window for kind in kinds}}  # fmt: skip
        return {kind: backend.plan_segments(chunked[kind.sliding_window], kind) for kind in kinds}

    def run(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        return self.logits(batch, self.plan(batch), logit_rows)

    def logits(self, batch: ForwardBatch, plan: Mapping[LayerAttention, Any], logit_rows: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward(batch, self.backend, plan, self.deterministic)
        return self.model.compute_logits(hidden.index_select(0, logit_rows.to(hidden.device)), self.deterministic)


class WholeStep:
    """Every layer of a step in one C call, over the model's packed weights (see the module docstring).

    Owns the C model handle (`Int4DecodeStack`): built once, over the layers' packed weights,
    the embedding table (dense, or rows looked up quantized), the final norm and the file's
    own LM head where it is in a packed format."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend[Any], deterministic: bool,
                 stack: Int4DecodeStack):
        self.model = model
        self.backend = backend
        self.deterministic = deterministic
        self.stack = stack
        head = model.invariant_lm_head
        self.head = head if isinstance(head, linear.PackedLMHead) else None  # else the model's dense head

    @staticmethod
    def create(model: LlamaForCausalLM, backend: AttentionBackend[Any], deterministic: bool) -> WholeStep | None:
        """The executor where it applies to `model` over `backend` (see the module docstring),
        else None. Deterministic steps must be possible (`deterministic_problem` is None)."""
        if not (backend.attends_segments if deterministic else backend.reads_pool_in_place):
            return None
        stack = WholeStep.stack_for(model)
        return None if stack is None else WholeStep(model, backend, deterministic, stack)

    @staticmethod
    def stack_for(model: LlamaForCausalLM) -> Int4DecodeStack | None:
        """The kernel's model over `model`'s layers, or None where it does not run them: every
        layer on packed weights (`Int4LayerSteps`), at most two distinct windows
        (`LlamaForCausalLM.stack_layers`); each layer's biases, norms, rope table, window,
        softmax scale and score cap, and the model's Gemma arithmetic and logit cap, go with it."""
        layers = model.stack_layers()
        if layers is None:
            return None
        return Int4DecodeStack.create(layers[0], model.config.intermediate_size, layers[1])

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether this executor runs `batch`: every deterministic step, others of at most `STACK_MAX_ROWS` tokens."""
        return self.deterministic or batch.num_tokens <= STACK_MAX_ROWS

    def plan(self, batch: ForwardBatch) -> tuple[AttentionSegments, ...]:
        """The step's attention as segments, one plan per window of the layers
        (`Int4DecodeStack.windows`): cut at whole chunks in deterministic steps and for a
        window (`aligned_attention_segments`)."""
        min_shared, chunk = self.backend.shared_prefix_min_tokens, self.backend.attention_chunk
        return tuple(attention_segments(batch, min_shared) if window is None and not self.deterministic
                     else aligned_attention_segments(batch, min_shared, chunk, window)
                     for window in self.stack.windows)  # fmt: skip

    def run(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        return self.logits(batch, self.plan(batch), logit_rows)

    def logits(
        self, batch: ForwardBatch, plan: tuple[AttentionSegments, ...], logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """float32 logits of rows of the step: all of it in the kernel's call when the LM head is
        the file's own in a packed format, else the kernel's hidden states through the model's head."""
        model, kv_cache = self.model, self.backend.kv_cache
        embedding, tables = model.embedding_table(), model.rope_tables(max(batch.seq_lens))
        if self.head is not None:
            return self.stack.logits(embedding, tables, batch, kv_cache, plan, model.norm, self.head.packed,
                                     logit_rows.contiguous())  # fmt: skip
        hidden = model.final_norm(self.stack.hidden_states(embedding, tables, batch, kv_cache, plan))
        return model.compute_logits(hidden.index_select(0, logit_rows), self.deterministic)

    @property
    def runs_decodes(self) -> bool:
        """Whether `decode_run` applies: deterministic steps, the file's own LM head in a packed
        format (the run samples its logits, soft-capped where the model says, in C)."""
        return self.deterministic and self.head is not None

    def decode_run(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[torch.Tensor],
        sampling: cpu.RunSampling, num_steps: int, interrupt: ctypes.c_int32 | None = None,
    ) -> cpu.RunOutput:
        """Up to `num_steps` deterministic decode steps in one call (check `runs_decodes` first):
        sequence i's last token `tokens[i]` at `positions[i]`, its slots `slots[i]` for positions
        0 .. positions[i] + num_steps - 1, sampled by `sampling` (`cpu.RunSampling`), stopping
        early after a step that drew a stop token or saw `interrupt` set. Returns the steps'
        tokens, log-probabilities and (if asked) top log-probabilities (`cpu.RunOutput`): what as
        many `logits` steps and `Sampler.sample` give, bit for bit. The run plans its attention
        itself, step by step, as `plan` would: each sequence's shared prefix found here, once."""
        assert self.runs_decodes and self.head is not None
        backend, chunk = self.backend, self.backend.attention_chunk
        lengths = [slot_list.numel() for slot_list in slots]
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        all_slots = torch.cat(list(slots))
        owners = shared_chunk_owners(all_slots, starts, positions, backend.shared_prefix_min_tokens, chunk)
        owner, shared_chunks = zip(*owners)
        index = torch.tensor([*tokens, *positions, *starts, *owner, *shared_chunks], dtype=torch.int64)
        count = len(tokens)
        rows = cpu.RunRows(index[:count], index[count : 2 * count], all_slots, index[2 * count : 3 * count],
                           index[3 * count : 4 * count], index[4 * count :], chunk)
        model = self.model
        tables = model.rope_tables(max(positions) + num_steps)
        return self.stack.decode_run(model.embedding_table(), tables, backend.kv_cache, model.norm, self.head.packed,
                                     rows, sampling, num_steps, interrupt)  # fmt: skip
