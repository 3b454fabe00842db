"""Llama-family model: config, weights loading and our own forward over the paged KV pool."""
