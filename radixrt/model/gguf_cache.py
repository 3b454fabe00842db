"""A GGUF file converted once, through transformers, into a cached Hugging Face folder: for
benchmarks, which give transformers-based peers (and tokenizer-only comparisons) a folder of the
model radixrt reads from the file. radixrt itself never loads through it: every supported family
is read in place (`gguf_loader`).

transformers de-quantizes a GGUF checkpoint into an fp32 model; every later
use would pay that again. So the first use writes what transformers
produced (config.json, model.safetensors in fp32, generation_config.json,
tokenizer files with the chat template) into a cache folder, read later like
any other checkpoint.

    $RADIXRT_CACHE_DIR (default ~/.cache/radixrt)/
        <file stem>-<key>/        complete: renamed into place last
        .tmp-<file stem>-<key>-<pid>-<random>/   being written

The folder is written under a temporary name and renamed into place, so a
crash leaves at worst a `.tmp-*` folder (removed by a later conversion once
its process is gone), never a half-written cache. `<key>` hashes the file's
size, its first and last MiB and the cache format, so a different file under
the same name gets its own folder, without hashing gigabytes on every load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from radixrt.model.config import SUPPORTED_ARCHITECTURES
from radixrt.paths import CACHE_ENV_VAR, cache_root

logger = logging.getLogger(__name__)

# A rough guide for the log line, scaled by file size; never a limit
# (docs/benchmarks.md, "Load-time estimates").
_CONVERT_BYTES_PER_S = 3 * 2**20
# Bump when what we write changes, so old caches are not read.
_CACHE_FORMAT = 1
_SAMPLE_BYTES = 1 << 20


def cached_folder(gguf_path: Path) -> Path:
    """The cache folder for this GGUF file (it may not exist yet)."""
    digest = hashlib.sha256(f"radixrt-gguf-cache-v{_CACHE_FORMAT}:{gguf_path.stat().st_size}:".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, gguf_path.stat().st_size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))
    return cache_root() / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


def gguf_to_hf_folder(gguf_path: Path) -> Path:
    """The converted Hugging Face folder for `gguf_path`, converting on first use."""
    folder = cached_folder(gguf_path)
    if folder.is_dir():
        return folder
    logger.info(
        "converting %s into a Hugging Face folder in %s: once per model, roughly %.0f s on a 2-core CPU; "
        "later starts read the folder (set %s to keep it elsewhere)",
        gguf_path.name, folder.parent, max(gguf_path.stat().st_size / _CONVERT_BYTES_PER_S, 5.0), CACHE_ENV_VAR,
    )
    started = time.perf_counter()
    check_gguf(gguf_path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_tmp(folder)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return folder


def check_gguf(gguf_path: Path) -> None:
    """ValueError unless the file is a GGUF of a supported architecture with tokenizer data."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(gguf_path).fields
    except Exception as error:  # the parser fails in many ways on a foreign or truncated file
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {error}") from error
    supported_types = sorted(set(SUPPORTED_ARCHITECTURES.values()))
    architecture = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if architecture not in supported_types:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {architecture!r}; supported: {', '.join(supported_types)}"
        )
    if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
        raise ValueError(
            f"{gguf_path} has no tokenizer data (tokenizer.ggml.*); radixrt needs a GGUF with an embedded "
            "tokenizer, or a Hugging Face folder with tokenizer files"
        )


def _convert(gguf_path: Path, out: Path) -> None:
    """De-quantize with transformers and save model, config and tokenizer as a HF folder.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the
    pieces are written one by one: config (with `architectures`, which GGUF
    configs lack, and without the GGUF quantization entry), generation config, fp32 safetensors (without a tied LM
    head), tokenizer. A progress bar counts these steps, since the whole takes
    half a minute; transformers nests its own bar for the de-quantization.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    steps = ("reading the tokenizer", "reading and de-quantizing the weights", "writing the weights", "done")
    with tqdm(total=len(steps) - 1, desc=f"converting {gguf_path.name}", postfix=steps[0],
              bar_format="{desc}: {bar:20} {n}/{total} steps, {elapsed}{postfix}") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        _advance(bar, steps[1])
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        _advance(bar, steps[2])
        config = model.config
        config.architectures = [type(model).__name__]
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights we write are plain fp32
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(out)
        _advance(bar, steps[3])


def _advance(bar: tqdm, next_step: str) -> None:
    bar.set_postfix_str(next_step, refresh=False)
    bar.update()


def _remove_orphaned_tmp(folder: Path) -> None:
    """Delete temporary folders of this conversion left by processes that no longer run."""
    for tmp in folder.parent.glob(f".tmp-{folder.name}-*"):
        pid = tmp.name[len(f".tmp-{folder.name}-") :].split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
