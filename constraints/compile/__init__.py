"""Compiling a spec: planning it, running the plan in killable worker processes, and caching
the results in memory and on disk."""
