"""The C++ inverse-CDF sampler (``kernels/csrc/cpu_sampler.cpp``) behind ``sample_inverse_cdf``
on an AVX-512 CPU: softmax's distribution, never a banned token, a row's token its own."""

from __future__ import annotations

import collections

import pytest
import torch

from kernels.cpu_fused import vectorised_cpu_ops
from sampler.ops import sample_inverse_cdf

pytestmark = pytest.mark.skipif(vectorised_cpu_ops() is None, reason="the C++ sampler needs AVX-512 and a compiler")


def test_draws_follow_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5, -3.0, 1.5, 0.25, -1.0, 0.0, 0.75, 2.5, -0.5, 1.0,
                           0.0, -2.0, 0.1, 0.2, 0.3])  # 19: a partial last block
    draws = 200_000
    torch.manual_seed(0)
    tokens = sample_inverse_cdf(logits.expand(draws, -1).contiguous(), torch.rand(draws, dtype=torch.float64))
    counts = collections.Counter(tokens.tolist())
    expected = torch.softmax(logits, dim=0)
    assert counts[3] == 0
    for token, p in enumerate(expected.tolist()):
        assert abs(counts[token] / draws - p) < 4 * (p * (1 - p) / draws) ** 0.5 + 1e-9


def test_banned_and_nan_tokens_are_never_drawn() -> None:
    vocab = 49152
    rows = torch.full((4, vocab), float("-inf"))
    rows[0, 31] = 0.0  # one allowed token
    rows[1, vocab - 1] = 5.0  # the last one, in the last block
    rows[2, 100:200] = torch.randn(100) * 50 - 300  # far below any normal float's exp
    rows[3, :] = float("nan")
    rows[3, 7] = 1.0
    for u in (0.0, 0.5, 1.0 - 2**-53):
        tokens = sample_inverse_cdf(rows, torch.full((4,), u, dtype=torch.float64)).tolist()
        assert tokens[0] == 31 and tokens[1] == vocab - 1 and 100 <= tokens[2] < 200 and tokens[3] == 7


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    torch.manual_seed(1)
    rows = torch.randn(9, 49152) * 4
    u = torch.rand(9, dtype=torch.float64)
    together = sample_inverse_cdf(rows, u)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [sample_inverse_cdf(rows[i : i + 1].clone(), u[i : i + 1])[0] for i in range(9)]
    finally:
        torch.set_num_threads(threads)
    assert together.tolist() == [int(t) for t in alone]


def test_it_mostly_agrees_with_the_torch_route() -> None:
    """The torch route's cumsum adds in another order: a draw differs only where two cumulative
    sums straddle u * total (rare), never by the distribution."""
    torch.manual_seed(2)
    rows = torch.randn(256, 4096) * 3
    u = torch.rand(256, dtype=torch.float64)
    weights = (rows - rows.amax(dim=-1, keepdim=True)).exp()
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    reference = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    assert (sample_inverse_cdf(rows, u) == reference).float().mean() > 0.98
