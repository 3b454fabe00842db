"""What the GPU check's stages build on: random-weight models from configs, a byte-level
tokenizer, runtimes over them, step timing.

No weights travel to the GPU machine: a model is `LlamaForCausalLM` built from a
`ModelConfig` (SmolLM2-135M's shape, Llama-3.2-1B's) and filled with random
values on the device, scaled so that every projection's output has about unit
variance and attention is neither flat nor one-hot. The tokenizer maps text to
its UTF-8 bytes (ids 0-255) and decodes every other id of the vocabulary as a
placeholder `<tN>`, so the suite's workloads keep their token counts (a
1000-token few-shot prefix is 1000 bytes) and any sampled id decodes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from radixrt.model.config import ModelConfig

# The packages the GPU machine lacks (the device tool's KINDS.md): the dry run hides them,
# so a path of the check that needs one fails here first.
ABSENT_ON_GPU_MACHINE = ("flashinfer", "gguf", "fastapi", "pydantic", "orjson", "llguidance", "uvicorn", "ray")


def _llama(name: str, **shape: Any) -> tuple[str, ModelConfig]:
    fields: dict[str, Any] = dict(
        architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_scaling=None, attention_bias=False,
        o_proj_bias=False, tie_word_embeddings=True, bos_token_id=None,
    )
    fields.update(shape)
    fields["eos_token_ids"] = (fields["vocab_size"] - 1,)
    return name, ModelConfig(**fields)


MODELS: dict[str, ModelConfig] = dict([
    # HuggingFaceTB/SmolLM2-135M's config.json: GQA 3, head_dim 64
    _llama("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192),
    # meta-llama/Llama-3.2-1B's shape (its llama3 rope scaling left out: it changes no cost): GQA 4
    _llama("llama-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
           num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072),
    # the dry run's: GQA 3 as SmolLM2's; heads of 16, the least the Triton kernels take
    _llama("tiny", vocab_size=512, hidden_size=96, intermediate_size=128, num_layers=2,
           num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096),
])  # fmt: skip


def hide_packages(names: tuple[str, ...] = ABSENT_ON_GPU_MACHINE) -> None:
    """Make `import name` fail and `importlib.util.find_spec(name)` return None, as where it is
    not installed (a None entry in sys.modules does both)."""
    import sys

    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights one decode step reads: every parameter once (a tied head counted once)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return (embeddings + config.num_layers * per_layer + h) * torch.empty((), dtype=dtype).element_size()


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """`LlamaForCausalLM` with random weights made on `device`: norms 1, each matrix std
    1/sqrt(its input width), embeddings std 1 (rows are normalised before the first layer)."""
    from radixrt.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(param.shape[1])
                param.normal_(0.0, std, generator=generator)
    model.prepack()  # as the loader does after reading a checkpoint
    return model


def byte_tokenizer(vocab_size: int) -> Any:
    """radixrt's `Tokenizer` over a byte-level BPE without merges: text -> UTF-8 bytes; ids
    256.. decode as `<tN>`. No transformers needed (building it would need files)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from radixrt.model.tokenizer import Tokenizer, TokenizerRecord

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({f"<t{i}>": i for i in range(len(alphabet), vocab_size)})
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    record = TokenizerRecord(
        backend_json=backend.to_str(), chat_template=None, special_tokens_map={},
        special_ids={"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "unk_token_id": None},
    )  # fmt: skip

    def no_transformers() -> Any:
        raise RuntimeError("the GPU check's byte tokenizer has no transformers tokenizer behind it")

    return Tokenizer(record, no_transformers)


def loaded_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A `LoadedModel` (what `Runtime` takes) over `random_model` and `byte_tokenizer`."""
    from radixrt.model.loader import LoadedModel

    config = MODELS[name]

    def no_hf_config() -> Any:
        raise RuntimeError("a random-weight model has no transformers config")

    return LoadedModel(model=random_model(config, device, dtype), config=config,
                       tokenizer=byte_tokenizer(config.vocab_size), name=f"{name}-random",
                       path=Path("."), read_hf_config=no_hf_config)  # fmt: skip


@contextlib.contextmanager
def gpu_backends_on_cpu() -> Iterator[None]:
    """The dry run's one detour: `create_backend` refuses triton/flashinfer over a CPU KV
    cache, so the runtime's backend is built from its class directly (the kernels then run
    under TRITON_INTERPRET=1). Nothing else about the runtime changes."""
    from radixrt.kernels import registry
    from radixrt.runtime import driver

    original = driver.create_backend

    def create(name: str | None, kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        if name in ("triton", "flashinfer") and kv_cache.device.type == "cpu":
            return registry._load(name)(kv_cache, *args, **kwargs)
        return original(name, kv_cache, *args, **kwargs)

    driver.create_backend = create
    try:
        yield
    finally:
        driver.create_backend = original


def make_backend(name: str, kv_cache: Any, config: ModelConfig, page_size: int) -> Any:
    """The named attention backend over `kv_cache`, from its class (works on CPU caches too)."""
    from radixrt.kernels import registry

    return registry._load(name)(kv_cache, config.num_heads, config.num_kv_heads, config.head_dim, page_size)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, warmups: int, reps: int) -> float:
    """Median wall time of `fn` over `reps` runs after `warmups`, the device synchronized around each."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
