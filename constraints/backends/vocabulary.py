"""The tokenizer as every backend sees it: a :class:`TokenizerContext` with its per-tokenizer
cache, and the tables built once per tokenizer in that cache (xgrammar's tokenizer info, every
token's bytes, the ordinary vocabulary) that several backends and the closing walk share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass
class TokenizerContext:
    """What every backend needs to know about the tokenizer (shared, read-only)."""

    tokenizer: Any
    vocab_size: int  # logits width
    tokenizer_vocab: int  # ids >= this are never allowed
    stop_token_ids: tuple[int, ...]
    fingerprint: str
    cache: dict[str, Any] = field(default_factory=dict)  # per-backend tokenizer objects

    def cached(self, name: str, build: Callable[[], Any]) -> Any:
        """The object kept under ``name`` for this tokenizer, built by ``build`` the first time."""
        found = self.cache.get(name)
        if found is None:
            found = self.cache[name] = build()
        return found

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of ``text`` without special tokens."""
        backend = rust_tokenizer(self.tokenizer)
        if backend is not None:  # what transformers' encode calls, without its wrapper (a third of the time)
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        backend = rust_tokenizer(self.tokenizer)
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def rust_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer's ``tokenizers.Tokenizer`` where transformers' encode/decode add nothing
    to its own (no clean-up of spaces after decoding), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend if hasattr(backend, "encode") and hasattr(backend, "decode") else None


def tokenizer_info(ctx: TokenizerContext) -> "xgr.TokenizerInfo":
    """xgrammar's view of the tokenizer (built once per context)."""
    def build() -> "xgr.TokenizerInfo":
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(
            ctx.tokenizer, vocab_size=ctx.vocab_size, stop_token_ids=list(ctx.stop_token_ids)
        )

    return ctx.cached("xgrammar_info", build)


def token_bytes(ctx: TokenizerContext) -> list[bytes]:
    """Raw bytes of every token id (shared per tokenizer)."""
    return ctx.cached("token_bytes", lambda: [bytes(b) for b in tokenizer_info(ctx).decoded_vocab])


def token_texts(ctx: TokenizerContext) -> list[bytes]:
    """The bytes each id writes into the answer, for every id below ``ctx.vocab_size``: empty for
    stop and special tokens (they write no text) and for ids beyond the tokenizer (shared per
    tokenizer; the JSON scanners of the narrowing matchers read these)."""
    def build() -> list[bytes]:
        raw = token_bytes(ctx)
        neutral = set(ctx.stop_token_ids) | special_ids(ctx.tokenizer)
        return [b"" if i in neutral or i >= len(raw) or i >= ctx.tokenizer_vocab else raw[i]
                for i in range(ctx.vocab_size)]

    return ctx.cached("token_texts", build)


def special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in decoder.items() if getattr(t, "special", True))
    return ids


def vocabulary_bytes(ctx: TokenizerContext) -> dict[bytes, list[int]]:
    """Token bytes -> ids for ordinary tokens (no special/added tokens, no stop tokens)."""
    decoded = tokenizer_info(ctx).decoded_vocab
    skip = set(ctx.stop_token_ids) | special_ids(ctx.tokenizer)
    out: dict[bytes, list[int]] = {}
    for i, raw in enumerate(decoded[: ctx.tokenizer_vocab]):
        if raw and i not in skip:
            out.setdefault(bytes(raw), []).append(i)
    return out
