"""apply_token_bitmask_inplace: Triton (interpreter / CUDA) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import apply_token_bitmask_inplace, apply_token_bitmask_inplace_reference, unpack_bitmask


def _random_words(n_rows: int, n_words: int, gen: torch.Generator) -> torch.Tensor:
    """[R, W] int32 with every bit pattern possible (including the sign bit)."""
    return torch.randint(-(2**31), 2**31 - 1, (n_rows, n_words), generator=gen, dtype=torch.int64).to(torch.int32)


def _python_allowed(words: torch.Tensor, n_cols: int) -> list[list[bool]]:
    """Slow oracle for the bit layout."""
    out = []
    for row in words.tolist():
        out.append([t // 32 < len(row) and bool((row[t // 32] >> (t % 32)) & 1) for t in range(n_cols)])
    return out


def test_unpack_layout_matches_python_oracle(gen: torch.Generator) -> None:
    words = _random_words(3, 3, gen)
    for n_cols in (1, 31, 33, 96, 100):
        assert unpack_bitmask(words, n_cols).tolist() == _python_allowed(words, n_cols)


def _widths(vocab: int) -> list[int]:
    exact = (vocab + 31) // 32
    return sorted({exact, max(1, exact - 3), exact + 2})


CASES = [(v, w) for v in (1, 31, 33, 1000, 49152, 49157) for w in _widths(v)]


@pytest.mark.parametrize(("vocab", "n_words"), CASES)
@pytest.mark.parametrize("kind", ["random", "all_banned", "all_allowed"])
def test_bitmask_matches_reference(backend, gen, vocab: int, n_words: int, kind: str) -> None:
    n_rows = 4 if vocab < 40000 else 2
    logits = torch.randn(n_rows + 1, vocab, generator=gen)
    words = {
        "random": _random_words(n_rows, n_words, gen),
        "all_banned": torch.zeros(n_rows, n_words, dtype=torch.int32),
        "all_allowed": torch.full((n_rows, n_words), -1, dtype=torch.int32),
    }[kind]
    indices = torch.randperm(n_rows + 1, generator=gen)[:n_rows]
    for idx in (indices, None):
        expected = logits.clone()
        apply_token_bitmask_inplace_reference(expected, words, idx)
        got = logits.to(backend)
        assert kernels.select_backend(got, use_triton=True) == "triton"
        apply_token_bitmask_inplace(got, words.to(backend), None if idx is None else idx.to(backend), use_triton=True)
        assert torch.equal(got.cpu(), expected)


def test_reference_semantics(gen: torch.Generator) -> None:
    logits = torch.randn(3, 70, generator=gen)
    words = _random_words(2, 2, gen)  # covers 64 columns only
    out = logits.clone()
    apply_token_bitmask_inplace_reference(out, words, torch.tensor([2, 0]))
    assert torch.equal(out[1], logits[1]), "rows without a bitmask must be untouched"
    for r, row in ((0, 2), (1, 0)):
        allowed = torch.tensor(_python_allowed(words[r : r + 1], 70)[0])
        assert torch.isneginf(out[row][~allowed]).all()
        assert torch.equal(out[row][allowed], logits[row][allowed])
        assert torch.isneginf(out[row, 64:]).all(), "columns past W*32 are banned"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(backend, gen, dtype: torch.dtype) -> None:
    logits = torch.randn(3, 1000, generator=gen).to(dtype)
    words = _random_words(3, 32, gen)
    expected = logits.clone()
    apply_token_bitmask_inplace_reference(expected, words)
    got = logits.to(backend)
    apply_token_bitmask_inplace(got, words.to(backend), use_triton=True)
    assert torch.equal(got.cpu(), expected)


def test_empty_inputs(gen: torch.Generator) -> None:
    logits = torch.randn(2, 10, generator=gen)
    before = logits.clone()
    apply_token_bitmask_inplace(logits, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert torch.equal(logits, before)


def test_input_validation() -> None:
    with pytest.raises(TypeError):
        apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(2, 1, dtype=torch.int32))


def test_cpu_default_is_reference() -> None:
    assert kernels.select_backend(torch.zeros(1)) == "reference"
    assert kernels.select_backend(torch.zeros(1), use_triton=False) == "reference"


@pytest.mark.parametrize("vocab", [33, 1000, 49157])
def test_rows_variant_masks_like_the_indexed_one_and_skips_negative_rows(backend, gen, vocab: int) -> None:
    n_words = (vocab + 31) // 32
    words = _random_words(5, n_words, gen)
    logits = torch.randn(4, vocab, generator=gen)
    word_rows = torch.tensor([3, -1, 0, -1])  # logits rows 1 and 3 unconstrained
    expected = logits.clone()
    apply_token_bitmask_inplace_reference(expected, words[[3, 0]], torch.tensor([0, 2]))
    reference = logits.clone()
    kernels.apply_token_bitmask_rows_inplace(reference, words, word_rows, use_triton=False)
    assert torch.equal(reference, expected)
    got = logits.to(backend)
    kernels.apply_token_bitmask_rows_inplace(got, words.to(backend), word_rows.to(backend), use_triton=True)
    assert torch.equal(got.cpu(), expected)


def test_rows_variant_validates_its_inputs() -> None:
    with pytest.raises(ValueError, match="word_rows"):
        kernels.apply_token_bitmask_rows_inplace(torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(3))
    with pytest.raises(TypeError, match="int32"):
        kernels.apply_token_bitmask_rows_inplace(torch.zeros(2, 40), torch.zeros(1, 2), torch.zeros(2, dtype=torch.long))
