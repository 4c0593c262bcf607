"""Batched, seeded, constraint-aware token sampling.

Public API::

    from sampler import SamplingParams, SamplingRow, Sampler, SampleResult, TokenLogprobs, DeviceDFA
"""

from sampler.dfa import DeviceDFA, DFATables
from sampler.params import LOGPROB_FLOOR, SampleResult, SamplingParams, TokenLogprobs
from sampler.row import SamplingRow
from sampler.sampler import Sampler

__all__ = [
    "DFATables",
    "DeviceDFA",
    "LOGPROB_FLOOR",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprobs",
]
