"""Our Llama-family decoder: the forward pass over the paged KV pool.

transformers only supplies configs and weights; this module runs them.
Every layer is a handful of large tensor ops over all new tokens of the batch
(no per-token Python): one fused q/k/v matmul, one rotary application to q and
k together, the attention backend, one fused gate/up matmul. Projections are
plain callables over the weights (`radixrt.model.linear`), not `nn.Linear`
modules: no module dispatch per op, and `prepack()` can swap in a faster
matmul once the weights are loaded.

The same classes run Gemma 2/3 (`config.is_gemma`: extra norms around the
sublayers, GeGLU, scaled embeddings, soft-capping; the arithmetic is in
`radixrt.model.gemma`) and Phi-3 (q/k/v and gate/up stored fused). Layers may
attend differently (a sliding window on some, a softmax scale, a score cap):
each layer has its `LayerAttention`, and a step is planned once per
distinct one (`radixrt.model.executors`).

This is the reference forward: the runner plans each step's attention and
picks how to run it (`radixrt.model.executors`); on native packed weights a
step may instead run every layer in one C call (`executors.WholeStep`) over
the weights the layers hold.

Deterministic steps (`deterministic=True` to `forward` and
`compute_logits`, after `prepare_deterministic`) make each token's logits
bitwise those it gets in any other batch (`docs/determinism.md`): on native
4-bit weights through that kernel and the file's own LM head whatever their
size; on dense weights through `linear.rowwise` projections and head and the
C attention reading the pool; attention cut at whole chunks either way.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels import cpu
from radixrt.kernels.base import AttentionBackend, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.memory import huge_pages
from radixrt.model import gemma, linear
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_int4 import Int4Weight, Int8Weight, NativeWeights
from radixrt.model.int4_layer import Int4LayerSteps, stack_extras
from radixrt.model.rope import RotaryEmbedding


# With native 4-bit weights, steps of at most this many tokens run a plain Llama
# layer in two C calls (`Int4LayerSteps`); larger ones (prefills, big decode
# batches) run the layer's torch ops over the same packed weights: no dense
# copy is kept, so they are slower than a dense bf16 GEMM (docs/benchmarks.md).
INT4_MAX_ROWS = 16


RMSNorm = Callable[..., torch.Tensor]  # (hidden, weight, eps, residual=None) -> normed
# the parameter that holds each fused projection's dense weight
_PROJECTION_PARAMETERS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
_FORMAT_NAMES = {number: name for name, number in cpu.FORMATS.items()}


def stored_formats(weight: Int4Weight | Int8Weight | cpu.PackedWeight) -> Counter[str]:
    """The parameters of a quantized weight by the format its kernel reads (GGUF type names)."""
    if isinstance(weight, Int4Weight):
        return Counter({"Q4_1": weight.codes.numel()})  # codes, a scale and an offset per group
    if isinstance(weight, Int8Weight):
        return Counter({"Q8_0": weight.shape[0] * weight.shape[1]})
    columns = weight.columns()
    counts: Counter[str] = Counter()
    for part in weight.layout():
        counts[_FORMAT_NAMES[part.format]] += part.num_rows * columns
    return counts


def packed_shape(weight: cpu.PackedWeight) -> tuple[int, int]:
    """[rows, inputs] of a weight in radixrt's packed layouts."""
    return weight.num_rows, weight.columns()


def _packed_on_first_call(weight: torch.Tensor, bias: torch.Tensor | None = None) -> linear.Linear:
    return linear.on_first_call(lambda: linear.pack(weight, bias))


def _torch_rms_norm(
    hidden: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        hidden.add_(residual)
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


def _rms_norm_for(device: torch.device, dtype: torch.dtype) -> RMSNorm:
    """radixrt's C RMSNorm for bf16 on the CPU (one pass instead of ~8 ops; transformers'
    RMSNorm arithmetic, rows reduced independently of the batch), else torch's: fp32 stays on torch, as our exactness tests compare it.
    Both add `residual` into `hidden` in place first when given."""
    kernel = cpu.rms_norm() if device.type == "cpu" and dtype == torch.bfloat16 else None
    return _torch_rms_norm if kernel is None else kernel


def _weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused projections.

    `qkv_proj` rows are [q heads | k heads | v heads]; `gate_up_proj` rows are
    [gate | up]: one matmul each instead of three and two. Gemma adds
    `pre_feedforward_norm` and `post_feedforward_norm` (and uses
    `post_attention_norm` on the attention output rather than before the MLP).
    """

    def __init__(
        self, config: ModelConfig, index: int, device: torch.device, dtype: torch.dtype, rms_norm: RMSNorm,
        dense_projections: bool = True,
    ):
        super().__init__()
        self.index = index
        self.config = config
        self.rms_norm = rms_norm
        hidden, head_dim = config.hidden_size, config.head_dim
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        self.input_norm = _weight(hidden, device=device, dtype=dtype)
        # without `dense_projections` each projection is an empty placeholder until a loader sets it
        # (`set_dense_projection`) or replaces it by quantized weights (`use_int4`)
        shapes = self.projection_shapes() if dense_projections else dict.fromkeys(_PROJECTION_PARAMETERS, (0,))
        self.qkv_proj = _weight(*shapes["qkv"], device=device, dtype=dtype)
        self.qkv_bias = _weight(qkv_rows, device=device, dtype=dtype) if config.attention_bias else None
        self.o_proj = _weight(*shapes["o"], device=device, dtype=dtype)
        self.o_bias = _weight(hidden, device=device, dtype=dtype) if config.o_proj_bias else None
        self.q_norm = _weight(head_dim, device=device, dtype=dtype) if config.qk_norm else None
        self.k_norm = _weight(head_dim, device=device, dtype=dtype) if config.qk_norm else None
        self.post_attention_norm = _weight(hidden, device=device, dtype=dtype)
        self.pre_feedforward_norm = _weight(hidden, device=device, dtype=dtype) if config.is_gemma else None
        self.post_feedforward_norm = _weight(hidden, device=device, dtype=dtype) if config.is_gemma else None
        self.activation = gemma.gelu_tanh if config.hidden_act == "gelu_pytorch_tanh" else F.silu
        scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.attention = LayerAttention(config.layer_window(index), scale, config.attn_logit_softcapping)
        self.gate_up_proj = _weight(*shapes["gate_up"], device=device, dtype=dtype)
        self.down_proj = _weight(*shapes["down"], device=device, dtype=dtype)
        self._bind_linears(linear.plain)
        self.int4_steps: Int4LayerSteps | None = None  # decode-sized steps in C (`use_int4`)
        self.stack_steps: Int4LayerSteps | None = None  # the layer as the whole-step kernel runs it
        # every projection multiplies in radixrt's quantized kernel (`use_int4`), whose rows do not
        # depend on their batch: deterministic steps may use them as they are
        self.kernel_projections = False
        self.packed_projections: dict[str, cpu.PackedWeight] = {}  # those `use_int4` runs one at a time
        self.quantized_formats: Counter[str] = Counter()  # parameters of the quantized projections by format
        # (qkv, o, gate_up, down) for deterministic steps (`use_rowwise`)
        self.rowwise: tuple[linear.Linear, linear.Linear, linear.Linear, linear.Linear] | None = None

    def _projections(
        self, make: Callable[..., linear.Linear]
    ) -> tuple[linear.Linear, linear.Linear, linear.Linear, linear.Linear]:
        """(qkv, o, gate_up, down), each `make(weight, bias)` over the layer's parameters."""
        return (make(self.qkv_proj, self.qkv_bias), make(self.o_proj, self.o_bias), make(self.gate_up_proj),
                make(self.down_proj))

    def _bind_linears(self, make: Callable[..., linear.Linear]) -> None:
        self.qkv, self.o, self.gate_up, self.down = self._projections(make)

    def prepack(self) -> None:
        """Reorder the loaded weights for the platform's matmul (see `radixrt.model.linear`), the first
        time a step multiplies by them (`LlamaForCausalLM.prepack` says why)."""
        self._bind_linears(_packed_on_first_call)

    def use_rowwise(self) -> None:
        """Build the batch-invariant projections deterministic steps use (`linear.rowwise`)."""
        self.rowwise = self._projections(linear.rowwise)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """[rows, inputs] of the fused projections "qkv", "o", "gate_up" and "down"."""
        config, hidden, head_dim = self.config, self.config.hidden_size, self.config.head_dim
        return {"qkv": ((config.num_heads + 2 * config.num_kv_heads) * head_dim, hidden),
                "o": (hidden, config.num_heads * head_dim), "gate_up": (2 * config.intermediate_size, hidden),
                "down": (hidden, config.intermediate_size)}  # fmt: skip

    def set_dense_projection(self, name: str, weight: torch.Tensor) -> None:
        """Make `weight` (its rows fused as the layer's are) the dense projection `name`, multiplied
        by as loaded (call `prepack` afterwards for the packed matmul)."""
        if tuple(weight.shape) != self.projection_shapes()[name]:
            raise ValueError(f"layer {self.index} {name}: shape {tuple(weight.shape)}, model expects "
                             f"{self.projection_shapes()[name]}")
        setattr(self, _PROJECTION_PARAMETERS[name], nn.Parameter(weight, requires_grad=False))
        self._bind_linears(linear.plain)

    def use_int4(self, weights: Mapping[str, Int4Weight | cpu.PackedWeight]) -> None:
        """Multiply by these quantized projections (any of "qkv", "o", "gate_up", "down"; 4-bit
        codes, or weights already in radixrt's packed layouts, any format) at every step size; the
        others stay dense. Their dense parameters are dropped: a projection that runs quantized is
        held once, in the kernel's layout, never beside a dense copy. The layer's C steps
        (`Int4LayerSteps`) take every packed format."""
        shapes = self.projection_shapes()
        for name, weight in weights.items():
            self.quantized_formats.update(stored_formats(weight))
            shape = weight.shape if isinstance(weight, Int4Weight) else packed_shape(weight)
            if shape != shapes[name]:
                raise ValueError(f"layer {self.index} {name}: 4-bit shape {shape}, model expects {shapes[name]}")
        dtype, device = self.input_norm.dtype, self.input_norm.device
        for name in weights:
            setattr(self, _PROJECTION_PARAMETERS[name], _weight(0, device=device, dtype=dtype))
        config = self.config
        plain_llama = (self.q_norm is None and self.qkv_bias is None and self.o_bias is None
                       and self.pre_feedforward_norm is None and self.activation is F.silu
                       and config.rotary_dim == config.head_dim and config.local_rope_theta is None)
        steps = None
        if len(weights) == len(shapes):
            steps = Int4LayerSteps.create(
                weights, self.input_norm, self.post_attention_norm, config.rms_norm_eps, config.num_heads,
                config.num_kv_heads, config.head_dim, None if plain_llama else self.layer_extras(),
            )  # fmt: skip
        if steps is not None and plain_llama:
            self.use_int4_steps(steps)
            return
        if steps is not None:  # the whole-step kernel runs it; alone, its torch ops over the same packed weights
            self.stack_steps = steps
            weights = dict(zip(_PROJECTION_PARAMETERS, steps.packed_weights()))
        self._use_projections(weights)

    def _use_projections(self, weights: Mapping[str, Int4Weight | cpu.PackedWeight]) -> None:
        """Each of `weights`' projections multiplied one at a time in its quantized format, its
        bias kept; `packed_projections` holds the packed ones."""
        dtype = self.input_norm.dtype
        biases = {"qkv": self.qkv_bias, "o": self.o_bias}
        for name, weight in weights.items():
            bias = biases.get(name)
            if isinstance(weight, cpu.PackedWeight):
                self.packed_projections[name] = weight
            made = linear.int4(weight, dtype, bias) if isinstance(weight, Int4Weight) else linear.packed(weight, bias)
            setattr(self, name, made)
        self.kernel_projections = len(weights) == len(_PROJECTION_PARAMETERS) and all(
            isinstance(w, cpu.PackedWeight) or linear.runs_own_kernel(w.shape, dtype) for w in weights.values())

    def layer_extras(self) -> cpu.LayerExtras | None:
        """The layer's biases and norms beyond a plain Llama layer, as the whole-step kernel takes
        them, or None for a plain one."""
        extras = cpu.LayerExtras(self.qkv_bias, self.o_bias, self.q_norm, self.k_norm, self.pre_feedforward_norm,
                                 self.post_feedforward_norm)  # fmt: skip
        return None if all(tensor is None for tensor in extras.tensors) else extras

    def use_packed_steps(self, steps: Int4LayerSteps) -> None:
        """`steps` (the layer's own, its packed weights moved) in place of the layer's: its C steps
        where it has them, else its projections over those weights, biases kept (nothing keeps
        the weights as they were alive)."""
        if self.int4_steps is not None:
            self.use_int4_steps(steps)
            return
        self.stack_steps = steps
        self._use_projections(dict(zip(_PROJECTION_PARAMETERS, steps.packed_weights())))

    def use_int4_steps(self, steps: Int4LayerSteps) -> None:
        """Run small steps in `steps`' two C calls, and larger ones through the same packed
        weights one projection at a time (no dense copy of them exists). The two calls run plain
        Llama layers only: checked here, once, not at every step."""
        assert steps.extras is None, "the per-layer calls run plain Llama layers"
        self.int4_steps = self.stack_steps = steps
        self.kernel_projections = True
        self.qkv, self.o, self.gate_up, self.down = (linear.packed(packed) for packed in steps.packed_weights())

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        rope: RotaryEmbedding,
        batch: ForwardBatch,
        backend: AttentionBackend[Any],
        plan: Any,
        deterministic: bool = False,
    ) -> torch.Tensor:
        config = self.config
        num_tokens = hidden.shape[0]
        if deterministic:
            assert self.rowwise is not None, "call LlamaForCausalLM.prepare_deterministic first"
            qkv_proj, o_proj, gate_up, down = self.rowwise
        else:
            if self.int4_steps is not None and num_tokens <= INT4_MAX_ROWS:
                return self._int4_forward(self.int4_steps, hidden, cos, signed_sin, batch, backend, plan)
            qkv_proj, o_proj, gate_up, down = self.qkv, self.o, self.gate_up, self.down
        x = self.rms_norm(hidden, self.input_norm, config.rms_norm_eps)
        qkv = qkv_proj(x).view(num_tokens, -1, config.head_dim)
        num_qk_heads = config.num_heads + config.num_kv_heads
        qk = qkv[:, :num_qk_heads] if self.q_norm is None else self._qk_norm(qkv)
        qk = rope.apply(qk, cos, signed_sin)
        # Strided views (head_dim stride 1), not copies: every backend takes row/head strides.
        q = qk[:, : config.num_heads]
        k = qk[:, config.num_heads :]
        v = qkv[:, num_qk_heads:]
        attn = o_proj(backend.forward(q, k, v, self.index, batch, plan).reshape(num_tokens, -1))
        eps = config.rms_norm_eps
        if self.pre_feedforward_norm is None or self.post_feedforward_norm is None:
            # hidden += attn, in place (hidden is this step's own activation), then normalized
            return hidden.add_(self._mlp(self.rms_norm(hidden, self.post_attention_norm, eps, attn), gate_up, down))
        # Gemma: each sublayer's output is normalized before it joins the residual stream
        hidden.add_(self.rms_norm(attn, self.post_attention_norm, eps))
        mlp = self._mlp(self.rms_norm(hidden, self.pre_feedforward_norm, eps), gate_up, down)
        return hidden.add_(self.rms_norm(mlp, self.post_feedforward_norm, eps))

    def _int4_forward(
        self, steps: Int4LayerSteps, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
        batch: ForwardBatch, backend: AttentionBackend[Any], plan: Any,
    ) -> torch.Tensor:
        """`forward` for a few tokens of a plain Llama layer on 4-bit weights (`int4_layer`)."""
        num_tokens, num_heads = hidden.shape[0], self.config.num_heads
        qkv = steps.attention_inputs(hidden, cos.view(num_tokens, -1), signed_sin.view(num_tokens, -1))
        qk_heads = num_heads + self.config.num_kv_heads
        attn = backend.forward(qkv[:, :num_heads], qkv[:, num_heads:qk_heads], qkv[:, qk_heads:], self.index, batch,
                               plan)
        return steps.finish(hidden, attn.reshape(num_tokens, -1))

    def _mlp(self, x: torch.Tensor, gate_up: linear.Linear, down: linear.Linear) -> torch.Tensor:
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(self.activation(gate) * up)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm of each q and k head, [T, q heads + k heads, head_dim].

        `reshape` copies the strided head slices into the dense rows `self.rms_norm` needs.
        """
        assert self.q_norm is not None and self.k_norm is not None
        config, num_tokens, head_dim = self.config, qkv.shape[0], self.config.head_dim
        q = self.rms_norm(qkv[:, : config.num_heads].reshape(-1, head_dim), self.q_norm, config.rms_norm_eps)
        k = qkv[:, config.num_heads : config.num_heads + config.num_kv_heads].reshape(-1, head_dim)
        k = self.rms_norm(k, self.k_norm, config.rms_norm_eps)
        return torch.cat((q.view(num_tokens, -1, head_dim), k.view(num_tokens, -1, head_dim)), dim=1)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model.

    Parameters are created empty; fill them with `load_hf_state_dict`.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 dense_projections: bool = True):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.rms_norm = gemma.rms_norm if config.is_gemma else _rms_norm_for(device, dtype)
        self.embedding_scale = gemma.embedding_scale(config.hidden_size, dtype) if config.is_gemma else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, device, dtype, self.rms_norm, dense_projections)
            for i in range(config.num_layers)
        )
        self.norm = _weight(config.hidden_size, device=device, dtype=dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        )
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling, device,
                                    config.rope_freq_factors)
        # Gemma 3's sliding layers rotate with their own base
        self.local_rope = None
        if config.local_rope_theta is not None:
            self.local_rope = RotaryEmbedding(config.rotary_dim, config.local_rope_theta, None, device)
        local_rope = self.local_rope
        self._layer_ropes = [
            local_rope if local_rope is not None and config.is_sliding_layer(i) else self.rope
            for i in range(config.num_layers)
        ]
        self._lm_head = linear.plain(self.lm_head)
        self._packed_embedding: cpu.PackedWeight | None = None  # rows looked up quantized (`finish_int4`)
        self._native = False  # projections on 4-bit weights (use_int4_projections)
        # the head deterministic steps use, for every row count: the file's quantized one, or `linear.rowwise`
        self._invariant_lm_head: linear.Linear | None = None
        self._head_formats: Counter[str] = Counter()  # a quantized head's parameters by format

    def prepack(self, projections: bool = True) -> None:
        """Call once the weights are loaded: faster projections, identical results, each packed the
        first time a step needs it. Deterministic steps never do (`linear.rowwise` reads the weights
        as loaded), so a deterministic runtime holds one copy of the dense weights, not two.
        `projections` False (native weights, their dense copies not loaded): only the LM head; the
        projections are `use_int4_projections`'s business."""
        if projections:
            for layer in self.layers:
                assert isinstance(layer, LlamaDecoderLayer)
                layer.prepack()
        self._lm_head = _packed_on_first_call(self.lm_head)

    def use_int4_projections(self, native: NativeWeights) -> None:
        """Multiply by 4-bit weights at every step size: each layer's `use_int4`, then `finish_int4`
        with the file's LM head. Call after `prepack`."""
        if len(native.layers) != len(self.layers):
            raise ValueError(f"got 4-bit weights for {len(native.layers)} layers, the model has {len(self.layers)}")
        for layer, weights in zip(self.decoder_layers(), native.layers):
            layer.use_int4(weights)
        self.finish_int4(native.lm_head)

    def finish_int4(self, head: Int4Weight | Int8Weight | cpu.PackedWeight | None,
                    quantized_embedding: bool | cpu.PackedWeight = False,
                    placed: huge_pages.SideBySide | None = None) -> None:
        """Once every layer that has 4-bit projections got them (`LlamaDecoderLayer.use_int4`): the
        LM head as the file stores it (None: a type without a kernel, it stays dense), the packed
        weights side by side, and the whole-step kernel where every layer can run in it.
        A quantized head serves every step. With `quantized_embedding` True, a tied head that
        radixrt's kernels run (`embedding_runs_quantized`) is the embedding too; given a packed
        weight, that is the embedding (an untied model's table as the file stores it): either
        way rows are dequantized as looked up and the dense table is dropped (the caller need
        not fill it); otherwise the dense embedding stays, only looked up. `placed`: the buffer every layer's
        packed weights were already written into (`huge_pages.SideBySide`), whose last slot
        takes a packed head (a head already in the kernel's layout is in its slot)."""
        self._native = True
        if head is not None:
            self._head_formats = stored_formats(head)
            shape = packed_shape(head) if isinstance(head, cpu.PackedWeight) else head.shape
            if shape != tuple(self.lm_head.shape):
                raise ValueError(f"quantized LM head shape {shape}, model expects {tuple(self.lm_head.shape)}")
            self._invariant_lm_head = linear.lm_head(head, self.dtype)
            self._lm_head = self._invariant_lm_head
            if not self.config.tie_word_embeddings:  # the quantized head serves every step: no dense copy
                self.lm_head = _weight(0, self.config.hidden_size, device=self.device, dtype=self.dtype)
        packed_head = self._invariant_lm_head
        if isinstance(quantized_embedding, cpu.PackedWeight):
            if packed_shape(quantized_embedding) != tuple(self.embed_tokens.shape):
                raise ValueError(f"packed embedding shape {packed_shape(quantized_embedding)}, model expects "
                                 f"{tuple(self.embed_tokens.shape)}")
            self._packed_embedding = quantized_embedding
            self.embed_tokens = _weight(0, self.config.hidden_size, device=self.device, dtype=self.dtype)
        elif (quantized_embedding and isinstance(packed_head, linear.PackedLMHead)
              and self.config.tie_word_embeddings and not self.config.is_gemma):
            self._packed_embedding = packed_head.packed
            self.embed_tokens = self.lm_head = _weight(0, self.config.hidden_size, device=self.device, dtype=self.dtype)
        if placed is None:
            self._packed_weights_side_by_side()
        elif isinstance(packed_head, linear.PackedLMHead) and not isinstance(head, cpu.PackedWeight):
            packed_head.packed = packed_head.packed._replace(data=placed.place(packed_head.packed.data))
        if self._packed_embedding is not None and isinstance(packed_head, linear.PackedLMHead) and (
                self.config.tie_word_embeddings and not isinstance(quantized_embedding, cpu.PackedWeight)):
            self._packed_embedding = packed_head.packed  # the head as placed, read by both

    def weight_formats(self) -> dict[str, int]:
        """How many parameters the model holds in each format, as its kernels run them: quantized
        ones by GGUF type name (radixrt's own 4-bit layout, which reads Q4_0 and Q4_1 alike, as
        Q4_1), dense ones by dtype ("BF16", "F32", "F16"). A tied embedding counts once."""
        counts: Counter[str] = Counter()
        for parameter in self.parameters():
            if parameter.numel():
                counts[_DTYPE_NAMES.get(parameter.dtype, str(parameter.dtype).removeprefix("torch."))] += parameter.numel()
        for layer in self.decoder_layers():
            counts.update(layer.quantized_formats)
        counts.update(self._head_formats)
        head = self._invariant_lm_head
        embedding = self._packed_embedding
        if embedding is not None and not (isinstance(head, linear.PackedLMHead) and head.packed is embedding):
            counts.update(stored_formats(embedding))
        return dict(sorted(counts.items()))

    def embedding_runs_quantized(self, format: int, shape: tuple[int, int]) -> bool:
        """Whether an embedding table of `format` (a GGUF type number) and `shape` can be looked up
        quantized: a model without a scaled embedding (Gemma's), radixrt's kernels for that format."""
        return not self.config.is_gemma and linear.runs_format(format, shape, self.dtype)

    def _packed_weights_side_by_side(self) -> None:
        """Every layer's packed 4-bit weights and the packed LM head moved into one buffer on
        huge pages, in the order a step reads them (`memory.huge_pages`: fewer TLB misses a
        step; docs/benchmarks.md, "Huge pages for the packed weights")."""
        layers = self.decoder_layers()
        steps = [layer.stack_steps for layer in layers if layer.stack_steps is not None]
        if len(steps) != len(layers):
            return
        head = self._invariant_lm_head if isinstance(self._invariant_lm_head, linear.PackedLMHead) else None
        weights = [packed.data for layer_steps in steps for packed in layer_steps.packed_weights()]
        copies = iter(huge_pages.side_by_side(weights + ([head.packed.data] if head is not None else [])))
        for layer, layer_steps in zip(layers, steps):
            layer.use_packed_steps(layer_steps.with_packed_data(copies))
        if head is not None:
            head.packed = head.packed._replace(data=next(copies))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LlamaForCausalLM:
        """After `.to()` and the like, the norm is the one the new dtype and device get at
        construction: the whole-step kernel normalizes in C, and its logits must equal `forward`'s."""
        super()._apply(fn, recurse)
        if not self.config.is_gemma:
            self.rms_norm = _rms_norm_for(self.device, self.dtype)
            for layer in self.decoder_layers():
                layer.rms_norm = self.rms_norm
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]

    @functools.cached_property
    def attention_kinds(self) -> tuple[LayerAttention, ...]:
        """The distinct `LayerAttention`s of the layers, in layer order (worked out once: every
        step asks for them, and comparing every layer's dataclass each time showed in a step;
        docs/benchmarks.md, "Per-step Python")."""
        return tuple(dict.fromkeys(layer.attention for layer in self.decoder_layers()))

    @functools.cached_property
    def _distinct_ropes(self) -> tuple[RotaryEmbedding, ...]:
        return tuple(dict.fromkeys(self._layer_ropes))

    def deterministic_problem(self, backend: AttentionBackend[Any]) -> str | None:
        """Why steps of this model through `backend` cannot be batch-invariant, or None if they can
        (through either executor: the same conditions hold with or without the whole-step kernel).

        Only radixrt's own kernels are invariant by construction (every row the same
        instructions whatever the step holds), and they run on the CPU: on native packed
        weights the quantized kernels (every projection, the file's own LM head; the whole-step
        kernel where it takes the model, any family, score caps included); on dense
        bf16 or float32 weights the rowwise matmul; and the C attention reading the pool,
        full or in a sliding window, scores capped or not (RMSNorm:
        radixrt's in bf16, torch's in float32 and Gemma's, whose rows are reduced alone:
        measured, and the tests check it).
        """
        if not backend.attends_segments:
            return (f"the {backend.name} attention backend is not batch-invariant here: deterministic steps need "
                    "radixrt's C attention reading the KV pool (attention_backend='torch' or 'auto'): a CPU where "
                    "radixrt's kernels build with a C compiler, bfloat16 or float32, at most 16 query heads per KV "
                    "head and heads of at most 256")
        if self._native:
            if not all(layer.kernel_projections for layer in self.decoder_layers()):
                return ("on native quantized weights deterministic steps need every projection in radixrt's "
                        "kernels: a GGUF model whose every projection is in a packed format (Q4_0, Q4_1, Q5_0, "
                        "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and a C compiler (this model: "
                        f"{self.config.architecture}); weights='dense' runs them on the dense weights")
            if self._invariant_lm_head is None:
                return ("deterministic steps need the GGUF file's LM head stored in a packed format (Q4_0, Q4_1, "
                        "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)")
        elif cpu.rowwise_matmul() is None:
            return "deterministic steps on dense weights need radixrt's rowwise matmul: a C compiler"
        return None

    def prepare_deterministic(self) -> None:
        """Build what deterministic steps use (check `deterministic_problem` first): on dense weights
        the batch-invariant projections and LM head (no copies: they read the loaded weights);
        quantized weights have theirs already (the whole-step kernel, or projections in the
        quantized matmul, whose rows do not depend on their batch)."""
        if self._native:  # quantized projections: radixrt's kernel, the same for a row in any batch
            for layer in self.decoder_layers():
                if layer.kernel_projections:  # never the dense products `linear.packed` takes for many rows
                    qkv, o, gate_up, down = (p.invariant() if isinstance(p, linear.PackedLinear) else p
                                             for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
                    layer.rowwise = (qkv, o, gate_up, down)
            return
        if self._invariant_lm_head is not None:
            return
        for layer in self.decoder_layers():
            layer.use_rowwise()
        self._invariant_lm_head = linear.rowwise(self.lm_head, float_out=True)

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend[Any], plans: Mapping[LayerAttention, Any],
        deterministic: bool = False,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [batch.num_tokens, hidden_size].

        `plans` holds `backend`'s plan of this very batch for each of `attention_kinds`
        (`executors.LayerByLayer.plan`); every layer's attention stores its new K/V at
        `batch.out_slots`.
        """
        hidden = self._embed(batch.input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        # each distinct rope's tables once a step (Gemma 3: one for full layers, one for sliding ones)
        tables = {rope: rope.cos_sin(batch.positions, self.dtype) for rope in self._distinct_ropes}
        for layer, rope in zip(self.decoder_layers(), self._layer_ropes):
            cos, signed_sin = tables[rope]
            hidden = layer.forward(hidden, cos, signed_sin, rope, batch, backend, plans[layer.attention],
                                   deterministic)
        return self.final_norm(hidden)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of the last layer's hidden states."""
        return self.rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def embedding_table(self) -> torch.Tensor | cpu.PackedWeight:
        """What token rows are looked up in: the dense embedding, or a packed one (the tied LM head,
        or the file's own table)."""
        return self.embed_tokens if self._packed_embedding is None else self._packed_embedding

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embedding_table()
        if isinstance(table, torch.Tensor):
            return F.embedding(ids, table)
        matmul = cpu.quantized_matmul()
        assert matmul is not None  # a packed embedding is made only where it runs
        return matmul.rows(table, ids.cpu().reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    def rope_tables(self, num_positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each distinct rope's tables of positions 0 .. num_positions - 1 (`RotaryEmbedding.tables`),
        in the order `stack_layers` numbers them (Gemma 3: two)."""
        return [rope.tables(num_positions, self.dtype) for rope in self._distinct_ropes]

    def stack_layers(self) -> tuple[list[Int4LayerSteps], cpu.ModelExtras] | None:
        """Every layer as the whole-step kernel runs it and the model's features
        (`int4_layer.stack_extras`: rope tables numbered as `rope_tables` lists them), or None
        where the kernel does not take the model (a layer without packed steps, more windows
        than its attention plans)."""
        layers, ropes = self.decoder_layers(), self._distinct_ropes
        return stack_extras(self.config, [layer.attention for layer in layers], [layer.stack_steps for layer in layers],
                            [ropes.index(rope) for rope in self._layer_ropes])  # fmt: skip

    @property
    def invariant_lm_head(self) -> linear.Linear | None:
        """The LM head deterministic steps use for any number of rows (None before
        `prepare_deterministic` on dense weights): on native weights the file's own."""
        return self._invariant_lm_head

    def compute_logits(self, hidden_rows: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """float32 logits [N, vocab_size] for N rows of `forward`'s output (soft-capped where the
        config says, in float32). `deterministic`: through the head that rounds a row the same for
        any N (native weights: the file's own; the dense one, faster for many rows, rounds the
        weights differently)."""
        logits = self._head_for(hidden_rows.shape[0], deterministic)(hidden_rows).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else gemma.soft_cap(logits, cap)

    def _head_for(self, num_rows: int, deterministic: bool) -> linear.Linear:
        """The LM head `compute_logits` multiplies `num_rows` rows by."""
        head = self._invariant_lm_head if deterministic else self._lm_head
        assert head is not None, "check deterministic_problem first"
        return head

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], projections: bool = True,
                           share: bool = False) -> None:
        """Load weights named as in a transformers checkpoint, fusing q/k/v and gate/up (Phi-3's come fused).

        `state_dict` may be any mapping (e.g. lazily reading safetensors
        shards); each tensor is read once and copied into place, cast to this
        model's dtype. Missing, unexpected or mis-shaped tensors raise
        ValueError naming them. With tied embeddings a stored `lm_head.weight`
        is ignored. `projections` False skips the layers' projections (native
        weights bring their own; see `use_int4_projections`). `share`: a
        tensor already in this model's dtype, on the CPU, becomes the
        parameter itself instead of being copied (a view of a memory-mapped
        file stays one); the parts of a fused projection do only where the
        mapping finds them back to back (`stacked`), else they are copied.
        """
        loader = _StateDictReader(state_dict, share and self.device.type == "cpu")
        config = self.config
        loader.load(self, "embed_tokens", "model.embed_tokens.weight")
        loader.load(self, "norm", "model.norm.weight")
        if config.tie_word_embeddings:
            loader.ignore("lm_head.weight")
            self.lm_head = self.embed_tokens
        else:
            loader.load(self, "lm_head", "lm_head.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            prefix = f"model.layers.{i}."
            loader.load(layer, "input_norm", prefix + "input_layernorm.weight")
            loader.load(layer, "post_attention_norm", prefix + "post_attention_layernorm.weight")
            if layer.pre_feedforward_norm is not None and layer.post_feedforward_norm is not None:
                loader.load(layer, "pre_feedforward_norm", prefix + "pre_feedforward_layernorm.weight")
                loader.load(layer, "post_feedforward_norm", prefix + "post_feedforward_layernorm.weight")
            loader.ignore(prefix + "self_attn.rotary_emb.inv_freq")
            parts = checkpoint_projections(config, i)
            for fused, names in parts.items():
                if projections:
                    loader.load_rows(layer, _PROJECTION_PARAMETERS[fused], names)
                else:
                    for name, _ in names:
                        loader.ignore(name)
            if layer.qkv_bias is not None:
                loader.load_rows(layer, "qkv_bias", [(name.removesuffix("weight") + "bias", rows)
                                                     for name, rows in parts["qkv"]])  # fmt: skip
            if layer.o_bias is not None:
                loader.load(layer, "o_bias", prefix + "self_attn.o_proj.bias")
            if layer.q_norm is not None and layer.k_norm is not None:
                loader.load(layer, "q_norm", prefix + "self_attn.q_norm.weight")
                loader.load(layer, "k_norm", prefix + "self_attn.k_norm.weight")
        loader.finish()
        if loader.share:  # the linears over the parameters as they now are
            for layer in self.decoder_layers():
                layer._bind_linears(linear.plain)
            self._lm_head = linear.plain(self.lm_head)


def checkpoint_projections(config: ModelConfig, index: int) -> dict[str, list[tuple[str, int]]]:
    """Layer `index`'s fused projections ("qkv", "o", "gate_up", "down") as the transformers
    checkpoint stores them: (tensor name, rows) in our row order (Phi-3 stores q/k/v and gate/up
    already fused)."""
    prefix = f"model.layers.{index}."
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inner, hidden = config.intermediate_size, config.hidden_size
    if config.architecture == "Phi3ForCausalLM":
        qkv = [(prefix + "self_attn.qkv_proj.weight", q_rows + 2 * kv_rows)]
        gate_up = [(prefix + "mlp.gate_up_proj.weight", 2 * inner)]
    else:
        qkv = [(f"{prefix}self_attn.{name}_proj.weight", rows) for name, rows in (("q", q_rows), ("k", kv_rows),
                                                                                   ("v", kv_rows))]  # fmt: skip
        gate_up = [(prefix + "mlp.gate_proj.weight", inner), (prefix + "mlp.up_proj.weight", inner)]
    return {"qkv": qkv, "o": [(prefix + "self_attn.o_proj.weight", hidden)], "gate_up": gate_up,
            "down": [(prefix + "mlp.down_proj.weight", hidden)]}  # fmt: skip


class _StateDictReader:
    """Tracks which checkpoint tensors were used, to report missing and unexpected ones together.

    With `share`, a tensor of the destination's dtype and device becomes the parameter (see
    `LlamaForCausalLM.load_hf_state_dict`); otherwise it is copied into the one allocated."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], share: bool = False):
        self.state_dict = state_dict
        self.share = share
        self.used: set[str] = set()
        self.missing: list[str] = []

    def load(self, owner: nn.Module, attr: str, name: str) -> None:
        """`owner.attr` = the checkpoint's tensor `name`: shared where it can be, else copied."""
        destination = getattr(owner, attr)
        tensor = self._checked(name, tuple(destination.shape))
        if tensor is None:
            return
        if self._shareable(tensor, destination):
            setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
        else:
            destination.copy_(tensor)
            self._release([name])

    def load_rows(self, owner: nn.Module, attr: str, parts: Sequence[tuple[str, int]]) -> None:
        """`owner.attr` = the checkpoint's tensors (name, rows) stacked along rows: one view of the
        file where the mapping has them back to back (`stacked`), else copied part by part."""
        destination = getattr(owner, attr)
        stacked = getattr(self.state_dict, "stacked", None)
        if self.share and stacked is not None and all(name in self.state_dict for name, _ in parts):
            whole = stacked([name for name, _ in parts])
            fits = whole is not None and tuple(whole.shape) == tuple(destination.shape)
            if whole is not None and fits and self._shareable(whole, destination):
                self.used.update(name for name, _ in parts)
                setattr(owner, attr, nn.Parameter(whole, requires_grad=False))
                return
        start = 0
        for name, rows in parts:
            part = destination.narrow(0, start, rows)
            tensor = self._checked(name, tuple(part.shape))
            if tensor is not None:
                part.copy_(tensor)
                self._release([name])
            start += rows

    def _release(self, names: list[str]) -> None:
        """Where tensors are shared, the map outlives the load: the pages of one copied are
        dropped from the process (`SafetensorsWeights.release`; they stay in the page cache)."""
        release = getattr(self.state_dict, "release", None) if self.share else None
        if release is not None:
            release(names)

    def _checked(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        self.used.add(name)
        if name not in self.state_dict:
            self.missing.append(name)
            return None
        tensor = self.state_dict[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {shape}")
        return tensor

    def _shareable(self, tensor: torch.Tensor, destination: torch.Tensor) -> bool:
        return (self.share and tensor.dtype == destination.dtype and tensor.device == destination.device
                and tensor.is_contiguous())

    def ignore(self, name: str) -> None:
        self.used.add(name)

    def finish(self) -> None:
        unexpected = sorted(set(self.state_dict) - self.used)
        if self.missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {self.missing[:8]} ({len(self.missing)} in all), "
                f"unexpected {unexpected[:8]} ({len(unexpected)} in all)"
            )
