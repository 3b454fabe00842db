"""The baseline a user would otherwise reach for: Hugging Face transformers `generate`.

Same weights (the HF folder radixrt loads), same device and dtype. A call is
one `generate` over all its prompts, left-padded with an attention mask;
`n > 1` uses `num_return_sequences`. Settings match radixrt's: greedy when
the workload is greedy, else `do_sample` with the same temperature and no
top-k/top-p filtering; EOS never stops a sequence (radixrt runs with
`ignore_eos`), so both generate exactly `max_new_tokens`.

transformers has no per-request timing, so a streamer records when each
decoding step's tokens arrive: a row's TTFT is the first step's arrival, its
end-to-end latency the call's end (rows of one batch finish together).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from radixrt.benchmarks.system_api import Completion, resolved_device
from radixrt.benchmarks.workloads import Sampling


class _StepClock:
    """A generate streamer that notes the time of every put (first: the prompt, then one per step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersSystem:
    name = "transformers"
    concurrent = False
    runtime = None

    def __init__(self, folder: Path, device: str, dtype: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from radixrt.model.loader import resolve_device, resolve_dtype

        resolved = resolve_device(resolved_device(device))
        self.device = resolved
        self.dtype = resolve_dtype(dtype, resolved)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype)
        # transformers wraps `to` in functools.wraps, which typeshed types as a plain callable
        # (not a method), so mypy takes the device for `self`.
        self.model = model.to(resolved).eval()  # type: ignore[arg-type]
        tokenizer = AutoTokenizer.from_pretrained(folder)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        # A blank default config: the checkpoint's generation_config.json (its EOS, top-k, ...)
        # must not leak into calls whose every setting we state.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id)
        self._config_class = GenerationConfig

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, n: int = 1) -> list[list[Completion]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampled = sampling.temperature > 0
        config = self._config_class(
            max_new_tokens=sampling.max_new_tokens, do_sample=sampled,
            temperature=sampling.temperature if sampled else None, top_k=0 if sampled else None,
            top_p=1.0 if sampled else None, num_return_sequences=n, pad_token_id=self.pad_token_id,
            eos_token_id=None,
        )
        if sampled:
            torch.manual_seed(sampling.seed)
        clock = _StepClock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ended = time.perf_counter()
        first_token_s = (clock.times[1] if len(clock.times) > 1 else ended) - started
        rows = out[:, width:].tolist()
        return [
            [Completion(len(rows[i * n + j]), len(prompt), 0, first_token_s, ended - started, tuple(rows[i * n + j]))
             for j in range(n)]
            for i, prompt in enumerate(prompts)
        ]

    def reset(self) -> None:
        """Nothing to forget: generate keeps no state between calls."""

    def cache_counts(self) -> None:
        return None

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
