"""Fused penalties + temperature kernel vs reference and a per-row Python oracle."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import apply_penalties_inplace, apply_penalties_reference


def _oracle_row(x: list[float], counts: list[int], prompt: list[bool], rep: float, pres: float, freq: float) -> list[float]:
    out = []
    for v, c, p in zip(x, counts, prompt):
        if c > 0 or p:
            v = v / rep if v > 0 else v * rep
        out.append(v - freq * c - pres * (c > 0))
    return out


def _data(batch: int, vocab: int, gen: torch.Generator):
    pool = 8
    logits = torch.randn(batch, vocab, generator=gen) * 4
    counts = torch.randint(0, 3, (pool, vocab + 5), generator=gen, dtype=torch.int32)
    counts *= torch.rand(pool, vocab + 5, generator=gen) < 0.2
    prompt = torch.rand(pool, vocab + 5, generator=gen) < 0.1
    return logits, counts, prompt


def test_reference_matches_python_oracle(gen: torch.Generator) -> None:
    logits, counts, prompt = _data(3, 50, gen)
    slots, idx = torch.tensor([5, 2]), torch.tensor([2, 0])
    rep, pres, freq = torch.tensor([1.5, 0.7]), torch.tensor([0.3, -0.5]), torch.tensor([0.25, 1.0])
    out = logits.clone()
    apply_penalties_reference(out, slots, counts, prompt, rep, pres, freq, idx)
    assert torch.equal(out[1], logits[1])
    for r in range(2):
        s, row = int(slots[r]), int(idx[r])
        exp = _oracle_row(logits[row].tolist(), counts[s, :50].tolist(), prompt[s, :50].tolist(), float(rep[r]), float(pres[r]), float(freq[r]))
        torch.testing.assert_close(out[row], torch.tensor(exp))


@pytest.mark.parametrize("vocab", [1, 33, 1000, 49157])
@pytest.mark.parametrize("with_indices", [True, False])
@pytest.mark.parametrize("with_temp", [True, False])
def test_triton_matches_reference(backend, gen, vocab: int, with_indices: bool, with_temp: bool) -> None:
    batch = 4
    logits, counts, prompt = _data(batch, vocab, gen)
    if with_indices:
        idx, slots = torch.tensor([3, 1]), torch.tensor([6, 0])
    else:
        idx, slots = None, torch.tensor([6, 0, 2, 3])
    n = slots.numel()
    rep = torch.rand(n, generator=gen) + 0.5
    pres = torch.rand(n, generator=gen) - 0.5
    freq = torch.rand(n, generator=gen) - 0.5
    temp = torch.rand(n, generator=gen) + 0.5 if with_temp else None
    expected = logits.clone()
    apply_penalties_reference(expected, slots, counts, prompt, rep, pres, freq, idx, temp)
    dev = lambda t: None if t is None else t.to(backend)  # noqa: E731
    got = logits.to(backend)
    assert kernels.select_backend(got, use_triton=True) == "triton"
    apply_penalties_inplace(got, dev(slots), dev(counts), dev(prompt), dev(rep), dev(pres), dev(freq), dev(idx), dev(temp), use_triton=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)
