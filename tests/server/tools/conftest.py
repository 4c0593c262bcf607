"""Shared fixtures: the default model's tokenizer and an xgrammar compiler for it."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from server.model_loader import default_model_dir, load_tokenizer

    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def compiler(tokenizer: Any) -> Any:
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    return xgr.GrammarCompiler(info)
