"""Run the benchmark suite from a checkout: python bench/run_suite.py [--quick] [--workloads ...] [--reps N].

A thin wrapper: the suite lives in the package (radixrt/benchmarks/) so that
the `radixrt bench` command works from any install; this script and
`radixrt bench` take the same options and write the same files (default
bench/results/, which git ignores). See docs/benchmarks_suite.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.benchmarks.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
