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


def assert_classified(compiler, tok, schema, valid, invalid, options=None) -> None:
    """Compile ``schema`` (strict, with these spec ``options``): each value is walked to EOS
    exactly when jsonschema, in the schema's own draft, calls it valid (and the lists agree
    with jsonschema)."""
    import jsonschema

    from constraints import ConstraintSpec

    check = jsonschema.validators.validator_for(schema)(schema).is_valid
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, options))
    for value in valid:
        assert check(value) and walk_json(compiled, tok, value), value
    for value in invalid:
        assert not check(value) and not walk_json(compiled, tok, value), value


def closing_tokens(tok, chars: str) -> set[int]:
    """Ids of the tokens holding any of ``chars`` (what closes strings and containers)."""
    return {i for i, text in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))) if any(c in text for c in chars)}


def walk_schemas_randomly(compiler, tok, schemas, options: dict, seed: int, walks: int) -> None:
    """:func:`random_walk` ``walks`` times through each schema (compiled with ``options``), often
    towards a quote or a brace, each finished answer checked by jsonschema."""
    import random

    import jsonschema

    from constraints import ConstraintSpec

    closers = closing_tokens(tok, '"},')
    rng = random.Random(seed)
    for schema in schemas:
        compiled = compiler.compile(ConstraintSpec("json_schema", schema, options))
        check = jsonschema.Draft202012Validator(schema).is_valid
        for _ in range(walks):
            random_walk(compiled.new_matcher(), tok, rng, 120, closers, 0.7, check)


def random_walk(matcher, tok, rng, steps: int, closers: set[int], closing_share: float, check=None, on_mask=None) -> None:
    """Walk ``matcher`` through its own mask for up to ``steps`` tokens, ``closing_share`` of the
    time towards a token of ``closers``: every state offers a token, every allowed token is
    accepted, and a finished answer satisfies ``check`` (its JSON value). ``on_mask(mask)``
    sees every mask."""
    ids: list[int] = []
    for _ in range(steps):
        mask = new_mask()
        matcher.fill_bitmask(mask, 0)
        if on_mask is not None:
            on_mask(mask)
        options = sorted(allowed_ids(mask))
        assert options, tok.decode(ids)
        closing = [t for t in options if t in closers]
        t = rng.choice(closing if closing and rng.random() < closing_share else options)
        assert matcher.accept_token(t)
        if matcher.is_terminated():
            assert check is None or check(json.loads(tok.decode(ids))), tok.decode(ids)
            return
        ids.append(t)
