"""DFA mask / advance kernels vs references and a plain-Python oracle."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import dfa_advance, dfa_advance_reference, dfa_apply_mask_inplace


def _random_dfa(n_states: int, vocab: int, max_deg: int, gen: torch.Generator):
    """CSR tables with sorted tokens per state."""
    deg = torch.randint(0, max_deg + 1, (n_states,), generator=gen)
    offsets = torch.zeros(n_states + 1, dtype=torch.int32)
    offsets[1:] = deg.cumsum(0)
    tokens = [torch.randperm(vocab, generator=gen)[:d].sort().values for d in deg.tolist()]
    trans_tokens = torch.cat(tokens).to(torch.int32) if tokens else torch.zeros(0, dtype=torch.int32)
    trans_next = torch.randint(0, n_states, (trans_tokens.numel(),), generator=gen, dtype=torch.int32)
    return offsets, trans_tokens, trans_next


def _python_advance(states, tokens, offsets, trans_tokens, trans_next) -> list[int]:
    out = []
    for s, t in zip(states.tolist(), tokens.tolist()):
        nxt = -1
        if s >= 0:
            for e in range(int(offsets[s]), int(offsets[s + 1])):
                if int(trans_tokens[e]) == t:
                    nxt = int(trans_next[e])
        out.append(nxt)
    return out


@pytest.mark.parametrize(("n_states", "vocab", "max_deg"), [(1, 1, 1), (5, 40, 40), (30, 1000, 300), (3, 49157, 2000)])
def test_advance_matches_oracle(backend, gen, n_states: int, vocab: int, max_deg: int) -> None:
    offsets, trans_tokens, trans_next = _random_dfa(n_states, vocab, max_deg, gen)
    n = 200
    states = torch.randint(-1, n_states, (n,), generator=gen, dtype=torch.int32)
    # half the tokens are real transitions, half random
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    if trans_tokens.numel():
        pick = trans_tokens[torch.randint(0, trans_tokens.numel(), (n,), generator=gen)].long()
        tokens = torch.where(torch.arange(n) % 2 == 0, pick, tokens)
    expected = _python_advance(states, tokens, offsets, trans_tokens, trans_next)
    max_degree = int((offsets[1:] - offsets[:-1]).max())
    assert dfa_advance_reference(states, tokens, offsets, trans_tokens, trans_next).tolist() == expected
    assert dfa_advance_reference(states, tokens, offsets, trans_tokens, trans_next, max_degree).tolist() == expected
    dev = [t.to(backend) for t in (states, tokens, offsets, trans_tokens, trans_next)]
    assert kernels.select_backend(dev[0], use_triton=True) == "triton"
    got = dfa_advance(*dev, max_degree=max_degree, use_triton=True)
    assert got.dtype == torch.int32 and got.device.type == backend.type
    assert got.cpu().tolist() == expected


def test_advance_terminal_state_is_sticky() -> None:
    offsets = torch.tensor([0, 2, 2], dtype=torch.int32)
    trans_tokens = torch.tensor([3, 7], dtype=torch.int32)
    trans_next = torch.tensor([1, 0], dtype=torch.int32)
    states = torch.tensor([0, 0, 0, 1, -1], dtype=torch.int32)
    tokens = torch.tensor([3, 7, 5, 3, 3])
    assert dfa_advance(states, tokens, offsets, trans_tokens, trans_next).tolist() == [1, 0, -1, -1, -1]


@pytest.mark.parametrize(("vocab", "n_words"), [(1, 1), (33, 1), (1000, 32), (1000, 20), (49157, 1537)])
def test_dfa_mask_matches_reference(backend, gen, vocab: int, n_words: int) -> None:
    n_states = 6
    allowed = torch.randint(-(2**31), 2**31 - 1, (n_states, n_words), generator=gen, dtype=torch.int64).to(torch.int32)
    allowed[0] = 0  # a state with nothing allowed
    allowed[1] = -1  # a state with everything allowed
    batch = 5
    logits = torch.randn(batch, vocab, generator=gen)
    states = torch.tensor([0, 1, -1, 4], dtype=torch.int32)
    indices = torch.tensor([3, 0, 1, 4])
    expected = logits.clone()
    kernels.apply_token_bitmask_inplace_reference(expected, allowed[[0, 1, 4]], indices[[0, 1, 3]])
    ref = logits.clone()
    dfa_apply_mask_inplace(ref, allowed, states, indices, use_triton=False)
    assert torch.equal(ref, expected)
    assert torch.equal(ref[1], logits[1]) and torch.equal(ref[2], logits[2])  # state -1 / unconstrained
    got = logits.to(backend)
    dfa_apply_mask_inplace(got, allowed.to(backend), states.to(backend), indices.to(backend), use_triton=True)
    assert torch.equal(got.cpu(), expected)
