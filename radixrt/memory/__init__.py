"""The paged KV pool: which slots are free, and the K/V tensors behind them."""

from radixrt.memory.kv_cache import KVCache, KVShape
from radixrt.memory.page_pool import OutOfPages, PagePool

__all__ = ["KVCache", "KVShape", "OutOfPages", "PagePool"]
