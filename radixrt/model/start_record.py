"""A model folder's (or GGUF file's) config and tokenizer as transformers reads them, recorded so later
starts skip transformers.

Importing transformers and reading a folder through it (config, tokenizer)
takes seconds on the project's 2-core machine (docs/model.md); the weights
never needed it. The first load of a folder still goes through transformers
and records what it read; later loads build `ModelConfig` and the
`tokenizer.Tokenizer` from the record alone. A GGUF file's first load needs no
transformers either where radixrt builds its tokenizer from the metadata as
transformers would (`gguf_tokenizer`; its config comes from the metadata in
any case, `gguf_config`): that record is written the same way.

    $RADIXRT_CACHE_DIR (default ~/.cache/radixrt)/start/<folder name>-<key>.json
        {"format": 1, "config": {...transformers' full config...}, "tokenizer": {...TokenizerRecord...}}

`<key>` hashes the record format, the installed transformers version (its
package metadata: nothing is imported), `radixrt/model/config.py` (the code
that reads a config) and every file of the folder except weights, name and
bytes (for a GGUF file: its header and metadata, which hold config and
tokenizer, and `gguf_config.py` and `gguf_tokenizer.py`, the code that reads
them): a change to any of them makes a new record, read through transformers
(or `gguf_tokenizer`) once. The folder keeps the `MAX_RECORDS` most recently
used records (a read refreshes a record's time): without a bound, every
temporary model folder a test suite makes, and every transformers upgrade,
would leave records behind for good. A record is written only where it
reproduces transformers: `ModelConfig.from_hf` over the recorded config must
equal it over the config read, and `TokenizerRecord.of` must accept the
tokenizer, or the tokenizer record is `gguf_tokenizer`'s, built only for the
vocabularies it reproduces (else every start uses transformers, as before).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from radixrt.model import config as config_module
from radixrt.model import gguf_config, gguf_tokenizer
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile
from radixrt.model.tokenizer import TokenizerRecord
from radixrt.paths import cache_root

logger = logging.getLogger(__name__)

_FORMAT = 1
MAX_RECORDS = 64
# Weights do not change what transformers reads from a folder's config and tokenizer files.
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx"})


@dataclass(frozen=True)
class StartRecord:
    """A folder's transformers config (as a plain dict) and its tokenizer's record."""

    config: dict[str, Any]
    tokenizer: TokenizerRecord

    def model_config(self) -> ModelConfig:
        """`ModelConfig.from_hf` over the recorded config, which reads it by attribute as it reads transformers'."""
        return ModelConfig.from_hf(SimpleNamespace(**self.config))


def record_path(source: Path | GGUFFile) -> Path:
    """Where the record of a folder's current files, or of a GGUF file's metadata, lives (it may not
    exist yet). A GGUF's header and metadata are what transformers reads its config and tokenizer
    from; its tensors are not hashed."""
    digest = hashlib.sha256(f"radixrt-start-record-v{_FORMAT}:{_transformers_version()}:".encode())
    digest.update(Path(config_module.__file__).read_bytes())
    if isinstance(source, GGUFFile):
        digest.update(Path(gguf_config.__file__).read_bytes())
        digest.update(Path(gguf_tokenizer.__file__).read_bytes())
        digest.update(b"\0gguf\0" + source.metadata_bytes())
        return cache_root() / "start" / f"{source.path.stem}-{digest.hexdigest()[:16]}.json"
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES:
            digest.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return cache_root() / "start" / f"{source.name}-{digest.hexdigest()[:16]}.json"


def read_record(source: Path | GGUFFile) -> StartRecord | None:
    """The record for a folder's files (a GGUF's metadata) as they are now, or None (none yet, or unreadable)."""
    path = record_path(source)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != _FORMAT:
            return None
        record = StartRecord(data["config"], TokenizerRecord.from_json(data["tokenizer"]))
        with contextlib.suppress(OSError):  # a read-only cache still serves its records
            os.utime(path)  # used now: pruned last
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(source: Path | GGUFFile, hf_config: Any, model_config: ModelConfig,
                 tokenizer: Any) -> StartRecord | None:
    """Record the config and tokenizer of a folder (a GGUF file), if the record reproduces them; None if it would not.

    `hf_config` is transformers' config, or one read as it is (`gguf_config.MetadataConfig`:
    `to_json_string` and attribute access); `tokenizer` is transformers' tokenizer, or the
    `TokenizerRecord` of one (`gguf_tokenizer.tokenizer_record`: then nothing here imports
    transformers). A cache that cannot be written only costs the next start its speed-up.
    """
    name = source.path.name if isinstance(source, GGUFFile) else source.name
    if not isinstance(tokenizer, TokenizerRecord):
        hf_tokenizer, tokenizer = tokenizer, TokenizerRecord.of(tokenizer)
        if tokenizer is None:
            logger.info("%s: its tokenizer (%s) is read through transformers on every start", name,
                        type(hf_tokenizer).__name__)
            return None
    try:
        record = StartRecord(json.loads(hf_config.to_json_string(use_diff=False)), tokenizer)
        reproduced = record.model_config() == model_config
    except (TypeError, ValueError, AttributeError):  # a config that does not round-trip through JSON
        reproduced = False
    if not reproduced:
        logger.info("%s: its config is read through transformers on every start", name)
        return None
    path = record_path(source)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": _FORMAT, "config": record.config, "tokenizer": tokenizer.to_json()}))
        os.replace(tmp, path)  # readers see the whole record or none
        _prune(path.parent)
    except OSError as error:
        logger.warning("could not write %s (%s); later starts read %s through transformers again", path, error,
                       name)
        tmp.unlink(missing_ok=True)
    return record


def _prune(records: Path) -> None:
    """Delete all but the `MAX_RECORDS` most recently used records (a concurrent pruner may get there first)."""
    by_age = sorted(records.glob("*.json"), key=lambda p: p.stat().st_mtime if p.exists() else 0.0, reverse=True)
    for stale in by_age[MAX_RECORDS:]:
        stale.unlink(missing_ok=True)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
