"""Sampling: the user-facing parameters (`params`) and the tensor sampler (`sampler`).

Importing this package loads no torch; `radixrt.sampling.sampler` does.
"""

from radixrt.sampling.params import GREEDY_TEMPERATURE, SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams"]
