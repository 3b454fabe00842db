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
cut into pieces of --piece-len tokens, each piece run as one prefill. With
--greedy, each path also answers the chat prompts greedily itself (`Runtime`,
deterministic where its kernels serve it), and the table adds the share of the
float32 answers' tokens it reproduces before its first different token.

`--source bf16-folder` measures quantizing at load instead: the bundled model's
dense weights written as a bf16 Hugging Face folder (a temp dir), the
reference that folder computed in float32, and the paths `dense` (the folder
in bf16), `q8_0` and `q4_0` (the folder quantized at load, `quantize=`).

Run: python bench/quality_bench.py [--source gguf|bf16-folder] [--paths dense,native] [--pieces N]
         [--piece-len N] [--answer-len N] [--greedy]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
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


def texts(tokenizer: Any, pieces: int, piece_len: int, answer_len: int,
          model: Path | None = None) -> dict[str, list[Piece]]:
    def cut(text: str) -> list[Piece]:
        ids = tokenizer.encode(text)
        return [Piece(ids[s : s + piece_len], 1) for s in range(0, pieces * piece_len, piece_len) if s + 2 <= len(ids)]

    prose = "\n\n".join(pydoc_data.topics.topics[name] for name in PROSE_TOPICS)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)
        for prompt in CHAT_PROMPTS
    ]  # fmt: skip
    runtime = Runtime(model, dtype="float32", weights="dense")  # the float32 model's own greedy answers
    try:
        answers = runtime.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": answer_len})
    finally:
        runtime.shutdown()
    chat = [Piece(ids + answer["output_ids"], len(ids)) for ids, answer in zip(prompts, answers)]
    return {"prose": cut(prose), "code": cut(Path(textwrap.__file__).read_text()), "chat answers": chat}


def greedy_share(loaded: LoadedModel, chat: list[Piece]) -> float:
    """The share of the float32 answers' tokens `loaded` reproduces, answering greedily itself,
    before its first different token."""
    runtime = Runtime(loaded, max_total_tokens=8192)
    try:
        prompts = [piece.ids[: piece.first] for piece in chat]
        lengths = [len(piece.ids) - piece.first for piece in chat]
        params = {"temperature": 0, "max_new_tokens": max(lengths)}
        outputs = runtime.generate(input_ids=prompts, sampling_params=params)
    finally:
        runtime.shutdown()
    same = 0
    for piece, output in zip(chat, outputs):
        for expected, token in zip(piece.ids[piece.first :], output["output_ids"]):
            if expected != token:
                break
            same += 1
    return same / sum(lengths)


def load_paths(source: str, names: list[str], temp: str) -> tuple[LoadedModel, dict[str, LoadedModel], str]:
    """The float32 reference, each path (bf16), and the table's description of the source."""
    if source == "gguf":
        reference = load_model(None, device="cpu", dtype="fp32", weights="dense")
        paths = {name: load_model(None, device="cpu", dtype="bf16", weights=name) for name in names}
        return reference, paths, "bundled model; each path against float32 arithmetic on the same dense weights"
    from radixrt.benchmarks.hf_folders import write_hf_folder

    folder = write_hf_folder(Path(temp) / "SmolLM2-135M-Instruct-bf16")
    reference = load_model(folder, device="cpu", dtype="fp32")
    paths = {name: load_model(folder, device="cpu", dtype="bf16", quantize=None if name == "dense" else name)
             for name in names}  # fmt: skip
    return reference, paths, ("the bundled model's dense weights as a bf16 folder; each path against float32 "
                              "arithmetic on those bf16 weights (quantization counted)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("gguf", "bf16-folder"), default="gguf")
    parser.add_argument("--paths", default=None,
                        help="weights, each in bf16: dense, native (gguf; the default), or dense, q8_0, q4_0 "
                        "(bf16-folder; the default)")
    parser.add_argument("--greedy", action="store_true", help="also each path's own greedy chat answers")
    parser.add_argument("--pieces", type=int, default=4, help="pieces of prose and of code")
    parser.add_argument("--piece-len", type=int, default=512)
    parser.add_argument("--answer-len", type=int, default=48, help="tokens of each chat answer")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = (args.paths or ("dense,native" if args.source == "gguf" else "dense,q8_0,q4_0")).split(",")
    temp = tempfile.TemporaryDirectory()
    reference, paths, described = load_paths(args.source, names, temp.name)
    corpus = texts(reference.tokenizer, args.pieces, args.piece_len, args.answer_len,
                   None if args.source == "gguf" else reference.path)
    with torch.inference_mode():
        tallies = {(text, path): Tally() for text in corpus for path in paths}
        for text, text_pieces in corpus.items():
            for piece in text_pieces:
                expected = log_probs(reference, piece.ids)[piece.first - 1 :]
                targets = torch.tensor(piece.ids[piece.first :])
                for path, loaded in paths.items():
                    tallies[text, path].add(expected, log_probs(loaded, piece.ids)[piece.first - 1 :], targets)
    greedy = {path: greedy_share(loaded, corpus["chat answers"]) for path, loaded in paths.items() if args.greedy}
    print(f"CPU: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads); {described}")
    for path, share in greedy.items():
        print(f"- {path}: its own greedy chat answers reproduce {share:.1%} of float32's tokens before the first "
              "different one")
    print("| text | positions | path (bf16) | mean KL (nats) | p99 KL | same top token | perplexity (float32) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (text, path), tally in tallies.items():
        n, kl, p99, same, ppl, reference_ppl = tally.row()
        print(f"| {text} | {n:,} | {path} | {kl:.5f} | {p99:.4f} | {same:.1%} | {ppl:.3f} ({reference_ppl:.3f}) |")


if __name__ == "__main__":
    main()
