"""Everything a Runtime can be configured with, in one documented dataclass.

Names follow SGLang's server arguments where one exists, so that a user of
SGLang can carry their settings over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixrt.kernels import BACKEND_NAMES, DEFAULT_SHARED_PREFIX_MIN_TOKENS

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
DEVICES = ("auto", "cpu", "cuda")
WEIGHTS = ("auto", "dense", "native")
QUANTIZE_TYPES = ("q8_0", "q4_0")


@dataclass
class RuntimeConfig:
    """Runtime settings.

    device: "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on cuda; on cpu the model's fastest exact-enough
        choice, see docs/model.md), "float32", "bfloat16", "float16".
    weights: "dense" expands every weight to `dtype`; "native" keeps a GGUF
        model's 4-bit (Q4_0/Q4_1) projections and Q4_0/Q4_1/Q8_0 LM head as
        stored and multiplies by them directly on the CPU, reading a quarter
        of the bytes per step (other types load dense, with a warning);
        "auto" is native for a GGUF model (any supported family) on the CPU in bfloat16
        (where it is faster), dense otherwise.
    quantize: None, "q8_0" or "q4_0": quantize a dense model's projections
        (a Hugging Face folder, or a GGUF of F32/F16/BF16 tensors) at load,
        in llama.cpp's blocks of 32, and its LM head to Q8_0, for radixrt's
        quantized CPU kernels (bfloat16 on an AVX512-BF16 CPU): about a
        half (q8_0) or a third (q4_0) of bf16's projection bytes per decode
        step (docs/model.md). A GGUF that is already quantized is refused.
    page_size: tokens per KV page; the radix tree caches whole pages only.
    max_total_tokens: KV pool size in tokens. When None it is derived from
        `kv_memory_fraction` of free GPU memory on cuda, or from
        `kv_memory_bytes` on cpu.
    kv_memory_fraction: share of free GPU memory (after weights) for the KV pool.
    kv_memory_bytes: KV pool budget in bytes on cpu.
    attention_backend: "auto" | "torch" | "triton" | "flashinfer".
    schedule_policy: "lpm" (longest cached prefix first), "dfs-weight" or "fcfs".
    disable_radix_cache: never reuse KV across requests (the baseline).
    chunked_prefill_size: the most prompt tokens one request computes in one step.
    max_running_requests: the most requests decoding at once.
    max_prefill_tokens: the most prompt tokens computed in one step, all requests together.
    new_token_reserve_ratio: share of each running request's remaining
        max_new_tokens kept free for its future decode tokens when admitting
        new prompts; too low retracts more, too high admits fewer.
    deterministic: True makes every output bitwise independent of how
        requests were batched, chunked, cached, evicted or retracted: greedy
        tokens, seeded samples and log-probabilities (docs/determinism.md).
        It needs radixrt's own CPU kernels (a GGUF Llama on native 4-bit
        weights in bfloat16); a configuration they cannot serve is a
        ValueError at construction. "auto" (the default) is True where they
        serve it (it costs nothing measurable there) and False elsewhere.
    check_invariants: check tree, pool and request bookkeeping after every step (tests).
    decode_steps: when every running request is decoding and none is waiting
        (or those waiting wait for a running place), run up to this many
        decode steps in one call of radixrt's C kernels (deterministic native 4-bit
        steps; elsewhere one step a call): no scheduling, sampling in Python
        or bookkeeping between them. Outputs are the same bits as step by
        step; streamed tokens arrive that many at a time. A request (or an
        abort) posted meanwhile ends the run after its current step, so it
        waits no longer than it would step by step. 1 turns runs off.
    jump_forward: where a request's output constraint allows only one text
        next (a JSON key, a fixed separator), compute that text's tokens in one
        step as a draft the sampler checks token by token, instead of a step
        per token (docs/structured.md). The outputs are those of token-by-token
        constrained decoding; False turns it off.

    Tuning (the defaults were measured on the CPU path; see docs/design.md):
    new_token_reserve_clip: a request's remaining max_new_tokens count at most
        this much toward the decode reserve (a 32k max_new_tokens would
        otherwise block admission while most requests stop far earlier).
    lpm_queue_limit: with more waiting requests than this, "lpm" orders them
        first come first served: matching every one of them each step would
        cost more than the order saves.
    in_batch_share_min_tokens: a waiting request that shares at least this
        many uncached tokens with a prompt being computed waits one step and
        then hits them in the cache instead of computing them again.
    shared_prefix_min_tokens: sequences of a step that share at least this
        many cached tokens attend them in one call (torch backend), merged
        exactly with their own tails; below it the split costs more than it saves.
    small_step_threads, small_step_tokens: on the CPU, torch's ops in a step
        of at most `small_step_tokens` new tokens (decoding up to that many
        requests), and between steps (sampling), run on `small_step_threads`
        threads; larger steps (prefills) use every thread torch has, and
        radixrt's C kernels (the whole 4-bit decode step, attention, the LM
        head) always do. Measured on 2 cores through the engine: the small
        ops of a decode step and the sampler pay more for waking a second
        thread than they gain from it, while the C step gains from both cores
        (docs/benchmarks.md).
    """

    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"
    quantize: str | None = None
    page_size: int = 1
    max_total_tokens: int | None = None
    kv_memory_fraction: float = 0.85
    kv_memory_bytes: int = 1 << 30
    attention_backend: str = "auto"
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    new_token_reserve_ratio: float = 0.3
    check_invariants: bool = False
    decode_steps: int = 8
    deterministic: bool | str = "auto"
    jump_forward: bool = True
    new_token_reserve_clip: int = 4096
    lpm_queue_limit: int = 128
    in_batch_share_min_tokens: int = 32
    shared_prefix_min_tokens: int = DEFAULT_SHARED_PREFIX_MIN_TOKENS
    small_step_threads: int = 1
    small_step_tokens: int = 8

    def __post_init__(self) -> None:
        _require_int("page_size", self.page_size, 1)
        if self.max_total_tokens is not None:
            _require_int("max_total_tokens", self.max_total_tokens, 1)
        _require_int("kv_memory_bytes", self.kv_memory_bytes, 1)
        _require_int("chunked_prefill_size", self.chunked_prefill_size, 1)
        _require_int("max_running_requests", self.max_running_requests, 1)
        _require_int("max_prefill_tokens", self.max_prefill_tokens, 1)
        _require_int("decode_steps", self.decode_steps, 1)
        _require_int("new_token_reserve_clip", self.new_token_reserve_clip, 0)
        _require_int("lpm_queue_limit", self.lpm_queue_limit, 0)
        _require_int("in_batch_share_min_tokens", self.in_batch_share_min_tokens, 1)
        _require_int("shared_prefix_min_tokens", self.shared_prefix_min_tokens, 1)
        _require_int("small_step_threads", self.small_step_threads, 1)
        _require_int("small_step_tokens", self.small_step_tokens, 0)
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if not 0.0 <= self.new_token_reserve_ratio <= 1.0:
            raise ValueError(f"new_token_reserve_ratio must be in [0, 1], got {self.new_token_reserve_ratio!r}")
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be True or False, got {self.jump_forward!r}")
        if not (isinstance(self.deterministic, bool) or self.deterministic == "auto"):
            raise ValueError(f"deterministic must be True, False or 'auto', got {self.deterministic!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE_TYPES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_TYPES)} (or None), got {self.quantize!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {self.attention_backend!r}")
        if not (self.device in DEVICES or str(self.device).startswith("cuda:")):
            raise ValueError(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "RuntimeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Runtime option(s) {unknown}; accepted: {sorted(known)}")
        return cls(**kwargs)


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
