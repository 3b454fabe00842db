"""Replicas behind routers: how much of the prompt each router lets the replicas reuse, and at what speed.

Opt-in benchmark, not a test: wall-clock figures depend on the machine.

Workload (seeded, built here): multi-tenant chat. --tenants system prompts
of 250-300 tokens (serve_bench's shop assistants), --conversations per
tenant, each opening with its own ~200-token document (a customer's order
history) before its first question, --turns turns. Every turn sends all
conversations at once, in a seeded order of its own, and waits for all of them (an answer is exactly
--new-tokens greedy tokens, resent verbatim in the next turn), so every
turn's routing decisions are made with the whole fleet busy.

Systems (--systems), each started fresh, from an empty cache:
  single       one `radixrt serve` (no Ray): the reference, a replica holding everything
  prefix       `radixrt serve --replicas N --router prefix` (a local Ray instance)
  round_robin  ... --router round_robin
  least_load   ... --router least_load
  sglang       SGLang's router (`python -m sglang_router.launch_router --policy cache_aware`, --sglang-python)
               in front of N single `radixrt serve` workers
  ray_prefix   Ray Serve's PrefixCacheAffinityRouter choosing among N radixrt replicas of one deployment
               (bench/ray_prefix_baseline.py; it cannot report work per replica)
Every radixrt process gets cores / N compute threads (single: all cores).

Every system runs --reps times (rounds in alternating order); per system and N, the median of: the share of prompt tokens served from cache (usage's
cached_tokens), the prefill tokens computed, TTFT p50/p99, output tokens/s
over the run, and the load per replica (tokens it computed, from
/get_server_info), as max/min. Goals (issue #18): prefix reuses >= 95% of
what `single` reuses, computes >= 2x fewer prefill tokens than round_robin,
keeps max/min load <= 1.5, and beats SGLang's router on cached share and TTFT p99.

Run: python bench/scaleout_bench.py [--replicas 2,3] [--systems single,prefix,round_robin,least_load]
     [--tenants 3] [--conversations 6] [--turns 4] [--new-tokens 16] [--max-total-tokens 32768] [--reps 3]
     [--sglang-python PY] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serve_bench  # noqa: E402
from serve_bench import SHOPS, HttpPath, Job, Sample, free_port, load_tokenizer, p99, system_prompt  # noqa: E402

SYSTEMS = ("single", "prefix", "round_robin", "least_load", "sglang", "ray_prefix")
ITEMS = ["order", "refund", "parcel", "invoice", "voucher", "exchange"]


@dataclass(frozen=True)
class Conversation:
    system: str
    document: str
    questions: tuple[str, ...]


def order_history(rng: random.Random, count: Any) -> str:
    """A customer's own document: order lines until ~200 tokens."""
    name = rng.choice(serve_bench.NAMES)
    text = f"My name is {name}. Here is my order history:\n"
    while count(text) < 200:
        text += (f"- #{rng.randint(10000, 99999)} {rng.choice(ITEMS)}: {rng.randint(1, 9)} items, "
                 f"{rng.randint(5, 300)}.{rng.choice(['00', '50', '90'])} euros, "
                 f"{rng.choice(serve_bench.TOWNS)}, {rng.choice(['delivered', 'in transit', 'returned'])}\n")
    return text


def workload(tenants: int, per_tenant: int, turns: int, seed: int) -> list[Conversation]:
    tokenizer = load_tokenizer()

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rng = random.Random(seed)
    systems = [system_prompt(i % len(SHOPS), rng, count) for i in range(tenants)]
    conversations = []
    for i in range(tenants * per_tenant):
        tenant = i % tenants
        items = SHOPS[tenant % len(SHOPS)][3]
        questions = tuple(serve_bench.user_turn(items, rng, count) for _ in range(turns))
        conversations.append(Conversation(systems[tenant], order_history(rng, count), questions))
    rng.shuffle(conversations)
    return conversations


async def run_turns(
    url: str, conversations: list[Conversation], new_tokens: int, seed: int = 0
) -> tuple[list[Sample], float]:
    """Every conversation's turn t at once, for each t, sent in a seeded order of its own (as a
    service sees them: whoever answers first asks first; a fixed order would hand round_robin
    each conversation's replica again whenever N divides the number of conversations);
    returns the samples and the wall time."""
    histories = [[{"role": "system", "content": c.system}] for c in conversations]
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=len(conversations) + 4, max_keepalive_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        path = HttpPath(client)
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        for turn in range(len(conversations[0].questions)):
            for conversation, history in zip(conversations, histories):
                question = conversation.questions[turn]
                history.append({"role": "user", "content": conversation.document + question if turn == 0 else question})
            order = list(range(len(histories)))
            random.Random(seed * 1000 + turn).shuffle(order)
            sent = await asyncio.gather(*(path.run(Job(new_tokens, messages=list(histories[i]), model=model))
                                          for i in order))
            results = [sample for _, sample in sorted(zip(order, sent, strict=True), key=lambda pair: pair[0])]
            for history, sample in zip(histories, results, strict=True):
                history.append({"role": "assistant", "content": sample.text})
            samples.extend(results)
        return samples, time.perf_counter() - start


# --- the systems -------------------------------------------------------------------------------------
def wait_healthy(url: str, processes: list[subprocess.Popen], log: Path, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a process exited with {process.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became healthy; see {log}")


def radixrt_serve(port: int, threads: int, pool: int, log: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "radixrt.cli", "serve", "--port", str(port),
               "--max-total-tokens", str(pool), "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def system(name: str, replicas: int, pool: int, log: Path, sglang_python: str | None) -> Iterator[tuple[str, list[str]]]:
    """Start a system; yield its URL and the URLs to read per-replica stats from."""
    cores = os.cpu_count() or 1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes: list[subprocess.Popen] = []
    try:
        if name == "single":
            processes.append(radixrt_serve(port, cores, pool, log))
            wait_healthy(url, processes, log)
            yield url, [url]
        elif name == "sglang":
            if sglang_python is None:
                raise SystemExit("--systems sglang needs --sglang-python (a Python with sglang-router installed)")
            workers = [f"http://127.0.0.1:{free_port()}" for _ in range(replicas)]
            for worker in workers:
                processes.append(radixrt_serve(int(worker.rsplit(":", 1)[1]), max(1, cores // replicas), pool, log))
            for worker in workers:
                wait_healthy(worker, processes, log)
            processes.append(subprocess.Popen(
                [sglang_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--policy", "cache_aware", "--worker-urls", *workers],
                stdout=log.open("ab"), stderr=subprocess.STDOUT))
            wait_healthy(url, processes, log)
            yield url, workers
        elif name == "ray_prefix":
            baseline = Path(__file__).resolve().parent / "ray_prefix_baseline.py"
            processes.append(subprocess.Popen(
                [sys.executable, str(baseline), "--port", str(port), "--replicas", str(replicas),
                 "--max-total-tokens", str(pool)], stdout=log.open("ab"), stderr=subprocess.STDOUT))
            wait_healthy(url, processes, log)
            yield url, [url]
        else:
            processes.append(radixrt_serve(port, cores, pool, log, "--replicas", str(replicas), "--router", name))
            wait_healthy(url, processes, log)
            yield url, [url]
    finally:
        stop(processes)


def replica_work(stat_urls: list[str]) -> list[int]:
    """Tokens each replica computed (prefill and decode), from /get_server_info."""
    work = []
    for url in stat_urls:
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        for stats in [r["cache_stats"] for r in info["replicas"]] if "replicas" in info else [info["cache_stats"]]:
            work.append(int(stats["computed_tokens"]))
    return work


def measure(name: str, replicas: int, conversations: list[Conversation], args: argparse.Namespace,
            log: Path) -> dict[str, Any]:
    with system(name, replicas, args.max_total_tokens, log, args.sglang_python) as (url, stat_urls):
        asyncio.run(run_turns(url, [Conversation("Be brief.", "", ("Hello!",))], args.new_tokens))  # warm-up
        before = replica_work(stat_urls)
        samples, wall = asyncio.run(run_turns(url, conversations, args.new_tokens, args.seed))
        work = [after - b for after, b in zip(replica_work(stat_urls), before)]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens or 0 for s in samples)
    ttfts = [s.ttft for s in samples]
    return {
        "system": name, "replicas": 1 if name == "single" else replicas, "requests": len(samples),
        "prompt_tokens": prompt, "cached_share": cached / prompt, "prefill_tokens": prompt - cached,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": p99(ttfts),
        "output_tokens_per_s": sum(s.output_tokens for s in samples) / wall, "wall_s": wall,
        "replica_work": work, "load_max_over_min": max(work) / max(min(work), 1) if len(work) > 1 else None,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repetitions; the work per replica of the run with the median wall time."""
    middle = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    out = dict(middle)
    for key, value in middle.items():
        if isinstance(value, float) and all(r[key] is not None for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    out["prefill_tokens"] = statistics.median(r["prefill_tokens"] for r in runs)
    out["runs"] = runs
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| replicas | system | cached share | prefill tokens | TTFT p50 s | TTFT p99 s | output tok/s "
             "| work per replica | max/min |", "|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        lines.append(
            f"| {r['replicas']} | {r['system']} | {r['cached_share']:.1%} | {r['prefill_tokens']:,.0f} "
            f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['output_tokens_per_s']:.0f} "
            f"| {', '.join(f'{w:,}' for w in r['replica_work']) or 'n/a'} "
            f"| {'n/a' if r['load_max_over_min'] is None else format(r['load_max_over_min'], '.2f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="2,3")
    parser.add_argument("--systems", default="single,prefix,round_robin,least_load")
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=6, help="per tenant")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3, help="runs of every system; figures are medians")
    parser.add_argument("--max-total-tokens", type=int, default=32768,
                        help="KV pool per replica (smaller: replicas evict, and routers that guess drift)")
    parser.add_argument("--sglang-python", help="a Python with sglang-router installed (for --systems sglang)")
    parser.add_argument("--log", default="/tmp/scaleout_bench.log")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    names = args.systems.split(",")
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    conversations = workload(args.tenants, args.conversations, args.turns, args.seed)
    log = Path(args.log)
    plan = [("single", 1)] if "single" in names else []
    plan += [(name, int(n)) for n in args.replicas.split(",") for name in names if name != "single"]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in plan}
    for rep in range(args.reps):  # whole rounds, the order reversed every other round
        for name, replicas in plan if rep % 2 == 0 else reversed(plan):
            runs[(name, replicas)].append(measure(name, replicas, conversations, args, log))
            print(f"rep {rep + 1}:", table(runs[(name, replicas)][-1:]).splitlines()[-1], flush=True)
    results = [median_of(runs[key]) for key in plan]
    print()
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
