"""How far each bf16 path's next-token distributions are from float32 arithmetic on the same weights.

For numerics decisions: a kernel's rounding, a quantized format's inputs. Speed
benchmarks cannot say what such a change costs, and greedy agreement over a few
answers is a noisy proxy (one near-tie flips the rest of an answer). Here every
position of three texts is scored with teacher forcing, and each path's
distribution is compared with the bundled model's weights computed in float32
(the dense weights read from the same file, so the quantization itself is not
counted): the mean KL divergence KL(float32 || path) in nats a token, its 99th
percentile, the share of positions whose most likely token is float32's, and
the text's perplexity.

Texts: prose (Python's own documentation topics, `pydoc_data.topics`), code
(the standard library's `textwrap.py`), and chat (fixed prompts in the chat
template with the float32 model's greedy answers from `Runtime.generate`, the
answers scored). Each is
cut into pieces of --piece-len tokens, each piece run as one prefill.

Run: python bench/quality_bench.py [--paths dense,native] [--pieces N] [--piece-len N] [--answer-len N]
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydoc_data.topics

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from model_bench import cpu_name, make_runner  # noqa: E402

from radixrt.kernels.forward_batch import ForwardBatch  # noqa: E402
from radixrt.model.loader import LoadedModel, load_model  # noqa: E402
from radixrt.runtime.api import Runtime  # noqa: E402

PROSE_TOPICS = ("assignment", "naming", "exceptions", "import", "compound", "function", "class", "numbers")
CHAT_PROMPTS = (
    "The capital of France is", "Write a short poem about the sea.", "Explain what a hash table is.",
    "List three uses of copper.", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What does a CPU cache do?", "How do vaccines work?",
    "Write a haiku about autumn.", "Tell me a fun fact about octopuses.", "What is machine learning?",
)  # fmt: skip


@dataclass
class Piece:
    """Token ids, of which positions `first` .. end are scored (each from the tokens before it)."""

    ids: list[int]
    first: int


@dataclass
class Tally:
    """One path's distance from float32 over one text."""

    kl: list[torch.Tensor] = field(default_factory=list)
    same_top: int = 0
    nll: float = 0.0
    reference_nll: float = 0.0

    def add(self, reference: torch.Tensor, path: torch.Tensor, targets: torch.Tensor) -> None:
        """reference, path: float64 log-probabilities [positions, vocab]; targets [positions]."""
        self.kl.append((reference.exp() * (reference - path)).sum(-1))
        self.same_top += int((path.argmax(-1) == reference.argmax(-1)).sum())
        self.nll -= float(path.gather(1, targets[:, None]).sum())
        self.reference_nll -= float(reference.gather(1, targets[:, None]).sum())

    def row(self) -> tuple[int, float, float, float, float, float]:
        kl = torch.cat(self.kl)
        n = kl.numel()
        return (n, float(kl.mean()), float(kl.quantile(0.99)), self.same_top / n, math.exp(self.nll / n),
                math.exp(self.reference_nll / n))  # fmt: skip


def log_probs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """float64 log-probabilities [len(ids) - 1, vocab] of the token after each position but the last."""
    runner = make_runner(loaded, len(ids))
    batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))])
    logits = runner.forward(batch, torch.arange(len(ids) - 1))
    return torch.log_softmax(logits.double(), dim=-1)


def texts(tokenizer: Any, pieces: int, piece_len: int, answer_len: int) -> dict[str, list[Piece]]:
    def cut(text: str) -> list[Piece]:
        ids = tokenizer.encode(text)
        return [Piece(ids[s : s + piece_len], 1) for s in range(0, pieces * piece_len, piece_len) if s + 2 <= len(ids)]

    prose = "\n\n".join(pydoc_data.topics.topics[name] for name in PROSE_TOPICS)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)
        for prompt in CHAT_PROMPTS
    ]  # fmt: skip
    runtime = Runtime(dtype="float32", weights="dense")  # the float32 model's own greedy answers
    try:
        answers = runtime.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": answer_len})
    finally:
        runtime.shutdown()
    chat = [Piece(ids + answer["output_ids"], len(ids)) for ids, answer in zip(prompts, answers)]
    return {"prose": cut(prose), "code": cut(Path(textwrap.__file__).read_text()), "chat answers": chat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="dense,native", help="weights, each in bf16: dense, native")
    parser.add_argument("--pieces", type=int, default=4, help="pieces of prose and of code")
    parser.add_argument("--piece-len", type=int, default=512)
    parser.add_argument("--answer-len", type=int, default=48, help="tokens of each chat answer")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reference = load_model(None, device="cpu", dtype="fp32", weights="dense")
    paths = {name: load_model(None, device="cpu", dtype="bf16", weights=name) for name in args.paths.split(",")}
    corpus = texts(reference.tokenizer, args.pieces, args.piece_len, args.answer_len)
    with torch.inference_mode():
        tallies = {(text, path): Tally() for text in corpus for path in paths}
        for text, text_pieces in corpus.items():
            for piece in text_pieces:
                expected = log_probs(reference, piece.ids)[piece.first - 1 :]
                targets = torch.tensor(piece.ids[piece.first :])
                for path, loaded in paths.items():
                    tallies[text, path].add(expected, log_probs(loaded, piece.ids)[piece.first - 1 :], targets)
    print(f"CPU: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads); bundled model; "
          "each path against float32 arithmetic on the same dense weights")  # fmt: skip
    print("| text | positions | path (bf16) | mean KL (nats) | p99 KL | same top token | perplexity (float32) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (text, path), tally in tallies.items():
        n, kl, p99, same, ppl, reference_ppl = tally.row()
        print(f"| {text} | {n:,} | {path} | {kl:.5f} | {p99:.4f} | {same:.1%} | {ppl:.3f} ({reference_ppl:.3f}) |")


if __name__ == "__main__":
    main()
