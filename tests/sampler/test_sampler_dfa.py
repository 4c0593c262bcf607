"""DFA-constrained rows: masking, device-side advance, forking, caching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampler_reference import TokenDFASpec, words_from_allowed

import sampler.sampler as sampler_module
from sampler import DeviceDFA, Sampler, SamplingParams

V = 40
EOS = 0
A, B, C, AB = 1, 2, 3, 4
VALID = {(A, B, EOS), (A, C, EOS), (B, EOS), (AB, EOS)}


def _choice_dfa() -> TokenDFASpec:
    """Accepts "ab" | "ac" | "b" with tokens a, b, c, ab; EOS (stop) allowed only when final."""
    edges = {0: {A: 1, B: 3, AB: 3}, 1: {B: 3, C: 3}}
    return TokenDFASpec.from_edges(4, V, edges, final={3}, stops=[EOS])


def _finite(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > float("-inf")).flatten().tolist())


def test_mask_follows_state(device: torch.device) -> None:
    sampler = Sampler(V, device)
    row = sampler.new_row(SamplingParams(temperature=0), [])
    dfa = row.attach_dfa(sampler.new_dfa(_choice_dfa()))
    logits = torch.randn(1, V)
    assert _finite(sampler.process_logits(logits.to(device), [row])[0]) == {A, B, AB}
    row.append_token(A)
    assert _finite(sampler.process_logits(logits.to(device), [row])[0]) == {B, C}
    assert dfa.state == 1 and not dfa.is_final()
    row.append_token(C)
    assert _finite(sampler.process_logits(logits.to(device), [row])[0]) == {EOS}
    assert dfa.state == 3 and dfa.is_final()
    row.append_token(EOS)
    assert dfa.state == -1 and dfa.is_terminated() and dfa.is_final()
    # terminated rows are no longer masked
    assert _finite(sampler.process_logits(logits.to(device), [row])[0]) == set(range(V))


def test_invalid_token_is_not_final(device: torch.device) -> None:
    dfa = DeviceDFA(_choice_dfa(), device)
    dfa.push(C)
    assert dfa.state == -1 and not dfa.is_final()


def test_generation_loop_only_produces_valid_strings(device: torch.device) -> None:
    n = 32
    sampler = Sampler(V, device)
    spec = _choice_dfa()
    rows = [sampler.new_row(SamplingParams(seed=s, temperature=2.0), []) for s in range(n)]
    free = sampler.new_row(SamplingParams(seed=123), [])  # unconstrained neighbour
    for row in rows:
        row.attach_dfa(spec)
    batch = rows + [free]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        active = [r for r in rows if not r.output_token_ids or r.output_token_ids[-1] != EOS] + [free]
        result = sampler.sample((torch.randn(len(active), V, generator=gen) * 3).to(device), active)
        for row, tok in zip(active, result.token_ids):
            row.append_token(tok)
    assert {tuple(r.output_token_ids) for r in rows} <= VALID
    assert len({tuple(r.output_token_ids) for r in rows}) > 1
    assert all(r.dfa.is_final() for r in rows)
    assert batch[-1] is free


def test_n_choices_get_separate_states(device: torch.device) -> None:
    sampler = Sampler(V, device)
    dfa = sampler.new_dfa(_choice_dfa())
    r1 = sampler.new_row(SamplingParams(), [])
    r2 = sampler.new_row(SamplingParams(), [])
    d1, d2 = r1.attach_dfa(dfa), r2.attach_dfa(dfa)
    assert d1 is dfa and d2 is not dfa and d2.tables is d1.tables
    r1.append_token(A)
    r2.append_token(B)
    logits = torch.zeros(2, V)
    out = sampler.process_logits(logits.to(device), [r1, r2])
    assert _finite(out[0]) == {B, C} and _finite(out[1]) == {EOS}
    assert (d1.state, d2.state) == (1, 3)


def test_tables_cached_per_token_dfa(device: torch.device) -> None:
    spec = _choice_dfa()
    assert DeviceDFA(spec, device).tables is DeviceDFA(spec, device).tables
    assert DeviceDFA(_choice_dfa(), device).tables is not DeviceDFA(spec, device).tables


def test_forced_tokens_then_sampling(device: torch.device) -> None:
    """Jump-forward: tokens appended without sampling advance the DFA too."""
    sampler = Sampler(V, device)
    row = sampler.new_row(SamplingParams(seed=1), [])
    row.attach_dfa(_choice_dfa())
    row.append_token(A)  # forced
    for _ in range(5):
        tok = sampler.sample(torch.randn(1, V).to(device), [row]).token_ids[0]
        assert tok in (B, C)


def test_dfa_and_bitmask_intersect(device: torch.device) -> None:
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(), []) for _ in range(3)]
    rows[1].attach_dfa(_choice_dfa())
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [A, C, 7]] = True
    logits = torch.randn(3, V)
    out = sampler.process_logits(logits.to(device), rows, words_from_allowed(allowed).to(device), torch.tensor([1]).to(device))
    assert _finite(out[1]) == {A}
    assert torch.equal(out[0].cpu(), logits[0]) and torch.equal(out[2].cpu(), logits[2])


def test_attach_after_first_pass_invalidates_plan(device: torch.device) -> None:
    sampler = Sampler(V, device)
    row = sampler.new_row(SamplingParams(temperature=0), [])
    logits = torch.randn(1, V)
    assert len(_finite(sampler.process_logits(logits.to(device), [row])[0])) == V
    row.attach_dfa(_choice_dfa())
    assert _finite(sampler.process_logits(logits.to(device), [row])[0]) == {A, B, AB}
    row.detach_dfa()
    assert len(_finite(sampler.process_logits(logits.to(device), [row])[0])) == V


def test_numpy_uint32_tables_and_final_set(device: torch.device) -> None:
    spec = _choice_dfa()
    from types import SimpleNamespace

    np_spec = SimpleNamespace(
        initial_state=0,
        allowed=spec.allowed.numpy().view(np.uint32),
        trans_offsets=spec.trans_offsets.numpy(),
        trans_tokens=spec.trans_tokens.numpy().astype(np.int64),
        trans_next=list(spec.trans_next.tolist()),
        final={3},
        stop_token_ids=(EOS,),
    )
    dfa = DeviceDFA(np_spec, device)
    assert torch.equal(dfa.tables.allowed.cpu(), DeviceDFA(spec, device).tables.allowed.cpu())
    dfa.push(B)
    assert dfa.is_final()


def test_unconstrained_rows_pay_no_mask_work(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    real_dfa, real_bitmask = sampler_module.dfa_apply_mask_inplace, sampler_module.apply_token_bitmask_inplace

    def spy_dfa(logits, allowed, states, indices):
        calls.append(("dfa", states.numel()))
        real_dfa(logits, allowed, states, indices)

    def spy_bitmask(logits, bitmask, indices):
        calls.append(("bitmask", bitmask.shape[0]))
        real_bitmask(logits, bitmask, indices)

    monkeypatch.setattr(sampler_module, "dfa_apply_mask_inplace", spy_dfa)
    monkeypatch.setattr(sampler_module, "apply_token_bitmask_inplace", spy_bitmask)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(), []) for _ in range(64)]
    rows[17].attach_dfa(_choice_dfa())
    allowed = torch.ones(1, V, dtype=torch.bool)
    sampler.sample(torch.randn(64, V).to(device), rows, words_from_allowed(allowed).to(device), torch.tensor([40]).to(device))
    assert sorted(calls) == [("bitmask", 1), ("dfa", 1)]
    calls.clear()
    sampler.sample(torch.randn(63, V).to(device), rows[:17] + rows[18:])
    assert calls == []
