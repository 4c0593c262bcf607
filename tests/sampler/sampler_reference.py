"""Straightforward per-row reference of the sampler's logits processing (test oracle)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sampler import SamplingParams

NEG_INF = float("-inf")


@dataclass
class TokenDFASpec:
    """A minimal TokenDFA (the constraints package's shape) built by hand in tests."""

    initial_state: int
    allowed: torch.Tensor  # int32 [S, W]
    trans_offsets: torch.Tensor
    trans_tokens: torch.Tensor
    trans_next: torch.Tensor
    final: torch.Tensor  # bool [S]
    stop_token_ids: list[int] = field(default_factory=list)

    @staticmethod
    def from_edges(n_states: int, vocab: int, edges: dict[int, dict[int, int]], final: set[int], stops: Sequence[int]) -> TokenDFASpec:
        """edges[state][token] = next state; allowed = tokens with an edge (+ stops if final)."""
        n_words = (vocab + 31) // 32
        allowed = torch.zeros(n_states, n_words, dtype=torch.int64)
        offsets, toks, nxt = [0], [], []
        for s in range(n_states):
            for t in sorted(edges.get(s, {})):
                toks.append(t)
                nxt.append(edges[s][t])
                allowed[s, t // 32] |= 1 << (t % 32)
            offsets.append(len(toks))
        allowed = torch.where(allowed >= 2**31, allowed - 2**32, allowed).to(torch.int32)
        return TokenDFASpec(
            0, allowed, torch.tensor(offsets, dtype=torch.int32), torch.tensor(toks, dtype=torch.int32),
            torch.tensor(nxt, dtype=torch.int32), torch.tensor([s in final for s in range(n_states)]), list(stops),
        )


def reference_process(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    allowed: torch.Tensor | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Processed float32 logits [V] of one row, written as plainly as possible.

    ``top_p``: the row's current top-p (decaying top-p); default ``params.top_p``."""
    x = logits.float().clone()
    vocab = x.numel()
    if allowed is not None:
        x[~allowed] = NEG_INF
    for tok, val in (params.logit_bias or {}).items():
        x[tok] += val
    banned = set(reference_bad_word_bans(params.bad_words, prompt, output))
    if len(output) < params.min_tokens:
        banned |= set(params.banned_until_min_tokens)
    if banned:
        y = x.clone()
        for tok in banned:
            y[tok] = NEG_INF
        if y.max() > NEG_INF:
            x = y
    counts = Counter(output)
    for tok in set(prompt) | set(output):
        v = float(x[tok])
        x[tok] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    for tok, c in counts.items():
        x[tok] -= params.frequency_penalty * c + params.presence_penalty
    if params.temperature == 0:
        return x
    x = x / params.temperature
    if 0 < params.top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
        x[x < kth] = NEG_INF
    top_p = params.top_p if top_p is None else top_p
    if top_p < 1.0:
        probs = torch.softmax(x.double(), 0).tolist()
        order = sorted(range(vocab), key=lambda t: -float(x[t]))
        mass, threshold = 0.0, None
        for t in order:
            threshold = float(x[t])
            mass += probs[t]
            if mass >= top_p:
                break
        x[x < threshold] = NEG_INF
    if params.min_p > 0:
        probs = torch.softmax(x.double(), 0)
        x[probs < params.min_p * probs.max()] = NEG_INF
    return x


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same banned set; finite values close."""
    got, expected = got.cpu(), expected.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected)), (
        torch.nonzero(torch.isneginf(got) != torch.isneginf(expected)).flatten().tolist()
    )
    finite = ~torch.isneginf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def words_from_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> packed int32 [R, ceil(V/32)]."""
    rows, vocab = allowed.shape
    n_words = (vocab + 31) // 32
    padded = torch.zeros(rows, n_words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, n_words, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """float64 log_softmax (reference precision)."""
    return torch.log_softmax(x.double(), 0)



def reference_bad_word_bans(words, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
    """Tokens completing a bad word after prompt + output (the whole sequence is the context)."""
    context = list(prompt) + list(output)
    return [w[-1] for w in words if len(context) >= len(w) - 1 and context[len(context) - (len(w) - 1):] == list(w[:-1])]


def reference_top_p_schedule(params: SamplingParams, tokens: Sequence[int]) -> list[float]:
    """The top-p used for each step while ``tokens`` are generated (TensorRT-LLM's decay rule)."""
    p, schedule = params.top_p, []
    for tok in tokens:
        schedule.append(p)
        p = params.top_p if tok in params.top_p_reset_ids else max(p * params.top_p_decay, params.top_p_min)
    return schedule
