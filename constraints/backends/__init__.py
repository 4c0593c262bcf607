"""The backends that enforce a constraint token by token (llguidance, xgrammar, outlines-core),
their shared interfaces and tokenizer vocabulary, the token DFA, closing walks and batched fills."""
