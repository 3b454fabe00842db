"""The `radixrt` command: generate, demo, bench, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixrt", description="A RadixAttention inference runtime.")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--weights", default="auto", choices=["auto", "dense", "native"],
        help="native: keep a GGUF model's 4-bit projections as stored (CPU; fewer bytes per step); "
        "auto: native for such a model on a bf16 CPU, else dense",
    )
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument(
        "--log-level", default=None, choices=["debug", "info", "warning", "error"],
        help="default: info for serve, warning otherwise",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message with the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")

    commands.add_parser("demo", help="the table example: a long shared prefix hit by a second question")
    _add_serve_parser(commands)
    # bench's own options belong to the suite (radixrt/benchmarks/suite.py): they pass through
    # unparsed, so `radixrt bench --help` prints the suite's help.
    commands.add_parser("bench", add_help=False, help="the benchmark suite (radixrt bench --help for its options)")

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(parser, args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    log_level = args.log_level or ("info" if args.command == "serve" else "warning")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        return _serve(parser, args)
    from radixrt.runtime import Runtime

    try:
        runtime = Runtime(
            args.model,
            device=args.device,
            dtype=args.dtype,
            weights=args.weights,
            attention_backend=args.attention_backend,
            page_size=args.page_size,
            disable_radix_cache=args.disable_radix_cache,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"radixrt: {error}", file=sys.stderr)
        return 2
    with runtime:
        if args.command == "demo":
            from radixrt.demo import run_demo

            run_demo(runtime)
            return 0
        params = {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
        }
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


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    """Run the suite; the global --model/--device/--dtype/--attention-backend/--page-size apply to it."""
    if args.disable_radix_cache:
        print("radixrt: bench runs radixrt with and without the cache; choose with --systems", file=sys.stderr)
        return 2
    from radixrt.benchmarks.suite import main as bench_main

    forwarded = []
    for dest in ("model", "device", "dtype", "attention_backend", "page_size"):
        value = getattr(args, dest)
        if value != parser.get_default(dest):  # only what was given: the suite has its own defaults
            forwarded += ["--" + dest.replace("_", "-"), str(value)]
    return bench_main(forwarded + rest)


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible and SGLang-native HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", action="append", default=[], help="require this bearer key (repeat for tenants)")
    serve.add_argument("--api-key-file", help="a file of API keys, one per line")
    serve.add_argument(
        "--cache-isolation", choices=["none", "per-key"], default="none",
        help="per-key: each API key gets its own cache namespace (no cross-tenant hits)",
    )
    serve.add_argument("--max-queued-requests", type=int, default=1024, help="beyond running + this, a 503")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    serve.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens")
    serve.add_argument("--max-running-requests", type=int, help="the most requests decoding at once")
    serve.add_argument("--chunked-prefill-size", type=int, help="the most prompt tokens of one request per step")
    serve.add_argument("--schedule-policy", choices=["lpm", "dfs-weight", "fcfs"])


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
    if args.max_queued_requests < 0:
        parser.error(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    options: dict[str, Any] = {
        "device": args.device, "dtype": args.dtype, "weights": args.weights,
        "attention_backend": args.attention_backend,
        "page_size": args.page_size, "disable_radix_cache": args.disable_radix_cache,
    }
    for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size", "schedule_policy"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    settings = ServerSettings(
        api_keys=frozenset(keys),
        cache_isolation=args.cache_isolation,
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
    )
    try:
        return serve(args.model, options, settings, host=args.host, port=args.port)
    except (ValueError, FileNotFoundError) as error:
        print(f"radixrt: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
