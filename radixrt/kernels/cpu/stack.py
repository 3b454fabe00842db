"""Model-sized calls: a layer's work around attention (int4_layer.c), the whole step
(decode_stack.c) and runs of decode steps (decode_run.c), over the model handle built once at
load (`stack_model`), and the learnt split of their products between threads."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixrt.kernels.cpu.library import call_threads, load_library
from radixrt.kernels.cpu.matmul import PackedWeight, QuantizedMatmul, quantized_matmul
from radixrt.kernels.cpu.stack_model import (
    LayerWeights,
    ModelExtras,
    SegmentList,
    StackModel,
    StackWeights,
    TileBytes,
)
from radixrt.sampling.run_data import RunSampling

# A decode run's call back between steps (`RunMasks.advance`): nonzero ends the run.
_ADVANCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)


class Int4Layer:
    """`int4_layer.c`: a Llama layer's work before and after attention on packed weights (`PackedWeight`)."""

    def __init__(self, library: ctypes.CDLL, matmul: QuantizedMatmul):
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._matmul = matmul
        self._inputs = library.radixrt_layer_attention_inputs_bf16
        self._inputs.argtypes = [
            pointer, i64, i64, pointer, f32,  # hidden, rows, dim, norm weight, eps
            pointer, pointer, pointer,  # qkv matrix, cos, signed_sin
            i64, i64, pointer, i32,  # rotated heads, head_dim, qkv out, num_threads
        ]
        self._inputs.restype = i32
        self._finish = library.radixrt_layer_finish_bf16
        self._finish.argtypes = [
            pointer, pointer, i64, i64, i64, i64,  # hidden, attn, attn row stride, rows, dim, attn dim
            pointer, pointer, f32, pointer, pointer, i32,  # o, norm weight, eps, gate_up, down matrices, threads
        ]
        self._finish.restype = i32

    def attention_inputs(
        self, hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: PackedWeight,
        cos: torch.Tensor, signed_sin: torch.Tensor, rotated_heads: int, head_dim: int,
    ) -> torch.Tensor:
        """[T, qkv rows] bf16: rms_norm(hidden) @ w_qkv.T with RoPE on the first `rotated_heads` heads.
        hidden [T, dim], cos and signed_sin [T, head_dim] rows: bf16, contiguous; packed weights."""
        rows, dim = hidden.shape
        out = torch.empty(rows, qkv.num_rows, dtype=torch.bfloat16)
        status = self._inputs(
            hidden.data_ptr(), rows, dim, norm_weight.data_ptr(), eps, ctypes.byref(self._matmul.matrix(qkv)),
            cos.data_ptr(), signed_sin.data_ptr(), rotated_heads, head_dim, out.data_ptr(), call_threads(),
        )  # fmt: skip
        _raise_for_layer_status(status, qkv)
        return out

    def finish(
        self, hidden: torch.Tensor, attn: torch.Tensor, o: PackedWeight, norm_weight: torch.Tensor, eps: float,
        gate_up: PackedWeight, down: PackedWeight,
    ) -> torch.Tensor:
        """`hidden` ([T, dim] bf16, contiguous) after the attention output `attn` ([T, heads * head_dim],
        unit stride along a row) and the MLP are added to it, in place; returned. Packed weights."""
        rows, dim = hidden.shape
        matrix = self._matmul.matrix
        status = self._finish(
            hidden.data_ptr(), attn.data_ptr(), attn.stride(0), rows, dim, attn.shape[1], ctypes.byref(matrix(o)),
            norm_weight.data_ptr(), eps, ctypes.byref(matrix(gate_up)), ctypes.byref(matrix(down)), call_threads(),
        )  # fmt: skip
        _raise_for_layer_status(status, o, gate_up, down)
        return hidden


def _raise_for_layer_status(status: int, *weights: PackedWeight) -> None:
    if status == -2:
        raise ValueError(f"the layer kernel refused weights of layouts {[w.layout() for w in weights]}")
    if status:
        raise MemoryError("layer kernel could not allocate its buffers")


class ProductBalance:
    """How a whole-step kernel's threads divide each kind of weight product (`product_balance.c`):
    learnt from their measured speeds and kept from call to call. The split changes only which
    thread computes a tile, never a result."""

    KINDS = ("qkv", "o", "gate_up", "down", "head")

    def __init__(self, library: ctypes.CDLL):
        self._shares_fn = library.radixrt_product_balance_shares
        self._shares_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._shares_fn.restype = ctypes.c_int
        self._set_fn = library.radixrt_product_balance_set
        self._set_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self._max_threads = int(library.radixrt_product_balance_threads())
        self._state = torch.zeros(int(library.radixrt_product_balance_bytes()), dtype=torch.uint8)

    @property
    def pointer(self) -> int:
        """The state's address, for the kernels (the object keeps it alive)."""
        return self._state.data_ptr()

    def shares(self) -> dict[str, list[float]] | None:
        """Each kind's share of its tiles per thread, or None before a step of two or more threads."""
        out = torch.zeros(len(self.KINDS), self._max_threads, dtype=torch.float32)
        threads = self._shares_fn(self.pointer, out.data_ptr())
        return None if threads == 0 else {kind: out[k, :threads].tolist() for k, kind in enumerate(self.KINDS)}

    def set_shares(self, shares: Sequence[Sequence[float]]) -> None:
        """Fix each kind's shares (a row per kind in `KINDS` order, one positive share per thread,
        summing to 1); later steps learn on from them."""
        table = torch.tensor(shares, dtype=torch.float32)
        if table.dim() != 2 or table.shape[0] != len(self.KINDS) or not 2 <= table.shape[1] <= self._max_threads:
            raise ValueError(f"shares must be {len(self.KINDS)} rows ({', '.join(self.KINDS)}) of 2 .. "
                             f"{self._max_threads} per-thread shares, got shape {tuple(table.shape)}")
        if not bool((table > 0).all()) or not torch.allclose(table.sum(1), torch.ones(len(self.KINDS)), atol=1e-5):
            raise ValueError(f"shares must be positive and each row must sum to 1, got {table.tolist()}")
        self._set_fn(self.pointer, table.shape[1], table.contiguous().data_ptr())


class DecodeStack:
    """`decode_stack.c`: a whole step of a Llama-family model on packed weights (`StackWeights`),
    token ids to logits, for a few new tokens, in one call."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_stack_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(StackModel), pointer, i64, pointer, pointer,  # model, token ids, rows, hidden, positions
            pointer, pointer, pointer,  # out_slots, kv_indices, each plan's segments (SegmentList[])
            i64, pointer, pointer, i32,  # logit rows: count, rows; logits; threads
        ]
        self._fn.restype = i32
        self.balance = ProductBalance(library)
        self.tile_bytes = TileBytes(library)

    def weights(self, embedding: PackedWeight | torch.Tensor, layers: list[LayerWeights],
                final_norm: torch.Tensor | None, head: PackedWeight | None, eps: float, heads: tuple[int, int, int],
                intermediate: int, extras: ModelExtras | None = None) -> StackWeights:
        """The model handle these kernels read (`stack_model.StackWeights`, keeping the weights alive):
        `embedding` [vocab, dim] bf16 or packed (its rows dequantized as looked up), every layer's
        norms and packed projections (and features, `LayerExtras`), with `head` the final norm and
        packed LM head, and the model's features (`ModelExtras`; None: a plain Llama)."""
        return StackWeights(self.tile_bytes, embedding, layers, final_norm, head, eps, heads, intermediate, extras)

    def __call__(
        self, weights: StackWeights, token_ids: torch.Tensor, hidden: torch.Tensor | None, k_pools: torch.Tensor,
        v_pools: torch.Tensor, num_slots: int, positions: torch.Tensor,
        rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], out_slots: torch.Tensor, kv_indices: torch.Tensor,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        logits: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`token_ids` ([T] rows of the embedding) through every layer into `hidden` ([T, dim] bf16,
        contiguous); with `logits` = (logit rows, out), also out [N, head rows] float32, the LM
        head's logits of the normed rows `logit rows` ([N] rows of the step), and `hidden` may be
        None (the kernel's own buffer).

        k_pools, v_pools: [layers] int64 addresses of [num_slots, Hkv, D] bf16 pools; rope_tables:
        each table's (cos, signed_sin) [P, rotary_dim] bf16, row p for position p; positions: [T];
        out_slots: [T], each row's new K/V slot; segments: for each attention plan of the model
        (its window), (starts, lens, row_ptr, rows) over kv_indices, as `kernels.segments` builds
        them. Every index tensor int64 and contiguous. Raises
        IndexError, computing nothing, for a slot outside the pools, a token id outside the
        embedding, a position outside the tables or a logit row outside the step.
        """
        logit_rows, out = (None, None) if logits is None else logits
        model = weights.model(k_pools, v_pools, num_slots, rope_tables, self.balance.pointer)
        if len(segments) != model.num_plans:
            raise ValueError(f"the layers attend {model.num_plans} plans (windows), got {len(segments)} segment lists")
        plans = (SegmentList * len(segments))(*(
            SegmentList(starts.numel(), starts.data_ptr(), lens.data_ptr(), row_ptr.data_ptr(), rows.data_ptr())
            for starts, lens, row_ptr, rows in segments))  # fmt: skip
        status = self._fn(
            ctypes.byref(model), token_ids.data_ptr(), token_ids.shape[0], None if hidden is None else hidden.data_ptr(),
            positions.data_ptr(), out_slots.data_ptr(), kv_indices.data_ptr(), plans,
            0 if logit_rows is None else logit_rows.numel(), None if logit_rows is None else logit_rows.data_ptr(),
            None if out is None else out.data_ptr(), call_threads(),
        )  # fmt: skip
        if status == -6:
            raise IndexError(f"a logit row outside the step's rows 0 .. {token_ids.shape[0] - 1}")
        if status:
            heads = (model.num_q_heads, model.num_kv_heads, model.head_dim)
            table_rows = min(cos.shape[0] for cos, _ in rope_tables)
            _raise_for_stack_status(status, "decode stack", num_slots, weights.vocab_rows, table_rows, heads)


class RunRows(NamedTuple):
    """A decode run's batch (`decode_run.c`): row r's last token, its position (the keys before
    it), its slots (`slots[slot_starts[r]:]`, one for every position up to the run's last), and
    the whole `chunk`s of keys it reads from row `owner[r]`'s slots (`shared_chunks[r]` of them:
    a prefix they share). Every tensor int64, contiguous, [B] unless said."""

    first_tokens: torch.Tensor
    first_positions: torch.Tensor
    slots: torch.Tensor  # every row's slots, one after another
    slot_starts: torch.Tensor
    owner: torch.Tensor
    shared_chunks: torch.Tensor
    chunk: int


class RunOutput(NamedTuple):
    """What a decode run's n steps give: each step's token of each row and its log-probability
    at temperature 1 ([n, B]), and with `RunSampling.top_logprobs` = k > 0 each row's k most
    likely tokens and their log-probabilities ([n, B, k], largest first, equal values in token
    order: `sampler.top_tokens`'s rule), else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_tokens: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def top_lists(self) -> list[list[list[tuple[int, float]]]] | None:
        """The top log-probabilities as the sampler lists them, [step][row] -> [(token, logprob)]."""
        if self.top_tokens is None or self.top_logprobs is None:
            return None
        return [[list(zip(row_tokens, row_logprobs)) for row_tokens, row_logprobs in zip(*step)]
                for step in zip(self.top_tokens.tolist(), self.top_logprobs.tolist())]  # fmt: skip


class DecodeRun:
    """`decode_run.c`: up to k decode steps of a Llama-family model on packed weights (`StackWeights`)
    in one call, each sampling the tokens of the next."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_run_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(StackModel),  # the model (its head required)
            i64, pointer, pointer, pointer,  # rows, first tokens, first positions, slots
            pointer, pointer, pointer, i64,  # slot starts, owner, shared chunks, chunk
            pointer, pointer, pointer, pointer, pointer,  # temperatures, top_k, top_p, min_p, uniforms
            pointer, pointer, pointer, pointer, pointer,  # repetition, frequency, presence, seen, output counts
            pointer, pointer, pointer, i32, pointer,  # stop ptr, stop ids, interrupt, steps, tokens
            pointer, i32, pointer, pointer,  # logprobs, top count, top tokens, top logprobs
            pointer, i64, pointer, _ADVANCE,  # allowed, allowed words, masked, advance
            i32,  # threads
        ]
        self._fn.restype = i32
        self.balance = ProductBalance(library)

    def __call__(
        self, weights: StackWeights, k_pools: torch.Tensor, v_pools: torch.Tensor, num_slots: int,
        rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: RunRows, sampling: RunSampling, num_steps: int,
        interrupt: ctypes.c_int32 | None = None,
    ) -> RunOutput:
        """The n <= `num_steps` steps run (`RunOutput`): n stops at the first step where a row
        drew a stop token, or where `interrupt` (set from any thread) was nonzero. The model as
        `DecodeStack` takes it, with its head; each step's K/V go to the rows' next slots. Raises IndexError,
        computing nothing, for a slot outside the pools, a token id outside the embedding or a
        position outside the tables; ValueError for penalty counts not [B, head rows] int32 and
        contiguous, or top_logprobs outside 0 .. head rows."""
        head = weights.head
        if head is None:
            raise ValueError("a decode run needs the model's LM head")
        batch = rows.first_tokens.shape[0]
        penalties = sampling.penalties
        for counts in () if penalties is None else (penalties.seen, penalties.output_counts):
            if counts.shape != (batch, head.num_rows) or counts.dtype != torch.int32 or not counts.is_contiguous():
                raise ValueError(f"penalty counts must be [{batch}, {head.num_rows}] int32 and contiguous, "
                                 f"got {tuple(counts.shape)} {counts.dtype}")
        if not 0 <= sampling.top_logprobs <= head.num_rows:
            raise ValueError(f"top_logprobs must be in [0, {head.num_rows}], got {sampling.top_logprobs}")
        tokens = torch.empty(num_steps, batch, dtype=torch.int64)
        logprobs = torch.empty(num_steps, batch, dtype=torch.float32)
        masks, advance, failure = sampling.masks, None, []
        if masks is not None:
            if (masks.allowed.dtype != torch.int32 or masks.allowed.shape[0] != batch or not masks.allowed.is_contiguous()
                    or masks.allowed.shape[1] * 32 < head.num_rows):  # fmt: skip
                raise ValueError(f"masks must be [{batch}, >= {(head.num_rows + 31) // 32}] int32 and contiguous, "
                                 f"got {tuple(masks.allowed.shape)} {masks.allowed.dtype}")
            if masks.masked.dtype != torch.uint8 or masks.masked.shape != (batch,):
                raise ValueError(f"masked must be [{batch}] uint8, got {tuple(masks.masked.shape)}")

            def call_back(step: int) -> int:
                try:
                    return int(bool(masks.advance(step, tokens[step].tolist())))
                except BaseException as error:  # raised again once the run is over
                    failure.append(error)
                    return 1

            advance = _ADVANCE(call_back)
        top = sampling.top_logprobs
        top_tokens = torch.empty(num_steps, batch, top, dtype=torch.int64) if top else None
        top_logprobs = torch.empty(num_steps, batch, top, dtype=torch.float32) if top else None
        model = weights.model(k_pools, v_pools, num_slots, rope_tables, self.balance.pointer)
        done = self._fn(
            ctypes.byref(model), batch, rows.first_tokens.data_ptr(), rows.first_positions.data_ptr(), rows.slots.data_ptr(),
            rows.slot_starts.data_ptr(), rows.owner.data_ptr(), rows.shared_chunks.data_ptr(), rows.chunk,
            sampling.temperatures.data_ptr(), sampling.top_k.data_ptr(), sampling.top_p.data_ptr(),
            sampling.min_p.data_ptr(), sampling.uniforms.data_ptr(),
            *([None] * 5 if penalties is None else [tensor.data_ptr() for tensor in penalties]),
            sampling.stop_ptr.data_ptr(), sampling.stop_ids.data_ptr(),
            None if interrupt is None else ctypes.addressof(interrupt), num_steps, tokens.data_ptr(),
            logprobs.data_ptr(), top, None if top_tokens is None else top_tokens.data_ptr(),
            None if top_logprobs is None else top_logprobs.data_ptr(),
            None if masks is None else masks.allowed.data_ptr(), 0 if masks is None else masks.allowed.shape[1],
            None if masks is None else masks.masked.data_ptr(), advance or _ADVANCE(), call_threads(),
        )  # fmt: skip
        if failure:
            raise failure[0]
        if done < 0:
            heads = (model.num_q_heads, model.num_kv_heads, model.head_dim)
            table_rows = min(cos.shape[0] for cos, _ in rope_tables)
            _raise_for_stack_status(done, "decode run", num_slots, weights.vocab_rows, table_rows, heads)
        return RunOutput(tokens[:done], logprobs[:done], None if top_tokens is None else top_tokens[:done],
                         None if top_logprobs is None else top_logprobs[:done])


def _raise_for_stack_status(
    status: int, kernel: str, num_slots: int, vocab_rows: int, table_rows: int, heads: tuple[int, int, int]
) -> None:
    """The error a whole-step kernel's negative status stands for (nothing was computed)."""
    if status == -3:
        raise IndexError(f"a K/V slot is outside the pool of {num_slots} slots")
    if status == -4:
        raise IndexError(f"a token id outside the embedding's rows 0 .. {vocab_rows - 1}")
    if status == -5:
        raise IndexError(f"a position outside the RoPE tables' rows 0 .. {table_rows - 1}")
    if status == -1:
        raise ValueError(f"{kernel} kernel refused heads {heads} or the shape of its batch")
    if status:
        raise MemoryError(f"{kernel} kernel could not allocate its buffers")


def int4_layer() -> Int4Layer | None:
    """The compiled 4-bit layer parts; None wherever `quantized_matmul` is."""
    library = load_library()
    matmul = quantized_matmul()
    return None if library is None or matmul is None else Int4Layer(library, matmul)


def decode_stack() -> DecodeStack | None:
    """The compiled whole-step kernel; None wherever `quantized_matmul` is."""
    library = load_library()
    return None if library is None or not library.radixrt_quantized_matmul_available() else DecodeStack(library)


def decode_run() -> DecodeRun | None:
    """The compiled multi-step decode kernel; None wherever `quantized_matmul` is."""
    library = load_library()
    return None if library is None or not library.radixrt_quantized_matmul_available() else DecodeRun(library)
