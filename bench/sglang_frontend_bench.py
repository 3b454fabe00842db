"""One program set, two frontends: SGLang's own (`sglang.lang`, over HTTP to `radixrt serve`)
against radixrt's `radixrt.lang` in process, on the bundled SmolLM2-135M-Instruct.

The same programs, written once over either module (their APIs agree): a chat `run_batch`
(16 questions, greedy, 24 tokens), `select` among 4 choices (8 questions), `fork` into 3 tips
(12 tokens each) and join, a regex + JSON-schema + `dtype=int` program (4 runs). Both sides use
the runtime's defaults; every run starts from an empty cache (`flush_cache`), and each figure is
the median of the runs' wall times. The server runs in its own process on the same cores, so
its column pays HTTP, JSON and a second Python process; on a shared 2-core machine compare the
two columns of one run, not runs of different days.

Run: python bench/sglang_frontend_bench.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

QUESTIONS = ["Name a color.", "Name a fruit.", "Name an animal.", "Name a city.", "Name a river.", "Name a tool.",
             "Name a sport.", "Name a planet."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def program_set(lang: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The workloads, as (name, run) over `lang` (the sglang or the radixrt module)."""

    @lang.function
    def chat(s, question):  # type: ignore[no-untyped-def]
        s += lang.system("You are a helpful assistant.")
        s += lang.user(question)
        s += lang.assistant(lang.gen("answer", max_tokens=24, temperature=0))

    @lang.function
    def pick(s, question):  # type: ignore[no-untyped-def]
        s += f"Q: {question}\nA:"
        s += lang.select("choice", choices=[" red", " apple", " dog", " Paris"])

    @lang.function
    def tips(s):  # type: ignore[no-untyped-def]
        s += "Here are three tips for staying healthy:\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i + 1}."
            f += lang.gen("tip", max_tokens=12, temperature=0, stop="\n")
        s += "".join(f"{i + 1}.{f['tip']}\n" for i, f in enumerate(forks))

    @lang.function
    def typed(s):  # type: ignore[no-untyped-def]
        s += "Is water wet? Answer yes or no: "
        s += lang.gen("yes_no", max_tokens=4, regex=r"(yes|no)")
        s += "\nA person as JSON: "
        s += lang.gen("person", max_tokens=40, json_schema=json.dumps(SCHEMA))
        s += "\nHow many legs does a dog have? "
        s += lang.gen("legs", dtype=int, max_tokens=6)

    def done(states: list[Any]) -> list[str]:
        return [state.text() for state in states]  # waits for the state's last operation (sglang's run may not)

    return [
        ("chat run_batch (16 x 24 tokens)", lambda: done(chat.run_batch([{"question": q} for q in QUESTIONS * 2],
                                                                        num_threads=16))),
        ("select, 4 choices (8 programs)", lambda: done([pick.run(question=q) for q in QUESTIONS])),
        ("fork 3 tips and join (4 programs)", lambda: done([tips.run() for _ in range(4)])),
        ("regex + JSON schema + dtype=int (4 programs)", lambda: done([typed.run() for _ in range(4)])),
    ]


def timed(runs: int, flush: Callable[[], None], work: Callable[[], Any]) -> float:
    work()  # warm-up: grammars compiled, code paths touched
    times = []
    for _ in range(runs):
        flush()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def start_server(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "radixrt.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("radixrt serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import sglang

    import radixrt
    import radixrt.lang

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = start_server(port)
    try:
        backend = sglang.RuntimeEndpoint(f"http://127.0.0.1:{port}", chat_template_name="chatml")
        sglang.set_default_backend(backend)
        over_http = {name: timed(args.runs, backend.flush_cache, work) for name, work in program_set(sglang)}
    finally:
        server.terminate()
        server.wait(timeout=60)
    with radixrt.Runtime() as runtime:
        radixrt.lang.set_default_runtime(runtime)
        in_process = {name: timed(args.runs, runtime.flush_cache, work) for name, work in program_set(radixrt.lang)}
    print(f"| program | sglang.lang over HTTP (s) | radixrt.lang in process (s) | ratio |\n|---|---:|---:|---:|")
    for name in over_http:
        print(f"| {name} | {over_http[name]:.2f} | {in_process[name]:.2f} | {over_http[name] / in_process[name]:.2f}x |")
    total_http, total_local = sum(over_http.values()), sum(in_process.values())
    print(f"| all | {total_http:.2f} | {total_local:.2f} | {total_http / total_local:.2f}x |")


if __name__ == "__main__":
    main()
