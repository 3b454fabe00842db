"""The systems under test, made by name: radixrt with its radix cache, without it, in deterministic
mode, and transformers.

A system turns prompts (token ids) into completions and says, for each, when
its first and last tokens came and how much of its prompt came from a cache;
`system_api` states that interface. The transformers baseline implements it
in `hf_system`, loaded only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from radixrt.benchmarks.system_api import Completion, System, completion_of_meta
from radixrt.benchmarks.workloads import Sampling

SYSTEM_NAMES = ("radixrt", "radixrt-no-cache", "radixrt-nondeterministic", "transformers")
# What a run measures unless --systems says otherwise.
DEFAULT_SYSTEMS = ("radixrt", "radixrt-no-cache", "transformers")


class RadixSystem:
    """radixrt.Runtime as users get it (deterministic where its kernels serve the model), with the
    radix cache on (`radixrt`) or off (`radixrt-no-cache`); or with the cache on and
    `deterministic=False` (`radixrt-nondeterministic`: what batch invariance costs or saves)."""

    concurrent = True

    def __init__(self, model: str | None, *, cache: bool, device: str, dtype: str, attention_backend: str,
                 page_size: int, deterministic: bool | str = "auto", quantize: str | None = None):
        from radixrt.runtime import Runtime

        self.name = "radixrt-nondeterministic" if deterministic is False else "radixrt" if cache else "radixrt-no-cache"
        self.runtime = Runtime(model, device=device, dtype=dtype, attention_backend=attention_backend,
                               page_size=page_size, disable_radix_cache=not cache, deterministic=deterministic,
                               quantize=quantize)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, n: int = 1) -> list[list[Completion]]:
        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "seed": sampling.seed, "ignore_eos": True, "n": n}
        outputs = self.runtime.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
        completions = [completion_of(out) for out in outputs]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def reset(self) -> None:
        self.runtime.flush_cache()

    def cache_counts(self) -> tuple[int, int]:
        stats = self.runtime.cache_stats()
        return int(stats["prompt_tokens"]), int(stats["cached_prompt_tokens"])

    def close(self) -> None:
        self.runtime.shutdown()


def completion_of(output: dict[str, Any]) -> Completion:
    """A Completion from a radixrt.Runtime.generate result dict."""
    meta = output["meta_info"]
    return completion_of_meta(meta, tuple(output["output_ids"]))


def model_folder(model: str | None) -> Path:
    """The Hugging Face folder behind `model` (the bundled GGUF's converted cache folder for None),
    which transformers loads for the baseline and whose tokenizer builds the prompts."""
    from radixrt.model.gguf_cache import gguf_to_hf_folder
    from radixrt.model.loader import bundled_model_path

    source = bundled_model_path() if model is None else Path(model).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"model path {str(source)!r} does not exist")
    return gguf_to_hf_folder(source) if source.is_file() else source


def make_system(name: str, model: str | None, device: str, dtype: str, attention_backend: str,
                page_size: int, quantize: str | None = None) -> System:
    """A ready system by name (one of SYSTEM_NAMES)."""
    if name == "transformers":
        from radixrt.benchmarks.hf_system import TransformersSystem

        return TransformersSystem(model_folder(model), device=device, dtype=dtype)
    if name in ("radixrt", "radixrt-no-cache", "radixrt-nondeterministic"):
        return RadixSystem(model, cache=name != "radixrt-no-cache", device=device, dtype=dtype,
                           attention_backend=attention_backend, page_size=page_size,
                           deterministic=False if name == "radixrt-nondeterministic" else "auto",
                           quantize=quantize)
    raise ValueError(f"unknown system {name!r}; choose from {list(SYSTEM_NAMES)}")
