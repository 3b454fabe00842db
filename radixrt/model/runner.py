"""One model step: pick the executor, plan the step's attention, run it to the logits of the wanted rows."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixrt.kernels import cpu
from radixrt.kernels.base import AttentionBackend
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.memory.kv_cache import KVCache
from radixrt.model.executors import LayerByLayer, WholeStep
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.row_kernels import cpu_row_kernels


@functools.cache
def _process_threads() -> int:
    return torch.get_num_threads()


@dataclass(frozen=True)
class StepThreads:
    """How many CPU threads a step computes on.

    torch's ops run on `small` threads in steps of at most `small_step_tokens` new tokens, and
    on `large` in the rest (default: torch's thread count when the first StepThreads of the
    process was made, i.e. before any runner changed it); radixrt's C kernels always run on
    `large` (`kernels.cpu.kernel_threads`). Between steps the engine's thread keeps `small`
    (`between_steps`): sampling and bookkeeping are small ops too.
    """

    small: int
    small_step_tokens: int
    large: int = dataclasses.field(default_factory=_process_threads)

    def for_tokens(self, num_tokens: int) -> int:
        return self.between_steps() if num_tokens <= self.small_step_tokens else self.large

    def between_steps(self) -> int:
        return min(self.small, self.large)


class ModelRunner:
    """Runs `LlamaForCausalLM` over a `KVCache` through one attention backend.

    Ownership: the runner only writes the K/V of a batch's new tokens, at
    `batch.out_slots`; which slots those are, and who owns them afterwards,
    is the caller's business (the scheduler allocates them from the PagePool).
    `threads` (CPU only) sets torch's thread count for each step, restoring it
    afterwards; None leaves it alone. `deterministic`: True makes every step
    batch-invariant (`LlamaForCausalLM.deterministic_problem` says why it cannot
    be: ValueError); "auto" where it can be, else not; `self.deterministic` says which.
    Each step runs through one of two executors (`radixrt.model.executors`): the whole-step
    kernel where it applies and `whole_steps` allows, else the model's layers one by one.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend[Any],
        threads: StepThreads | None = None,
        deterministic: bool | str = False,
        whole_steps: bool = True,
    ):
        config = model.config
        expected = (config.num_layers, config.num_kv_heads, config.head_dim)
        shape = kv_cache.shape
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != expected:
            raise ValueError(
                f"kv_cache shape (layers, kv_heads, head_dim) = "
                f"{(shape.num_layers, shape.num_kv_heads, shape.head_dim)} does not fit the model's {expected}"
            )
        if shape.dtype != model.dtype:
            raise ValueError(f"kv_cache dtype {shape.dtype} must be the model's dtype {model.dtype}")
        if not _same_device(kv_cache.device, model.device):
            raise ValueError(f"kv_cache is on {kv_cache.device}, the model on {model.device}")
        if backend.kv_cache is not kv_cache:
            raise ValueError("backend must be built over the same kv_cache")
        problem = model.deterministic_problem(backend) if deterministic else None
        if deterministic is True and problem is not None:
            raise ValueError(f"deterministic=True: {problem}")
        self.deterministic = bool(deterministic) and problem is None
        if self.deterministic:
            model.prepare_deterministic()
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.layer_by_layer = LayerByLayer(model, backend, self.deterministic)
        self.whole_step = WholeStep.create(model, backend, self.deterministic) if whole_steps else None
        self.threads = threads if model.device.type == "cpu" else None
        # The sampler's compiled passes over this runner's logits rows (CPU rows only).
        self.row_kernels = (cpu_row_kernels(None if self.threads is None else self.threads.large)
                            if model.device.type == "cpu" else None)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def kernel_isa(self) -> str | None:
        """The instruction-set level of radixrt's C kernels this runner's CPU steps use
        ("portable", "avx2", "avx512"; "none" without a C compiler), or None on a GPU."""
        return cpu.isa() if self.model.device.type == "cpu" else None

    @property
    def runs_decodes(self) -> bool:
        """Whether `decode_run` can take this runner's decode batches (`WholeStep.runs_decodes`)."""
        return self.whole_step is not None and self.whole_step.runs_decodes

    def decode_run(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[torch.Tensor],
        sampling: cpu.RunSampling, num_steps: int, interrupt: ctypes.c_int32 | None = None,
    ) -> cpu.RunOutput:
        """Up to `num_steps` decode steps in one call, each sampling the next tokens (check
        `runs_decodes` first): see `WholeStep.decode_run`. Each step writes K/V at the
        sequences' next slots, as `forward` does at `batch.out_slots`; a nonzero `interrupt`
        ends the run after the step that sees it."""
        with torch.inference_mode(), cpu.kernel_threads(None if self.threads is None else self.threads.large):
            assert self.whole_step is not None
            return self.whole_step.decode_run(tokens, positions, slots, sampling, num_steps, interrupt)

    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [len(logit_rows), vocab_size] for rows of the batch's new tokens.

        `logit_rows` defaults to `batch.last_token_rows` (one row per
        sequence, for sampling); pass more rows (any order, repeats allowed)
        to score prompt tokens, e.g. for log-probabilities of choices.
        """
        if logit_rows is None:
            logit_rows = batch.last_token_rows
        elif not isinstance(logit_rows, torch.Tensor) or logit_rows.dim() != 1 or logit_rows.dtype != torch.int64:
            raise TypeError("logit_rows must be a 1-D int64 tensor of rows of the batch's new tokens")
        previous = torch.get_num_threads()
        wanted = previous if self.threads is None else self.threads.for_tokens(batch.num_tokens)
        if wanted != previous:
            torch.set_num_threads(wanted)
        try:
            with torch.inference_mode(), cpu.kernel_threads(None if self.threads is None else self.threads.large):
                return self.executor(batch).run(batch, logit_rows)
        finally:
            if wanted != previous:  # the thread count is the process's: leave it as found
                torch.set_num_threads(previous)

    def executor(self, batch: ForwardBatch) -> WholeStep | LayerByLayer:
        """The executor that runs `batch`: the whole-step kernel where it takes the step, else the layers."""
        whole = self.whole_step
        return whole if whole is not None and whole.takes(batch) else self.layer_by_layer


def _same_device(a: torch.device, b: torch.device) -> bool:
    """"cuda" and "cuda:0" are one device when the current device is 0: torch compares them unequal."""
    def resolved(device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    return a.type == b.type and (a.type != "cuda" or resolved(a) == resolved(b))
