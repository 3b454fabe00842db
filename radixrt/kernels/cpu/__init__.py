"""C kernels for the CPU path, compiled on first use by the machine's C compiler.

A decode step is hundreds of small ops; where torch's CPU kernels spend more
on setup than on arithmetic at those sizes, a plain C loop does the job:

    decode_attention.c  torch's CPU attention is built for long query blocks:
                        for one query per sequence its flash kernel spends
                        most of its time on per-block setup, and the padded
                        gather in front of it copies every key once more per
                        layer. Here each key and value is read once, in
                        place, for all the query heads that share it.
    pack_gguf.c         GGUF Q4_0/Q4_1 rows into quantized_matmul.c's layout in one
                        pass over the file's blocks, at load.
    rms_norm.c          torch's bf16 rms_norm is about eight ops; here one
                        pass, with the residual add fused in.
    quantized_matmul.c  torch's 4-bit CPU matmul dequantizes to float32 and
                        works one row at a time: 8 rows cost 8 times 1.
                        Here the codes feed bf16 dot products directly and
                        are decoded once for several rows (one version
                        per instruction set, plain C the reference).
    kv_store.c          a step's new K and V rows into their pool slots in one
                        call, instead of two indexed assignments a layer.
    row_stats.c         each logits row's argmax and log-sum-exp in two
                        vectorized passes, for the sampler (torch's index
                        reduction does not vectorize, its logsumexp is
                        several ops).
    sample_rows.c       a token drawn from a row's temperature-scaled softmax
                        after its top-k/top-p/min-p filters, in a few passes,
                        instead of torch's ~10 ops a row and, for a wide
                        nucleus, a full sort.
    packed_matrix.c     a weight whose rows come in parts of different formats
                        (a fused projection, llama.cpp's mixes) as one matrix
                        of tiles: the products below take any format.
    int4_layer.c        a quantized Llama layer's work around attention (norms,
                        projections, RoPE, SwiGLU, residuals) in two calls
                        instead of about thirty ops, for decode-sized steps.
    decode_stack.c      a whole step of a Llama-family model (biases, q/k
                        norms, partial rotary, windows, soft-caps, Gemma's
                        norms), token ids to logits, for a few new tokens in
                        one call: threads forked once a step, not once an op,
                        and no Python in between.
    decode_run.c        several decode steps of a steady batch in one call,
                        each sampling the tokens the next one reads: no
                        engine and no Python between the steps at all.
    rowwise_matmul.c    a dense matmul whose every output is reduced in one
                        fixed order whatever the batch: library GEMMs change
                        a row's rounding with the number of rows (deterministic
                        mode; one version per instruction set).

The sources are compiled together once per instruction-set level (`build.py`:
portable C, AVX2, AVX-512), cached under `cache_root()/kernels`, and the best
build the CPU runs is loaded with ctypes (no torch headers), capped by
RADIXRT_CPU_ISA; `isa()` names it. Without a C compiler, or if building fails,
the accessors return None and callers keep torch's path.

The bindings live by kind: `library` (loading, `isa`, `kernel_threads`),
`attention`, `rows` (RMSNorm, the sampler's passes), `matmul` (quantized and
rowwise products, packing), `stack` (layer, whole step, decode runs); the
model handle's C structs in `stack_model`, the weight formats in `formats`
and `format_matmul`. Everything callers use is re-exported here.
"""

from __future__ import annotations

from radixrt.kernels.cpu.attention import (
    DecodeAttention,
    KVStore,
    decode_attention,
    kv_store,
    supports,
    supports_segments,
)
from radixrt.kernels.cpu.library import MAX_GROUP, MAX_HEAD_DIM, isa, kernel_threads, library_name, load_library
from radixrt.kernels.cpu.matmul import PackedWeight, QuantizedMatmul, RowwiseMatmul, quantized_matmul, rowwise_matmul
from radixrt.kernels.cpu.rows import (
    RMSNorm,
    RowSampler,
    RowStats,
    TokenMasks,
    rms_norm,
    row_sampler,
    row_stats,
    token_masks,
)
from radixrt.kernels.cpu.stack import (
    DecodeRun,
    DecodeStack,
    Int4Layer,
    ProductBalance,
    RunOutput,
    RunRows,
    decode_run,
    decode_stack,
    int4_layer,
)
from radixrt.kernels.cpu.stack_model import (
    FORMATS,
    STACK_MAX_PLANS,
    STACK_MAX_ROPES,
    LayerExtras,
    LayerWeights,
    ModelExtras,
    PackedPart,
    StackWeights,
)
from radixrt.sampling.run_data import RunMasks, RunPenalties, RunSampling

__all__ = [
    "FORMATS", "MAX_GROUP", "MAX_HEAD_DIM", "STACK_MAX_PLANS", "STACK_MAX_ROPES",
    "DecodeAttention", "DecodeRun", "DecodeStack", "Int4Layer", "KVStore", "LayerExtras", "LayerWeights",
    "ModelExtras", "PackedPart", "PackedWeight", "ProductBalance", "QuantizedMatmul", "RMSNorm", "RowSampler",
    "RowStats", "RowwiseMatmul", "RunMasks", "RunOutput", "RunPenalties", "RunRows", "RunSampling",
    "StackWeights", "TokenMasks",
    "decode_attention", "decode_run", "decode_stack", "int4_layer", "isa", "kernel_threads", "kv_store",
    "library_name", "load_library", "quantized_matmul", "rms_norm", "row_sampler", "row_stats", "rowwise_matmul", "supports",
    "supports_segments", "token_masks",
]  # fmt: skip
