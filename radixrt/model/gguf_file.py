"""A GGUF file, memory-mapped: its metadata and its tensors' bytes, checked before anything is read.

    header     magic "GGUF" | version (2, 3) | tensor count (u64) | metadata count (u64)
    metadata   key (string) | value type (u32) | value          strings: u64 length + UTF-8 bytes
    tensors    name | dims (u32 count, u64 each, innermost first) | ggml type (u32) | offset (u64)
    data       at the next multiple of `general.alignment` (default 32); each tensor at its offset

radixrt reads the tensors straight from the mapped file (`GGUFTensor.data`),
so a load never holds a second copy of the file. Every size is checked
against the file's length and the tensor's shape when the file is opened: a
truncated or corrupt file is a ValueError naming the file (and the tensor),
never a crash or a read past the end later. gguf's own `GGUFReader` turns
each of the tokenizer's ~100k strings into a numpy array, which makes it
several times slower (docs/model.md has the times); this reader keeps them
as Python strings, and a warm start hashes only `metadata_bytes`.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value types: struct format of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in torch order (rows first), its ggml type, and `data`, its bytes in the
    mapped file as [rows, bytes per row] uint8 (a row is `shape[-1] / block_size` whole blocks)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray = field(repr=False)
    offset: int = 0  # of `data` in the file

    @property
    def qtype(self) -> GGMLQuantizationType:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType[self.type_name]

    @property
    def num_bytes(self) -> int:
        return int(self.data.size)


class GGUFFile:
    """The parsed header of `path` and views of its tensors (ValueError on a malformed file)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            raise ValueError(f"{self.path} is not a readable GGUF file: {error}") from error
        self._pos = 0
        if self._take(4) != MAGIC:
            raise ValueError(f"{self.path} is not a readable GGUF file: it does not start with {MAGIC!r}")
        version = self._scalar("I")
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (versions {VERSIONS})")
        num_tensors, num_fields = self._scalar("Q"), self._scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"), key)
        self.metadata_end = self._pos
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = self._check_layout(infos, start, alignment)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def release(self, tensors: list[GGUFTensor]) -> None:
        """Drop these tensors' pages from this process's memory once they are read (they stay in
        the page cache; a later read maps them back): a load then never holds the whole file
        resident beside the weights it built from it."""
        page = mmap.PAGESIZE
        for tensor in tensors:
            start = tensor.offset // page * page
            with contextlib.suppress(OSError, ValueError, AttributeError):  # advice only
                self._map.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.num_bytes - start)

    def metadata_bytes(self) -> bytes:
        """The header and metadata as stored: what config and tokenizer are read from."""
        return self._map[: self.metadata_end]

    def _check_layout(self, infos: list[tuple[str, tuple[int, ...], int, int]], start: int,
                      alignment: int) -> dict[str, GGUFTensor]:
        # gguf (a dependency) knows every ggml type's block; imported here, not with radixrt: a
        # machine without it still runs everything but GGUF files
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        tensors: dict[str, GGUFTensor] = {}
        spans = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
                block_size, block_bytes = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {type_id}") from None
            if not dims or any(d <= 0 for d in dims) or dims[0] % block_size:
                raise ValueError(f"{self.path}: tensor {name} ({qtype.name}) has shape {dims[::-1]}: its rows "
                                 f"must be whole blocks of {block_size}")
            num_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            row_bytes = dims[0] // block_size * block_bytes
            begin, end = start + offset, start + offset + num_rows * row_bytes
            if offset % alignment or end > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} ({qtype.name}, shape {dims[::-1]}) needs bytes "
                                 f"{begin}..{end} but the file has {len(self._map)}: truncated or corrupt")
            if name in tensors:
                raise ValueError(f"{self.path}: tensor {name} is stored twice")
            data = np.frombuffer(self._map, dtype=np.uint8, count=end - begin, offset=begin)
            tensors[name] = GGUFTensor(name, qtype.name, tuple(reversed(dims)), data.reshape(num_rows, row_bytes), begin)
            spans.append((begin, end, name))
        spans.sort()
        for (_, end, name), (begin, _, following) in zip(spans, spans[1:]):
            if end > begin:  # a shape whose block count does not match the bytes stored for it
                raise ValueError(f"{self.path}: tensor {name} runs into tensor {following}: its shape does not "
                                 "match its stored blocks (corrupt file)")
        return tensors

    def _take(self, size: int) -> bytes:
        end = self._pos + size
        if size < 0 or end > len(self._map):
            raise ValueError(f"{self.path}: the GGUF header ends early at byte {len(self._map)}: truncated or corrupt")
        chunk = self._map[self._pos : end]
        self._pos = end
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        length = self._scalar("Q")
        if length > len(self._map):
            raise ValueError(f"{self.path}: a string of {length} bytes in the header: truncated or corrupt")
        try:
            return self._take(length).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.path}: a header string is not UTF-8: corrupt") from error

    def _value(self, value_type: int, key: str) -> Any:
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar("I"), self._scalar("Q")
            if item_type in _NUMPY:
                item = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                raw = self._take(count * item.itemsize) if count <= len(self._map) else self._take(-1)
                return np.frombuffer(raw, dtype=item).tolist()
            if count > len(self._map):
                self._take(-1)
            return [self._value(item_type, key) for _ in range(count)]
        raise ValueError(f"{self.path}: metadata {key} has unknown value type {value_type}: corrupt")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("I")
        if num_dims > 8:
            raise ValueError(f"{self.path}: tensor {name} has {num_dims} dimensions: corrupt")
        dims = tuple(self._scalar("Q") for _ in range(num_dims))
        return name, dims, self._scalar("I"), self._scalar("Q")
