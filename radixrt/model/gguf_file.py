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
several times slower (docs/model.md has the times). This reader decodes a
metadata value only when it is first read (`metadata` is a lazy mapping):
opening a file walks the header once, stepping over the vocabulary's strings
by their lengths, so a start whose tokenizer comes from the start record
never builds them. Every length is still checked against the file when it
is opened; a value that is not valid UTF-8 is a ValueError when it is read.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import struct
from collections.abc import Iterator, Mapping
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


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")  # a string's length is a u64 too
_SIZES = {type_id: struct.calcsize("<" + fmt) for type_id, fmt in _SCALARS.items()}


class GGUFMetadata(Mapping[str, Any]):
    """The file's metadata, each value decoded from the mapped header on its first read (and
    kept): keys and where their values lie are known from the walk at open."""

    def __init__(self, file: GGUFFile, places: dict[str, tuple[int, int]]):
        self._file = file
        self._places = places  # key -> (value type, offset of the value)
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            value_type, offset = self._places[key]
            self._values[key] = self._file._decode(value_type, offset, key)[0]
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._places

    def __iter__(self) -> Iterator[str]:
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)


class GGUFFile:
    """The parsed header of `path` and views of its tensors (ValueError on a malformed file)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            raise ValueError(f"{self.path} is not a readable GGUF file: {error}") from error
        if self._map[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a readable GGUF file: it does not start with {MAGIC!r}")
        version = self._unpack(_U32, 4)
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (versions {VERSIONS})")
        num_tensors, num_fields = self._unpack(_U64, 8), self._unpack(_U64, 16)
        places: dict[str, tuple[int, int]] = {}
        position = 24
        for _ in range(num_fields):
            key, position = self._string(position)
            value_type = self._unpack(_U32, position)
            places[key] = (value_type, position + 4)
            position = self._skip(value_type, position + 4, key)
        self.metadata: Mapping[str, Any] = GGUFMetadata(self, places)
        self.metadata_end = position
        infos = []
        for _ in range(num_tensors):
            info, position = self._tensor_info(position)
            infos.append(info)
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-position // alignment) * alignment
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
        tensors: dict[str, GGUFTensor] = {}
        spans = []
        blocks = _ggml_blocks()
        for name, dims, type_id, offset in infos:
            if type_id not in blocks:
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {type_id}")
            type_name, block_size, block_bytes = blocks[type_id]
            if not dims or any(d <= 0 for d in dims) or dims[0] % block_size:
                raise ValueError(f"{self.path}: tensor {name} ({type_name}) has shape {dims[::-1]}: its rows "
                                 f"must be whole blocks of {block_size}")
            num_rows = math.prod(dims[1:])
            row_bytes = dims[0] // block_size * block_bytes
            begin, end = start + offset, start + offset + num_rows * row_bytes
            if offset % alignment or end > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} ({type_name}, shape {dims[::-1]}) needs bytes "
                                 f"{begin}..{end} but the file has {len(self._map)}: truncated or corrupt")
            if name in tensors:
                raise ValueError(f"{self.path}: tensor {name} is stored twice")
            data = np.frombuffer(self._map, dtype=np.uint8, count=end - begin, offset=begin)
            tensors[name] = GGUFTensor(name, type_name, tuple(reversed(dims)), data.reshape(num_rows, row_bytes), begin)
            spans.append((begin, end, name))
        spans.sort()
        for (_, end, name), (begin, _, following) in zip(spans, spans[1:]):
            if end > begin:  # a shape whose block count does not match the bytes stored for it
                raise ValueError(f"{self.path}: tensor {name} runs into tensor {following}: its shape does not "
                                 "match its stored blocks (corrupt file)")
        return tensors

    def _ends_early(self) -> ValueError:
        return ValueError(f"{self.path}: the GGUF header ends early at byte {len(self._map)}: truncated or corrupt")

    def _unpack(self, unpacker: struct.Struct, position: int) -> Any:
        try:
            return unpacker.unpack_from(self._map, position)[0]
        except struct.error:
            raise self._ends_early() from None

    def _string(self, position: int) -> tuple[str, int]:
        raw, position = self._string_bytes(position)
        try:
            return raw.decode("utf-8"), position
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.path}: a header string is not UTF-8: corrupt") from error

    def _string_bytes(self, position: int) -> tuple[bytes, int]:
        length = self._unpack(_U64, position)
        end = position + 8 + length
        if end > len(self._map):
            raise self._ends_early()
        return self._map[position + 8 : end], end

    def _skip(self, value_type: int, position: int, key: str) -> int:
        """Where the value of `value_type` at `position` ends, every length checked against the file."""
        size = len(self._map)
        if value_type in _SIZES:
            position += _SIZES[value_type]
        elif value_type == _STRING:
            position += 8 + self._unpack(_U64, position)
        elif value_type == _ARRAY:
            item_type, count = self._unpack(_U32, position), self._unpack(_U64, position + 4)
            position += 12
            if item_type in _SIZES:
                position += count * _SIZES[item_type]
            elif item_type == _STRING:
                if count > size:
                    raise self._ends_early()
                unpack = _U64.unpack_from
                try:
                    for _ in range(count):  # the vocabulary: only its lengths are read
                        position += 8 + unpack(self._map, position)[0]
                except struct.error:
                    raise self._ends_early() from None
            else:
                if count > size:
                    raise self._ends_early()
                for _ in range(count):
                    position = self._skip(item_type, position, key)
        else:
            raise ValueError(f"{self.path}: metadata {key} has unknown value type {value_type}: corrupt")
        if position > size:
            raise self._ends_early()
        return position

    def _decode(self, value_type: int, position: int, key: str) -> tuple[Any, int]:
        """The value of `value_type` at `position` (already walked by `_skip`), and where it ends."""
        if value_type in _SCALARS:
            return struct.unpack_from("<" + _SCALARS[value_type], self._map, position)[0], position + _SIZES[value_type]
        if value_type == _STRING:
            return self._string(position)
        item_type, count = self._unpack(_U32, position), self._unpack(_U64, position + 4)
        position += 12
        if item_type in _NUMPY:
            item = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            values = np.frombuffer(self._map, dtype=item, count=count, offset=position).tolist()
            return values, position + count * item.itemsize
        if item_type == _STRING:
            items, map_ = [], self._map
            unpack = _U64.unpack_from
            try:
                for _ in range(count):
                    end = position + 8 + unpack(map_, position)[0]
                    items.append(map_[position + 8 : end].decode("utf-8"))
                    position = end
            except UnicodeDecodeError as error:
                raise ValueError(f"{self.path}: a string of metadata {key} is not UTF-8: corrupt") from error
            return items, position
        values = []
        for _ in range(count):
            value, position = self._decode(item_type, position, key)
            values.append(value)
        return values, position

    def _tensor_info(self, position: int) -> tuple[tuple[str, tuple[int, ...], int, int], int]:
        name, position = self._string(position)
        num_dims = self._unpack(_U32, position)
        if num_dims > 8:
            raise ValueError(f"{self.path}: tensor {name} has {num_dims} dimensions: corrupt")
        try:
            *dims, type_id, offset = struct.unpack_from(f"<{num_dims}QIQ", self._map, position + 4)
        except struct.error:
            raise self._ends_early() from None
        return (name, tuple(dims), type_id, offset), position + 4 + 8 * num_dims + 12


@functools.cache
def _ggml_blocks() -> dict[int, tuple[str, int, int]]:
    """Every ggml type gguf knows: type number -> (name, elements, bytes of a block). gguf (a
    dependency) is imported here, not with radixrt: a machine without it still runs everything
    but GGUF files."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(qtype): (qtype.name, *GGML_QUANT_SIZES[qtype]) for qtype in GGMLQuantizationType
            if qtype in GGML_QUANT_SIZES}
