"""One system's side of `peers_bench.py`: start it, run the timed workloads once, write seconds as JSON.

Run by `peers_bench.py` in a fresh process per system and repetition, with
the interpreter that has the system installed (vLLM lives in its own venv,
because it pins its own torch), so this file imports only the standard
library; `main` imports the one package its system needs, before the
start-up timer starts.

    python bench/peers_worker.py SYSTEM SPEC.json OUT.json

Every system gets the same token ids from SPEC.json (built once by
`peers_bench.py` with the model's tokenizer and chat template), and every
request generates exactly its `new_tokens`: radixrt and vLLM with
`ignore_eos`, llama.cpp by reading that many tokens from `Llama.generate`,
which never stops at EOS by itself. A worker checks the counts, so a system
that stopped early fails instead of looking fast.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # radixrt from this checkout

# Exit status of a worker whose system is not installed; peers_bench.py drops that system.
MISSING_PACKAGE = 3
INSTALL_HINT = {
    "radixrt": "pip install -e .",
    "llama_cpp": "pip install radixrt[peers] (llama-cpp-python, built from source)",
    "vllm": "install vLLM's CPU build in its own venv and pass its python with --vllm-python",
}


@dataclass(frozen=True)
class Completion:
    """One generated sequence; `cached_tokens` is None when the system does not tell."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None


class Adapter(Protocol):
    """A system behind the four calls the workloads need.

    `generate` runs `n` samples of every prompt the way the system serves
    many requests (radixrt and vLLM batch them, llama.cpp runs them one after
    another) and returns them prompt by prompt; `flush` empties every
    prefix cache, so the next request starts cold.
    """

    version: str

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[Completion]: ...

    def generate_json(self, prompts: list[list[int]], schema: dict[str, Any], max_tokens: int) -> list[Completion]:
        """Greedy, each output held to `schema` by the system's own structured-output path."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RadixrtAdapter:
    """radixrt.Runtime with its defaults: bf16 on a CPU with native bf16, weights="auto" (native 4-bit)."""

    def __init__(self, radixrt: ModuleType, spec: dict[str, Any]):
        self.runtime = radixrt.Runtime()
        dtype = str(self.runtime.engine.runner.model.dtype).removeprefix("torch.")
        self.version = f"radixrt {radixrt.__version__} ({dtype}, weights={self.runtime.config.weights})"

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[Completion]:
        return self._run(prompts, {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True,
                                   "n": n, "seed": seed})  # fmt: skip

    def generate_json(self, prompts: list[list[int]], schema: dict[str, Any], max_tokens: int) -> list[Completion]:
        return self._run(prompts, {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": schema})

    def _run(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Completion]:
        results = self.runtime.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(results, list)
        return [Completion(r["output_ids"], r["meta_info"]["prompt_tokens"], r["meta_info"]["cached_tokens"])
                for r in results]

    def flush(self) -> None:
        self.runtime.flush_cache()

    def close(self) -> None:
        self.runtime.shutdown()


class LlamaCppAdapter:
    """llama-cpp-python's `Llama` on one GGUF file: 2 threads, one sequence, prefix reuse between calls.

    `Llama.generate` keeps the KV cache of the previous call and evaluates
    only what follows the longest common token prefix (minus one token when
    the whole prompt matches, to refresh the logits). `_reused` applies that
    rule to the token state before each call; llama-cpp-python counts it
    only in a verbose log line.
    """

    def __init__(self, llama_cpp: ModuleType, spec: dict[str, Any], gguf_path: str):
        threads = spec["threads"]
        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=spec["context_tokens"], n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False)
        self.version = f"llama-cpp-python {llama_cpp.__version__} ({Path(gguf_path).name})"

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[Completion]:
        completions = []
        for prompt in prompts:
            for sample in range(n):
                reused = self._reused(prompt)
                self.llm.set_seed(seed + sample)
                output: list[int] = []
                # top_k=0, top_p=1, min_p=0: plain temperature sampling, as radixrt's and vLLM's defaults.
                for token in self.llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=temperature,
                                               repeat_penalty=1.0):
                    output.append(token)
                    if len(output) == new_tokens:
                        break
                completions.append(Completion(output, len(prompt), reused))
        return completions

    def generate_json(self, prompts: list[list[int]], schema: dict[str, Any], max_tokens: int) -> list[Completion]:
        grammar = self.llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        completions = []
        for prompt in prompts:
            reused = self._reused(prompt)
            output: list[int] = []
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, grammar=grammar):
                if token == self.llm.token_eos() or len(output) == max_tokens:
                    break
                output.append(token)
            completions.append(Completion(output, len(prompt), reused))
        return completions

    def _reused(self, prompt: list[int]) -> int:
        common = 0
        for cached, token in zip(self.llm.input_ids[: self.llm.n_tokens], prompt):
            if cached != token:
                break
            common += 1
        return common - 1 if common == len(prompt) else common

    def flush(self) -> None:
        self.llm.reset()

    def close(self) -> None:
        self.llm.close()


class VllmAdapter:
    """vLLM's offline `LLM` on the bf16 Hugging Face folder, prefix caching on, all requests in one call.

    Its CPU defaults otherwise (on 2 cores: one runs the model, one its
    scheduler and front end). The KV cache gets 1 GiB, as radixrt's CPU
    default: vLLM's own default reserves 92% of the memory node and refuses
    to start when other processes hold some of it.
    """

    def __init__(self, vllm: ModuleType, spec: dict[str, Any]):
        self.vllm = vllm
        self.llm = vllm.LLM(model=spec["hf_folder"], dtype="bfloat16", enable_prefix_caching=True,
                            max_model_len=spec["context_tokens"], seed=0, kv_cache_memory_bytes=1 << 30)
        self.version = f"vllm {vllm.__version__} (bf16)"

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[Completion]:
        params = self.vllm.SamplingParams(n=n, temperature=temperature, max_tokens=new_tokens, ignore_eos=True,
                                          seed=seed)
        inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [Completion(list(sample.token_ids), len(out.prompt_token_ids), out.num_cached_tokens)
                for out in outputs for sample in out.outputs]

    def generate_json(self, prompts: list[list[int]], schema: dict[str, Any], max_tokens: int) -> list[Completion]:
        """vLLM's structured outputs with its default backend."""
        sampling = self.vllm.sampling_params
        if hasattr(sampling, "StructuredOutputsParams"):
            constraint = {"structured_outputs": sampling.StructuredOutputsParams(json=schema)}
        else:
            constraint = {"guided_decoding": sampling.GuidedDecodingParams(json=schema)}
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, **constraint)
        outputs = self.llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        return [Completion(list(out.outputs[0].token_ids), len(out.prompt_token_ids), out.num_cached_tokens)
                for out in outputs]

    def flush(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


# system -> (its package, how to start it with that package imported and the spec)
SYSTEMS: dict[str, tuple[str, Callable[[ModuleType, dict[str, Any]], Adapter]]] = {
    "radixrt": ("radixrt", RadixrtAdapter),
    "llamacpp-q4": ("llama_cpp", lambda module, spec: LlamaCppAdapter(module, spec, spec["gguf_q4"])),
    "llamacpp-bf16": ("llama_cpp", lambda module, spec: LlamaCppAdapter(module, spec, spec["gguf_bf16"])),
    "vllm": ("vllm", VllmAdapter),
}


def timed(system: Adapter, prompts: list[list[int]], new_tokens: int, **sampling: Any) -> tuple[float, list[Completion]]:
    """Wall seconds of one `generate`, after checking every sequence generated exactly `new_tokens`."""
    start = time.perf_counter()
    completions = system.generate(prompts, new_tokens, **sampling)
    seconds = time.perf_counter() - start
    lengths = sorted({len(c.output_ids) for c in completions})
    if lengths != [new_tokens]:
        raise RuntimeError(f"expected {new_tokens} new tokens per sequence, got lengths {lengths}")
    return seconds, completions


def run_workloads(system: Adapter, work: dict[str, Any], workloads: list[str]) -> dict[str, float]:
    """Seconds of each timed workload named in `workloads`; each starts from an empty prefix cache."""
    result: dict[str, float] = {}
    if "table" in workloads:
        table = work["table"]
        system.flush()
        result["table_cold_s"], _ = timed(system, [table["cold"]], table["new_tokens"])
        result["table_hit_s"], _ = timed(system, [table["hit"]], table["new_tokens"])
    if "few_shot" in workloads:
        few_shot = work["few_shot"]
        system.flush()
        system.generate([few_shot["prefix"]], 1)  # the prefix is warm, as in a running service
        result["few_shot_s"], _ = timed(system, few_shot["prompts"], few_shot["new_tokens"])
    if "fork" in workloads:
        fork = work["fork"]
        system.flush()
        result["fork_s"], _ = timed(system, [fork["prompt"]], fork["new_tokens"], temperature=fork["temperature"],
                                    n=fork["n"], seed=1)
    if "chat" in workloads:
        result.update(_chat(system, work["chat"]))
    if "structured" in workloads:
        result.update(_structured(system, work["structured"]))
    return result


def _chat(system: Adapter, chat: dict[str, Any]) -> dict[str, float]:
    result: dict[str, float] = {}
    system.flush()
    conversations = [list(first) for first in chat["first"]]
    result["chat_s"] = result["chat_prompt_tokens"] = result["chat_reused_tokens"] = 0.0
    reuse_known = True
    for turn in range(chat["turns"]):
        if turn:
            conversations = [history + chat["next"][c][turn - 1] for c, history in enumerate(conversations)]
        # each turn's prompt is the whole conversation so far
        seconds, replies = timed(system, conversations, chat["new_tokens"])
        result["chat_s"] += seconds
        for reply in replies:
            result["chat_prompt_tokens"] += reply.prompt_tokens
            reuse_known = reuse_known and reply.cached_tokens is not None
            result["chat_reused_tokens"] += reply.cached_tokens or 0
        conversations = [history + reply.output_ids for history, reply in zip(conversations, replies, strict=True)]
    if not reuse_known:
        del result["chat_reused_tokens"]
    return result


def _structured(system: Adapter, structured: dict[str, Any]) -> dict[str, float]:
    result: dict[str, float] = {}
    system.flush()
    system.generate(structured["prompts"][:1], 1)  # the chat template's common prefix is warm
    start = time.perf_counter()
    records = system.generate_json(structured["prompts"], structured["schema"], structured["new_tokens"])
    result["structured_s"] = time.perf_counter() - start
    result["structured_tokens"] = sum(len(r.output_ids) for r in records)
    result["structured_complete"] = sum(len(r.output_ids) < structured["new_tokens"] for r in records)
    # an agent's shape: one record at a time, each request waiting for the one before
    start = time.perf_counter()
    singles = [system.generate_json([prompt], structured["schema"], structured["new_tokens"])[0]
               for prompt in structured["prompts"][: structured["one_by_one"]]]  # fmt: skip
    result["structured_one_by_one_s"] = time.perf_counter() - start
    result["structured_one_by_one_tokens"] = sum(len(r.output_ids) for r in singles)
    return result


def main(argv: list[str]) -> int:
    name, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    module, start_system = SYSTEMS[name]
    try:
        package = importlib.import_module(module)  # imports are not start-up: the timer starts at construction
    except ImportError as error:
        print(f"{name}: {module} is not installed ({error}); {INSTALL_HINT[module]}", file=sys.stderr)
        return MISSING_PACKAGE
    start = time.perf_counter()
    system = start_system(package, spec)
    system.generate([spec["work"]["startup"]], 1)  # ready = it has answered a request
    startup_s = time.perf_counter() - start
    try:
        for prompts in spec["work"]["warmup"]:  # untimed: first-call costs (allocations, kernel choice) go here
            system.generate(prompts, 4)
            system.generate(prompts[:1], 4, temperature=0.7, n=2)
        result = {"startup_s": startup_s, **run_workloads(system, spec["work"], spec["workloads"])}
    finally:
        system.close()
    Path(out_path).write_text(json.dumps({"system": name, "version": system.version, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
