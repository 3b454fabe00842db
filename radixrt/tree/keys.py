"""Token sequences packed as bytes, so edges compare at C speed.

The tree never walks a key token by token in Python. Every token sequence is
packed once, on entry, into native unsigned 64-bit integers (`array('Q')`
bytes); an edge then matches a query when `query.startswith(edge, offset)`
holds, which is one `memcmp` and copies nothing. Only where an edge and a
query part ways does `common_prefix_pages` bisect over such compares.
"""

from __future__ import annotations

import ctypes
import sys
from array import array
from typing import Union

import torch

TOKEN_BYTES = 8
"""Bytes per packed token (one native uint64)."""

Tokens = Union[list, tuple, array, torch.Tensor]
"""What the tree accepts as a token sequence."""

# Byte of a native int64 that holds its sign bit: a sequence is non-negative
# exactly when every such byte is below 0x80, i.e. `bytes.isascii()`.
_SIGN_BYTE = TOKEN_BYTES - 1 if sys.byteorder == "little" else 0
_SMALL_INT_TYPECODES = frozenset("bBhHiIlL")
_NOT_TOKEN_DTYPES = frozenset({torch.bool})


def pack_tokens(tokens: Tokens) -> bytes:
    """Validate `tokens` and return them packed as native uint64 bytes.

    Accepts a list or tuple of ints, an integer `array`, or a 1-D integer
    tensor; anything else, or any negative token, raises `ValueError`. The
    check costs one C-level pass, so it is done on every public call.
    """
    if isinstance(tokens, (list, tuple)):
        try:
            return array("Q", tokens).tobytes()
        except (TypeError, OverflowError):
            raise ValueError(
                "tokens must be a 1-D sequence of non-negative ints"
            ) from None
    if isinstance(tokens, array):
        return _pack_array(tokens)
    if isinstance(tokens, torch.Tensor):
        return _pack_tensor(tokens)
    raise ValueError(
        "tokens must be a list, tuple, array or 1-D integer tensor, "
        f"got {type(tokens).__name__}"
    )


def _pack_array(tokens: array) -> bytes:
    code = tokens.typecode
    if code == "Q":
        return tokens.tobytes()
    if code == "q":
        packed = tokens.tobytes()
        if not packed[_SIGN_BYTE::TOKEN_BYTES].isascii():
            raise ValueError("tokens must be non-negative, got a negative token")
        return packed
    if code in _SMALL_INT_TYPECODES:
        try:
            return array("Q", tokens).tobytes()
        except OverflowError:
            raise ValueError("tokens must be non-negative, got a negative token") from None
    raise ValueError(f"tokens array must hold integers, got typecode {code!r}")


def _pack_tensor(tokens: torch.Tensor) -> bytes:
    if tokens.dim() != 1:
        raise ValueError(f"tokens tensor must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype in _NOT_TOKEN_DTYPES:
        raise ValueError(f"tokens tensor must have an integer dtype, got {tokens.dtype}")
    flat = tokens.to(device="cpu", dtype=torch.int64).contiguous()
    if flat.numel() == 0:
        return b""
    # string_at copies the tensor's memory in one memcpy; no numpy needed.
    packed = ctypes.string_at(flat.data_ptr(), flat.numel() * TOKEN_BYTES)
    if not packed[_SIGN_BYTE::TOKEN_BYTES].isascii():
        raise ValueError("tokens must be non-negative, got a negative token")
    return packed


def common_prefix_pages(query: bytes, offset: int, key: bytes, page_bytes: int) -> int:
    """Whole pages that `key` and `query[offset:]` have in common.

    The caller has already seen the first page match (it found `key` by that
    page) and the whole key fail to match, so the answer lies in
    [1, limit]. Bisection compares only the not-yet-compared middle each time,
    so the bytes compared add up to about one pass over the shorter side.
    """
    limit = min(len(key), len(query) - offset) // page_bytes
    view = memoryview(key)
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        start = low * page_bytes
        if query.startswith(view[start : mid * page_bytes], offset + start):
            low = mid
        else:
            high = mid - 1
    return low
