"""Per-token cost of streaming detokenization on the bundled SmolLM2 tokenizer.

Streams 4,000-token outputs one token at a time through radixrt's own
`IncrementalDetokenizer` (Python windows over `tokenizer.decode`) and through
what `make_detokenizer` picks for this fast tokenizer (`StreamDetokenizer`,
tokenizers' `DecodeStream`), alternating the two, and checks that both
release exactly the same chunks. Three texts: English prose (this project's
docs), text where most characters are multi-byte (emoji, CJK, accents: their
bytes are split over byte tokens), and chat turns with special tokens, the
last with skip_special_tokens on and off. Time is CPU time over the whole
stream divided by its tokens; median of --runs.

Run: python bench/detok_bench.py [--runs N] [--tokens N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radixrt.engine.detokenizer import (  # noqa: E402
    Detokenizer,
    IncrementalDetokenizer,
    StreamDetokenizer,
    make_detokenizer,
)

MULTIBYTE_WORDS = ["😀", "🇫🇷", "👍🏽", "世界", "你好", "日本語", "naïve", "Ünïcödé", "∑", "𝔘", "—", "€", "ok", "the"]
PROMPT = "Write the answer below."


def load_tokenizer():
    """The bundled model's tokenizer, as radixrt's loader reads it."""
    from transformers import AutoTokenizer

    from radixrt.model.gguf_cache import gguf_to_hf_folder
    from radixrt.model.loader import bundled_model_path

    return AutoTokenizer.from_pretrained(gguf_to_hf_folder(bundled_model_path()))


def texts(tokenizer, num_tokens: int) -> dict[str, list[int]]:
    """Token ids of each text, cut to `num_tokens`."""
    prose = "\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    rng = random.Random(0)
    multibyte = " ".join(rng.choice(MULTIBYTE_WORDS) for _ in range(num_tokens))
    turns: list[str] = []
    while len(turns) < num_tokens // 20:
        turns.append(f"<|im_start|>user\n{rng.choice(MULTIBYTE_WORDS)} {prose[len(turns) * 40:][:60]}<|im_end|>\n")
    ids = {name: tokenizer.encode(text)[:num_tokens] for name, text in
           (("prose", prose), ("multibyte", multibyte), ("chat", "".join(turns)))}
    for name, token_ids in ids.items():
        if len(token_ids) < num_tokens:
            raise RuntimeError(f"the {name} text has only {len(token_ids)} tokens")
    return ids


def stream(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.append(token_id) for token_id in ids] + [detokenizer.flush()]


def cpu_seconds(run: Callable[[], list[str]]) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="streams per detokenizer and case (median)")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens per stream")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    prompt_ids = tokenizer.encode(PROMPT)
    if not isinstance(make_detokenizer(tokenizer, prompt_ids), StreamDetokenizer):
        raise RuntimeError("make_detokenizer did not pick StreamDetokenizer for the bundled tokenizer")
    ids = texts(tokenizer, args.tokens)
    cases = [("prose", True), ("multibyte", True), ("chat", True), ("chat", False)]
    print(f"{type(tokenizer).__name__}, {args.tokens} tokens per stream, median of {args.runs} runs (CPU time)")
    print(f"{'text':10} {'skip special':>12} {'ours us/token':>14} {'DecodeStream us/token':>22} {'speed-up':>9}")
    for name, skip in cases:
        token_ids = ids[name]

        def ours() -> list[str]:
            return stream(IncrementalDetokenizer(tokenizer, prompt_ids, skip), token_ids)

        def fast() -> list[str]:
            return stream(make_detokenizer(tokenizer, prompt_ids, skip), token_ids)

        expected = tokenizer.decode(token_ids, skip_special_tokens=skip)
        if ours() != fast() or "".join(fast()) != expected:
            raise RuntimeError(f"{name}: the two detokenizers released different text")
        times: dict[str, list[float]] = {"ours": [], "fast": []}
        for run in range(args.runs):
            order = (("ours", ours), ("fast", fast)) if run % 2 == 0 else (("fast", fast), ("ours", ours))
            for label, detokenize in order:
                times[label].append(cpu_seconds(detokenize) / len(token_ids) * 1e6)
        ours_us, fast_us = statistics.median(times["ours"]), statistics.median(times["fast"])
        print(f"{name:10} {str(skip):>12} {ours_us:14.2f} {fast_us:22.2f} {ours_us / fast_us:8.1f}x")


if __name__ == "__main__":
    main()
