"""`radixrt serve` over HTTP against the same engine in-process and vLLM's server: what it adds, and a soak.

Opt-in benchmark, not a test: wall-clock figures depend on the machine.

Workloads (seeded, built here; their token counts are printed first):
  chat      3-turn conversations over 3 shared system prompts of 250-300
            tokens (a shop assistant's persona, rules and a stock table):
            max(min(2K, 64), K, 8) of them (or --conversations), two per client
            but at most 64 (more would make a full run far too long on 2
            cores; docs/benchmarks.md, "bench/serve_bench.py's limits");
            user turns of 15-30 tokens; every answer exactly 32 tokens (greedy,
            ignore_eos). A turn resends the earlier answers exactly as returned,
            so later turns hit the radix cache on the whole history.
  few-shot  max(2K, 16) questions after one ~1,000-token prefix of 6 worked
            examples, sent as completions (/v1/completions) of exactly 16 tokens.
At concurrency K, K client tasks take the next conversation or question from
a shared queue until none is left.

Paths (--paths; the radixrt ones with the same runtime options: bundled
model, default dtype, a 65,536-token KV pool, so no request is retracted):
  http    `radixrt serve` in a subprocess on 127.0.0.1, driven by an
          httpx.AsyncClient reading SSE (stream, include_usage)
  inproc  a radixrt.Runtime in this process, `async_generate(stream=True)`
  vllm    (with --vllm-python) vLLM's OpenAI server
          (`python -m vllm.entrypoints.openai.api_server`) in a subprocess on
          127.0.0.1, driven exactly as `http`. Set up as peers_bench's vLLM:
          radixrt's de-quantized Hugging Face folder in bf16, prefix caching
          on, seed 0, vLLM's CPU defaults otherwise (its automatic thread
          binding: on 2 cores one OpenMP compute thread, the other core left
          to its scheduler and front end); the folder's chat template, a KV
          cache of the same 65,536 tokens, cached prompt tokens reported
          (--enable-prompt-tokens-details), no access log (as `radixrt
          serve` at info), and its dev endpoint /reset_prefix_cache to flush.
          Its start-up (model compilation) takes minutes.
All chosen paths stay loaded for the whole run (an idle engine sleeps, so
the idle ones cost next to no CPU, vLLM's idle worker included)
and take turns level by level, repetition by repetition, the order reversing
between repetitions so none always runs first. Each path is warmed up once;
every level starts from a flushed cache.
The HTTP client runs in this process: its CPU time counts against the HTTP
paths, as it would for any real client on this machine.

Per request: TTFT (request sent -> first content delta), the gaps between
content deltas, output tokens, prompt and cached prompt tokens (usage over
HTTP, meta_info in-process; "n/a" where a server does not report them). Per
level: requests/s and output tokens/s over the level's wall time, TTFT and
inter-token latency p50/p99, the share of prompt tokens cached; each figure
is the median over --reps whole-level runs. Printed: markdown tables,
HTTP/in-process ratios, radixrt-over-HTTP/vLLM ratios when vLLM ran (else
the chat figures next to the vLLM CPU anchor), the goals; JSON in --out.

--soak S instead runs 64 streaming chat clients against the server for S
seconds; a quarter of the requests close their stream after a random number
of events. It reports errors seen by the other requests (should be 0), the
server's cache_stats after a settle (running, waiting and protected tokens
should be 0), the tokens the server generated for the requests that left
against those they received (aborts work when the two are close, not 32),
and its RSS over time (the KV pool is resident from the start; growth that
levels off is the allocator reaching the working set of the largest
batches, a leak keeps growing).

Run (one at a time, on an otherwise idle machine):
  .venv/bin/python bench/serve_bench.py [--reps 3] [--concurrency 1,8,32,64] [--workloads chat,few-shot]
      [--paths http,inproc,vllm --vllm-python /path/to/vllm-venv/bin/python] [--conversations N]
  .venv/bin/python bench/serve_bench.py --soak 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peers_bench import hf_folder

import radixrt  # noqa: E402
from radixrt.model.gguf_cache import gguf_to_hf_folder  # noqa: E402
from radixrt.model.config import ModelConfig  # noqa: E402
from radixrt.model.loader import bundled_model_path  # noqa: E402

MAX_TOTAL_TOKENS = 65536
CHAT_TURNS, CHAT_NEW_TOKENS, FEW_SHOT_NEW_TOKENS = 3, 32, 16
SOAK_CLIENTS, SOAK_DISCONNECT_SHARE = 64, 0.25
PATHS = ("http", "inproc", "vllm")
# vLLM's OpenAI server, CPU build 0.32, prefix caching, one compute thread, bf16, same machine class:
# streaming 3-turn chats under 3 shared system prompts, 32 tokens per answer; 57-88% of prompt tokens cached.
VLLM_ANCHOR: dict[int, dict[str, float | None]] = {
    1: {"output_tokens_per_s": 29, "ttft_p50_s": 0.11, "itl_p50_ms": 28},
    8: {"output_tokens_per_s": 153, "ttft_p50_s": 0.54, "itl_p50_ms": None},
    32: {"output_tokens_per_s": 263, "ttft_p50_s": 1.38, "itl_p50_ms": 85},
}
VLLM_CACHED = "57-88%"

# --- workloads ---------------------------------------------------------------------------------------
SHOPS = (
    ("Atlas", "Kestrel Bikes", "bicycles and parts",
     ["city bike", "gravel bike", "folding bike", "cargo bike", "kids' bike", "road helmet", "rear light",
      "chain lock", "floor pump", "saddle bag", "rain cape", "bell"]),
    ("Juniper", "Brightwater Books", "books and stationery",
     ["atlas of birds", "cookbook", "pocket dictionary", "crime novel", "poetry collection", "notebook",
      "fountain pen", "desk lamp", "bookmark set", "puzzle book", "wall calendar", "reading light"]),
    ("Mira", "Harbor Tea Company", "tea and teaware",
     ["green tea", "black tea", "jasmine tea", "mint tea", "tea sampler", "glass teapot", "cast iron kettle",
      "tea strainer", "travel mug", "honey jar", "gift box", "matcha whisk"]),
)
TOWNS = ["Ashford", "Brightwater", "Coldspring", "Dunmore", "Eastwick", "Fairhaven", "Glenrock", "Highmoor",
         "Ironbridge", "Kingsport", "Larkhill", "Millbrook", "Northcliff", "Oakridge", "Riverton", "Thornbury"]
NAMES = ["Ada Moreno", "Bruno Keller", "Chiara Russo", "Elena Sato", "Farid Haddad", "Greta Lindqvist",
         "Hugo Laurent", "Ines Costa", "Jonas Weber", "Keiko Tanaka", "Maya Patel", "Olga Novak"]


def _rules(rng: random.Random) -> list[str]:
    town = rng.choice(TOWNS)
    rules = [
        "Answer in at most three sentences and never invent a product, a price or a policy.",
        (f"Orders over {rng.randint(4, 9) * 10} euros ship free; smaller orders pay a delivery fee of "
         f"{rng.randint(3, 7)} euros."),
        f"Items can be returned within {rng.choice([14, 30, 60])} days of delivery if unused and in their box.",
        "If a customer is upset, apologise once and offer to open a ticket with the team.",
        "Prices include VAT; business customers can ask for an invoice without it.",
        "Never ask for card numbers or passwords: payments happen only on the checkout page.",
        "Stock changes every hour, so say that the figures below were correct this morning.",
        f"Our shop in {town} is open from {rng.randint(8, 10)}:00 to {rng.randint(17, 20)}:00, Monday to Saturday.",
        "When an item is out of stock, suggest the closest item in the table instead.",
    ]
    return rng.sample(rules, 5)


def system_prompt(index: int, rng: random.Random, count: Callable[[str], int]) -> str:
    """Persona, rules, then stock-table rows added until the prompt has 250-300 tokens."""
    name, shop, goods, items = SHOPS[index]
    head = (f"You are {name}, the customer assistant of {shop}, an online shop for {goods}. Be friendly, "
            f"brief and exact.\nRules:\n")
    text = head + "".join(f"{i}. {rule}\n" for i, rule in enumerate(_rules(rng), 1))
    text += "Reference table (item | price in euros | in stock | delivery days):\n"
    for item in rng.sample(items, len(items)):
        if count(text) >= 250:
            break
        text += f"{item} | {rng.randint(4, 120)}.{rng.choice(['00', '50', '90'])} | {rng.randint(0, 40)} | " \
                f"{rng.randint(1, 9)}\n"
    if not 250 <= count(text) <= 300:
        raise AssertionError(f"system prompt {index} has {count(text)} tokens, not 250-300")
    return text


def user_turn(items: list[str], rng: random.Random, count: Callable[[str], int]) -> str:
    """A customer's question about the table, 15-30 tokens (drawn again until it fits)."""
    while True:
        item, other = rng.sample(items, 2)
        town, n = rng.choice(TOWNS), rng.randint(2, 9)
        text = rng.choice([
            f"How much does the {item} cost, and how many days does delivery to {town} usually take?",
            f"Is the {item} in stock right now? I would like to order {n} of them for my team.",
            f"Can I return the {item} if it does not suit me, and who pays for the return shipping?",
            f"Which is cheaper, the {item} or the {other}, and which one would you recommend to a beginner?",
            f"I ordered the {item} {n} days ago and it has not arrived in {town} yet. What should I do?",
            f"Thanks. Do you offer a discount if I buy the {item} together with the {other}?",
        ])
        if 15 <= count(text) <= 30:
            return text


@dataclass(frozen=True)
class Conversation:
    system: str
    questions: tuple[str, ...]


def chat_workload(count: Callable[[str], int], num: int, seed: int) -> tuple[list[str], list[Conversation]]:
    """Three system prompts and `num` conversations spread over them in turn."""
    rng = random.Random(seed)
    systems = [system_prompt(i, rng, count) for i in range(len(SHOPS))]
    conversations = [
        Conversation(systems[i % 3], tuple(user_turn(SHOPS[i % 3][3], rng, count) for _ in range(CHAT_TURNS)))
        for i in range(num)
    ]
    return systems, conversations


def _order(rng: random.Random, notes: int) -> tuple[str, str]:
    """An order record with `notes` sentences of delivery notes, and its worked answer."""
    items = rng.choice(SHOPS)[3]
    (a, b), qa, qb, pa, pb = rng.sample(items, 2), rng.randint(1, 6), rng.randint(1, 6), rng.randint(2, 40), \
        rng.randint(2, 40)
    town, packer = rng.choice(TOWNS), rng.choice(NAMES)
    extra = [
        f"The parcel left the warehouse on day {rng.randint(1, 28)} and reached {town} after {rng.randint(1, 9)} days.",
        f"{packer} packed the order, wrapped the fragile items in paper and added a printed invoice.",
        f"The customer asked for the parcel to be left with a neighbour if nobody was at home in {town}.",
        f"A discount code was entered but had expired {rng.randint(2, 20)} days earlier, so it was not applied.",
        f"The courier called once because the house number in {town} was hard to find in the dark.",
        f"The customer has ordered from the shop {rng.randint(2, 30)} times since {rng.randint(2015, 2024)}.",
        f"Payment was made by bank transfer and arrived {rng.randint(1, 4)} days after the order.",
        "A short thank-you note was written on the back of the invoice by hand.",
    ]
    record = (f"Order: {rng.choice(NAMES)} from {town} bought {qa} x {a} at {pa} euros each and {qb} x {b} at "
              f"{pb} euros each. " + " ".join(rng.sample(extra, notes)))
    answer = f"{qa} x {pa} = {qa * pa} and {qb} x {pb} = {qb * pb}, so the total is {qa * pa + qb * pb} euros."
    return record, answer


def few_shot_workload(count: Callable[[str], int], num: int, seed: int) -> tuple[str, list[str]]:
    """A prefix of 6 worked examples, their notes lengthened until it has ~1,000 tokens, and `num` questions."""
    rng = random.Random(seed + 1)
    head = "Read each order and compute what the customer paid in total, showing the multiplication.\n\n"
    question = "\nQuestion: What was the total price?\nAnswer:"
    start = rng.getstate()
    for notes in range(9):
        rng.setstate(start)
        prefix = head + "".join(f"{record}{question} {answer}\n\n" for record, answer in
                                (_order(rng, notes) for _ in range(6)))
        if count(prefix) >= 950:
            break
    if not 950 <= count(prefix) <= 1100:
        raise AssertionError(f"the few-shot prefix has {count(prefix)} tokens, not ~1,000")
    return prefix, [_order(rng, 1)[0] + question for _ in range(num)]


# --- the paths ---------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One request as the client saw it."""

    ttft: float
    gaps: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    text: str


@dataclass(frozen=True)
class Job:
    """One request: chat `messages` or a completion `prompt`, and how many tokens it must generate."""

    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    model: str | None = None  # sent when set (SGLang's router fills in "unknown" otherwise)


class Timer:
    """Content arrival times of one request: TTFT and the gaps between deltas."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.arrivals: list[float] = []
        self.text: list[str] = []

    def content(self, text: str) -> None:
        if text:
            self.arrivals.append(time.perf_counter())
            self.text.append(text)

    def sample(self, job: Job, output_tokens: int, prompt_tokens: int, cached_tokens: int | None) -> Sample:
        if output_tokens != job.max_tokens or not self.arrivals:
            raise RuntimeError(f"expected {job.max_tokens} output tokens, got {output_tokens} "
                               f"in {len(self.arrivals)} deltas")
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return Sample(self.arrivals[0] - self.sent, gaps, output_tokens, prompt_tokens, cached_tokens,
                      "".join(self.text))


class BenchPath(Protocol):
    name: str

    async def run(self, job: Job) -> Sample: ...

    async def flush(self) -> None: ...


def _greedy(job: Job) -> dict[str, Any]:
    """OpenAI body fields of every benchmark request: exactly `max_tokens` greedy tokens, streamed with usage."""
    body: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if job.model is not None:
        body["model"] = job.model
    if job.messages is not None:
        body["messages"] = job.messages
    else:
        body["prompt"] = job.prompt
    return body


def _route(job: Job) -> str:
    return "/v1/chat/completions" if job.messages is not None else "/v1/completions"


class HttpPath:
    """Requests to `radixrt serve` through one shared client (keep-alive connections, like a load generator)."""

    name = "http"

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def run(self, job: Job) -> Sample:
        timer = Timer()
        usage: dict[str, Any] | None = None
        done = False
        async with self.client.stream("POST", _route(job), json=_greedy(job)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":  # read on to the end, so the connection is kept for the next request
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                for choice in event["choices"]:
                    text = choice["text"] if job.messages is None else choice["delta"].get("content")
                    timer.content(text or "")
                    if choice["finish_reason"] not in (None, "length"):
                        raise RuntimeError(f"finish_reason {choice['finish_reason']!r}, expected 'length'")
                usage = event.get("usage") or usage
        if not done or usage is None:
            raise RuntimeError(f"the stream ended without {'[DONE]' if not done else 'a usage chunk'}")
        return timer.sample(job, usage["completion_tokens"], usage["prompt_tokens"], self.cached_tokens(usage))

    @staticmethod
    def cached_tokens(usage: dict[str, Any]) -> int | None:
        """radixrt reports cached tokens on every response: a missing field is an error, not "n/a"."""
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    async def flush(self) -> None:
        (await self.client.post("/flush_cache")).raise_for_status()


class VllmPath(HttpPath):
    """The same requests to vLLM's OpenAI server; it reports cached tokens only when started to."""

    name = "vllm"

    @staticmethod
    def cached_tokens(usage: dict[str, Any]) -> int | None:
        details = usage.get("prompt_tokens_details")
        return None if details is None else int(details["cached_tokens"])

    async def flush(self) -> None:
        """POST /reset_prefix_cache (a dev endpoint); it answers success false while blocks are in use."""
        response = await self.client.post("/reset_prefix_cache")
        response.raise_for_status()
        if not response.json().get("success"):
            raise RuntimeError(f"vLLM did not reset its prefix cache: {response.text[:300]}")


class InprocPath:
    """The same requests through `Runtime.async_generate` in this process: the server's floor."""

    name = "inproc"

    def __init__(self, runtime: radixrt.Runtime):
        self.runtime = runtime

    async def run(self, job: Job) -> Sample:
        timer = Timer()
        params = {"max_new_tokens": job.max_tokens, "temperature": 0, "ignore_eos": True}
        chunks = await self.runtime.async_generate(job.prompt, params, stream=True, messages=job.messages)
        meta: dict[str, Any] = {}
        async for chunk in chunks:
            timer.content(chunk["text"])
            meta = chunk.get("meta_info") or meta
        return timer.sample(job, meta["completion_tokens"], meta["prompt_tokens"], meta["cached_tokens"])

    async def flush(self) -> None:
        await asyncio.to_thread(self.runtime.flush_cache)


# --- driving a level ---------------------------------------------------------------------------------
async def run_chat(path: BenchPath, conversations: list[Conversation], concurrency: int) -> list[Sample]:
    """K clients, each taking the next conversation and running its turns in order."""
    pending, samples = list(reversed(conversations)), []

    async def client() -> None:
        while pending:
            conversation = pending.pop()
            messages = [{"role": "system", "content": conversation.system}]
            for question in conversation.questions:
                messages.append({"role": "user", "content": question})
                sample = await path.run(Job(CHAT_NEW_TOKENS, messages=list(messages)))
                samples.append(sample)
                messages.append({"role": "assistant", "content": sample.text})

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples


async def run_few_shot(path: BenchPath, prompts: list[str], concurrency: int) -> list[Sample]:
    pending, samples = list(reversed(prompts)), []

    async def client() -> None:
        while pending:
            samples.append(await path.run(Job(FEW_SHOT_NEW_TOKENS, prompt=pending.pop())))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def summarize(samples: list[Sample], wall: float) -> dict[str, float | None]:
    ttfts = [s.ttft for s in samples]
    gaps = [g for s in samples for g in s.gaps]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = [s.cached_tokens for s in samples]
    return {
        "wall_s": wall,
        "requests": len(samples),
        "requests_per_s": len(samples) / wall,
        "output_tokens_per_s": sum(s.output_tokens for s in samples) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": p99(ttfts),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * p99(gaps),
        "prompt_tokens": prompt,
        "cached_share": None if None in cached else sum(c for c in cached if c is not None) / prompt,
    }


# --- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A server in a subprocess on a free loopback port, its output in a log file.

    The subprocess leads a process group of its own, so a server that
    starts helpers (vLLM's engine core and worker) is stopped with all of them.
    """

    def __init__(self, name: str, command: Callable[[int], list[str]], log_path: Path,
                 env: dict[str, str] | None = None, start_timeout_s: float = 600, stop_timeout_s: float = 60):
        self.name = name
        self.port = free_port()
        self.command = command(self.port)
        self.log_path = log_path
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        deadline = time.perf_counter() + self.start_timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} was not healthy after {self.start_timeout_s:.0f} s; see {self.log_path}")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line")

    def stop(self) -> int:
        """SIGTERM (a graceful stop) and the exit code; a server that hangs past its stop timeout is killed,
        and so is whatever of its process group outlives it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def log_lines(self, *needles: str) -> list[str]:
        """Lines of the server's log that contain any of `needles`."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if any(needle in line for needle in needles)]

    def log_problems(self) -> list[str]:
        """Lines of the server's log that report an error or a traceback."""
        return self.log_lines("Traceback", " ERROR ", "Exception")


def radixrt_server(log_path: Path) -> Server:
    return Server("radixrt serve", lambda port: [
        sys.executable, "-m", "radixrt.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--max-total-tokens", str(MAX_TOTAL_TOKENS)], log_path)


def kv_cache_bytes(folder: Path, num_tokens: int) -> int:
    """Bytes of a bf16 KV cache for `num_tokens` tokens of the model in `folder`: vLLM sizes its cache in bytes,
    radixrt in tokens."""
    config = ModelConfig.from_hf(SimpleNamespace(**json.loads((folder / "config.json").read_text())))
    return num_tokens * config.kv_shape(torch.bfloat16).bytes_per_token


def vllm_server(python: str, extra_args: list[str], log_path: Path) -> Server:
    """vLLM's OpenAI server set up as peers_bench's vLLM (module docstring); VLLM_SERVER_DEV_MODE opens
    /reset_prefix_cache. Its start-up compiles the model; its shutdown also stops its engine-core and worker
    processes."""
    folder = hf_folder()
    return Server("vLLM", lambda port: [
        python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(folder), "--dtype", "bfloat16", "--enable-prefix-caching", "--seed", "0",
        "--kv-cache-memory-bytes", str(kv_cache_bytes(folder, MAX_TOTAL_TOKENS)),
        "--chat-template", str(folder / "chat_template.jinja"), "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log", *extra_args], log_path,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, start_timeout_s=900, stop_timeout_s=120)


def http_client(base_url: str, connections: int) -> httpx.AsyncClient:
    """Keep-alive for every concurrent client (httpx keeps 20 by default: more would reconnect per request);
    no proxies from the environment on loopback."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900), limits=limits, trust_env=False)


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_to_hf_folder(bundled_model_path()))


def machine() -> dict[str, Any]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "radixrt": radixrt.__version__}


# --- the benchmark -----------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one workload sends at concurrency K."""

    name: str
    unit: str  # what `size` counts
    size: Callable[[int], int]
    run: Callable[[BenchPath, int, int], Awaitable[list[Sample]]]  # path, concurrency, size
    info: dict[str, Any] = field(default_factory=dict)


def plans(names: list[str], tokenizer: Any, largest: int, seed: int,
          num_conversations: int | None = None) -> list[Plan]:
    """The workloads, built once for the largest level; a level uses the first `size(K)` items
    (`num_conversations` of the chat, if given)."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    built: list[Plan] = []
    if "chat" in names:
        def chat_size(k: int) -> int:
            return num_conversations or max(min(2 * k, 64), k, 8)

        systems, conversations = chat_workload(count, chat_size(largest), seed)
        user = [count(q) for c in conversations for q in c.questions]
        built.append(Plan("chat", "conversations", chat_size, lambda path, k, n: run_chat(path, conversations[:n], k), {
            "system_prompt_tokens": [count(s) for s in systems], "user_turn_tokens": [min(user), max(user)],
            "turns": CHAT_TURNS, "answer_tokens": CHAT_NEW_TOKENS,
        }))
    if "few-shot" in names:
        def few_shot_size(k: int) -> int:
            return max(2 * k, 16)

        prefix, questions = few_shot_workload(count, few_shot_size(largest), seed)
        prompts = [prefix + q for q in questions]
        question_tokens = [count(q) for q in questions]
        built.append(Plan("few-shot", "questions", few_shot_size, lambda path, k, n: run_few_shot(path, prompts[:n], k), {
            "prefix_tokens": count(prefix), "question_tokens": [min(question_tokens), max(question_tokens)],
            "answer_tokens": FEW_SHOT_NEW_TOKENS,
        }))
    return built


async def warm_up(path: BenchPath) -> None:
    await path.run(Job(4, messages=[{"role": "user", "content": "Say hello."}]))


async def measure(plan: Plan, k: int, paths: list[BenchPath], reps: int) -> dict[str, dict[str, Any]]:
    """One level, `reps` times per path (the order alternating), each run from a flushed cache."""
    runs: dict[str, list[dict[str, float | None]]] = {path.name: [] for path in paths}
    for rep in range(reps):
        for path in paths if rep % 2 == 0 else paths[::-1]:
            await path.flush()
            started = time.perf_counter()
            samples = await plan.run(path, k, plan.size(k))
            figures = summarize(samples, time.perf_counter() - started)
            runs[path.name].append(figures)
            print(f"  {plan.name} K={k} rep {rep + 1} {path.name}: {figures['wall_s']:.1f} s, "
                  f"{figures['output_tokens_per_s']:.1f} tok/s, TTFT p50 {figures['ttft_p50_s']:.3f} s", flush=True)
    return {name: {**{key: _median([r[key] for r in runs_]) for key in runs_[0]}, "reps": runs_}
            for name, runs_ in runs.items()}


def _median(values: list[float | None]) -> float | None:
    """The median, or None when a run lacks the figure (a server that does not report cached tokens)."""
    return None if None in values else statistics.median(v for v in values if v is not None)


async def open_paths(args: argparse.Namespace, connections: int, stack: contextlib.AsyncExitStack,
                     servers: dict[str, Server]) -> list[BenchPath]:
    """The paths named in --paths, in that order, each ready. The servers start first, in the background
    (vLLM's takes minutes); each goes into `servers` as soon as it exists, so the caller stops it on any error."""
    out = Path(args.out)
    if "vllm" in args.paths:
        servers["vllm"] = vllm_server(args.vllm_python, shlex.split(args.vllm_args), out.with_suffix(".vllm.log"))
    if "http" in args.paths:
        servers["http"] = radixrt_server(out.with_suffix(".server.log"))
    opened: dict[str, BenchPath] = {}
    if "inproc" in args.paths:
        opened["inproc"] = InprocPath(stack.enter_context(radixrt.Runtime(max_total_tokens=MAX_TOTAL_TOKENS)))
    for name, server in servers.items():
        client = await stack.enter_async_context(http_client(server.url, connections))
        await server.wait_ready(client)
        opened[name] = VllmPath(client) if name == "vllm" else HttpPath(client)
    return [opened[name] for name in args.paths]


def server_report(server: Server, exit_code: int) -> dict[str, Any]:
    report = {"command": server.command, "exit_code_after_sigterm": exit_code, "log_problems": server.log_problems()}
    if server.name == "vLLM":  # its thread binding shows how many cores compute ("core ids=") and which it keeps
        report["thread_binding"] = server.log_lines("VLLM_CPU_OMP_THREADS_BIND", "core ids=", "reserved_cpus=")
    return report


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(k) for k in args.concurrency.split(",")]
    workloads = plans(args.workloads.split(","), load_tokenizer(), max(levels), args.seed, args.conversations)
    for plan in workloads:
        print(f"{plan.name}: {plan.info}; {plan.unit} at K = {levels}: {[plan.size(k) for k in levels]}", flush=True)
    servers: dict[str, Server] = {}
    results: dict[str, Any] = {}
    vllm_version = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            paths = await open_paths(args, max(levels) + 8, stack, servers)
            for path in paths:
                await warm_up(path)
                if isinstance(path, VllmPath):
                    vllm_version = (await path.client.get("/version")).json()["version"]
            for plan in workloads:
                for k in levels:
                    for name, figures in (await measure(plan, k, paths, args.reps)).items():
                        results.setdefault(plan.name, {}).setdefault(name, {})[str(k)] = figures
    finally:
        exit_codes = {name: server.stop() for name, server in servers.items()}
    report = {
        "machine": machine(), "command": " ".join(sys.argv), "reps": args.reps, "concurrency": levels,
        "paths": args.paths, "max_total_tokens": MAX_TOTAL_TOKENS,
        "schedule": "all paths loaded; they take turns per level and rep, the order reversing every rep",
        "workloads": {plan.name: plan.info for plan in workloads}, "results": results,
    }
    if "http" in servers:
        report["server"] = server_report(servers["http"], exit_codes["http"])
    if "vllm" in servers:
        report["vllm_server"] = {"version": vllm_version, **server_report(servers["vllm"], exit_codes["vllm"])}
    return report


# --- the soak ----------------------------------------------------------------------------------------
async def _disconnect_after(client: httpx.AsyncClient, job: Job, events: int) -> int:
    """Read `events` SSE events, then close the response (and with it the connection) mid-stream;
    returns the content deltas (tokens) received, the first event being the role chunk."""
    async with client.stream("POST", _route(job), json=_greedy(job)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                break
        return seen - 1


async def _generated_tokens(client: httpx.AsyncClient) -> int:
    return int((await client.get("/get_server_info")).json()["cache_stats"]["generated_tokens"])


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer()
    _, conversations = chat_workload(lambda text: len(tokenizer.encode(text, add_special_tokens=False)), 256,
                                     args.seed)
    server = radixrt_server(Path(args.out).with_suffix(".server.log"))
    samples: list[Sample] = []
    errors: list[str] = []
    disconnect_errors: list[str] = []
    disconnects = tokens_before_leaving = 0
    rss: list[tuple[float, float]] = []
    try:
        async with http_client(server.url, SOAK_CLIENTS + 8) as client:
            await server.wait_ready(client)
            http = HttpPath(client)
            await warm_up(http)
            generated_before = await _generated_tokens(client)
            started = time.perf_counter()
            deadline = started + args.soak
            rss.append((0.0, server.rss_mib()))

            async def chat_client(seed: int) -> None:
                nonlocal disconnects, tokens_before_leaving
                rng = random.Random(seed)
                while time.perf_counter() < deadline:
                    conversation = rng.choice(conversations)
                    messages = [{"role": "system", "content": conversation.system}]
                    for question in conversation.questions:
                        if time.perf_counter() >= deadline:
                            return
                        messages.append({"role": "user", "content": question})
                        job = Job(CHAT_NEW_TOKENS, messages=list(messages))
                        leaves = rng.random() < SOAK_DISCONNECT_SHARE
                        try:
                            if leaves:
                                # role chunk + 32 deltas: leave anywhere from before the first token to after the last
                                received = await _disconnect_after(client, job, rng.randint(1, CHAT_NEW_TOKENS + 1))
                                tokens_before_leaving += received  # not `+= await`: that reads the sum before awaiting
                                disconnects += 1
                                break  # no answer to continue the conversation from
                            sample = await http.run(job)
                        except Exception as error:  # noqa: BLE001 - every failure is a finding
                            (disconnect_errors if leaves else errors).append(f"{type(error).__name__}: {error}"[:300])
                            break
                        samples.append(sample)
                        messages.append({"role": "assistant", "content": sample.text})

            async def watch_rss() -> None:
                while time.perf_counter() < deadline:
                    await asyncio.sleep(min(30.0, max(deadline - time.perf_counter(), 0.0)))
                    rss.append((time.perf_counter() - started, server.rss_mib()))

            await asyncio.gather(watch_rss(), *(chat_client(args.seed * 1000 + i) for i in range(SOAK_CLIENTS)))
            elapsed = time.perf_counter() - started
            stats: dict[str, Any] = {}
            for _ in range(30):  # settle: aborted requests leave within an engine step
                await asyncio.sleep(1)
                stats = (await client.get("/get_server_info")).json()["cache_stats"]
                if not (stats["running_requests"] or stats["waiting_requests"] or stats["protected_tokens"]):
                    break
            rss.append((time.perf_counter() - started, server.rss_mib()))
            metrics = (await client.get("/metrics")).text
            # What the engine generated beyond the answers delivered whole went to the requests that left:
            # near what they received before leaving when a disconnect aborts, 32 each when it does not.
            generated_for_leavers = await _generated_tokens(client) - generated_before - sum(
                sample.output_tokens for sample in samples)
    finally:
        exit_code = server.stop()
    aborted = next((float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("radixrt:aborted_requests_total")), None)
    return {
        "machine": machine(), "command": " ".join(sys.argv), "seconds": args.soak, "clients": SOAK_CLIENTS,
        "completed_requests": len(samples), "disconnected_requests": disconnects,
        "server_aborted_requests": aborted, "errors": errors, "disconnect_errors": disconnect_errors,
        "tokens_per_left_request": {"received": tokens_before_leaving / max(disconnects, 1),
                                    "generated": generated_for_leavers / max(disconnects, 1)},
        "figures": summarize(samples, elapsed) if samples else {},
        "cache_stats_after_settle": stats, "rss_mib": rss,
        "server": {"exit_code_after_sigterm": exit_code, "log_problems": server.log_problems()},
    }


# --- the report --------------------------------------------------------------------------------------
def goals(results: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """The server's targets that this run's levels can answer: (goal, value, met). The vLLM goals take vLLM's
    figures from this run when it ran, else the anchor's."""
    found: list[tuple[str, float, bool]] = []
    for workload, paths in results.items():
        http, inproc = paths.get("http", {}), paths.get("inproc", {})
        if "32" in http and "32" in inproc:
            ratio = http["32"]["output_tokens_per_s"] / inproc["32"]["output_tokens_per_s"]
            found.append((f"{workload}, K=32: HTTP / in-process output tokens/s >= 0.90", ratio, ratio >= 0.90))
        if "1" in http and "1" in inproc:
            added = 1000 * (http["1"]["ttft_p50_s"] - inproc["1"]["ttft_p50_s"])
            found.append((f"{workload}, K=1: TTFT p50 added by HTTP <= 5 ms", added, added <= 5))
    chat = results.get("chat", {})
    ours = chat.get("http", {})
    measured = chat.get("vllm")
    reference = {int(k): figures for k, figures in measured.items()} if measured else VLLM_ANCHOR
    whose = "vLLM's (this run)" if measured else "the vLLM anchor's"
    for k, theirs in reference.items():
        if str(k) not in ours:
            continue
        mine = ours[str(k)]
        if k in (8, 32):
            ratio = mine["output_tokens_per_s"] / float(theirs["output_tokens_per_s"] or 1)
            found.append((f"chat over HTTP, K={k}: output tokens/s / {whose} >= 1.5", ratio, ratio >= 1.5))
        ttft = float(theirs["ttft_p50_s"] or 0)
        found.append((f"chat over HTTP, K={k}: TTFT p50 <= {whose} {ttft:.3f} s", mine["ttft_p50_s"],
                      mine["ttft_p50_s"] <= ttft))
    return found


def _cached(figures: dict[str, Any]) -> str:
    share = figures["cached_share"]
    return "n/a" if share is None else f"{100 * share:.1f}%"


def _path_tables(report: dict[str, Any]) -> list[str]:
    """One table per workload: every path's figures at every level."""
    lines = []
    for workload, paths in report["results"].items():
        lines += [f"### {workload}: {report['workloads'][workload]}", "",
                  ("| K | path | requests | req/s | output tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms "
                   "| prompt tokens cached |"), "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k in report["concurrency"]:
            for path in report["paths"]:
                f = paths[path][str(k)]
                lines.append(f"| {k} | {path} | {f['requests']:.0f} | {f['requests_per_s']:.2f} | "
                             f"{f['output_tokens_per_s']:.1f} | {f['ttft_p50_s']:.3f} | {f['ttft_p99_s']:.3f} | "
                             f"{f['itl_p50_ms']:.1f} | {f['itl_p99_ms']:.1f} | {_cached(f)} |")
        lines.append("")
    return lines


def _inproc_table(report: dict[str, Any]) -> list[str]:
    lines = ["### HTTP against in-process", "",
             "| workload | K | output tok/s, HTTP / in-process | TTFT p50, HTTP - in-process (ms) |",
             "|---|---:|---:|---:|"]
    for workload, paths in report["results"].items():
        for k in report["concurrency"]:
            http, inproc = paths["http"][str(k)], paths["inproc"][str(k)]
            lines.append(f"| {workload} | {k} | {http['output_tokens_per_s'] / inproc['output_tokens_per_s']:.3f} | "
                         f"{1000 * (http['ttft_p50_s'] - inproc['ttft_p50_s']):+.1f} |")
    return lines + [""]


def _vllm_table(report: dict[str, Any]) -> list[str]:
    """radixrt over HTTP against vLLM's server from this run, side by side, with the goals' two ratios."""
    lines = [f"### radixrt over HTTP against vLLM {report['vllm_server']['version']} (this run)", "",
             ("| workload | K | radixrt tok/s | vLLM tok/s | tok/s radixrt / vLLM | radixrt TTFT p50 s | vLLM TTFT p50 s "
              "| TTFT p50 radixrt / vLLM | radixrt ITL p50 ms | vLLM ITL p50 ms | radixrt cached | vLLM cached |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, paths in report["results"].items():
        for k in report["concurrency"]:
            ours, theirs = paths["http"][str(k)], paths["vllm"][str(k)]
            lines.append(f"| {workload} | {k} | {ours['output_tokens_per_s']:.1f} | {theirs['output_tokens_per_s']:.1f} | "
                         f"{ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x | "
                         f"{ours['ttft_p50_s']:.3f} | {theirs['ttft_p50_s']:.3f} | "
                         f"{ours['ttft_p50_s'] / theirs['ttft_p50_s']:.2f}x | {ours['itl_p50_ms']:.1f} | "
                         f"{theirs['itl_p50_ms']:.1f} | {_cached(ours)} | {_cached(theirs)} |")
    return lines + [""]


def _anchor_table(report: dict[str, Any]) -> list[str]:
    chat = report["results"].get("chat", {}).get("http", {})
    anchored = [k for k in VLLM_ANCHOR if str(k) in chat]
    if not anchored:
        return []
    lines = [f"### Chat over HTTP against vLLM 0.32 CPU (anchor: {VLLM_CACHED} of prompt tokens cached)", "",
             ("| K | radixrt tok/s | vLLM tok/s | ratio | radixrt TTFT p50 s | vLLM TTFT p50 s "
              "| radixrt ITL p50 ms | vLLM ITL p50 ms | radixrt cached |"), "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in anchored:
        ours, theirs = chat[str(k)], VLLM_ANCHOR[k]
        itl = "-" if theirs["itl_p50_ms"] is None else f"{theirs['itl_p50_ms']:.0f}"
        lines.append(f"| {k} | {ours['output_tokens_per_s']:.1f} | {theirs['output_tokens_per_s']:.0f} | "
                     f"{ours['output_tokens_per_s'] / float(theirs['output_tokens_per_s'] or 1):.2f}x | "
                     f"{ours['ttft_p50_s']:.3f} | {theirs['ttft_p50_s']:.2f} | {ours['itl_p50_ms']:.1f} | {itl} | "
                     f"{_cached(ours)} |")
    return lines + [""]


def bench_tables(report: dict[str, Any]) -> str:
    """Markdown: the paths' figures, then the comparisons this run's paths allow, then the goals."""
    lines = _path_tables(report)
    if {"http", "inproc"} <= set(report["paths"]):
        lines += _inproc_table(report)
    if {"http", "vllm"} <= set(report["paths"]):
        lines += _vllm_table(report)
    elif "http" in report["paths"]:
        lines += _anchor_table(report)
    lines += ["### Goals", "", "| goal | value | met |", "|---|---:|---|"]
    lines += [f"| {goal} | {value:.3f} | {'yes' if met else 'no'} |" for goal, value, met in report["goals"]]
    return "\n".join(lines)


def soak_summary(report: dict[str, Any]) -> str:
    stats = report["cache_stats_after_settle"]
    figures = report["figures"]
    rss = ", ".join(f"{t:.0f} s: {mib:.0f}" for t, mib in report["rss_mib"])
    return "\n".join([
        (f"soak: {report['clients']} streaming chat clients for {report['seconds']} s, "
         f"{100 * SOAK_DISCONNECT_SHARE:.0f}% of requests leave mid-stream"),
        (f"- completed {report['completed_requests']} requests ({figures.get('output_tokens_per_s', 0):.1f} output "
         f"tok/s, TTFT p50 {figures.get('ttft_p50_s', 0):.3f} s, cached {100 * figures.get('cached_share', 0):.1f}%), "
         f"left mid-stream {report['disconnected_requests']}; the server counted "
         f"{report['server_aborted_requests']} aborted"),
        (f"- tokens per request that left: {report['tokens_per_left_request']['received']:.1f} received, "
         f"{report['tokens_per_left_request']['generated']:.1f} generated by the server (of {CHAT_NEW_TOKENS})"),
        f"- errors of the requests that stayed: {len(report['errors'])} {report['errors'][:5]}",
        (f"- errors of the requests that left (before leaving): {len(report['disconnect_errors'])} "
         f"{report['disconnect_errors'][:5]}"),
        (f"- after the settle: running {stats.get('running_requests')}, waiting {stats.get('waiting_requests')}, "
         f"protected tokens {stats.get('protected_tokens')}, tree tokens {stats.get('tree_tokens')}, "
         f"pool used {stats.get('pool_used_tokens')} of {stats.get('pool_total_tokens')}, "
         f"evicted {stats.get('evicted_tokens')}, retracted {stats.get('retracted_requests')}"),
        f"- server RSS MiB (seconds since the soak began: MiB): {rss}",
        (f"- server exit code after SIGTERM {report['server']['exit_code_after_sigterm']}, "
         f"error lines in its log: {len(report['server']['log_problems'])}"),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=3, help="whole-level runs per path; figures are their medians")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts")
    parser.add_argument("--workloads", default="chat,few-shot", help="chat, few-shot or both")
    parser.add_argument("--paths", help=f"comma-separated, from {', '.join(PATHS)} (default http,inproc, "
                                        "and vllm with --vllm-python); the soak runs http only")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="the python of the venv vLLM's CPU build is installed in: adds the vllm path")
    parser.add_argument("--vllm-args", default="", help="more arguments for vLLM's server, e.g. '--block-size 32'")
    parser.add_argument("--conversations", type=int, metavar="N",
                        help="chat conversations per level (default max(min(2K, 64), K, 8))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak", type=float, default=0, metavar="SECONDS", help="run the soak instead")
    parser.add_argument("--out", help="JSON report (default bench/results/serve_bench.json, or serve_soak.json)")
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - {"chat", "few-shot"}
    if unknown:
        parser.error(f"unknown workload(s) {sorted(unknown)}: choose chat, few-shot or both")
    args.paths = (args.paths or ("http,inproc,vllm" if args.vllm_python else "http,inproc")).split(",")
    if set(args.paths) - set(PATHS) or len(set(args.paths)) != len(args.paths):
        parser.error(f"--paths must name some of {', '.join(PATHS)} once each, got {args.paths}")
    if "vllm" in args.paths and not args.vllm_python:
        parser.error("the vllm path needs --vllm-python (vLLM pins its own torch, so it lives in a venv of its own)")
    if args.conversations is not None and args.conversations < 1:
        parser.error(f"--conversations must be >= 1, got {args.conversations}")
    args.out = args.out or str(ROOT / "bench" / "results" / ("serve_soak.json" if args.soak else "serve_bench.json"))
    if args.soak:
        report = asyncio.run(soak(args))
        text = soak_summary(report)
    else:
        report = asyncio.run(bench(args))
        report["goals"] = goals(report["results"])
        text = bench_tables(report)
    print(f"\n{report['machine']}\n{text}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    suffixes = {"http": ".server.log", "vllm": ".vllm.log"}
    logs = [str(Path(args.out).with_suffix(suffixes[path])) for path in (["http"] if args.soak else args.paths)
            if path in suffixes]
    print(f"\nJSON: {args.out}; server logs: {', '.join(logs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
