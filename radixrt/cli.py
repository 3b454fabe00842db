"""The `radixrt` command: generate, demo, bench, serve, explain.

Global options (model, device, pool size, logging) may come before or after
the command. Everything a command line can get wrong is checked before torch
is imported or a model loaded, so a typo costs a second, not a model load.
Ctrl-C ends a command with exit code 130 and one line (a running server
handles it itself: a graceful shutdown, exit code 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Sequence

import radixrt
from radixrt.config import DEVICES, QUANTIZE_TYPES, SCHEDULE_POLICIES, WEIGHTS
from radixrt.kernels import BACKEND_NAMES
from radixrt.sampling import SamplingParams
from radixrt.scaleout.config import POLICIES as ROUTER_POLICIES
from radixrt.scaleout.config import RouterConfig

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXIT_INTERRUPTED = 130  # the shell's convention for a process ended by SIGINT
_GLOBAL_FOR_BENCH = ("model", "device", "dtype", "attention_backend", "page_size", "quantize")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    params = _sampling_params(parser, args) if args.command == "generate" else None
    try:
        if args.command == "bench":
            return _bench(parser, args, rest)
        _configure_logging(args.log_level or ("warning" if args.command == "generate" else "info"))
        if args.command == "serve":
            return _serve(parser, args)
        if args.command == "explain":
            return _explain(args)
        return _run(args, params)
    except KeyboardInterrupt:
        print("radixrt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixrt", description="A RadixAttention inference runtime.")
    parser.add_argument("--version", action="version", version=f"radixrt {radixrt.__version__}")
    _add_global_options(parser, with_defaults=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,demo,serve,explain,bench}")

    gen = commands.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message with the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    gen.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]")
    gen.add_argument("--top-k", type=int, default=-1, help="-1 (off) or >= 1")
    gen.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    gen.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    gen.add_argument("--stop", action="append", default=None, help="stop at this string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")
    constraint = gen.add_argument_group("output constraint (at most one; docs/structured.md)")
    only_one = constraint.add_mutually_exclusive_group()
    only_one.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    only_one.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON Schema in FILE")
    only_one.add_argument("--ebnf", metavar="FILE", help="the output is derived from the EBNF grammar in FILE")
    _add_global_options(gen, with_defaults=False)

    demo = commands.add_parser("demo", help="the table example: a long shared prefix hit by a second question")
    _add_global_options(demo, with_defaults=False)
    serve = _add_serve_parser(commands)
    _add_global_options(serve, with_defaults=False)
    explain = commands.add_parser("explain", help="ask a running server how much of a prompt is cached, and why not more")
    explain.add_argument("prompt")
    explain.add_argument("--chat", action="store_true", help="as a user message with the chat template")
    explain.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default http://127.0.0.1:30000)")
    explain.add_argument("--api-key", help="the bearer key, when the server needs one")
    explain.add_argument("--cache-salt", help="the cache namespace to explain against")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    # bench's own options belong to the suite (radixrt/benchmarks/suite.py): they pass through
    # unparsed, so `radixrt bench --help` prints the suite's help.
    commands.add_parser("bench", add_help=False, help="the benchmark suite (radixrt bench --help for its options)")
    return parser


def _add_global_options(parser: argparse.ArgumentParser, with_defaults: bool) -> None:
    """The options every command shares. On a command's own parser they default to SUPPRESS, so
    one given after the command overrides the top-level value and one not given leaves it alone."""

    def default(value: Any) -> Any:
        return value if with_defaults else argparse.SUPPRESS

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument("--model", default=default(None),
                       help="a Hugging Face folder or a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--device", type=_device, default=default("auto"),
                       help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    group.add_argument("--dtype", choices=DTYPES, default=default("auto"),
                       help="auto: bfloat16 on a GPU or a CPU with native bf16, else float32; float16 is GPU only")
    group.add_argument("--weights", choices=WEIGHTS, default=default("auto"),
                       help="native: keep a GGUF model's 4-bit projections as stored (CPU; fewer bytes per step); "
                       "auto: native for such a model on a bf16 CPU, else dense")
    group.add_argument("--quantize", choices=QUANTIZE_TYPES, default=default(None),
                       help="quantize a dense model's projections and LM head at load (a HF folder or an "
                       "F32/F16/BF16 GGUF; CPU, bfloat16): q8_0 or q4_0, llama.cpp's blocks")
    group.add_argument("--attention-backend", choices=BACKEND_NAMES, default=default("auto"),
                       help="auto: flashinfer, else triton on a GPU; torch on a CPU")
    group.add_argument("--page-size", type=_int_at_least(1), default=default(1), help="tokens per KV page")
    group.add_argument("--max-total-tokens", type=_int_at_least(1), default=default(None),
                       help="KV pool size in tokens (default: 1 GiB of KV on a CPU, 85%% of free memory on a GPU)")
    group.add_argument("--disable-radix-cache", action="store_true", default=default(False),
                       help="never reuse KV across requests (the baseline)")
    group.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=default("auto"),
                       help="outputs bitwise independent of batching, chunking, memory pressure and the cache "
                       "(docs/determinism.md); default: on where radixrt's CPU kernels serve the model")
    group.add_argument("--jump-forward", action=argparse.BooleanOptionalAction, default=default(True),
                       help="compute the text an output constraint forces as one step's draft (default: on; "
                       "outputs are the same either way, docs/structured.md)")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=default(None),
                       help="default: info for demo and serve (loading phases, a status line while busy), else warning")


def _add_serve_parser(commands: Any) -> argparse.ArgumentParser:
    serve: argparse.ArgumentParser = commands.add_parser(
        "serve", help="an OpenAI-compatible and SGLang-native HTTP server"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_int_at_least(0), default=30000)
    serve.add_argument("--api-key", action="append", default=[], help="require this bearer key (repeat for tenants)")
    serve.add_argument("--api-key-file", help="a file of API keys, one per line")
    serve.add_argument(
        "--cache-isolation", choices=["none", "per-key"], default="none",
        help="per-key: each API key gets its own cache namespace (no cross-tenant hits)",
    )
    serve.add_argument("--max-queued-requests", type=_int_at_least(0), default=1024,
                       help="beyond running + this, a 503")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    serve.add_argument("--tool-call-parser", choices=["hermes", "qwen25", "llama3_json"],
                       help="the syntax of the model's tool calls (default: read from its chat template)")
    serve.add_argument("--max-running-requests", type=_int_at_least(1), help="the most requests decoding at once")
    serve.add_argument("--chunked-prefill-size", type=_int_at_least(1),
                       help="the most prompt tokens of one request per step")
    serve.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES)
    serve.add_argument("--decode-steps", type=_int_at_least(1),
                       help="decode steps run in one kernel call when every request is decoding (default 8; 1: off)")
    scale = serve.add_argument_group("replicas (on Ray Serve: pip install 'radixrt[ray]')")
    scale.add_argument("--replicas", type=_int_at_least(1), default=1,
                       help="runtimes behind one cache-aware router (default 1: no Ray)")
    scale.add_argument("--router", choices=ROUTER_POLICIES, default="prefix",
                       help="prefix (default): the replica holding the longest cached prefix, with a load guard")
    scale.add_argument("--router-min-match-tokens", type=_int_at_least(0), default=RouterConfig.min_match_tokens,
                       help=f"a shorter cached prefix routes by load (default {RouterConfig.min_match_tokens})")
    scale.add_argument("--router-max-load-gap", type=_int_at_least(0), default=RouterConfig.max_load_gap,
                       help="in-flight requests the best-matching replica may have beyond the least loaded "
                            f"(default {RouterConfig.max_load_gap})")
    scale.add_argument("--ray-address", help="an existing Ray cluster (e.g. auto); default: start a local one")
    return serve


def _device(value: str) -> str:
    if value in DEVICES or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = minimum - 1
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value!r}")
        return number

    return parse


def _sampling_params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """The request's sampling parameters, each checked alone first so the error names its option."""
    given = {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "stop": args.stop,
        "ignore_eos": args.ignore_eos, "regex": args.regex,
        "json_schema": _read_option_file(parser, "--json-schema", args.json_schema),
        "ebnf": _read_option_file(parser, "--ebnf", args.ebnf),
    }
    files = {"json_schema": args.json_schema, "ebnf": args.ebnf}
    for name, value in given.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as error:
            where = f"{files[name]}: " if files.get(name) else ""
            parser.error(f"argument --{name.replace('_', '-')}: {where}{error}")
    try:
        return SamplingParams(**given)
    except ValueError as error:  # alone each was fine: a combination (a constraint with 0 tokens)
        parser.error(str(error))


def _read_option_file(parser: argparse.ArgumentParser, option: str, path: str | None) -> str | None:
    """The text of the file an option names (None when not given); an unreadable file is a usage error.

    A JSON Schema file that is not JSON fails here too (SamplingParams parses it), before a model loads.
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"argument {option}: cannot read {path}: {error}")


def _configure_logging(level: str) -> None:
    """radixrt's own loggers at `level`; other libraries stay at warning, so info means ours."""
    detail = "%(name)s " if level == "debug" else ""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {detail}%(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("radixrt").setLevel(level.upper())


def _run(args: argparse.Namespace, params: SamplingParams | None) -> int:
    """generate or demo: load the runtime, then do the one thing asked."""
    if args.command == "demo":
        from radixrt.demo import INTRO

        print(INTRO, flush=True)
    logger.info("importing torch and transformers (a few seconds)")
    from radixrt.runtime import Runtime

    options = _runtime_options(args)
    try:
        runtime = Runtime(args.model, **options)
    except (ValueError, FileNotFoundError) as error:
        print(f"radixrt: {error}", file=sys.stderr)
        return 2
    with runtime:
        if args.command == "demo":
            from radixrt.demo import run_demo

            run_demo(runtime)
            return 0
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        try:
            if args.json:
                print(json.dumps(runtime.generate(prompt, params), indent=2))
            else:
                for chunk in runtime.generate(prompt, params, stream=True):
                    print(chunk["text"], end="", flush=True)
                print()
        except ValueError as error:
            print(f"radixrt: {error}", file=sys.stderr)
            return 2
    return 0


def _runtime_options(args: argparse.Namespace) -> dict[str, Any]:
    """The global options as `Runtime` keyword arguments."""
    options: dict[str, Any] = {
        "device": args.device, "dtype": args.dtype, "weights": args.weights, "quantize": args.quantize,
        "attention_backend": args.attention_backend, "page_size": args.page_size,
        "disable_radix_cache": args.disable_radix_cache, "deterministic": args.deterministic,
        "jump_forward": args.jump_forward,
    }
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    return options


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    """Run the suite; the global --model/--device/--dtype/--attention-backend/--page-size apply to it."""
    for option, value in (("--disable-radix-cache", args.disable_radix_cache),
                          ("--max-total-tokens", args.max_total_tokens)):
        if value:
            print(f"radixrt: bench sizes and switches the cache itself ({option} does not apply; "
                  "choose systems with --systems)", file=sys.stderr)
            return 2
    from radixrt.benchmarks.suite import main as bench_main

    forwarded = []
    for dest in _GLOBAL_FOR_BENCH:
        value = getattr(args, dest)
        if value != parser.get_default(dest):  # only what was given: the suite has its own defaults
            forwarded += ["--" + dest.replace("_", "-"), str(value)]
    return bench_main(forwarded + rest)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from radixrt.server.app import ServerSettings
    from radixrt.server.launch import serve

    keys = list(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                keys += [line.strip() for line in file if line.strip()]
        except OSError as error:
            parser.error(f"--api-key-file: {error}")
    if args.cache_isolation == "per-key" and not keys:
        parser.error("--cache-isolation per-key needs --api-key or --api-key-file")
    options = _runtime_options(args)
    for name in ("max_running_requests", "chunked_prefill_size", "schedule_policy", "decode_steps"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    settings = ServerSettings(
        api_keys=frozenset(keys),
        cache_isolation=args.cache_isolation,
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
    )
    try:
        if args.replicas > 1 or args.ray_address:
            return _serve_replicas(args, options, settings)
        return serve(args.model, options, settings, host=args.host, port=args.port)
    except (ValueError, FileNotFoundError) as error:
        print(f"radixrt: {error}", file=sys.stderr)
        return 2


def _explain(args: argparse.Namespace) -> int:
    from radixrt.server.explain_client import ExplainError, format_report, request_explanation

    try:
        report = request_explanation(args.url, args.prompt, args.chat, args.api_key, args.cache_salt)
    except ExplainError as error:
        print(f"radixrt explain: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _serve_replicas(args: argparse.Namespace, options: dict[str, Any], settings: Any) -> int:
    from radixrt.scaleout.deploy import FleetSpec, check_ray, serve_forever

    check_ray()  # before anything starts
    # A local instance shares this machine's cores between the replicas; a cluster's nodes keep theirs.
    threads = None if args.ray_address else max(1, (os.cpu_count() or 1) // args.replicas)
    router = RouterConfig(args.router, args.router_min_match_tokens, args.router_max_load_gap)
    spec = FleetSpec(args.model, options, settings, args.replicas, router, replica_threads=threads)
    return serve_forever(spec, args.host, args.port, args.ray_address)


if __name__ == "__main__":
    sys.exit(main())
