"""Forward-pass speed of radixrt's model runner against transformers, same weights, same run.

Measures, for the bundled SmolLM2-135M-Instruct (or `--config`: a Hugging Face folder,
or a named shape from SHAPES with random weights) on this machine, per dtype:
  prefill   one prompt of --prefill-len tokens: tokens/s (transformers: model(input_ids)
            with logits_to_keep=1, as generate() does; radixrt: one ForwardBatch)
  decode    one step for --batch-sizes sequences of --context tokens each: ms/step
            (transformers: one step with its DynamicCache, cropped back after each run;
            radixrt: one decode batch over the paged pool, torch attention backend,
            deterministic where the runtime's default makes it so)
  floor     the machine's read bandwidth (a 1 GiB float32 sum on all threads) and, per
            weights mode, the bytes a batch-1 decode step must read (every projection and
            the LM head once) divided by it: no step can be faster
  loop      a batch-1 decode step in a loop of back-to-back steps (the state a decode loop
            runs in, not in the wake of a transformers step) against the floor at the
            bandwidth measured between its steps (--runs rounds of one sum and 24 steps);
            and, where the runtime decodes a steady batch in decode runs (deterministic
            native weights), a step of a run of 8 greedy steps in the same rounds
Medians (or with --statistic min, best times) of --runs timed runs after one warm-up,
radixrt and transformers alternating. Use min on a machine shared with other jobs: the
best run is the one least disturbed. `--weights native` runs radixrt on the GGUF file's
own 4-bit projections (transformers always runs the dense weights).
Not a test: nothing is asserted.

    python bench/model_bench.py [--config qwen3-0.6b | gemma3-270m | ... | FOLDER]
                                [--dtypes fp32,bf16] [--weights dense,native] [--prefill-len 512]
                                [--context 256] [--batch-sizes 1,8,32] [--threads 1,2]

Named shapes are the real models' layer shapes with seeded random weights (speed does not
depend on the values): both sides then hold a copy, e.g. about 2 x 2.4 GB for qwen3-0.6b in fp32.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.memory.kv_cache import KVCache
from radixrt.model.gguf_int4 import Int8Weight, read_lm_head
from radixrt.model.loader import LoadedModel, bundled_model_path, load_model
from radixrt.model.runner import ModelRunner
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import run_sampling

_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 4096}  # fmt: skip
# name -> (transformers config class, its arguments): the published shapes (layers, widths,
# heads, vocabulary, windows) at the 135M-600M scale, and tiny ones for a quick run.
SHAPES: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-0.6b": ("Qwen3Config", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True}),
    "gemma3-270m": ("Gemma3TextConfig", {
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "max_position_embeddings": 32768, "rope_parameters": _GEMMA3_ROPE}),
    "qwen3-tiny": ("Qwen3Config", _TINY),
    "gemma2-tiny": ("Gemma2Config", {**_TINY, "sliding_window": 64}),
    "gemma3-tiny": ("Gemma3TextConfig", {**_TINY, "sliding_window": 64, "rope_parameters": _GEMMA3_ROPE}),
    "phi3-tiny": ("Phi3Config", {**_TINY, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
                                 "num_attention_heads": 2, "num_key_value_heads": 1}),
    "mistral-tiny": ("MistralConfig", {**_TINY, "sliding_window": 64}),
}  # fmt: skip


def model_folder(config: str, scratch: Path) -> Path:
    """`config` as a Hugging Face folder: itself if it is one, else the named shape written with
    seeded random weights and a one-token tokenizer (the benchmark feeds token ids)."""
    if Path(config).is_dir():
        return Path(config)
    if config not in SHAPES:
        raise SystemExit(f"--config {config!r} is neither a folder nor a shape; shapes: {', '.join(SHAPES)}")
    from tokenizers import Tokenizer, models

    class_name, kwargs = SHAPES[config]
    hf_config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(scratch)
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(scratch)
    return scratch


RUN_STEPS = 8  # the runtime's default decode_steps


def paired_times(
    ours: Callable[[], object],
    theirs: Callable[[], object],
    runs: int,
    statistic: Callable[[list[float]], float],
    reset_theirs: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """`statistic` of each step's seconds, timed alternately (ours, theirs, ours, ...) after one
    warm-up each, so a burst of load from elsewhere hits both sides alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(runs + 1):
        for side, step in enumerate((ours, theirs)):
            if side == 1 and reset_theirs is not None:
                reset_theirs()
            start = time.perf_counter()
            step()
            if i:
                times[side].append(time.perf_counter() - start)
    return statistic(times[0]), statistic(times[1])


def make_runner(loaded: LoadedModel, num_slots: int) -> ModelRunner:
    """A runner as `Runtime` makes one: deterministic where radixrt's kernels serve the model."""
    config = loaded.config
    kv_cache = KVCache(config.kv_shape(loaded.model.dtype), num_slots)
    backend = create_backend("torch", kv_cache, config.num_heads, config.num_kv_heads, config.head_dim)
    return ModelRunner(loaded.model, kv_cache, backend, deterministic="auto")


def bench_prefill(
    loaded: LoadedModel, hf_model: torch.nn.Module, length: int, runs: int, statistic: Callable[[list[float]], float]
) -> tuple[float, float]:
    ids = torch.randint(0, loaded.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    runner = make_runner(loaded, length)
    batch = ForwardBatch.build([ids.tolist()], [0], [torch.arange(length)])
    with torch.inference_mode():
        return paired_times(
            lambda: runner.forward(batch), lambda: hf_model(ids[None], logits_to_keep=1), runs, statistic
        )


def bench_decode(
    loaded: LoadedModel,
    hf_model: torch.nn.Module,
    batch_size: int,
    context: int,
    runs: int,
    statistic: Callable[[list[float]], float],
) -> tuple[float, float]:
    runner, step, prompts = decode_setup(loaded, batch_size, context)
    with torch.inference_mode():
        cache = hf_model(prompts[:, :-1], use_cache=True).past_key_values
        last = prompts[:, -1:]

        def drop_last_step() -> None:
            extra = cache.get_seq_length() - (context - 1)
            if extra:
                cache.crop(-extra)

        return paired_times(
            lambda: runner.forward(step),
            lambda: hf_model(last, past_key_values=cache, use_cache=True, logits_to_keep=1),
            runs,
            statistic,
            drop_last_step,
        )


def decode_setup(
    loaded: LoadedModel, batch_size: int, context: int, extra_slots: int = 0
) -> tuple[ModelRunner, ForwardBatch, torch.Tensor]:
    """A runner whose pool holds `batch_size` random prompts of `context - 1` tokens (and
    `extra_slots` free slots after each), the decode step of their last tokens, and the prompts."""
    generator = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(0, loaded.config.vocab_size, (batch_size, context), generator=generator)
    stride = context + extra_slots
    runner = make_runner(loaded, batch_size * stride)
    slots = [torch.arange(i * stride, i * stride + context) for i in range(batch_size)]
    runner.forward(ForwardBatch.build([p[:-1].tolist() for p in prompts], [0] * batch_size, [s[:-1] for s in slots]))
    step = ForwardBatch.build([[int(p[-1])] for p in prompts], [context - 1] * batch_size, slots)
    return runner, step, prompts


def bench_floor(
    loaded: LoadedModel, context: int, rounds: int, steps_per_round: int = 24
) -> tuple[float, float | None, float]:
    """(median seconds of a batch-1 decode step in a loop of back-to-back steps, as a decode loop
    of single steps runs them; the same a step of a decode run of RUN_STEPS greedy steps, as the
    runtime decodes a steady batch, None where runs do not apply; median bytes per second of a
    1 GiB float32 sum). Rounds alternate one sum, `steps_per_round` single steps and as many
    steps in runs, so that steps and bandwidth are measured in the same minutes: this VM's
    bandwidth drifts by half between quarters of an hour."""
    runner, step, prompts = decode_setup(loaded, 1, context, extra_slots=RUN_STEPS)
    runs = runner.runs_decodes
    sampling = run_sampling([SamplingParams(temperature=0)], [0], [[]], [[]], [[]], RUN_STEPS,
                            loaded.config.vocab_size)
    slots = [torch.arange(context + RUN_STEPS)]

    def run() -> None:
        out = runner.decode_run([int(prompts[0, -1])], [context - 1], slots, sampling, RUN_STEPS)
        assert out.tokens.shape[0] == RUN_STEPS

    data = torch.ones(1 << 28)
    steps, run_steps, sums = [], [], []
    with torch.inference_mode():
        runner.forward(step)
        if runs:
            run()
        for _ in range(rounds):
            sums.append(_timed(data.sum))
            steps.extend(_timed(lambda: runner.forward(step)) for _ in range(steps_per_round))
            if runs:
                run_steps.extend(_timed(run) / RUN_STEPS for _ in range(steps_per_round // RUN_STEPS))
    run_step = statistics.median(run_steps) if runs else None
    return statistics.median(steps), run_step, data.numel() * 4 / statistics.median(sums)


def read_bandwidth(runs: int = 5) -> float:
    """Bytes per second a float32 sum over 1 GiB reads, best of `runs` (all threads)."""
    data = torch.ones(1 << 28)
    data.sum()
    best = min(_timed(data.sum) for _ in range(runs))
    return data.numel() * 4 / best


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of weights one batch-1 decode step reads: the projections and the LM head, as stored
    (native: 4-bit codes with a 16-bit scale and offset per 32; a Q8_0 head 8-bit codes with a
    16-bit scale per 32)."""
    model = loaded.model

    def int4_bytes(numel: int) -> int:
        return numel // 2 + numel // 32 * 4

    def dense_bytes(weight: torch.Tensor) -> int:
        return weight.numel() * weight.element_size()

    native = loaded.weights == "native"
    head = read_lm_head(bundled_model_path()) if native else None  # native: only the bundled model
    if head is None:
        total = dense_bytes(model.lm_head)
    else:
        numel = head.shape[0] * head.shape[1]  # the dense table may be gone: a tied head is the embedding
        total = numel + numel // 32 * 2 if isinstance(head, Int8Weight) else int4_bytes(numel)
    for layer in model.layers:
        for name, shape in layer.projection_shapes().items():  # native: the dense parameters are empty
            weight = getattr(layer, f"{name}_proj")
            total += int4_bytes(shape[0] * shape[1]) if native else dense_bytes(weight)
    return total


def cpu_name() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"a Hugging Face folder or a shape: {', '.join(SHAPES)} (default: bundled)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--weights", default="dense", help="radixrt's weights: dense, native or both (dense,native)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--statistic", choices=("median", "min"), default="median")
    parser.add_argument(
        "--threads", default=str(torch.get_num_threads()),
        help="torch thread counts to measure, e.g. 1,2 (both sides use the same count)",
    )
    args = parser.parse_args()
    if args.config is not None and args.weights != "dense":
        raise SystemExit("--weights native needs the bundled GGUF model: drop --config or use --weights dense")
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="radixrt-model-bench-") as scratch:
        folder = None if args.config is None else model_folder(args.config, Path(scratch))
        run(args, folder)


def run(args: argparse.Namespace, folder: Path | None) -> None:
    """Print the table for the bundled model (`folder` None) or the model in `folder`."""
    statistic = statistics.median if args.statistic == "median" else min
    print(
        f"CPU: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}; {args.statistic} of {args.runs} runs; "
        f"model: {args.config or 'bundled SmolLM2-135M-Instruct'}"
    )
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (1 GiB float32 sum, best of 5)")
    print("| dtype | weights | threads | measure | radixrt | transformers | radixrt speed-up |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        hf_model = None
        for weights in args.weights.split(","):
            loaded = load_model(folder, device="cpu", dtype=dtype, weights=weights)
            if hf_model is None:
                source = {"gguf_file": loaded.path.name} if loaded.path.is_file() else {}  # a GGUF read in place
                hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                    loaded.path.parent if source else loaded.path, dtype=loaded.model.dtype, **source)
                hf_model.eval()
            weight_bytes = step_weight_bytes(loaded)
            floor = weight_bytes / bandwidth
            print(f"| {dtype} | {weights} | all | floor: batch-1 step reads {weight_bytes / 1e6:.0f} MB (ms) | "
                  f"{floor * 1e3:.1f} | | |", flush=True)
            for threads in (int(n) for n in args.threads.split(",")):
                torch.set_num_threads(threads)
                row = f"| {dtype} | {weights} | {threads} |"
                step, run_step, loop_bandwidth = bench_floor(loaded, args.context, args.runs)
                loop_floor = weight_bytes / loop_bandwidth
                print(
                    f"{row} batch-1 decode loop, {args.context}-token context: step / floor at the loop's "
                    f"{loop_bandwidth / 1e9:.1f} GB/s (ms) | {step * 1e3:.2f} / {loop_floor * 1e3:.2f} = "
                    f"{step / loop_floor:.2f}x | | |",
                    flush=True,
                )
                if run_step is not None:
                    print(
                        f"{row} batch-1 decode run of {RUN_STEPS} steps (the runtime's steady decoding), same "
                        f"minutes: step / floor (ms) | {run_step * 1e3:.2f} / {loop_floor * 1e3:.2f} = "
                        f"{run_step / loop_floor:.2f}x | | |",
                        flush=True,
                    )
                ours, theirs = bench_prefill(loaded, hf_model, args.prefill_len, args.runs, statistic)
                print(
                    f"{row} prefill {args.prefill_len} tokens (tokens/s) | {args.prefill_len / ours:.0f} | "
                    f"{args.prefill_len / theirs:.0f} | {theirs / ours:.2f}x |",
                    flush=True,
                )
                for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                    ours, theirs = bench_decode(loaded, hf_model, batch_size, args.context, args.runs, statistic)
                    print(
                        f"{row} decode step, batch {batch_size}, {args.context}-token contexts (ms) | "
                        f"{ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
