"""A Hugging Face folder's weight tensors by name, mapped from the files rather than read into fresh memory.

Reading a safetensors tensor through `safetensors` first copies it into new
memory, and touching fresh memory costs page faults (docs/benchmarks.md,
"Fresh memory on the 2-core VM"). Here a tensor is a view of a private
memory map of its file: its bytes are the page cache's. A tensor already in
the model's dtype becomes the parameter itself, no copy
(`LlamaForCausalLM.load_hf_state_dict(share=True)`); one in another dtype is
copied once, cast; the parts of a fused projection are one view where they
lie back to back in the file (`stacked`), else copied.

    file: [u64 header size][header JSON: name -> dtype, shape, data_offsets][data]
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

# safetensors dtype names; a tensor of another dtype (e.g. fp8) is read through `safetensors` itself.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def checkpoint_files(folder: Path) -> list[Path]:
    """The folder's weight files, sorted."""
    return sorted(f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in folder.glob(pattern))


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of the folder's weight files."""
    return sum(f.stat().st_size for f in checkpoint_files(folder))


def checkpoint_weights(folder: Path) -> Mapping[str, torch.Tensor]:
    """The folder's tensors by name: safetensors (sharded or not) mapped lazily, else PyTorch .bin files."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        return SafetensorsWeights(shards)
    if (folder / "model.safetensors").is_file():
        return SafetensorsWeights([folder / "model.safetensors"])
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        merged: dict[str, torch.Tensor] = {}
        for path in bins:
            merged.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        return merged
    raise FileNotFoundError(f"{folder} has no weights (model.safetensors, its index, or pytorch_model*.bin)")


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Tensors of safetensors shards as views of private memory maps (writing one never changes the file)."""

    def __init__(self, shards: list[Path]):
        self._shards = shards
        self._maps: list[mmap.mmap] = []
        self._where: dict[str, tuple[int, dict, int]] = {}  # name -> (shard, header entry, data start)
        for shard, path in enumerate(shards):
            with open(path, "rb") as file:
                self._maps.append(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY))
            (header_size,) = struct.unpack("<Q", self._maps[-1][:8])
            header = json.loads(self._maps[-1][8 : 8 + header_size])
            header.pop("__metadata__", None)
            self._where.update({name: (shard, entry, 8 + header_size) for name, entry in header.items()})

    def __getitem__(self, name: str) -> torch.Tensor:
        shard, entry, data_start = self._where[name]
        dtype = _DTYPES.get(entry["dtype"])
        begin, end = entry["data_offsets"]
        if dtype is None or (data_start + begin) % dtype.itemsize:
            from safetensors import safe_open

            with safe_open(str(self._shards[shard]), framework="pt") as handle:
                return handle.get_tensor(name)
        if begin == end:
            return torch.empty(entry["shape"], dtype=dtype)
        flat = torch.frombuffer(self._maps[shard], dtype=dtype, count=(end - begin) // dtype.itemsize,
                                offset=data_start + begin)
        return flat.view(entry["shape"])

    def stacked(self, names: Sequence[str]) -> torch.Tensor | None:
        """The tensors `names` stacked along their first dimension as one view of the file, where
        they lie back to back in this order in one shard, of one dtype and the same trailing
        dimensions (a fused projection's parts, e.g. gate and up, which a name-sorted file
        holds in that order); else None."""
        places = [self._where[name] for name in names]
        shard, first, data_start = places[0]
        dtype = _DTYPES.get(first["dtype"])
        if dtype is None or (data_start + first["data_offsets"][0]) % dtype.itemsize:
            return None
        end = first["data_offsets"][0]
        for where, entry, _ in places:
            same = entry["dtype"] == first["dtype"] and entry["shape"][1:] == first["shape"][1:]
            if where != shard or not same or entry["data_offsets"][0] != end or not entry["shape"]:
                return None
            end = entry["data_offsets"][1]
        rows = sum(entry["shape"][0] for _, entry, _ in places)
        begin = first["data_offsets"][0]
        if begin == end:
            return None
        flat = torch.frombuffer(self._maps[shard], dtype=dtype, count=(end - begin) // dtype.itemsize,
                                offset=data_start + begin)
        return flat.view(rows, *first["shape"][1:])

    def release(self, names: Sequence[str]) -> None:
        """Drop the whole pages of these tensors from this process's memory once they are read (a
        quantizing load: they stay in the page cache, and a later read maps them back)."""
        page = mmap.PAGESIZE
        for name in names:
            shard, entry, data_start = self._where[name]
            begin, end = (data_start + offset for offset in entry["data_offsets"])
            first, last = -(-begin // page) * page, end // page * page  # pages wholly inside the tensor
            if last > first:
                with contextlib.suppress(OSError, ValueError, AttributeError):  # advice only
                    self._maps[shard].madvise(mmap.MADV_DONTNEED, first, last - first)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
