"""`python -m radixrt.benchmarks`: the benchmark suite (see suite.py for the options)."""

from __future__ import annotations

import sys

from radixrt.benchmarks.suite import main

sys.exit(main())
