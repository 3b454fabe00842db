"""Token sequences (and slot indices) packed as bytes, so edges compare at C speed.

The tree never walks a key token by token in Python. Every token sequence is
packed once, on entry, into native unsigned 64-bit integers (`array('Q')`
bytes); an edge then matches a query when `query.startswith(edge, offset)`
holds, which is one `memcmp` and copies nothing. Only where an edge and a
query part ways does `common_prefix_pages` bisect over such compares. A long
int64 array is not even copied: it is read through a byte view for the
duration of the call.
"""

from __future__ import annotations

import ctypes
import sys
from array import array

import numpy as np
import torch

TOKEN_BYTES = 8
"""Bytes per packed token (one native uint64)."""

Tokens = list | tuple | array | torch.Tensor
"""What the tree accepts as a token sequence."""

Packed = bytes | memoryview
"""Packed tokens: bytes, or for long sequences a byte view of an int64 array."""

# Byte of a native uint64 that holds its top bit: tokens are in [0, 2**63)
# exactly when every such byte is below 0x80, i.e. `bytes.isascii()`.
_SIGN_BYTE = TOKEN_BYTES - 1 if sys.byteorder == "little" else 0
_INT64_TYPECODES = frozenset("qQlL")
_INT_TYPECODES = frozenset("bBhHiIlLqQ")
_NOT_TOKEN_DTYPES = frozenset({torch.bool})
_BULK_CHECK_BYTES = 2048 * TOKEN_BYTES
_VIEW_MIN_TOKENS = 8192


def pack_tokens(tokens: Tokens) -> Packed:
    """Pack `tokens` as native uint64 bytes, rejecting what is not int tokens.

    Accepts a list or tuple of ints, an integer `array`, or a 1-D integer
    tensor; anything else raises `ValueError`. Tokens must lie in
    [0, 2**63), but that check (`check_token_range`) is left to the caller on
    purpose: a part of the query found byte-equal to a stored key is in range
    already, so only the rest needs checking, and a long cached prefix is
    never scanned twice.
    """
    if isinstance(tokens, (list, tuple)):
        try:
            values = array("Q", tokens)
        except (TypeError, OverflowError):
            raise ValueError("tokens must be a 1-D sequence of non-negative ints") from None
        return _packed(values)
    if isinstance(tokens, array):
        return _pack_array(tokens)
    if isinstance(tokens, torch.Tensor):
        return _pack_tensor(tokens)
    raise ValueError(
        "tokens must be a list, tuple, array or 1-D integer tensor, "
        f"got {type(tokens).__name__}"
    )


def _packed(values: array) -> Packed:
    # A long sequence is read in place: copying a 30k-token document costs
    # more than the slower per-edge compares on a view (see RadixTree._walk).
    if len(values) >= _VIEW_MIN_TOKENS:
        return memoryview(values).cast("B")
    return values.tobytes()


def release_views(*packed: Packed) -> None:
    """Let go of byte views at once, so even a kept exception cannot pin the
    caller's array (an array with live views refuses to grow)."""
    for item in packed:
        if isinstance(item, memoryview):
            item.release()


def check_token_range(packed: Packed, start: int) -> None:
    """Raise `ValueError` unless every token from byte `start` on is in [0, 2**63).

    A token is in range when its top byte is below 0x80, so short tails are
    checked with one strided slice and `isascii`; from about 2,000 tokens on
    a numpy `min` over the bytes read as int64 is faster than either that
    or a torch `min` (docs/benchmarks.md, "Radix tree internals").
    """
    if len(packed) - start < _BULK_CHECK_BYTES:
        in_range = bytes(packed[start + _SIGN_BYTE :: TOKEN_BYTES]).isascii()
    else:
        in_range = int(np.frombuffer(packed, np.int64, offset=start).min()) >= 0
    if not in_range:
        raise ValueError("tokens must be non-negative ints below 2**63")


def _pack_array(tokens: array) -> Packed:
    code = tokens.typecode
    if code in _INT64_TYPECODES and tokens.itemsize == TOKEN_BYTES:
        return _packed(tokens)
    if code in _INT_TYPECODES:
        try:
            values = array("Q", tokens)
        except OverflowError:
            raise ValueError("tokens must be non-negative ints below 2**63") from None
        return _packed(values)
    raise ValueError(f"tokens array must hold integers, got typecode {code!r}")


def _pack_tensor(tokens: torch.Tensor) -> Packed:
    if tokens.dim() != 1:
        raise ValueError(f"tokens tensor must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype in _NOT_TOKEN_DTYPES:
        raise ValueError(f"tokens tensor must have an integer dtype, got {tokens.dtype}")
    values = tokens.to(device="cpu", dtype=torch.int64).contiguous()
    if values.numel() == 0:
        return b""
    # string_at copies the tensor's memory in one memcpy.
    return ctypes.string_at(values.data_ptr(), values.numel() * TOKEN_BYTES)


def common_prefix_pages(query: Packed, offset: int, key: bytes, page_bytes: int) -> int:
    """Whole pages that `key` and `query[offset:]` have in common.

    The caller has already seen the first page match (it found `key` by that
    page) and the whole key fail to match, so the answer lies in
    [1, limit]. Bisection compares only the not-yet-compared middle each time,
    so the bytes compared add up to about one pass over the shorter side.
    """
    limit = min(len(key), len(query) - offset) // page_bytes
    view = memoryview(query)
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        start = low * page_bytes
        if key.startswith(view[offset + start : offset + mid * page_bytes], start):
            low = mid
        else:
            high = mid - 1
    return low


def pack_slots(indices: torch.Tensor, start: int, end: int) -> bytes:
    """Slots `indices[start:end]` (a 1-D int64 tensor) as native int64 bytes.

    Nodes keep their slots as bytes: splitting an edge or reading a match then
    costs a bytes slice or join, cheaper than the tensor op each would take
    (docs/benchmarks.md, "Radix tree internals").
    """
    if not indices.is_cpu:
        indices = indices.cpu()
    if not indices.is_contiguous():
        indices = indices.contiguous()
    if end <= start:
        return b""
    return ctypes.string_at(indices.data_ptr() + start * TOKEN_BYTES, (end - start) * TOKEN_BYTES)


def unpack_slots(parts: list[bytes]) -> torch.Tensor:
    """The int64 tensor of the concatenated packed slots (a fresh copy)."""
    joined = bytearray().join(parts)
    if not joined:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(joined, dtype=torch.int64)
