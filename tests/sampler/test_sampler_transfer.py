"""The sampler reads ids and logprobs back in one transfer: the values equal reading each piece
back on its own (the construction before), exactly, for greedy, sampled and masked rows."""

from __future__ import annotations

import torch
from sampler_reference import words_from_allowed

from sampler import LOGPROB_FLOOR, Sampler, SamplingParams

V = 300


def per_piece(x: torch.Tensor, ids: list[int], params: list[SamplingParams]) -> list:
    """Logprobs as one ``tolist`` per piece from the processed logits ``x`` [B, V]."""
    out = []
    for row, p in enumerate(params):
        if not p.logprobs:
            out.append(None)
            continue
        lp = x[row].float().log_softmax(dim=-1)
        chosen = lp[ids[row]].clamp(min=LOGPROB_FLOOR).tolist()
        top = []
        if p.top_logprobs:
            values, indices = lp.topk(p.top_logprobs)
            top = list(zip(indices.tolist(), values.clamp(min=LOGPROB_FLOOR).tolist()))
        out.append((ids[row], chosen, top))
    return out


def test_one_transfer_equals_one_read_per_piece(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
        SamplingParams(seed=1, temperature=0.7, top_k=20, logprobs=True, top_logprobs=3),
        SamplingParams(seed=2),  # no logprobs
        SamplingParams(temperature=0, logprobs=True),  # chosen only
        SamplingParams(seed=3, top_p=0.8, logprobs=True, top_logprobs=8, presence_penalty=0.5),
    ]
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, 40:60] = True  # row 4 is constrained to 20 tokens: banned ones sit at the floor
    for _ in range(3):
        sampler = Sampler(V, device)
        rows = [sampler.new_row(p, [5, 6]) for p in params]
        for step in range(4):
            logits = torch.randn(len(rows), V, generator=gen) * 3
            bitmask = words_from_allowed(allowed).to(device)
            indices = torch.tensor([4], device=device)
            x = sampler.process_logits(logits.clone().to(device), rows, bitmask, indices)
            result = sampler.sample(logits.clone().to(device), rows, bitmask, indices)
            expected = per_piece(x, result.token_ids, params)
            got = [None if lp is None else (lp.token_id, lp.logprob, lp.top) for lp in result.logprobs]
            assert got == expected
            assert all(type(t) is int for t in result.token_ids)
            assert 40 <= result.token_ids[4] < 60
            for row, token in zip(rows, result.token_ids):
                row.append_token(token)


def test_greedy_ids_without_logprobs_are_the_argmax(device: torch.device) -> None:
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(4)]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9))
    assert sampler.sample(logits.clone().to(device), rows).token_ids == logits.argmax(-1).tolist()
