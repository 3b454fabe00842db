"""Attention backends over the paged KV pool: torch (reference), triton and flashinfer (GPU)."""
