"""Decode-sized steps of a Llama-family model on native quantized weights, in C.

A batch-1 decode step of the bundled model is ~30 small torch ops a layer;
their dispatch and allocations cost more than the arithmetic. With radixrt's
quantized kernels available (any packed format, `cpu.PackedWeight`), a plain
Llama layer (no biases, no q/k norms, SwiGLU, full rotary) runs its norms,
projections, RoPE, SwiGLU and residual adds in `kernels/cpu/int4_layer.c`,
rounding to bf16 where the torch layer does; only attention stays with the
backend, so every backend and attention variant still applies
(`Int4LayerSteps`; other families' layers run their torch ops over the same
packed weights there).

When every layer has its projections packed and the attention is radixrt's own
C attention over a bf16 pool, the whole step runs in one call
(`Int4DecodeStack`, `kernels/cpu/decode_stack.c`), from the embedding lookup
to the logits when the LM head is the file's own: the threads forked once a
step instead of once an op. That kernel runs every family the model runs:
Llama and Mistral, Qwen2's q/k/v biases, Qwen3's per-head q/k norms (and
biases), Phi-3's partial rotary, Gemma 2's and 3's norms around each sublayer,
GELU-tanh, embedding scale, softmax scale, score and logit soft-caps and
Gemma 3's second rope table, and sliding windows (at most two attention plans:
full and one window). `stack_extras` fills in each layer's rope table and attention plan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence

import torch

from radixrt.kernels import cpu
from radixrt.kernels.base import LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.segments import AttentionSegments
from radixrt.memory.kv_cache import KVCache
from radixrt.model import gemma
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_int4 import Int4Weight


@dataclasses.dataclass(frozen=True)
class Int4LayerSteps:
    """One layer's packed 4-bit weights and norms, and the two calls that use them."""

    kernels: cpu.Int4Layer
    qkv: cpu.PackedWeight
    o: cpu.PackedWeight
    gate_up: cpu.PackedWeight
    down: cpu.PackedWeight
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    heads: tuple[int, int, int]  # q heads, kv heads, head_dim
    # what the layer adds to a plain Llama layer (biases, norms), for the whole-step kernel only:
    # the two calls here run plain layers (None)
    extras: cpu.LayerExtras | None = None

    @staticmethod
    def create(
        weights: Mapping[str, Int4Weight | cpu.PackedWeight], input_norm: torch.Tensor, post_attention_norm: torch.Tensor,
        eps: float, num_heads: int, num_kv_heads: int, head_dim: int, extras: cpu.LayerExtras | None = None,
    ) -> Int4LayerSteps | None:
        """The steps for this layer (its weights as codes, or already in the kernel's layout), or
        None where the kernels do not run (no C compiler, non-bf16 norms, shapes
        outside the kernel's tiles). `extras`: the layer's features beyond a plain Llama layer
        (the whole-step kernel runs them; `attention_inputs` and `finish` do not)."""
        kernels, matmul = cpu.int4_layer(), cpu.quantized_matmul()
        if kernels is None or matmul is None or input_norm.dtype != torch.bfloat16:
            return None
        added = [] if extras is None else [tensor for tensor in extras.tensors if tensor is not None]
        if any(tensor.dtype != torch.bfloat16 or not tensor.is_contiguous() for tensor in added):
            return None
        if not all(isinstance(w, cpu.PackedWeight) or matmul.supports(w.shape) for w in weights.values()):
            return None
        packed = {name: w if isinstance(w, cpu.PackedWeight) else matmul.pack_int4(w.codes, w.scales, w.offsets)
                  for name, w in weights.items()}  # fmt: skip
        return Int4LayerSteps(
            kernels, packed["qkv"], packed["o"], packed["gate_up"], packed["down"], input_norm, post_attention_norm,
            eps, (num_heads, num_kv_heads, head_dim), extras,
        )  # fmt: skip

    def packed_weights(self) -> tuple[cpu.PackedWeight, ...]:
        """qkv, o, gate_up and down, in the order a step multiplies them."""
        return (self.qkv, self.o, self.gate_up, self.down)

    def with_packed_data(self, data: Iterator[torch.Tensor]) -> Int4LayerSteps:
        """These steps with each packed weight's bytes the next of `data` (equal copies, in
        `packed_weights` order)."""
        qkv, o, gate_up, down = (packed._replace(data=next(data)) for packed in self.packed_weights())
        return dataclasses.replace(self, qkv=qkv, o=o, gate_up=gate_up, down=down)

    def attention_inputs(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """[T, q + k + v heads, head_dim]: q and k rotated, as the torch layer computes them (a plain layer)."""
        num_heads, num_kv_heads, head_dim = self.heads
        qkv = self.kernels.attention_inputs(
            hidden, self.input_norm, self.eps, self.qkv, cos, signed_sin, num_heads + num_kv_heads, head_dim
        )
        return qkv.view(hidden.shape[0], -1, head_dim)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """`hidden` with the attention output's projection and the MLP added, in place."""
        return self.kernels.finish(hidden, attn, self.o, self.post_attention_norm, self.eps, self.gate_up, self.down)


RopeTables = Sequence[tuple[torch.Tensor, torch.Tensor]]  # each table's (cos, signed_sin), `RotaryEmbedding.tables`


class Int4DecodeStack:
    """Every layer's `Int4LayerSteps` run as one C call (see the module docstring)."""

    def __init__(self, kernel: cpu.DecodeStack, layers: Sequence[Int4LayerSteps], intermediate: int,
                 extras: cpu.ModelExtras):
        self._kernel = kernel
        self._layers = tuple(layers)
        self._intermediate = intermediate
        self._extras = extras
        # each attention plan's sliding window (None: full attention), in the order a step's segments are given
        self.windows: tuple[int | None, ...] = tuple(window or None for window in extras.windows)
        self._run_kernel = cpu.decode_run()
        # the model handle for the last (embedding, final norm, head) asked for, keeping them alive
        self._handle: tuple[tuple[int, ...], cpu.StackWeights] | None = None
        # the last pools' address tables, for as long as those pools live
        self._pools: tuple[weakref.ref[KVCache], torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def create(layers: Sequence[Int4LayerSteps | None], intermediate: int,
               extras: cpu.ModelExtras | None = None) -> Int4DecodeStack | None:
        """The stack over these layers (their `extras` naming their rope table and attention plan,
        `extras` the model's), or None unless every layer has its packed steps (alike in heads and
        norm epsilon) and the kernel built."""
        kernel = cpu.decode_stack()
        steps = [layer for layer in layers if layer is not None]
        if kernel is None or not steps or len(steps) != len(layers):
            return None
        if len({(layer.heads, layer.eps) for layer in steps}) != 1:
            return None
        return Int4DecodeStack(kernel, steps, intermediate, cpu.ModelExtras() if extras is None else extras)

    def weights(self, embedding: torch.Tensor | cpu.PackedWeight, final_norm: torch.Tensor | None = None,
                head: cpu.PackedWeight | None = None) -> cpu.StackWeights:
        """The kernels' model handle over the layers, `embedding` ([vocab, dim] bf16, or packed: its
        rows dequantized as looked up), and the final norm and packed LM head; built once for
        each (embedding, norm, head) in turn (a model passes the same ones at every step)."""
        key = tuple(0 if t is None else t.data_ptr() for t in (
            embedding if isinstance(embedding, torch.Tensor) else embedding.data, final_norm,
            None if head is None else head.data))  # fmt: skip
        if self._handle is None or self._handle[0] != key:
            layers = [cpu.LayerWeights(layer.input_norm, layer.post_attention_norm, layer.qkv, layer.o, layer.gate_up,
                                       layer.down, layer.extras) for layer in self._layers]  # fmt: skip
            first = self._layers[0]
            handle = self._kernel.weights(embedding, layers, final_norm, head, first.eps, first.heads,
                                          self._intermediate, self._extras)  # fmt: skip
            self._handle = (key, handle)
        return self._handle[1]

    def hidden_states(
        self, embedding: torch.Tensor | cpu.PackedWeight, rope_tables: RopeTables, batch: ForwardBatch,
        kv_cache: KVCache, segments: Sequence[AttentionSegments],
    ) -> torch.Tensor:
        """The step's hidden states after the last layer (before the final norm), [T, dim]: its
        tokens looked up in `embedding`, rotated with rows of `rope_tables` (`RotaryEmbedding.tables`
        of each table the layers name), each layer's new K/V stored at `batch.out_slots` and
        attended with `segments[its plan]` (one per `windows`). `embedding`: [vocab, dim] bf16, or a
        packed weight (a tied LM head, or the file's own table)."""
        hidden = torch.empty(batch.num_tokens, self._layers[0].input_norm.shape[0], dtype=torch.bfloat16)
        self._run(self.weights(embedding), rope_tables, batch, kv_cache, segments, hidden, None)
        return hidden

    def logits(
        self, embedding: torch.Tensor | cpu.PackedWeight, rope_tables: RopeTables, batch: ForwardBatch,
        kv_cache: KVCache, segments: Sequence[AttentionSegments], final_norm: torch.Tensor,
        head: cpu.PackedWeight, logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits [len(logit_rows), head rows] of the step's rows `logit_rows` after the
        final norm, through the packed LM head (soft-capped where the model says):
        `hidden_states`, norm and head in the same call."""
        logits = torch.empty(logit_rows.shape[0], head.num_rows, dtype=torch.float32)
        self._run(self.weights(embedding, final_norm, head), rope_tables, batch, kv_cache, segments, None,
                  (logit_rows, logits))  # fmt: skip
        return logits

    def decode_run(
        self, embedding: torch.Tensor | cpu.PackedWeight, rope_tables: RopeTables, kv_cache: KVCache,
        final_norm: torch.Tensor, head: cpu.PackedWeight, rows: cpu.RunRows,
        sampling: cpu.RunSampling, num_steps: int, interrupt: ctypes.c_int32 | None = None,
    ) -> cpu.RunOutput:
        """Up to `num_steps` decode steps of `rows` in one call, each sampling the next tokens
        (`cpu.DecodeRun`, `cpu.RunOutput`)."""
        assert self._run_kernel is not None  # built with the stack's own kernel
        k_pools, v_pools = self._pool_addresses(kv_cache)
        return self._run_kernel(
            self.weights(embedding, final_norm, head), k_pools, v_pools, kv_cache.k[0].shape[0], rope_tables,
            rows, sampling, num_steps, interrupt,
        )  # fmt: skip

    def _run(
        self, weights: cpu.StackWeights, rope_tables: RopeTables, batch: ForwardBatch,
        kv_cache: KVCache, segments: Sequence[AttentionSegments], hidden: torch.Tensor | None,
        logits: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        k_pools, v_pools = self._pool_addresses(kv_cache)
        self._kernel(
            weights, batch.input_ids, hidden, k_pools, v_pools, kv_cache.k[0].shape[0], batch.positions,
            rope_tables, batch.out_slots, batch.kv_indices,
            [(plan.starts, plan.lens, plan.row_ptr, plan.rows) for plan in segments], logits,
        )  # fmt: skip

    def _pool_addresses(self, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pools is None or self._pools[0]() is not kv_cache:
            k = torch.tensor([pool.data_ptr() for pool in kv_cache.k], dtype=torch.int64)
            v = torch.tensor([pool.data_ptr() for pool in kv_cache.v], dtype=torch.int64)
            self._pools = (weakref.ref(kv_cache), k, v)
        return self._pools[1], self._pools[2]


def stack_extras(
    config: ModelConfig, attentions: Sequence[LayerAttention], steps: Sequence[Int4LayerSteps | None],
    rope_indices: Sequence[int],
) -> tuple[list[Int4LayerSteps], cpu.ModelExtras] | None:
    """Each layer's steps with its rope table (`rope_indices`), attention plan, softmax scale and
    score cap filled in, and the model's features, for `Int4DecodeStack.create`; None where the
    kernel cannot run the model (a layer without its packed steps, more distinct windows than
    its attention plans)."""
    windows = tuple(dict.fromkeys(attention.sliding_window or 0 for attention in attentions))
    if len(windows) > cpu.STACK_MAX_PLANS or max(rope_indices, default=0) >= cpu.STACK_MAX_ROPES:
        return None
    filled: list[Int4LayerSteps] = []
    for attention, layer_steps, rope in zip(attentions, steps, rope_indices):
        if layer_steps is None:
            return None
        base = layer_steps.extras or cpu.LayerExtras()
        extras = base._replace(rope=rope, plan=windows.index(attention.sliding_window or 0),
                               scale=attention.scale, softcap=attention.logit_softcap or 0.0)  # fmt: skip
        filled.append(dataclasses.replace(layer_steps, extras=extras))
    final_cap = config.final_logit_softcapping
    embedding_scale = gemma.embedding_scale(config.hidden_size, torch.bfloat16) if config.is_gemma else None
    model = cpu.ModelExtras(config.rotary_dim, windows, config.is_gemma, embedding_scale,
                            0.0 if final_cap is None else final_cap)  # fmt: skip
    return filled, model
