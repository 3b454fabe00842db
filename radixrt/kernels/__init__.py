"""Attention backends over the paged KV pool: torch (reference), triton and flashinfer (GPU).

The table of backends lives here, with no heavy import, so that the runtime
configuration can validate a backend name without loading torch kernels.
"""

# name -> (module, class, the pip package its kernels come from; None: plain torch)
BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "flashinfer": ("radixrt.kernels.flashinfer_backend", "FlashInferAttentionBackend", "flashinfer"),
    "triton": ("radixrt.kernels.triton_backend", "TritonAttentionBackend", "triton"),
    "torch": ("radixrt.kernels.torch_backend", "TorchAttentionBackend", None),
}
BACKEND_NAMES = ("auto", *BACKENDS)

# Sequences of a batch that share at least this many cached slots attend them
# in one call (see `shared_prefix`); below it the extra call and merge cost
# more than they save. `RuntimeConfig.shared_prefix_min_tokens` defaults to it.
DEFAULT_SHARED_PREFIX_MIN_TOKENS = 64
