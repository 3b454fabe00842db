"""How long the cache's picture and its explanations take on big trees.

Trees of 1,000 to 100,000 nodes are built from seeded chat-like traces
(shared system prompts, conversations that grow turn by turn, one-off
prompts), with the bundled model's tokenizer decoding the snippets, as
`Runtime.cache_tree_svg` does. Timed apart:
  - snapshot: the part that runs on the engine thread between two steps
    (it walks the whole tree once, so it grows with the tree);
  - render: decoding the kept nodes' snippets and writing the SVG (bounded
    by max_nodes, off the engine thread);
  - explain: one `RadixTree.explain` of a prompt that leaves a cached
    conversation in its last turn.
Wall time (time.perf_counter), medians of --runs; the issue's goal is a
10,000-node tree drawn in under a second.

Run: python bench/cache_picture_bench.py [--nodes 1000,10000,100000] [--runs 5] [--max-nodes 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.model.loader import load_model  # noqa: E402
from radixrt.runtime.cache_report import tree_svg  # noqa: E402
from radixrt.tree import RadixTree  # noqa: E402

VOCAB = 49_000


def build_tree(num_nodes: int, seed: int) -> tuple[RadixTree, list[int]]:
    """A chat-like tree with at least `num_nodes` nodes, and one cached conversation to explain."""
    rng = random.Random(seed)
    tree = RadixTree()
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(50, 400))] for _ in range(20)]
    slot = 0
    conversation: list[int] = []
    while tree.snapshot(1).total_nodes < num_nodes:
        for _ in range(200):
            conversation = list(rng.choice(systems)) if rng.random() < 0.8 else []
            for _ in range(rng.randrange(1, 6)):
                conversation += [rng.randrange(VOCAB) for _ in range(rng.randrange(10, 80))]
                tree.insert(conversation, torch.arange(slot, slot + len(conversation)))
                slot += len(conversation)
    return tree, conversation


def median_ms(action, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,10000,100000")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-nodes", type=int, default=200)
    args = parser.parse_args()
    tokenizer = load_model(None).tokenizer

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    print("| tree nodes | snapshot (engine thread), ms | render, ms | total, ms | SVG elements | explain, ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num_nodes in (int(n) for n in args.nodes.split(",")):
        tree, conversation = build_tree(num_nodes, seed=num_nodes)
        snapshot = tree.snapshot(args.max_nodes)
        query = conversation[:-5] + [7, 7, 7, 7, 7]
        snap_ms = median_ms(lambda: tree.snapshot(args.max_nodes), args.runs)
        render_ms = median_ms(lambda: tree_svg(snapshot, decode), args.runs)
        explain_ms = median_ms(lambda: tree.explain(query), args.runs)
        elements = sum(1 for _ in ET.fromstring(tree_svg(snapshot, decode)).iter())
        print(
            f"| {snapshot.total_nodes:,} | {snap_ms:.1f} | {render_ms:.1f} | {snap_ms + render_ms:.1f} "
            f"| {elements:,} | {explain_ms:.3f} |"
        )


if __name__ == "__main__":
    main()
