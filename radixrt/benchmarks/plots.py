"""PNG plots of a report: throughput per workload per system, and TTFT distributions.

matplotlib is the optional `bench` extra (`pip install radixrt[bench]`);
without it the suite still writes JSON and Markdown and says it skipped these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"radixrt": "#1f77b4", "radixrt-no-cache": "#9ecae1", "radixrt-nondeterministic": "#08519c",
           "transformers": "#ff7f0e"}


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Write throughput.png and ttft.png under `out`; [] (and a message) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'radixrt[bench]')")
        return []
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    results = report["results"]
    host = report["machine"]
    subtitle = f"{host['model']}, {host['gpu'] or host['cpu']}, {host['dtype']}"
    paths = [out / "throughput.png", out / "ttft.png"]
    _throughput(plt, results, subtitle, paths[0])
    _ttft(plt, ticker, results, subtitle, paths[1])
    return paths


def _systems(results: dict[str, Any]) -> list[str]:
    seen = {system for by_system in results.values() for system in by_system}
    return [s for s in _COLORS if s in seen] + sorted(seen - set(_COLORS))


def _throughput(plt: Any, results: dict[str, Any], subtitle: str, path: Path) -> None:
    workloads, systems = list(results), _systems(results)
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads)), 4.2))
    for i, system in enumerate(systems):
        xs = [w + (i - (len(systems) - 1) / 2) * width for w in range(len(workloads))]
        ys = [results[w].get(system, {}).get("output_tokens_per_s", 0.0) for w in workloads]
        bars = ax.bar(xs, ys, width, label=system, color=_COLORS.get(system))
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads, rotation=15)
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title(f"Throughput per workload\n{subtitle}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ttft(plt: Any, ticker: Any, results: dict[str, Any], subtitle: str, path: Path) -> None:
    """One panel per workload: every request's TTFT (all repetitions), one box per system, log scale."""
    workloads, systems = list(results), _systems(results)
    columns = min(3, len(workloads))
    rows = -(-len(workloads) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        present = [s for s in systems if s in results[workload]]
        data = [[t for rep in results[workload][s]["reps"] for t in rep["ttft_s"]] for s in present]
        boxes = ax.boxplot(data, patch_artist=True, showfliers=True, flierprops={"markersize": 3})
        for patch, system in zip(boxes["boxes"], present):
            patch.set_facecolor(_COLORS.get(system, "#cccccc"))
        ax.set_xticks(range(1, len(present) + 1), present, fontsize=7, rotation=10)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        low, high = ax.get_ylim()
        narrow = high < 12 * low  # about one decade: label the minor ticks too, else none would show
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g") if narrow else ticker.NullFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(workload, fontsize=9)
        ax.set_ylabel("TTFT s")
    for ax in list(axes.flat)[len(workloads):]:
        ax.set_visible(False)
    fig.suptitle(f"Time to first token, every request of every repetition\n{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
