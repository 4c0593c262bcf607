"""Regular expressions: the ECMA-262 dialect, emptiness and finite languages, complements and
disjointness of patterns."""
