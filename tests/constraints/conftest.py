"""Shared fixtures: the default model's tokenizer and one compiler (both slow-ish to build)."""

from __future__ import annotations

import json

import pytest
import torch

from constraints import ConstraintCompiler

VOCAB = 49152


@pytest.fixture(scope="session")
def tok(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="session")
def compiler(default_compiler) -> ConstraintCompiler:
    return default_compiler


def new_mask() -> torch.Tensor:
    return torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)


def allowed(mask: torch.Tensor, t: int) -> bool:
    return bool((int(mask[0, t >> 5]) >> (t & 31)) & 1)


def allowed_ids(mask: torch.Tensor) -> set[int]:
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)).flatten().tolist())


def walk(matcher, ids: list[int], eos: int = 2) -> bool:
    """Drive the matcher like the sampler: every token must be in the mask and be accepted."""
    mask = new_mask()
    for t in [*ids, eos]:
        mask.zero_()
        matcher.fill_bitmask(mask, 0)
        if not allowed(mask, t) or not matcher.accept_token(t):
            return False
    return matcher.is_terminated()


def walk_text(compiled, tok, text: str) -> bool:
    return walk(compiled.new_matcher(), tok.encode(text, add_special_tokens=False))


def walk_json(compiled, tok, value) -> bool:
    return walk_text(compiled, tok, json.dumps(value))


def assert_classified(compiler, tok, schema, valid, invalid) -> None:
    """Compile ``schema`` (strict): each value is walked to EOS exactly when jsonschema, in the
    schema's own draft, calls it valid (and the lists agree with jsonschema)."""
    import jsonschema

    from constraints import ConstraintSpec

    check = jsonschema.validators.validator_for(schema)(schema).is_valid
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in valid:
        assert check(value) and walk_json(compiled, tok, value), value
    for value in invalid:
        assert not check(value) and not walk_json(compiled, tok, value), value
