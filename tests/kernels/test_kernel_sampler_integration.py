"""A full sampler pass with every kernel on the Triton path equals the reference pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kernels.bitmask
import kernels.dfa
import kernels.penalties

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sampler"))
from sampler_reference import TokenDFASpec, words_from_allowed  # noqa: E402

from sampler import Sampler, SamplingParams  # noqa: E402

V = 1000


def _run(device: torch.device, force_triton: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, list[int]]:
    calls: list[str] = []
    if force_triton:
        for mod in (kernels.bitmask, kernels.dfa, kernels.penalties):
            def pick(t, use_triton=None, _real=mod.select_backend):  # noqa: ANN001
                calls.append(_real(t, True))
                return _real(t, True)
            monkeypatch.setattr(mod, "select_backend", pick)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(V, device)
    params = [
        SamplingParams(seed=1, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(temperature=0),
        SamplingParams(seed=2, presence_penalty=0.5, top_k=50),
        SamplingParams(seed=3, temperature=0.7),
    ]
    rows = [sampler.new_row(p, [5, 6, 7]) for p in params]
    dfa = TokenDFASpec.from_edges(3, V, {0: {t: 1 for t in range(0, 200, 3)}, 1: {7: 2}}, {2}, [999])
    rows[3].attach_dfa(dfa)
    allowed = torch.rand(2, V, generator=gen) < 0.5
    words, idx = words_from_allowed(allowed).to(device), torch.tensor([0, 2], device=device)
    out, ids = [], []
    for _ in range(3):
        logits = (torch.randn(4, V, generator=gen) * 3).to(device)
        out.append(sampler.process_logits(logits, rows, words, idx))
        step = sampler.sample(logits.clone(), rows, words, idx).token_ids
        for row, tok in zip(rows, step):
            row.append_token(tok)
        ids += step
    if force_triton:
        assert set(calls) == {"triton"} and len(calls) >= 9
    return torch.stack(out).cpu(), ids


def test_sampler_pass_triton_equals_reference(backend: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    ref_logits, ref_ids = _run(backend, False, monkeypatch)
    tri_logits, tri_ids = _run(backend, True, monkeypatch)
    assert torch.equal(torch.isneginf(ref_logits), torch.isneginf(tri_logits))
    finite = ~torch.isneginf(ref_logits)
    torch.testing.assert_close(tri_logits[finite], ref_logits[finite], rtol=1e-6, atol=1e-6)
    assert tri_ids == ref_ids
